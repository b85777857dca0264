"""The methods a case can run, each inside the case's own process, and that process's entry point.

A method takes the case and the scratch directory and returns its measurements, repetitions under ``reps`` as lists
(medians, every value).
"""
from __future__ import annotations
import gc
import json
import os
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from . import every_step, gpu_check, integration_steps, limits, loads, objects, ranks, saves, snapshots, transport
from .cases import Case
from .limits import memory
from .state import BYTES_PER_PARAM, build, param_count, pick_width

def _with_state(fn: Callable[..., dict]) -> Callable[[Case, Path], dict]:
    """Build the case's state first; ``fn(case, scratch, bench, rss_built)``."""
    def run(case: Case, scratch: Path) -> dict:
        bench = build(case.state, case.size_gib, device=case.device)
        gc.collect()
        return {"state": bench.describe(), **fn(case, scratch, bench, memory()["VmRSS"])}
    return run

def _scaling(case: Case, scratch: Path, bench: Any, rss: int) -> dict:
    memcpy = limits.memcpy_reused(bench.tensors, bench.nbytes, case.repeat)
    direct = limits.parallel_writes(scratch, bench.nbytes, 1, case.repeat)
    out = saves.ckptd_saves(bench.state, scratch, case.repeat, rss)
    out["reps"].update(memcpy=memcpy, direct=direct)
    return out

def _raw_writes(case: Case, scratch: Path) -> dict:
    """All ranks' state bytes (computed, not built) by one O_DIRECT writer, and by one per rank at once."""
    writers = case.params["ranks"]
    n = param_count(pick_width(int(case.size_gib * (1 << 30)))) * BYTES_PER_PARAM * writers
    return {"nbytes": n, "reps": {"single": limits.parallel_writes(scratch, n, 1, case.repeat),
                                  "parallel": limits.parallel_writes(scratch, n, writers, case.repeat)}}

METHODS: dict[str, Callable[[Case, Path], dict]] = {
    "memcpy": _with_state(lambda c, _, b, __: {"reps": {"seconds": limits.memcpy_reused(b.tensors, b.nbytes,
                                                                                         c.repeat)}}),
    "memcpy_fresh": _with_state(lambda c, _, b, __: {"reps": {"seconds": limits.memcpy_fresh_shm(b.tensors, b.nbytes,
                                                                                                c.repeat)}}),
    "write": _with_state(lambda c, d, b, _: {"reps": {"seconds": limits.parallel_writes(d, b.nbytes, 1, c.repeat,
                                                                                        **c.params)}}),
    "torch_save": _with_state(lambda c, d, b, rss: saves.torch_saves(b.state, d, c.repeat, rss)),
    "dcp": _with_state(lambda c, d, b, rss: saves.dcp_saves(b.state, d, c.repeat, rss, **c.params)),
    "torchckpt": _with_state(lambda c, d, b, rss: saves.torchckpt_saves(b.state, d, c.repeat, rss, **c.params)),
    "ckptd": _with_state(lambda c, d, b, rss: saves.ckptd_saves(
        b.state, d, c.repeat, rss, **{k: v for k, v in c.params.items() if k != "reserve"},
        reserve_bytes=b.nbytes + (1 << 20) if c.params.get("reserve", True) else None)),
    "scaling": _with_state(_scaling),
    "snapshots": _with_state(lambda c, d, b, _: snapshots.snapshots(b.state, b.tensors, b.nbytes, d, c.repeat)),
    "raw_write": _raw_writes,
    "multi_saves": lambda c, d: ranks.multi_saves(d, size_gib=c.size_gib, device=c.device, repeat=c.repeat, **c.params),
    "load_prepare": lambda c, d: loads.prepare(d, c.size_gib),
    "load": lambda c, d: loads.load(d, c.size_gib, c.params["method"], c.repeat),
    "rank_loads": lambda c, d: ranks.rank_loads(d, size_gib=c.size_gib, repeat=c.repeat, **c.params),
    "sharded": lambda c, d: ranks.sharded(d, size_gib=c.size_gib, repeat=c.repeat, **c.params),
    "objects": objects.objects_case,
    "transport": transport.transport_case,
    "steps": integration_steps.steps_case,
    "everystep": every_step.every_step,
    "gpu_check": gpu_check.gpu_check,
}

def child(case: Case, scratch: str, conn: Any, log: str) -> None:
    """Run ``case`` with stdout and stderr in its log; send its one JSON line (what it is, how long it took and
    its method's measurements, or its error) through ``conn``."""
    gc.freeze()  # the server's imports are never garbage: a collect neither walks nor copies their pages
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)  # library and daemon output goes to the case's log, never into the result
    os.dup2(fd, 2)
    t0 = time.monotonic()
    try:
        out = METHODS[case.method](case, Path(scratch))
        line = json.dumps({"case": case.name, **asdict(case), **out, "wall_s": time.monotonic() - t0})
    except BaseException as exc:
        traceback.print_exc()
        line = json.dumps({"case": case.name, "error": f"{type(exc).__name__}: {exc} (log: {log})"})
    conn.send(line)


