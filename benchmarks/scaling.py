"""Section ``scaling``: ckptd with synchronous staging from 64 MiB to 4 GiB.

One worker per size builds the transformer-plus-AdamW state of that size
and measures, back to back, the two limits at that size (memcpy into a
reused buffer, O_DIRECT write + fsync) and then ckptd's sync-staging saves
(one warm-up, ``repeat`` timed). Reported per size: seconds per GiB for
blocking and durable, their ratios to the limits of the same size, and the
trainer's extra memory (the slot) over the state. "No collapse" means the
per-GiB costs at the largest sizes stay within 1.25x of those at 1 GiB.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

from .ckptd_runs import BenchDaemon
from .measure import MemPeak, Series, peak_rss_self, reset_peak_rss
from .runner import Ctx, log, run_one
from .worker import Channel

DEFAULT_SIZES = "64M,256M,1G,2G,4G"
COLLAPSE = 1.25


def parse_size(text: str) -> float:
    """``64M`` / ``1G`` / ``0.5`` (GiB) -> GiB."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t.endswith("M"):
        return float(t[:-1]) / 1024
    if t.endswith("G"):
        return float(t[:-1])
    return float(t)


def size_label(gib: float) -> str:
    return f"{gib:g} GiB" if gib >= 1 else f"{gib * 1024:g} MiB"


def task_scaling(ch: Channel, size_gib: float, repeat: int, scratch: str, run_dir: str) -> dict:
    from . import limits
    from .ckptd_runs import run_client
    from .save import prologue

    bench, rss_built = prologue(ch, size_gib)
    memcpy = limits.memcpy_reused(bench.tensors, bench.nbytes, repeat)
    gc.collect()
    direct = limits.odirect_write(Path(scratch), bench.nbytes, repeat)

    def steady() -> None:
        reset_peak_rss()
        ch.mark("steady")

    r = run_client(Path(run_dir), bench.state, Path(scratch), background=False, repeat=repeat, prefix="scale",
                   on_steady=steady)
    ch.mark("end")
    return {"memcpy": memcpy.values, "direct": direct.values, **r.to_json(), "rss_built": rss_built,
            "hwm": peak_rss_self()}


@dataclass
class ScalePoint:
    size_gib: float
    nbytes: int
    memcpy: Series
    direct: Series
    blocking: Series
    durable: Series
    extra: int
    """Trainer peak RSS during the timed saves over its RSS with the state built."""
    others: float | None
    daemon: MemPeak | None = None

    @property
    def gib(self) -> float:
        return self.nbytes / (1 << 30)


def run_section(ctx: Ctx, sizes: list[float]) -> list[ScalePoint]:
    points = []
    log("scaling: starting a ckptd daemon")
    with BenchDaemon(ctx.scratch) as daemon:
        for size in sizes:
            run = run_one(ctx, "scaling", f"scaling: {size_label(size)}", writer_pid=daemon.pid, size_gib=size,
                          repeat=ctx.repeat, scratch=str(ctx.scratch), run_dir=str(daemon.run_dir))
            r = run.result
            points.append(ScalePoint(size, run.ready["state"]["nbytes"], Series(r["memcpy"]), Series(r["direct"]),
                                     Series(r["returned"]), Series(r["durable"]), max(0, r["hwm"] - r["rss_built"]),
                                     run.phase.others, run.steady.peaks.get("writer")))
    return points
