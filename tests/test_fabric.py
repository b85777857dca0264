"""Lightning Fabric with ckptd: ``fabric.save``/``fabric.load`` in one process, and under torchrun with DDP and FSDP2.

The multi-rank runs are ``examples/fabric_train.py`` on gloo ranks: a first
run saves every three steps, a second run on three ranks resumes from
``ckptd.latest`` and prints a digest of the full weights it resumed from,
which this process recomputes from the checkpoint with ``ckptd.load``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import ckptd
from ckptd.integrations.fabric import CkptdCheckpointIO, CkptdFabricModelParallelStrategy

from helpers import REPO, torchrun_example
from zygote import run_module

EXAMPLE = REPO / "examples" / "fabric_train.py"


class Counter:
    """A Stateful entry: Fabric saves its state_dict() and load gives it back through load_state_dict()."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def setup(fabric: Fabric, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.1))


@pytest.mark.timeout(120)
def test_fabric_save_and_load_in_one_process(daemon, root: Path) -> None:
    io = CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False, timeout=10.0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    assert fabric.strategy.checkpoint_io is io
    model, optimizer = setup(fabric, 0)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    fabric.backward(model(x).pow(2).mean())
    optimizer.step()
    path = root / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "counter": Counter(5), "global_step": 1,
                       "notes": {"lr": 0.1, "tags": ("a", "b")}})
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    with torch.no_grad():  # after fabric.save returns the state may change: the checkpoint holds the old values
        for p in model.parameters():
            p.add_(1.0)

    model2, optimizer2 = setup(fabric, 1)  # other weights, no optimizer state yet
    counter = Counter()
    state = {"model": model2, "optimizer": optimizer2, "counter": counter, "global_step": 0}
    remainder = fabric.load(path, state)  # waits for the save in flight to path
    assert remainder == {"notes": {"lr": 0.1, "tags": ("a", "b")}}
    assert state["global_step"] == 1 and counter.n == 5
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_weights[k]), k
    for actual, expected in zip([s["exp_avg"] for s in optimizer2.state.values()], saved_moments, strict=True):
        assert torch.equal(actual, expected)
    assert ckptd.read_index(path).step == 1  # global_step names the checkpoint's step: ckptd.latest finds it
    assert ckptd.latest(root) == path

    fabric.save(path, {"model": model})  # a second save to the path replaces the first, as torch.save's would
    io.wait(path)
    assert ckptd.load(path).keys() == {"model"}
    io.teardown()


def run_example(daemon, ckpt_dir: Path, procs: int, *args: str) -> str:
    return torchrun_example(EXAMPLE, daemon, ckpt_dir, procs, *args)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy, saved_world", [("ddp", 1), ("fsdp", 2)])
def test_fabric_on_two_ranks_saves_and_resumes_on_three(daemon, root: Path, strategy: str, saved_world: int) -> None:
    """DDP saves one whole state from rank 0 (a one-rank checkpoint); FSDP2 saves each rank's shards."""
    ckpt_dir = root / strategy
    first = run_example(daemon, ckpt_dir, 2, "--strategy", strategy, "--steps", "6")
    assert "trained to step 6 on 2 ranks" in first, first
    assert sorted(os.listdir(ckpt_dir)) == ["step-0003", "step-0006"]
    six = ckpt_dir / "step-0006"
    assert ckptd.read_index(six).world_size == saved_world and ckptd.read_index(six).step == 6

    second = run_example(daemon, ckpt_dir, 3, "--strategy", strategy, "--steps", "9")
    match = re.search(r"resumed from step 6 on 3 ranks \((.*)\), weights (\S+)", second)
    assert match and match.group(1) == str(six), second
    saved = ckptd.load(six)
    assert float(match.group(2)) == sum(t.double().sum().item() for t in saved["model"].values())
    assert saved["global_step"] == 6 and "state" in saved["optimizer"]
    assert sorted(os.listdir(ckpt_dir)) == ["step-0003", "step-0006", "step-0009"]
    assert not [p for p in root.rglob("*") if p.name.endswith(".incomplete")]


@pytest.mark.timeout(300)
def test_fabric_refuses_a_model_sharded_over_some_ranks_only(daemon, root: Path) -> None:
    """FSDP2 over a data-parallel axis of 1 of 2 ranks: both ranks hold the same chunks; refused at fabric.save."""
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1")
    out = run_module("torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(EXAMPLE),
                     "--ckpt-dir", str(root / "fsdp"), "--strategy", "fsdp", "--data-parallel", "1",
                     env=env, cwd=str(REPO), timeout=240)
    assert out.returncode != 0
    assert "ValueError: state['model']['0.weight'] is sharded over 1 of the 2 ranks" in out.stderr, out.stderr[-6000:]


def test_the_sharded_strategy_refuses_what_it_cannot_save(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        CkptdFabricModelParallelStrategy(lambda m, mesh: m, save_distributed_checkpoint=False)
    strategy = CkptdFabricModelParallelStrategy(lambda m, mesh: m, checkpoint_io=CkptdCheckpointIO(run_dir=tmp_path))
    with pytest.raises(ValueError, match="filter= is not supported"):
        strategy.save_checkpoint(tmp_path / "c", {"model": nn.Linear(1, 1)}, filter={"model": lambda k, v: True})
    with pytest.raises(ValueError, match="exactly one model set up by the strategy.*found none"):
        strategy.save_checkpoint(tmp_path / "c", {"model": nn.Linear(1, 1)})  # not sharded: never set up
    with pytest.raises(ValueError, match="needs state="):
        strategy.load_checkpoint(tmp_path / "c", nn.Linear(1, 1))
    io = CkptdCheckpointIO(run_dir=tmp_path)  # a plugin configures the strategy's saves: every rank saves its shard
    fabric = Fabric(accelerator="cpu", devices=1, strategy=CkptdFabricModelParallelStrategy(lambda m, mesh: m),
                    plugins=[io])
    assert fabric.strategy.checkpoint_io is io and io._client_kwargs["rank"] is None
