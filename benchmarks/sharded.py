"""FSDP2 on several ranks (gloo on CPU): sharded saves against DCP and a memcpy, and a reshard load against dcp.load.

The case process forks the ranks. Each builds its shard of the transformer
under ``fully_shard`` (on the meta device first: no rank ever holds the full
model) with its AdamW state, and runs the dense cases' own save loops
(``saves.py``): every save starts on a barrier and every figure is the
slowest rank's. The limit is a memcpy of each rank's local bytes, all ranks
at once. The reshard load saves the state once with ckptd and once with
``dcp.save`` on N ranks, then loads each on N/2 into the DTensors of a fresh
model and optimizer, cold and warm, checked per tensor against what was saved.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import queue
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import limits, saves
from .probe import evict, files_under, memory
from .state import BenchState, TinyTransformer, iter_tensors, pick_width

_fork = mp.get_context("fork")


def fsdp_state(size_gib: float, seed: int) -> BenchState:
    """A ``fully_shard`` transformer of about ``size_gib`` GiB of state over every rank; this rank's local tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = TinyTransformer(pick_width(int(size_gib * (1 << 30))))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model.to_empty(device="cpu")
    torch.manual_seed(seed + dist.get_rank())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=False)  # foreach: 4× slower on DTensors
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
            p.grad = p.detach() * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd, "step": 1000}
    return BenchState(state, [t.to_local() if isinstance(t, DTensor) else t for t in iter_tensors(state)])


def dtensor_sums(state: Any) -> list[float]:
    """Each DTensor's sum over every rank (float64): equal for the same state on any number of ranks."""
    sums = torch.tensor([float(t.to_local().double().sum()) for t in iter_tensors(state) if isinstance(t, DTensor)],
                        dtype=torch.float64)
    dist.all_reduce(sums)
    return sums.tolist()


def _saves(rank: int, scratch: Path, mode: str, size_gib: float, repeat: int, daemon: Any) -> dict:
    bench = fsdp_state(size_gib, seed=0)
    rss = memory()["VmRSS"]
    if mode == "memcpy":
        out = {"reps": {"seconds": saves.slowest(limits.memcpy_reused(bench.tensors, bench.nbytes, repeat,
                                                                      cleanup=dist.barrier))}}
    elif mode == "ckptd":
        out = saves.ckptd_saves(bench.state, scratch, repeat, rss, daemon)
    else:
        out = saves.dcp_saves(bench.state, scratch, repeat, rss, mode=mode)
    everyone = torch.tensor([bench.nbytes], dtype=torch.float64)
    dist.all_reduce(everyone)
    return {"state": {**bench.describe(), "global_nbytes": int(everyone.item())}, **out}


def _prepare(rank: int, scratch: Path, size_gib: float, daemon: Any) -> dict:
    """The state saved by ckptd and by ``dcp.save``, and its per-tensor sums."""
    import ckptd
    import torch.distributed.checkpoint as dcp

    bench = fsdp_state(size_gib, seed=0)
    paths = {"ckptd": str(scratch / "sharded" / "ckptd"), "dcp": str(scratch / "sharded" / "dcp")}
    with ckptd.Client(run_dir=daemon.run_dir, spawn=False, commit_timeout=600.0) as client:
        client.save_async(bench.state, paths["ckptd"], step=1, overwrite=True).result()
    dcp.save(bench.state, checkpoint_id=paths["dcp"])
    return {"sums": dtensor_sums(bench.state), **paths}


def _loads(rank: int, scratch: Path, method: str, size_gib: float, repeat: int, ref: dict) -> dict:
    """Cold and warm loads of the saved state into a fresh model's and optimizer's DTensors, in place."""
    import ckptd
    import torch.distributed.checkpoint as dcp

    bench = fsdp_state(size_gib, seed=1000)
    path = ref[method]
    load: Callable[[], Any] = ((lambda: ckptd.load_into(bench.state, path)) if method == "ckptd" else
                               (lambda: dcp.load(bench.state, checkpoint_id=path)))
    files = files_under(Path(path))
    reps = {}
    for cache in ("cold", "warm"):
        def between() -> None:  # untimed: the next load starts cold (or not) on every rank at once
            if cache == "cold" and rank == 0:
                evict(files)
            dist.barrier()
        reps[cache] = saves.slowest(limits.timed(load, repeat, cleanup=between))
    got = torch.tensor(dtensor_sums(bench.state), dtype=torch.float64)
    if not torch.allclose(got, torch.tensor(ref["sums"], dtype=torch.float64), rtol=1e-6, atol=1e-12):
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
    procs = [_fork.Process(target=_rank, args=(r, world, port, body, args, out)) for r in range(world)]
    for p in procs:
        p.start()
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
        with saves.BenchDaemon(scratch) if mode == "ckptd" else contextlib.nullcontext() as daemon:
            return run_ranks(ranks, _saves, scratch, mode, size_gib, repeat, daemon)
    ref_file = scratch / "sharded" / "ref.json"
    if not ref_file.exists():
        with saves.BenchDaemon(scratch) as daemon:
            ref_file.parent.mkdir(parents=True, exist_ok=True)
            ref_file.write_text(json.dumps(run_ranks(ranks, _prepare, scratch, size_gib, daemon)))
    return run_ranks(ranks // 2, _loads, scratch, mode[len("load_"):], size_gib, repeat, json.loads(ref_file.read_text()))
