"""Several ranks on one node: clients saving at once, ranks loading at once under a load lease, and FSDP2.

The case process forks the ranks before it touches a tensor: each is a fresh process with its own state, and every
round starts on a barrier. Saving: each client its own state, into separate checkpoints or one (rank r of N),
aggregate from the first call to the last future resolved. Loading: fresh processes load their shard, hold it, drop
it. FSDP2 ranks (one gloo group) build their shards on the meta device (none holds the full model) and run the dense
cases' save loops (``saves.py``); the reshard load saves with ckptd and ``dcp.save`` on N ranks and loads on N/2.
"""
from __future__ import annotations
import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import shutil
import time
from pathlib import Path
from typing import Any, Callable
import ckptd
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from . import limits, saves
from .limits import Sampler, evict, files_under, machine_seconds, memory
from .saves import BenchDaemon
from .state import build, iter_tensors

BARRIER_TIMEOUT_S, HOLD_S = 600.0, 0.5
_fork = mp.get_context("fork")

def _saver(rank: int, ranks: int, shared: bool, size_gib: float, device: str, paths: list[str], run_dir: str,
           go: Any, out: Any) -> None:
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

def _start(target: Any, args_of: list[tuple], daemon: bool = True) -> list[mp.Process]:
    torch.set_num_threads(1)  # inherited: one intra-op thread per rank, as torchrun sets it for several per node
    procs = [_fork.Process(target=target, args=a, daemon=daemon) for a in args_of]
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
    groups = {"ranks": [p.pid for p in procs], "daemon": [daemon.pid]}
    with Sampler(groups) as sampler:
        for rnd, path in enumerate(paths):
            if rnd == 1:
                node0 = machine_seconds(scratch, groups)
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
        node = {k: (v - node0[k]) / rounds for k, v in machine_seconds(scratch, groups).items()} if rounds else {}
    _join(procs)
    return {"reps": reps, "nbytes": sum(m["nbytes"] for m in msgs), "ranks_peak": sampler.peaks["ranks"],
            "daemon": sampler.peaks["daemon"], "ranks_cpu": node.get("ranks", 0), "daemon_cpu": node.get("daemon", 0),
            "node": node, "path": paths[-1], "cores": os.cpu_count()}

def multi_saves(scratch: Path, *, ranks: int, shared: bool, size_gib: float, device: str, repeat: int) -> dict:
    with BenchDaemon(scratch) as daemon:
        return save_rounds(daemon, scratch, ranks=ranks, shared=shared, size_gib=size_gib, device=device, rounds=repeat)

def _loader(rank: int, path: str, run_dir: str, limit: int | None, go: Any, out: Any) -> None:
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

def dtensor_sums(state: Any) -> list[float]:
    """Each DTensor's sum over every rank: the same for the same state on any number of ranks."""
    return saves.across_ranks([float(t.to_local().double().sum()) for t in iter_tensors(state)
                               if isinstance(t, DTensor)], dist.ReduceOp.SUM)

def _saves(rank: int, scratch: Path, mode: str, size_gib: float, repeat: int, daemon: Any) -> dict:
    bench = build("transformer", size_gib, seed=rank, fsdp=True)
    if mode == "memcpy":
        seconds = limits.memcpy_reused(bench.tensors, bench.nbytes, repeat, cleanup=dist.barrier)
        out = {"reps": {"seconds": saves.across_ranks(seconds)}}
    elif mode == "ckptd":
        out = saves.ckptd_saves(bench.state, scratch, repeat, memory()["VmRSS"], daemon)
    elif mode == "ckptd_dcp":
        out = saves.ckptd_dcp_saves(bench.state, scratch, repeat, memory()["VmRSS"], daemon)
    elif mode.startswith("torchckpt"):
        out = saves.torchckpt_saves(bench.state, scratch, repeat, memory()["VmRSS"], fsync=mode.endswith("_fsync"))
    else:
        out = saves.dcp_saves(bench.state, scratch, repeat, memory()["VmRSS"], mode=mode)
    everyone = saves.across_ranks([bench.nbytes], dist.ReduceOp.SUM)[0]
    return {"state": {**bench.describe(), "global_nbytes": int(everyone)}, **out}

