"""Section ``load``: reading a checkpoint back, and four ranks loading at once.

One worker writes the same state three ways (ckptd, ``torch.save``, DCP
``save``); then every load method runs in its own worker, cold and warm:

* cold: before each repetition the checkpoint's files are evicted from the
  page cache (``posix_fadvise(DONTNEED)`` on those files, or the whole cache
  with ``--evict drop_caches``), and ``mincore`` confirms how much of them
  was still resident (the report gives the worst case). ckptd writes with
  O_DIRECT, so right after a save its checkpoint is cold: that is the case a
  restart sees.
* warm: the warm-up repetition has just read the files, so the page cache
  holds them.

Each load is checked against the reference sum of the saved tensors. The
floor is a raw sequential read of the same shard file in 8 MiB ``readinto``
calls into one reused buffer (through the page cache, and with O_DIRECT);
every method's time is also set against that read in the same cache state.

Then four ranks, each in its own process, load their 512 MiB shard of a
four-rank ckptd checkpoint with ``map_location="cpu"``, hold it 0.5 s (as a
rank that copies to the GPU would) and drop it; the sampler sums the four
processes' RSS and RssAnon every 20 ms. Once with no limit and once with
``max_concurrent_per_node=1`` (the daemon's load lease).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .ckptd_runs import BenchDaemon
from .measure import MemPeak, Series, evict, resident_fraction
from .runner import Ctx, Group, log, run_one
from .worker import Channel

METHODS: list[tuple[str, str]] = [
    ("raw_read", "raw read, page cache (floor)"),
    ("raw_read_direct", "raw read, O_DIRECT"),
    ("ckptd_load", "ckptd.load, zero-copy"),
    ("ckptd_load_noverify", "ckptd.load verify=False, zero-copy"),
    ("ckptd_load_cpu", 'ckptd.load map_location="cpu"'),
    ("ckptd_load_into", "ckptd.load_into model, then optimizer"),
    ("ckptd_load_into_sd", "ckptd.load_into one state dict"),
    ("torch_load", "torch.load"),
    ("torch_load_mmap", "torch.load mmap=True"),
    ("dcp_load", "DCP load (in place)"),
]
TOUCHING = {"ckptd_load", "ckptd_load_noverify", "torch_load_mmap"}
"""Methods whose result is backed by the file: also timed until every byte was touched."""
NEEDS_TARGET = {"ckptd_load_into", "ckptd_load_into_sd", "dcp_load"}
HOLD_S = 0.5
TOLERANCE = 1e-6


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


# --- worker side -------------------------------------------------------------


def task_prepare(ch: Channel, size_gib: float, scratch: str, run_dir: str, repeat: int) -> dict:
    """Save one state with ckptd, ``torch.save`` (+ fsync) and DCP; time a sum over it in memory."""
    import os

    import ckptd
    import torch

    from .peers import dcp_save_once
    from .save import prologue
    from .state import tensor_sum

    bench, _ = prologue(ch, size_gib)
    ch.mark("steady")
    root = Path(scratch)
    ref = tensor_sum(bench.tensors)
    sums = Series()
    for i in range(1 + repeat):
        t0 = time.perf_counter()
        tensor_sum(bench.tensors)
        if i:
            sums.add(time.perf_counter() - t0)
    with ckptd.Client(run_dir=run_dir, spawn=False, rank=0, world_size=1) as client:
        saved = client.save_async(bench.state, root / "load-ckptd", step=1, overwrite=True).result()
    torch_file = root / "load-torch.pt"
    with open(torch_file, "wb") as f:
        torch.save(bench.state, f)
        f.flush()
        os.fsync(f.fileno())
    dcp_save_once(bench.state, root / "load-dcp")
    ch.mark("end")
    shard_files = [str(p) for p in _files(root / "load-ckptd") if p.suffix == ".safetensors"]
    return {"nbytes": bench.nbytes, "ref": ref, "sum_in_memory": sums.values, "ckptd": str(saved.path),
            "ckptd_bytes": saved.bytes_written, "shards": shard_files, "torch": str(torch_file),
            "torch_bytes": torch_file.stat().st_size, "dcp": str(root / "load-dcp"),
            "dcp_bytes": sum(p.stat().st_size for p in _files(root / "load-dcp"))}


def _loader(method: str, paths: dict, target: Any) -> tuple[Callable[[], Any], Callable[[Any], float], list[Path]]:
    """(load, checksum of what was loaded, files read) for ``method``."""
    import ckptd
    import torch

    from .limits import read_file
    from .peers import dcp_load, init_gloo
    from .state import iter_tensors, tensor_sum

    ck, shards = Path(paths["ckptd"]), [Path(p) for p in paths["shards"]]

    def loaded_sum(obj: Any) -> float:
        return tensor_sum(iter_tensors(obj))

    if method == "raw_read":
        return (lambda: read_file(shards)), (lambda _: float("nan")), shards
    if method == "raw_read_direct":
        return (lambda: read_file(shards, direct=True)), (lambda _: float("nan")), shards
    if method == "ckptd_load":
        return (lambda: ckptd.load(ck)), loaded_sum, _files(ck)
    if method == "ckptd_load_noverify":
        return (lambda: ckptd.load(ck, verify=False)), loaded_sum, _files(ck)
    if method == "ckptd_load_cpu":
        return (lambda: ckptd.load(ck, map_location="cpu")), loaded_sum, _files(ck)
    if method == "ckptd_load_into":
        model, opt = target.model, target.optimizer

        def into() -> Any:
            ckptd.load_into(model, ck, key="model")
            ckptd.load_into(opt, ck, key="optimizer")
            return None

        return into, (lambda _: loaded_sum({"m": model.state_dict(), "o": opt.state_dict()})), _files(ck)
    if method == "ckptd_load_into_sd":
        sd = {"model": target.model.state_dict(), "optimizer": target.optimizer.state_dict(), "step": 0}
        return (lambda: ckptd.load_into(sd, ck)), (lambda _: loaded_sum(sd)), _files(ck)
    if method == "torch_load":
        tf = Path(paths["torch"])
        return (lambda: torch.load(tf)), loaded_sum, [tf]
    if method == "torch_load_mmap":
        tf = Path(paths["torch"])
        return (lambda: torch.load(tf, mmap=True)), loaded_sum, [tf]
    if method == "dcp_load":
        init_gloo()
        d = Path(paths["dcp"])
        sd = target.state
        return (lambda: dcp_load(sd, d)), (lambda _: loaded_sum(sd)), _files(d)
    raise ValueError(f"unknown load method {method!r}")


def task_method(ch: Channel, method: str, paths: dict, size_gib: float, repeat: int, evict_mode: str) -> dict:
    from .state import build_state, iter_tensors, tensor_sum

    from .measure import proc_memory

    target = build_state(size_gib, seed=1) if method in NEEDS_TARGET else None
    gc.collect()
    load, check, files = _loader(method, paths, target)
    ch.ready()
    out_base = proc_memory()
    out: dict[str, Any] = {"files": [str(f) for f in files], "resident_before_cold": 0.0,
                           "base": {"rss": out_base[0], "anon": out_base[1], "file": out_base[2]}}
    caches = ["cold"] if method == "raw_read_direct" else ["cold", "warm"]
    for cache in caches:
        load_s, touch_s = [], []
        ch.mark(f"{cache}-start")
        for i in range(1 + repeat):
            if cache == "cold":
                evict(files, evict_mode)
                out["resident_before_cold"] = max(out["resident_before_cold"], resident_fraction(files))
            t0 = time.perf_counter()
            result = load()
            t1 = time.perf_counter()
            t2 = None
            if method in TOUCHING:
                tensor_sum(iter_tensors(result))
                t2 = time.perf_counter()
            if i == 0 and cache == caches[0]:
                got = check(result)
                if got == got and abs(got - paths["ref"]) > TOLERANCE * max(1.0, abs(paths["ref"])):
                    raise AssertionError(f"{method} loaded tensors summing to {got}, saved {paths['ref']}")
                out["checked"] = got == got
            del result
            if i == repeat and cache == caches[-1]:
                before_gc = proc_memory()
                gc.collect()
                after_gc = proc_memory()
                out["after_del"] = {"file": before_gc[2], "anon": before_gc[1], "rss": before_gc[0],
                                    "file_gc": after_gc[2], "anon_gc": after_gc[1], "rss_gc": after_gc[0]}
            gc.collect()
            if i >= 1:
                load_s.append(t1 - t0)
                if t2 is not None:
                    touch_s.append(t2 - t0)
        ch.mark(f"{cache}-end")
        out[cache] = {"load": load_s, "touch": touch_s}
    return out


def task_rank_loader(ch: Channel, rank: int, path: str, run_dir: str, limit: int | None, hold_s: float) -> dict:
    """One rank's restart: load its shard to CPU memory, hold it, drop it (a fresh process each time)."""
    import ckptd
    import ckptd.client  # noqa: F401  (imports torch now, not inside the timed load)

    from .measure import proc_memory

    ch.ready()
    t0 = time.monotonic()
    state = ckptd.load(path, rank=rank, map_location="cpu", run_dir=run_dir, max_concurrent_per_node=limit)
    t_loaded = time.monotonic()
    time.sleep(hold_s)
    del state
    after_del = proc_memory()
    gc.collect()
    after_gc = proc_memory()
    t_dropped = time.monotonic()
    ch.send("round", t0=t0, loaded=t_loaded, dropped=t_dropped, after_del=after_del, after_gc=after_gc)
    return {}


