"""Section ``save``: ckptd against the machine's limits and against its peers.

Every method runs in its own worker process on the same state dict (built
from the same seed: same structure, same bytes), one warm-up and then
``repeat`` timed saves, back to back (each waits for the previous one to be
durable). Measured per method:

* blocking: the call's return (what the training step waits for);
* staged: the tensors may change from here (equals blocking where the copy
  happens inside the call);
* to durable: ``torch.save`` + fsync returning, DCP's future, ckptd's future;
* the trainer's extra memory: its peak RSS during the timed saves (``VmHWM``,
  reset after the warm-up) minus its RSS once the state was built: for
  ckptd, the slot;
* the writer process, where there is one (ckptd's daemon, DCP's checkpoint
  process): peak RSS and its split into RssAnon / RssFile / RssShmem.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ckptd_runs import BenchDaemon
from .measure import MemPeak, Series, peak_rss_self, proc_memory, reset_peak_rss
from .runner import Ctx, Run, log, run_one
from .worker import Channel

# --- worker side -------------------------------------------------------------


def prologue(ch: Channel, size_gib: float, seed: int = 0, **extra: Any):
    """Build the state, say ready (with its RSS and description), wait for go."""
    from .state import build_state, describe

    bench = build_state(size_gib, seed=seed)
    gc.collect()
    rss_built = proc_memory()[0]
    ch.ready(rss_built=rss_built, state=describe(bench), **extra)
    return bench, rss_built


def steady(ch: Channel) -> None:
    """After the warm-up: reset the peak-RSS mark and mark the timed part's start."""
    reset_peak_rss()
    ch.mark("steady")


def epilogue(ch: Channel, rss_built: int) -> dict:
    ch.mark("end")
    return {"rss_built": rss_built, "hwm": peak_rss_self()}


def task_limits(ch: Channel, size_gib: float, limit_repeat: int, scratch: str) -> dict:
    from . import limits

    bench, rss_built = prologue(ch, size_gib)
    scratch_p = Path(scratch)
    ch.mark("steady")
    out = {"memcpy": limits.memcpy_reused(bench.tensors, bench.nbytes, limit_repeat).values}
    gc.collect()
    out["fresh"] = limits.memcpy_fresh_shm(bench.tensors, bench.nbytes, limit_repeat).values
    out["direct"] = limits.odirect_write(scratch_p, bench.nbytes, limit_repeat).values
    out["buffered"] = limits.buffered_write(scratch_p, bench.nbytes, limit_repeat).values
    return {**out, **epilogue(ch, rss_built)}


def task_torch_save(ch: Channel, size_gib: float, repeat: int, scratch: str) -> dict:
    from .peers import torch_save

    bench, rss_built = prologue(ch, size_gib)
    r = torch_save(bench.state, Path(scratch), repeat, on_steady=lambda: steady(ch))
    return {"returned": r.durable.values, "staged": r.durable.values, "durable": r.durable.values,
            "serialize": r.serialize.values, "file_bytes": r.file_bytes, **epilogue(ch, rss_built)}


def task_dcp(ch: Channel, size_gib: float, repeat: int, scratch: str, mode: str) -> dict:
    from .peers import dcp_saves

    bench, rss_built = prologue(ch, size_gib)
    ended: dict = {}
    r = dcp_saves(bench.state, Path(scratch), mode, repeat, on_steady=lambda: steady(ch),
                  on_writer=lambda pid: ch.watch("writer", pid), on_end=lambda: ended.update(epilogue(ch, rss_built)))
    return {**r.to_json(), **ended}


def task_ckptd(ch: Channel, size_gib: float, repeat: int, scratch: str, run_dir: str, background: bool,
               options: dict | None = None, breakdown: bool = False) -> dict:
    from .ckptd_runs import run_client

    bench, rss_built = prologue(ch, size_gib)
    r = run_client(Path(run_dir), bench.state, Path(scratch), background=background, repeat=repeat,
                   on_steady=lambda: steady(ch), **(options or {}))
    ended = epilogue(ch, rss_built)
    return {**r.to_json(), **ended, "breakdown": staging_breakdown(bench.state, repeat) if breakdown else {}}


def staging_breakdown(state: Any, repeat: int) -> dict:
    """Where sync staging's time goes, from the client's own pieces (after the timed saves, untimed by them).

    ``flatten`` (name the tensors, pack the structure), ``layout_for`` (plan
    the safetensors header) and ``stage`` (header + one ``copy_`` per tensor)
    into a private pre-faulted slot, each timed alone. Best effort: these are
    client internals (``ckptd.client.flatten`` / ``staging`` / ``slots``), so
    a changed signature only loses this breakdown.
    """
    import time

    try:
        from ckptd.client import staging
        from ckptd.client.flatten import flatten
        from ckptd.client.slots import Slot
        from ckptd.client.staging import layout_for, stage
    except ImportError:
        return {}
    write_header = getattr(staging, "write_header", None)  # newer clients write the header separately
    out: dict[str, list[float]] = {"flatten": [], "layout": [], "stage": []}
    slot = None
    try:
        for i in range(1 + repeat):
            t0 = time.perf_counter()
            flat = flatten(state)
            t1 = time.perf_counter()
            layout = layout_for(flat)
            t2 = time.perf_counter()
            if slot is None:
                slot = Slot(layout.nbytes)
            t3 = time.perf_counter()
            if write_header is not None:
                write_header(layout, slot)
            copies = stage(flat, layout, slot)
            if copies is not None:
                copies.wait()
            t4 = time.perf_counter()
            if i:
                out["flatten"].append(t1 - t0)
                out["layout"].append(t2 - t1)
                out["stage"].append(t4 - t3)
    except Exception as exc:  # the library changed under us: report what we have
        out["error"] = [repr(exc)]  # type: ignore[list-item]
    finally:
        if slot is not None:
            slot.close()
    return out


