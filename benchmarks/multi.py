"""Section ``multi``: four clients on one node, saving at once.

Four worker processes (four "ranks"; ``--ranks``), each with its own ``ckptd.Client`` and
its own state of ``--multi-size-gib`` (default 0.5 GiB), save at the same
moment through one daemon, in two layouts:

* separate: each process saves its own checkpoint (rank 0 of 1, four paths);
* one checkpoint: rank r of 4 into the same path; the daemon commits it
  once every rank's shard is durable.

Each layout has a warm-up round (slots created, daemon mappings made) and
``repeat`` timed rounds; every round starts when all four are ready and the
machine is quiet. The aggregate time of a round runs from the first
``save_async`` call to the last future resolved; the aggregate bandwidth
(tensor bytes of all four over that time) is compared with a raw O_DIRECT
write + fsync of the same total bytes, measured in the same section just
before, by one writer and by four writers at once.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .ckptd_runs import BenchDaemon
from .measure import MemPeak, Series
from .runner import Ctx, Group, log, run_one
from .worker import Channel

RANKS = 4
"""Default number of clients (``--ranks``)."""


def layout_label(layout: str, ranks: int) -> str:
    return f"{ranks} separate checkpoints" if layout == "separate" else f"one checkpoint, ranks 0-{ranks - 1} of {ranks}"


LAYOUTS = ("separate", "shared")


def task_raw_write(ch: Channel, nbytes: int, writers: int, repeat: int, scratch: str) -> dict:
    from . import limits

    ch.ready()
    ch.mark("steady")
    single = limits.odirect_write(Path(scratch), nbytes, repeat)
    parallel = limits.parallel_direct_write(Path(scratch), nbytes // writers, writers, repeat)
    ch.mark("end")
    return {"single": single.values, "parallel": parallel.values}


def task_saver(ch: Channel, rank: int, ranks: int, size_gib: float, scratch: str, run_dir: str, layouts: list[str],
               rounds: int, prefix: str = "multi") -> dict:
    """Rank ``rank``: for each layout, a warm-up round and ``rounds`` timed rounds, each on go."""
    import ckptd

    from .state import build_state

    bench = build_state(size_gib, seed=rank)
    for layout in layouts:
        shared = layout == "shared"
        client = ckptd.Client(run_dir=run_dir, spawn=False, max_inflight=1, rank=rank if shared else 0,
                              world_size=ranks if shared else 1, commit_timeout=300.0)
        try:
            for rnd in range(1 + rounds):
                path = (Path(scratch) / f"{prefix}-{layout}-{rnd}" if shared
                        else Path(scratch) / f"{prefix}-{layout}-{rnd}-r{rank}")
                ch.ready(layout=layout, round=rnd, nbytes=bench.nbytes)
                t0 = time.monotonic()
                fut = client.save_async(bench.state, path, step=rnd)
                t_ret = time.monotonic()
                fut.wait_staged()
                t_staged = time.monotonic()
                saved = fut.result()
                t_dur = time.monotonic()
                ch.send("round", layout=layout, round=rnd, t0=t0, returned=t_ret, staged=t_staged, durable=t_dur,
                        bytes_written=saved.bytes_written, path=str(saved.path))
        finally:
            client.close()
    return {}


@dataclass
class LayoutResult:
    layout: str
    what: str
    aggregate: Series = field(default_factory=Series)
    """First call to last durable, per timed round."""
    blocking: Series = field(default_factory=Series)
    """Every rank's blocking time, every timed round."""
    durable: Series = field(default_factory=Series)
    """Every rank's own time to durable."""
    nbytes: int = 0
    """Tensor bytes of all ranks together."""
    ranks: MemPeak | None = None
    daemon: MemPeak | None = None
    others: list[float] = field(default_factory=list)
    daemon_cpu: list[float] = field(default_factory=list)
    """Daemon CPU seconds per timed round."""
    ranks_cpu: list[float] = field(default_factory=list)
    """All ranks' CPU seconds per timed round."""

    @property
    def gbps(self) -> float:
        return self.nbytes / 1e9 / self.aggregate.median