def _prepare(rank: int, scratch: Path, size_gib: float, daemon: Any) -> dict:
    """The state saved by ckptd and by ``dcp.save``, and its per-tensor sums."""
    bench = build("transformer", size_gib, seed=rank, fsdp=True)
    paths = {"ckptd": str(scratch / "sharded" / "ckptd"), "dcp": str(scratch / "sharded" / "dcp")}
    with ckptd.Client(run_dir=daemon.run_dir, spawn=False, commit_timeout=600.0) as client:
        client.save_async(bench.state, paths["ckptd"], step=1, overwrite=True).result()
    dcp.save(bench.state, checkpoint_id=paths["dcp"])
    return {"sums": dtensor_sums(bench.state), **paths}

def _loads(rank: int, scratch: Path, method: str, size_gib: float, repeat: int, ref: dict) -> dict:
    """Cold and warm loads of the saved state into a fresh model's and optimizer's DTensors, in place."""
    bench, path = build("transformer", size_gib, seed=1000 + rank, fsdp=True), ref[method]
    load: Callable[[], Any] = ((lambda: ckptd.load_into(bench.state, path)) if method == "ckptd" else
                               (lambda: dcp.load(bench.state, checkpoint_id=path)))
    reps = {}
    for cache in ("cold", "warm"):
        def between() -> None:  # untimed: the next load starts cold (or not) on every rank at once
            if cache == "cold" and rank == 0:
                evict(files_under(Path(path)))
            dist.barrier()
        reps[cache] = saves.across_ranks(limits.timed(load, repeat, cleanup=between))
    got, saved = (torch.tensor(x, dtype=torch.float64) for x in (dtensor_sums(bench.state), ref["sums"]))
    if not torch.allclose(got, saved, rtol=1e-6, atol=1e-12):
        raise AssertionError(f"{method} loaded tensors whose sums differ from the saved ones")
    return {"reps": reps, "nbytes": bench.nbytes, "state": bench.describe()}

def _rank(rank: int, world: int, port: int, body: Callable[..., dict], args: tuple, out: Any) -> None:
    saves.init_gloo(rank, world, port)
    result = body(rank, *args)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()

def run_ranks(world: int, body: Callable[..., dict], *args: Any) -> dict:
    """``body(rank, *args)`` on ``world`` fresh ranks of one gloo group; rank 0's result (any rank failing raises)."""
    out, port = _fork.Queue(), saves.free_port()
    procs = _start(_rank, [(r, world, port, body, args, out) for r in range(world)], daemon=False)  # DCP forks
    result = None
    try:
        while result is None:
            with contextlib.suppress(queue.Empty):
                result = out.get(timeout=1.0)
            if failed := [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]:
                raise RuntimeError(", ".join(failed) + " (its traceback is in the case's log)")
        return result
    finally:  # the others of a failed rank wait in a collective forever: killed at once
        for p in procs:
            p.join(saves.START_TIMEOUT_S if result is not None else 0)
            if p.is_alive():
                p.kill()

def sharded(scratch: Path, *, mode: str, ranks: int, size_gib: float, repeat: int) -> dict:
    """One sharded case: saves by ``mode`` on ``ranks`` ranks, or (``load_*``) loads on half as many."""
    if not mode.startswith("load_"):
        with BenchDaemon(scratch) if mode.startswith("ckptd") else contextlib.nullcontext() as daemon:
            return run_ranks(ranks, _saves, scratch, mode, size_gib, repeat, daemon)
    (ref := scratch / "sharded" / "ref.json").parent.mkdir(parents=True, exist_ok=True)
    if not ref.exists():
        with BenchDaemon(scratch) as daemon:
            ref.write_text(json.dumps(run_ranks(ranks, _prepare, scratch, size_gib, daemon)))
    return run_ranks(ranks // 2, _loads, scratch, mode[len("load_"):], size_gib, repeat, json.loads(ref.read_text()))
