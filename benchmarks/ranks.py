"""Several ranks on one node: clients saving at once, and ranks loading at once under a load lease.

The case process forks the ranks before it touches a tensor, so each rank
is a fresh process with its own state; every round starts on a barrier, and
the case samples the ranks' and the daemon's memory meanwhile. Saving: each
client its own state, into separate checkpoints or one (rank r of N); the
aggregate runs from the first call to the last future resolved. Loading:
fresh processes load their shard with ``map_location="cpu"``, hold it,
drop it, with no limit or with ``max_concurrent_per_node``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import shutil
import time
from pathlib import Path
from typing import Any

from .probe import Sampler, cpu_seconds, evict, files_under, memory
from .saves import BenchDaemon
from .state import build

BARRIER_TIMEOUT_S = 600.0
HOLD_S = 0.5
_fork = mp.get_context("fork")


def _saver(rank: int, ranks: int, shared: bool, size_gib: float, device: str, paths: list[str], run_dir: str,
           go: Any, out: Any) -> None:
    import ckptd

    bench = build("transformer", size_gib, device=device, seed=rank)
    with ckptd.Client(run_dir=run_dir, spawn=False, max_inflight=1, rank=rank if shared else 0,
                      world_size=ranks if shared else 1, commit_timeout=300.0) as client:
        for rnd, path in enumerate(paths):
            go.wait()
            t0 = time.monotonic()
            fut = client.save_async(bench.state, path if shared else f"{path}-r{rank}", step=rnd)
            t1 = time.monotonic()
            fut.result()
            out.put({"rank": rank, "t0": t0, "blocking": t1 - t0, "t_durable": time.monotonic(),
                     "nbytes": bench.nbytes})
            go.wait()  # the parent removes the round's checkpoints


def _start(target: Any, args_of: list[tuple]) -> list[mp.Process]:
    procs = [_fork.Process(target=target, args=a, daemon=True) for a in args_of]
    for p in procs:
        p.start()
    return procs


def _join(procs: list[mp.Process]) -> None:
    for p in procs:
        p.join(BARRIER_TIMEOUT_S)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank process exited with {p.exitcode}")


def save_rounds(daemon: BenchDaemon, scratch: Path, *, ranks: int, shared: bool, size_gib: float, device: str,
                rounds: int, keep_last: bool = False) -> dict:
    """A warm-up round and ``rounds`` timed ones; every rank's times, the aggregate, memory and CPU."""
    paths = [str(scratch / f"multi-{'one' if shared else 'sep'}-{r}") for r in range(1 + rounds)]
    go, out = _fork.Barrier(ranks + 1, timeout=BARRIER_TIMEOUT_S), _fork.Queue()
    procs = _start(_saver, [(r, ranks, shared, size_gib, device, paths, str(daemon.run_dir), go, out)
                            for r in range(ranks)])
    reps: dict[str, list[float]] = {"aggregate": [], "blocking": [], "durable": []}
    pids = [p.pid for p in procs]
    with Sampler({"ranks": pids, "daemon": [daemon.pid]}) as sampler:
        for rnd, path in enumerate(paths):
            if rnd == 1:
                cpu0 = [sum(cpu_seconds(p) for p in pids), cpu_seconds(daemon.pid)]
            go.wait()
            msgs = [out.get(timeout=BARRIER_TIMEOUT_S) for _ in range(ranks)]
            if rnd:
                reps["aggregate"].append(max(m["t_durable"] for m in msgs) - min(m["t0"] for m in msgs))
                reps["blocking"] += [m["blocking"] for m in msgs]
                reps["durable"] += [m["t_durable"] - m["t0"] for m in msgs]
            if not (keep_last and rnd == rounds):
                for p in [path] if shared else [f"{path}-r{r}" for r in range(ranks)]:
                    shutil.rmtree(p, ignore_errors=True)
            go.wait()
        cpu = [sum(cpu_seconds(p) for p in pids) - cpu0[0], cpu_seconds(daemon.pid) - cpu0[1]] if rounds else [0, 0]
    _join(procs)
    return {"reps": reps, "nbytes": sum(m["nbytes"] for m in msgs), "ranks_peak": sampler.peaks["ranks"],
            "daemon": sampler.peaks["daemon"], "ranks_cpu": cpu[0] / max(rounds, 1),
            "daemon_cpu": cpu[1] / max(rounds, 1), "path": paths[-1]}


def multi_saves(scratch: Path, *, ranks: int, shared: bool, size_gib: float, device: str, repeat: int) -> dict:
    with BenchDaemon(scratch) as daemon:
        return save_rounds(daemon, scratch, ranks=ranks, shared=shared, size_gib=size_gib, device=device,
                           rounds=repeat)


def _loader(rank: int, path: str, run_dir: str, limit: int | None, go: Any, out: Any) -> None:
    import ckptd

    go.wait()
    t0 = time.monotonic()
    state = ckptd.load(path, rank=rank, map_location="cpu", run_dir=run_dir, max_concurrent_per_node=limit)
    loaded = time.monotonic()
    time.sleep(HOLD_S)
    del state
    gc.collect()
    out.put({"load": loaded - t0, "dropped": time.monotonic(), "after_gc": memory()["VmRSS"]})


def rank_loads(scratch: Path, *, ranks: int, size_gib: float, limit: int | None, repeat: int) -> dict:
    """Write a ``ranks``-rank checkpoint, then ``repeat`` rounds of fresh processes loading it cold at once."""
    reps: dict[str, list] = {"wall": [], "load": [], "peak_rss": [], "peak_anon": [], "idle_rss": [],
                             "idle_anon": [], "after_gc_rss": []}
    with BenchDaemon(scratch) as daemon:
        path = save_rounds(daemon, scratch, ranks=ranks, shared=True, size_gib=size_gib, device="cpu", rounds=0,
                           keep_last=True)["path"]
        shards = [p for p in files_under(Path(path)) if p.suffix == ".safetensors"]
        shard_bytes = max(p.stat().st_size for p in shards)
        for _ in range(repeat):
            go, out = _fork.Barrier(ranks + 1, timeout=BARRIER_TIMEOUT_S), _fork.Queue()
            procs = _start(_loader, [(r, path, str(daemon.run_dir), limit, go, out) for r in range(ranks)])
            evict(shards)
            time.sleep(0.2)  # the ranks are idle: their baseline
            with Sampler({"ranks": [p.pid for p in procs]}) as sampler:
                t_go = time.monotonic()
                go.wait()
                msgs = [out.get(timeout=BARRIER_TIMEOUT_S) for _ in range(ranks)]
            _join(procs)
            reps["wall"].append(max(m["dropped"] for m in msgs) - t_go)
            reps["load"] += [m["load"] for m in msgs]
            reps["after_gc_rss"].append(sum(m["after_gc"] for m in msgs))
            for key, field in (("rss", "VmRSS"), ("anon", "RssAnon")):
                reps[f"peak_{key}"].append(sampler.peaks["ranks"][field])
                reps[f"idle_{key}"].append(sampler.first["ranks"][field])
        shutil.rmtree(path, ignore_errors=True)
    return {"reps": reps, "shard_bytes": shard_bytes}
