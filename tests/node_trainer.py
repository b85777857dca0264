"""The trainer rank of the multi-node tests (``tests/test_node_loss.py``, ``tests/test_ring.py``): its state at
each step, which tells a bitwise resume from any other, and its resume, as a training script does it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

import ckptd


def state(rank: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: different on every rank and at every step."""
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(256, 256, generator=gen), "b": torch.randn(300, generator=gen), "step": step}


def resume(rank: int, root: str, run_dir: str, log: dict[str, Any], *, saved_rank: int | None = None) -> None:
    """``ckptd.latest`` and ``ckptd.load_into`` against the daemon of ``run_dir``; ``log`` gets what was resumed
    (``resumed``), its step and whether it is bitwise that step's state of this rank (``bitwise``), or of
    ``saved_rank`` (a rank beyond the world that saved takes one saved rank's per-rank state: ``load_into``'s
    ``rank=``)."""
    resumed = ckptd.latest(root, run_dir=run_dir)
    log["resumed"] = None if resumed is None else str(resumed)
    if resumed is not None:
        into = {"w": torch.zeros(256, 256), "b": torch.zeros(300), "step": -1}
        ckptd.load_into(into, resumed, run_dir=run_dir, rank=saved_rank)
        want = state(rank if saved_rank is None else saved_rank, into["step"])
        log["step"] = into["step"]
        log["bitwise"] = all(torch.equal(into[k], want[k]) for k in ("w", "b"))


def snapshot(client: ckptd.Client, rank: int, root: str, steps: list[int]) -> None:
    """Take a memory snapshot of this rank's state at each of ``steps`` (``step-N`` under ``root``), each held and
    replicated on the node's buddy before the next."""
    for step in steps:
        fut = client.save_async(state(rank, step), Path(root) / f"step-{step}", step=step, persist=False)
        fut.result(60)
        fut.wait_replicated(60)


def report_and_train_on(out: str, rank: int, log: dict[str, Any]) -> None:
    """Write the rank's ``log`` (``rank-N.json``, then ``done-N``) and go on training, as a trainer does, until its
    job is killed."""
    Path(out, f"rank-{rank}.json").write_text(json.dumps(log))
    Path(out, f"done-{rank}").touch()
    while True:
        time.sleep(1)
