"""examples/torchrun_train.py under torchrun: two ranks save shards, a second run resumes.

The example runs as users run it (``python -m torch.distributed.run
--standalone``; the launcher forks from the test zygote, the ranks it starts
are fresh interpreters), against the test's daemon through ``CKPTD_RUN_DIR``. A
third, uninterrupted run shows that resuming lost nothing: its final weights
equal the resumed run's bit for bit (CPU, gloo, one thread per rank: the
arithmetic is deterministic).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd

from helpers import REPO, torchrun_example

EXAMPLE = REPO / "examples" / "torchrun_train.py"


def run_example(daemon, ckpt_dir: Path, steps: int) -> str:
    """One ``torchrun --nproc-per-node 2`` run of the example, saving every 5 steps: what it printed."""
    return torchrun_example(EXAMPLE, daemon, ckpt_dir, 2, "--steps", str(steps), "--save-every", "5", timeout=60)


@pytest.mark.timeout(150)
def test_torchrun_example_saves_two_shards_and_resumes_from_the_last_saved_step(daemon, root: Path) -> None:
    resumed_dir = root / "resumed"
    first = run_example(daemon, resumed_dir, 20)
    for rank in (0, 1):
        assert f"rank {rank}: no checkpoint under {resumed_dir}; starting from step 0" in first
        assert f"rank {rank}: trained to step 20" in first
        assert "committed steps [5, 10, 15, 20]" in first
    assert ckptd.latest(resumed_dir) == resumed_dir / "step-000020"

    second = run_example(daemon, resumed_dir, 30)
    for rank in (0, 1):
        assert f"rank {rank}: resumed from step 20 ({resumed_dir / 'step-000020'})" in second
    assert "committed steps [25, 30]" in second

    last = ckptd.latest(resumed_dir)
    assert last == resumed_dir / "step-000030"
    index = ckptd.read_index(last)
    assert index.world_size == 2 and index.step == 30
    assert sorted(f.rank for f in index.files) == [0, 1]
    assert sorted(p.name for p in last.iterdir()) == [
        "ckptd.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    shards = [ckptd.load(last, rank=r) for r in (0, 1)]
    assert [s["rank"] for s in shards] == [0, 1] and [s["step"] for s in shards] == [30, 30]
    assert not torch.equal(shards[0]["data_rng"], shards[1]["data_rng"])  # per-rank state, per-rank shard
    # the model and optimizer, the same on both ranks, are stored once, in rank 0's shard, and served to both
    replicated = [n for n in index.tensors if n.startswith(("model.", "optimizer."))]
    assert len(replicated) == 4 + 3 * 4
    assert {c.file for n in replicated for c in index.tensors[n].chunks} == {index.files[0].file}
    assert [n for n in ckptd.inspect(last).shards[1].tensors if n.name.startswith("model.")] == []
    for name, tensor in shards[0]["model"].items():
        assert torch.equal(shards[1]["model"][name], tensor)
    assert not [p for p in root.rglob("*") if p.name.endswith(".incomplete")]

    straight_dir = root / "straight"
    run_example(daemon, straight_dir, 30)
    straight = ckptd.load(straight_dir / "step-000030", rank=0)
    for name, tensor in straight["model"].items():
        assert torch.equal(shards[0]["model"][name], tensor), f"{name}: resuming changed the training"
