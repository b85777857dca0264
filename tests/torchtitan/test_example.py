"""examples/torchtitan_train.py under torchrun: two ranks train and save, three ranks resume from the newest step.

The resumed run says where it resumed and what its dataloader had consumed;
this process reads both from the checkpoint (``ckptd.load``, no process group).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ckptd

from helpers import REPO, wait_until
from zygote import run_module

EXAMPLE = REPO / "examples" / "torchtitan_train.py"


def run_example(daemon, ckpt_dir: Path, procs: int, steps: int, mode: str) -> str:
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1")
    args = ["--nproc-per-node", str(procs), "--standalone", str(EXAMPLE), "--ckpt-dir", str(ckpt_dir),
            "--steps", str(steps), "--save-every", "3", "--async-mode", mode]
    out = run_module("torch.distributed.run", *args, env=env, cwd=str(REPO), timeout=200)
    assert out.returncode == 0, f"torchrun exited {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.timeout(450)
def test_example_trains_on_two_ranks_and_resumes_on_three(daemon, root: Path) -> None:
    ckpt_dir = root / "titan"
    first = run_example(daemon, ckpt_dir, 2, 6, "async")
    assert "resumed" not in first and "rank 1: trained to step 6" in first
    six = ckpt_dir / "step-6"
    assert ckptd.read_index(six).world_size == 2

    second = run_example(daemon, ckpt_dir, 3, 9, "async_with_pinned_mem")
    consumed = ckptd.load(six)["dataloader"]["consumed"]
    assert consumed == 12
    for rank in range(3):
        assert f"rank {rank}: resumed at step 6 on 3 ranks, {consumed} batches consumed" in second, second
        assert f"rank {rank}: trained to step 9" in second
    nine = ckptd.load(ckpt_dir / "step-9")
    assert ckptd.read_index(ckpt_dir / "step-9").world_size == 3
    assert nine["train_state"]["step"] == 9 and nine["dataloader"]["consumed"] == 12 + 3 * 3
    kept = lambda: sorted(os.listdir(ckpt_dir))  # noqa: E731
    wait_until(lambda: kept() == ["step-6", "step-9"], timeout=60, what=lambda: f"keep_latest_k=2 left {kept()}")