# --- orchestrator side -------------------------------------------------------


@dataclass
class LoadMethod:
    key: str
    what: str
    cold: Series | None
    warm: Series | None
    cold_touch: Series | None = None
    warm_touch: Series | None = None
    mem: MemPeak | None = None
    """The worker's peaks over all its loads; baselines at the first load."""
    resident_before_cold: float = 0.0
    others: float | None = None
    checked: bool = False
    base: dict = field(default_factory=dict)
    """The worker's RSS / anon / file bytes before its first load."""
    after_del: dict = field(default_factory=dict)
    """After the last load's result was deleted: RSS / anon / file before and after ``gc.collect()``."""


@dataclass
class RankLoad:
    limit: int | None
    wall: Series = field(default_factory=Series)
    """Go to the last rank having dropped its state."""
    load: Series = field(default_factory=Series)
    """Each rank's load call (lease wait included), every timed round."""
    peak_rss: list[int] = field(default_factory=list)
    peak_anon: list[int] = field(default_factory=list)
    base_rss: list[int] = field(default_factory=list)
    base_anon: list[int] = field(default_factory=list)
    others: list[float] = field(default_factory=list)
    after_del_rss: list[int] = field(default_factory=list)
    """Sum over the ranks of RSS right after ``del`` of the loaded state (before ``gc.collect()``)."""
    after_gc_rss: list[int] = field(default_factory=list)
    after_gc_anon: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "no limit" if self.limit is None else f"max_concurrent_per_node={self.limit}"


