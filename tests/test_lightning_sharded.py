"""Lightning's ModelParallelStrategy (FSDP2) with ckptd: a real Trainer on two CPU ranks under torchrun.

``examples/lightning_fsdp.py`` trains with ``CkptdModelParallelStrategy`` on
two gloo ranks (Lightning allows the strategy on CPU), keeping the best two
checkpoints by a fixed score and ``last.ckpt``; a second run resumes from
``last.ckpt`` on three ranks. Each run prints a digest of the full weights
and AdamW moments it starts from; this process computes the same digests from
the checkpoint with ``ckptd.load`` (no process group), so the resharded
restore is checked against what was saved.

Lightning's ``FSDPStrategy`` (FSDP1) needs a GPU in a Trainer;
``CkptdFSDPStrategy``'s save and load are tested on real FSDP1-sharded
modules on two CPU ranks instead (``tests/fsdp1_ranks.py``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import lightning as L  # make test installs it (requirements-dev.txt): a missing one is a failure, never a skip

import torch  # noqa: E402

import ckptd  # noqa: E402
from ckptd.integrations.lightning import CkptdCheckpointIO  # noqa: E402
from ckptd.integrations.lightning_sharded import CkptdFSDPStrategy, CkptdModelParallelStrategy  # noqa: E402

from helpers import REPO, torchrun_example  # noqa: E402
from zygote import run_module  # noqa: E402

EXAMPLE = REPO / "examples" / "lightning_fsdp.py"


def run_example(daemon, ckpt_dir: Path, procs: int, *args: str) -> str:
    return torchrun_example(EXAMPLE, daemon, ckpt_dir, procs, *args)


def digests(path: Path) -> tuple[float, float]:
    """The sums of the full weights and first moments saved at ``path``, as the example prints them."""
    saved = ckptd.load(path)
    weights = sum(t.double().sum().item() for t in saved["state_dict"].values())
    moments = sum(s["exp_avg"].double().sum().item() for s in saved["optimizer_states"][0]["state"].values())
    return weights, moments


@pytest.mark.timeout(600)
def test_trainer_saves_sharded_top_k_and_last_and_resumes_on_three_ranks(daemon, root: Path) -> None:
    ckpt_dir = root / "lit"
    first = run_example(daemon, ckpt_dir, 2, "--epochs", "3")
    assert "start at step 0 on 2 ranks" in first, first
    # 4 steps per epoch on two ranks; scores fall every epoch: the best two are epochs 1 and 2
    assert "checkpoints ['epoch=1-step=8.ckpt', 'epoch=2-step=12.ckpt', 'last.ckpt']" in first, first
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    last = ckpt_dir / "last.ckpt"
    index = ckptd.read_index(last)
    assert index.world_size == 2 and index.step == 12
    assert {"state_dict.net.0.weight", "optimizer_states.0.state.net.0.weight.exp_avg"} <= set(index.tensors), \
        sorted(index.tensors)  # saved as global tensors, each rank's chunks, nothing gathered
    whole = ckptd.load(last)  # one plain process: the whole Lightning checkpoint, consolidated
    assert whole["global_step"] == 12 and whole["epoch"] == 2
    assert whole["pytorch-lightning_version"] == L.__version__
    assert whole["state_dict"]["net.0.weight"].shape == (32, 8)
    assert any(k.startswith("ModelCheckpoint") for k in whole["callbacks"])

    weights, moments = digests(last)
    second = run_example(daemon, ckpt_dir, 3, "--epochs", "7", "--resume")  # more epochs than the first run knew
    match = re.search(r"start at step (\d+) on 3 ranks: weights (\S+) moments (\S+)", second)
    assert match, second
    assert int(match.group(1)) == 12
    assert float(match.group(2)) == weights and float(match.group(3)) == moments and moments != 0
    # epochs 3 to 6 (3 steps each on three ranks) displaced epochs 1 and 2: the restored ModelCheckpoint state
    # went on pruning
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=5-step=21.ckpt", "epoch=6-step=24.ckpt", "last.ckpt"]
    assert ckptd.read_index(last).world_size == 3 and ckptd.read_index(last).step == 24
    assert not [p for p in root.rglob("*") if p.name.endswith(".incomplete")]


@pytest.mark.timeout(300)
def test_a_model_sharded_over_some_ranks_only_is_refused_when_saved(daemon, root: Path) -> None:
    """Lightning's default mesh on one node is 1 x world (tensor-parallel); FSDP2 over its data-parallel axis
    alone leaves every rank with the same chunks: refused at the first save, naming the tensor and the fix."""
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1")
    out = run_module("torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(EXAMPLE),
                     "--ckpt-dir", str(root / "lit"), "--epochs", "1", "--data-parallel", "1",
                     env=env, cwd=str(REPO), timeout=240)
    assert out.returncode != 0
    assert ("ValueError: state_dict['net.0.weight'] is sharded over 1 of the 2 ranks" in out.stderr
            and "data_parallel_size=<world size>" in out.stderr), out.stderr[-6000:]
    assert not (root / "lit").exists() or not [p for p in (root / "lit").iterdir() if not p.name.endswith("incomplete")]


def test_the_strategy_refuses_what_would_gather_or_save_elsewhere(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        CkptdModelParallelStrategy(save_distributed_checkpoint=False)
    strategy = CkptdModelParallelStrategy(checkpoint_io=CkptdCheckpointIO(run_dir=tmp_path, spawn=False))
    assert strategy.checkpoint_io._client_kwargs["rank"] is None  # every rank saves its shard
    with pytest.raises(TypeError, match="not a TorchCheckpointIO"):
        strategy.checkpoint_io = L.pytorch.plugins.TorchCheckpointIO()
    io = CkptdCheckpointIO(run_dir=tmp_path, spawn=False)  # a plugin configures the strategy's saves
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=CkptdModelParallelStrategy(), plugins=[io],
                        logger=False)
    assert trainer.strategy.checkpoint_io is io and io._client_kwargs["world_size"] is None
    with pytest.raises(TypeError, match="not a TorchCheckpointIO"):
        L.Trainer(accelerator="cpu", devices=1, strategy=CkptdModelParallelStrategy(),
                  plugins=[L.pytorch.plugins.TorchCheckpointIO()], logger=False)
    with pytest.raises(ValueError, match="takes no rank/world_size"):
        CkptdModelParallelStrategy(checkpoint_io=CkptdCheckpointIO(run_dir=tmp_path, rank=0, world_size=1))


@pytest.mark.timeout(60)
def test_load_exclude_leaves_top_level_keys_out(client, root: Path) -> None:
    client.save_async({"state_dict": {"w": torch.ones(4)}, "global_step": 3, "loops": {"n": torch.arange(2)}},
                      root / "c").result()
    rest = ckptd.load(root / "c", exclude=("state_dict",))
    assert rest.keys() == {"global_step", "loops"} and torch.equal(rest["loops"]["n"], torch.arange(2))
    with pytest.raises(TypeError, match="exclude must be a tuple of top-level key names"):
        ckptd.load(root / "c", exclude="state_dict")
    client.save_async([torch.ones(1)], root / "list").result()
    with pytest.raises(TypeError, match="saved a list, not a dict"):
        ckptd.load(root / "list", exclude=("x",))


@pytest.mark.timeout(300)
def test_fsdp1_strategy_saves_and_loads_real_fsdp1_shards_on_two_ranks(daemon, root: Path) -> None:
    """Lightning's Trainer allows ``FSDPStrategy`` only on GPUs ("The strategy `fsdp` requires a GPU accelerator"),
    so ``tests/fsdp1_ranks.py`` drives ``CkptdFSDPStrategy``'s state dicts, ``save_checkpoint`` and
    ``load_checkpoint`` on real FSDP1-wrapped modules on two CPU ranks, as the Trainer would."""
    path = root / "fsdp1.ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = run_module("torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                     str(REPO / "tests" / "fsdp1_ranks.py"), str(daemon.run_dir), str(path),
                     env=env, cwd=str(REPO), timeout=240)
    assert out.returncode == 0, f"torchrun exited {out.returncode}\n{out.stdout}\n{out.stderr[-6000:]}"
    match = re.search(r"saved \((\S+), (\S+)\) loaded \((\S+), (\S+)\) rest \['epoch', 'global_step'\] step 5",
                      out.stdout)
    assert match, out.stdout
    assert match.group(1, 2) == match.group(3, 4)  # the fresh model and optimizer hold what was saved
    index = ckptd.read_index(path)
    assert index.world_size == 2 and "state_dict.net.0.weight" in index.tensors  # each rank's chunks of it
    whole = ckptd.load(path)
    assert float(match.group(1)) == sum(t.double().sum().item() for t in whole["state_dict"].values())
    assert float(match.group(2)) == sum(s["exp_avg"].double().sum().item()
                                        for s in whole["optimizer_states"][0]["state"].values())
    with pytest.raises(ValueError, match="state_dict_type='full'"):
        CkptdFSDPStrategy(state_dict_type="full")
