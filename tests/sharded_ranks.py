"""Helpers for tests that run real gloo ranks: spawn them, and save one sharded checkpoint on four.

The saved state is an FSDP2 model (7 rows over 4 ranks: uneven) with its
AdamW state from ``get_state_dict``, a 2-D mesh tensor sharded on both
dimensions (so its chunks are not contiguous runs of the full tensor) and
plain values. Rank 0 writes every tensor's ``full_tensor()`` as the reference.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from helpers import join_ranks
from zygote import start_ranks


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


def fsdp(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model on ``world`` ranks with AdamW state after one step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = model()
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(5, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    return m, optim


def full(state: Any) -> Any:
    """``state`` with every DTensor replaced by its full tensor."""
    if isinstance(state, dict):
        return {k: full(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full(v) for v in state)
    if hasattr(state, "full_tensor"):
        return state.full_tensor().clone()
    return state.clone() if isinstance(state, torch.Tensor) else state


def save_on_four(rank: int, world: int, init: str, run_dir: str, path: str, out: str) -> None:
    """Rank ``rank`` of four saves the sharded state to ``path`` and logs what it did."""
    def body() -> dict:
        import ckptd
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        m, optim = fsdp(world)
        msd, osd = get_state_dict(m, optim)
        grid = torch.arange(6 * 5, dtype=torch.float64).reshape(6, 5)
        state = {"model": msd, "optim": osd, "epoch": 3, "note": "first run",
                 "grid": distribute_tensor(grid, init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])}
        reference = full(state)  # a collective: every rank takes part
        if rank == 0:
            torch.save(reference, Path(out) / "reference.pt")
        with ckptd.Client(run_dir=run_dir, spawn=False, commit_timeout=120, timeout=30) as client:
            return {"path": str(client.save_async(state, path, step=1).result(120).path)}

    run_rank(rank, world, init, out, "save", body)


def run_rank(rank: int, world: int, init: str, out: str, name: str, body: Callable[[], dict]) -> None:
    """Join the gloo group, run ``body``, write its log (or the traceback) as ``out/name-rank.json``."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        log = body()
    except BaseException:
        log = {"crash": traceback.format_exc()}
    Path(out, f"{name}-{rank}.json").write_text(json.dumps(log))
    dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, tmp: Path, name: str, *args: Any) -> list[dict]:
    """Spawn ``world`` processes of ``fn(rank, world, init, *args)``; their logs, each checked for a crash."""
    init = tmp / f"init-{name}"
    ctx = start_ranks(fn, (world, str(init), *args), world)
    deadline = time.monotonic() + 300
    try:
        join_ranks(ctx, deadline)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = Path(args[-1])
    logs = [json.loads((out / f"{name}-{r}.json").read_text()) for r in range(world)]
    for r, log in enumerate(logs):
        assert "crash" not in log, f"rank {r}: {log['crash']}"
    return logs


def sharded_checkpoint(tmp: Path) -> Iterator[tuple[Path, dict]]:
    """A module fixture's body: a daemon, the four-rank save, (checkpoint, reference); the daemon goes after."""
    from helpers import short_tempdir, start_daemon

    root, run_dir = tmp / "ckpts", short_tempdir("ckshd-")
    root.mkdir()
    daemon = start_daemon(run_dir, root)
    try:
        yield save_sharded(tmp, root, run_dir)
    finally:
        daemon.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def save_sharded(tmp: Path, root: Path, run_dir: Path) -> tuple[Path, dict]:
    """Save the sharded state on four ranks through the daemon at ``run_dir``; (checkpoint, reference)."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    path = root / "sharded"
    logs = run_ranks(save_on_four, 4, tmp, "save", str(run_dir), str(path), str(out))
    assert all(log["path"] == str(path) for log in logs), logs
    return path, torch.load(out / "reference.pt")