@dataclass
class MultiSection:
    size_gib: float
    ranks: int
    per_rank_bytes: int
    raw_single: Series
    raw_parallel: Series
    raw_others: float | None
    layouts: list[LayoutResult]

    @property
    def total_bytes(self) -> int:
        return self.per_rank_bytes * self.ranks


def run_saves(ctx: Ctx, daemon: BenchDaemon, *, ranks: int, size_gib: float, layouts: list[str], rounds: int,
              prefix: str, keep_last: bool = False, name: str = "multi") -> tuple[list[LayoutResult], list[str]]:
    """``ranks`` savers through ``daemon``; returns per-layout results and the paths kept (``keep_last``)."""
    args = [dict(rank=r, ranks=ranks, size_gib=size_gib, scratch=str(ctx.scratch), run_dir=str(daemon.run_dir), layouts=layouts,
                 rounds=rounds, prefix=prefix) for r in range(ranks)]
    ctx.sampler.watch("writer", daemon.pid)
    group = Group(ctx, "saver", name, "ranks", args)
    results: list[LayoutResult] = []
    kept: list[str] = []
    try:
        for layout in layouts:
            res = LayoutResult(layout, layout_label(layout, ranks))
            for rnd in range(1 + rounds):
                ready = group.ready()
                res.nbytes = sum(m["nbytes"] for m in ready)
                timed = rnd >= 1
                label = f"{name}: {res.what}, round {rnd}{'' if timed else ' (warm-up)'}"
                log(label)
                t_go = group.go(label if timed else None)
                rounds_msgs = group.collect("round")
                t_end = time.monotonic()
                paths = sorted({m["path"] for m in rounds_msgs})
                if timed:
                    res.aggregate.add(max(m["durable"] for m in rounds_msgs) - min(m["t0"] for m in rounds_msgs))
                    for m in rounds_msgs:
                        res.blocking.add(m["returned"] - m["t0"])
                        res.durable.add(m["durable"] - m["t0"])
                    w = ctx.sampler.window(t_go, t_end)
                    res.ranks = _max_peak(res.ranks, w.peaks.get("ranks"))
                    res.daemon = _max_peak(res.daemon, w.peaks.get("writer"))
                    if w.others is not None:
                        res.others.append(w.others)
                    if "writer" in w.cpu:
                        res.daemon_cpu.append(w.cpu["writer"])
                    if "ranks" in w.cpu:
                        res.ranks_cpu.append(w.cpu["ranks"])
                if keep_last and layout == layouts[-1] and rnd == rounds:
                    kept = paths
                else:
                    for p in paths:
                        shutil.rmtree(p, ignore_errors=True)
            results.append(res)
        group.collect("result")
    finally:
        group.close()
        ctx.sampler.unwatch("writer")
    return results, kept


def _max_peak(a: MemPeak | None, b: MemPeak | None) -> MemPeak | None:
    if a is None or b is None:
        return a or b
    return MemPeak(max(a.rss, b.rss), max(a.anon, b.anon), max(a.file, b.file), max(a.shmem, b.shmem),
                   min(a.first_rss, b.first_rss), min(a.first_anon, b.first_anon))


def run_section(ctx: Ctx, size_gib: float, ranks: int = RANKS) -> MultiSection:
    from .state import BYTES_PER_PARAM, param_count, pick_width

    per_rank = param_count(pick_width(int(size_gib * (1 << 30)))) * BYTES_PER_PARAM
    raw = run_one(ctx, "raw_write", "multi: raw O_DIRECT write", nbytes=per_rank * ranks, writers=ranks,
                  repeat=ctx.limit_repeat, scratch=str(ctx.scratch))
    log("multi: starting a ckptd daemon")
    with BenchDaemon(ctx.scratch) as daemon:
        layouts, _ = run_saves(ctx, daemon, ranks=ranks, size_gib=size_gib, layouts=list(LAYOUTS),
                               rounds=ctx.repeat, prefix="multi")
    return MultiSection(size_gib, ranks, layouts[0].nbytes // ranks if layouts else per_rank,
                        Series(raw.result["single"]), Series(raw.result["parallel"]), raw.phase.others, layouts)