@dataclass
class LoadSection:
    nbytes: int
    files: dict
    sum_in_memory: Series
    methods: list[LoadMethod]
    shard_bytes: int = 0
    ranks: list[RankLoad] = field(default_factory=list)
    rank_count: int = 0
    evict_mode: str = "fadvise"
    prepare_others: float | None = None
    """Other CPU while the checkpoints were written and the in-memory sum timed."""

    def method(self, key: str) -> LoadMethod | None:
        return next((m for m in self.methods if m.key == key), None)


def _mem(run_marks: dict, sampler) -> MemPeak | None:
    t0 = run_marks.get("cold-start")
    t1 = run_marks.get("warm-end", run_marks.get("cold-end"))
    if t0 is None or t1 is None:
        return None
    return sampler.window(t0, t1).peaks.get("trainer")


def run_section(ctx: Ctx, size_gib: float, rank_size_gib: float, *, ranks: int = 4) -> LoadSection:
    from . import multi

    log("load: starting a ckptd daemon")
    with BenchDaemon(ctx.scratch) as daemon:
        prep_run = run_one(ctx, "load_prepare", "load: writing the checkpoints", size_gib=size_gib,
                           scratch=str(ctx.scratch), run_dir=str(daemon.run_dir), repeat=ctx.repeat)
        prep = prep_run.result
        section = LoadSection(prep["nbytes"], prep, Series(prep["sum_in_memory"]), [], evict_mode=ctx.evict_mode,
                              prepare_others=prep_run.phase.others)
        for key, what in METHODS:
            run = run_one(ctx, "load_method", f"load: {what}", method=key, paths=prep, size_gib=size_gib,
                          repeat=ctx.repeat, evict_mode=ctx.evict_mode)
            r = run.result
            cold, warm = r.get("cold"), r.get("warm")
            section.methods.append(LoadMethod(
                key, what, Series.of(cold and cold["load"]), Series.of(warm and warm["load"]),
                Series.of(cold and cold["touch"]), Series.of(warm and warm["touch"]),
                _mem(run.marks, ctx.sampler),
                r["resident_before_cold"], run.phase.others, r.get("checked", False), r.get("base", {}),
                r.get("after_del", {})))
        if ranks > 0:
            _, kept = multi.run_saves(ctx, daemon, ranks=ranks, size_gib=rank_size_gib, layouts=["shared"], rounds=0,
                                      prefix="rank4", keep_last=True, name=f"load: writing a {ranks}-rank checkpoint")
            path = Path(kept[0])
            section.shard_bytes = max(p.stat().st_size for p in _files(path) if p.suffix == ".safetensors")
            section.ranks = _rank_loads(ctx, daemon, path, ranks)
            section.rank_count = ranks
    return section