# --- orchestrator side -------------------------------------------------------


@dataclass
class Method:
    """One save method's numbers, as the report needs them."""

    key: str
    what: str
    returned: Series
    staged: Series
    durable: Series
    rss_built: int = 0
    trainer_peak: int = 0
    """VmHWM during the timed saves."""
    trainer: MemPeak | None = None
    writer_name: str | None = None
    writer: MemPeak | None = None
    others: float | None = None
    quiet_wait: float = 0.0
    extra: dict = field(default_factory=dict)
    trainer_cpu: float | None = None
    """CPU seconds per timed save used by the trainer (its threads, and DCP's THREAD writer)."""
    writer_cpu: float | None = None
    """CPU seconds per timed save used by the writer process."""

    @property
    def trainer_extra(self) -> int:
        return max(0, self.trainer_peak - self.rss_built)


@dataclass
class SaveSection:
    nbytes: int
    state: dict
    memcpy: Series
    fresh: Series
    direct: Series
    buffered: Series
    limits_others: float | None
    methods: list[Method]

    def method(self, key: str) -> Method | None:
        return next((m for m in self.methods if m.key == key), None)


PEERS = [("torch_save", "torch.save + fsync", None), ("dcp_save", "DCP save", "save"),
         ("dcp_thread", "DCP async_save THREAD", "thread"), ("dcp_process", "DCP async_save PROCESS", "process"),
         ("dcp_process_stager", "DCP async_save PROCESS + reused DefaultStager", "process_stager")]


def _method(key: str, what: str, run: Run, writer_name: str | None) -> Method:
    r = run.result
    reps = max(1, len(r["durable"]))
    cpu = run.steady.cpu
    return Method(key, what, Series(r["returned"]), Series(r["staged"]), Series(r["durable"]),
                  rss_built=r["rss_built"], trainer_peak=r["hwm"], trainer=run.steady.peaks.get("trainer"),
                  writer_name=writer_name, writer=run.steady.peaks.get("writer"), others=run.phase.others,
                  quiet_wait=run.quiet_wait, extra=r,
                  trainer_cpu=cpu["trainer"] / reps if "trainer" in cpu else None,
                  writer_cpu=cpu["writer"] / reps if writer_name and "writer" in cpu else None)


def run_section(ctx: Ctx, *, dcp: bool = True) -> SaveSection:
    scratch = str(ctx.scratch)
    lim = run_one(ctx, "limits", "save: machine limits", size_gib=ctx.size_gib, limit_repeat=ctx.limit_repeat,
                  scratch=scratch)
    state = lim.ready["state"]
    methods: list[Method] = []
    ts = run_one(ctx, "torch_save", "save: torch.save", size_gib=ctx.size_gib, repeat=ctx.repeat, scratch=scratch)
    methods.append(_method("torch_save", "torch.save + fsync", ts, None))
    if dcp:
        for key, what, mode in PEERS[1:]:
            run = run_one(ctx, "dcp", f"save: {what}", size_gib=ctx.size_gib, repeat=ctx.repeat, scratch=scratch,
                          mode=mode)
            methods.append(_method(key, what, run, "DCP checkpoint process" if mode.startswith("process") else None))
    from .ckptd_runs import client_accepts

    variants = [("ckptd_sync", "ckptd save_async, sync staging", False, {})]
    if client_accepts("stream_commit"):  # opt-in since it appeared: measure it beside the default
        variants.append(("ckptd_sync_stream", "ckptd save_async, sync staging, stream_commit=True", False,
                         {"stream_commit": True}))
    variants.append(("ckptd_bg", "ckptd save_async, background staging", True, {}))
    log("save: starting a ckptd daemon")
    with BenchDaemon(ctx.scratch) as daemon:
        for key, what, background, options in variants:
            run = run_one(ctx, "ckptd", f"save: {what}", writer_pid=daemon.pid, size_gib=ctx.size_gib,
                          repeat=ctx.repeat, scratch=scratch, run_dir=str(daemon.run_dir), background=background,
                          options=options, breakdown=key == "ckptd_sync")
            methods.append(_method(key, what, run, "ckptd daemon"))
    r = lim.result
    return SaveSection(state["nbytes"], state, Series(r["memcpy"]), Series(r["fresh"]), Series(r["direct"]),
                       Series(r["buffered"]), lim.phase.others, methods)