def _rank_loads(ctx: Ctx, daemon: BenchDaemon, path: Path, ranks: int) -> list[RankLoad]:
    """``repeat`` rounds per limit, each with ``ranks`` fresh processes (a restart loads once)."""
    limits: list[int | None] = [None, 1]
    shards = [p for p in _files(path) if p.suffix == ".safetensors"]
    out = []
    for limit in limits:
        res = RankLoad(limit)
        for rnd in range(ctx.repeat):
            group = Group(ctx, "rank_loader", f"load-{ranks}-ranks", "ranks",
                          [dict(rank=r, path=str(path), run_dir=str(daemon.run_dir), limit=limit, hold_s=HOLD_S)
                           for r in range(ranks)])
            try:
                group.ready()
                evict(shards, ctx.evict_mode)
                label = f"load: {ranks} ranks, {res.label}, round {rnd + 1}"
                log(label)
                time.sleep(0.2)  # a baseline sample with everyone ready and idle
                t_go = group.go(label)
                msgs = group.collect("round")
                t_end = time.monotonic()
                time.sleep(2 * ctx.sampler.interval)
                w = ctx.sampler.window(t_go, t_end)
                group.collect("result")
            finally:
                group.close()
            p = w.peaks.get("ranks")
            res.wall.add(max(m["dropped"] for m in msgs) - t_go)
            for m in msgs:
                res.load.add(m["loaded"] - m["t0"])
            res.after_del_rss.append(sum(m["after_del"][0] for m in msgs))
            res.after_gc_rss.append(sum(m["after_gc"][0] for m in msgs))
            res.after_gc_anon.append(sum(m["after_gc"][1] for m in msgs))
            if p is not None:
                res.peak_rss.append(p.rss)
                res.peak_anon.append(p.anon)
                res.base_rss.append(p.first_rss)
                res.base_anon.append(p.first_anon)
            if w.others is not None:
                res.others.append(w.others)
        out.append(res)
    return out

