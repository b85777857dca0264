"""CkptdCheckpointIO: Lightning's checkpoints through a real ckptd daemon.

A real ``lightning.Trainer`` with ``ModelCheckpoint`` saves, prunes and
resumes through the plugin; the smaller tests drive the plugin the way
``ModelCheckpoint`` does (save, then remove or load the same path at once)
against daemons made slow or failing with injected storage faults.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import errno
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

import lightning as L  # make test installs it (requirements-dev.txt): a missing one is a failure, never a skip

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ckptd  # noqa: E402
from ckptd.integrations.lightning import CkptdCheckpointIO  # noqa: E402

from helpers import keys, wait_until

SCORES = [0.9, 0.5, 0.2, 0.1]
"""The monitored score of epochs 0-3 (lower is better): after three epochs the best two are
epochs 1 and 2 (epoch 0 saved, then pruned); a resumed fourth epoch displaces epoch 1."""
STEPS_PER_EPOCH = 4


class TinyModel(L.LightningModule):
    """A linear regressor whose logged score is fixed per epoch, so top-k is known in advance."""

    def __init__(self, lr: float = 0.05, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("score", torch.tensor(SCORES[self.current_epoch]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


class Recorder(Callback):
    """What the model and optimizer held when each checkpoint was saved, and at training start."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, Any]] = {}
        self.at_start: dict[str, Any] = {}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.saved[trainer.current_epoch] = {
            "weights": clone_state(checkpoint["state_dict"]),
            "exp_avg": [s["exp_avg"].clone() for s in checkpoint["optimizer_states"][0]["state"].values()],
            "global_step": checkpoint["global_step"],
        }

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.optimizers[0]
        self.at_start = {
            "weights": clone_state(pl_module.state_dict()),
            "exp_avg": [opt.state[p]["exp_avg"].clone() for p in pl_module.parameters() if p in opt.state],
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "lr": opt.param_groups[0]["lr"],
        }


def make_trainer(root: Path | str, run_dir: Path, max_epochs: int,
                 recorder: Recorder) -> tuple[L.Trainer, ModelCheckpoint]:
    checkpoints = ModelCheckpoint(dirpath=root, monitor="score", mode="min", save_top_k=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[checkpoints, recorder],
        plugins=[CkptdCheckpointIO(run_dir=run_dir, spawn=False, max_inflight=2, timeout=10.0)],
    )
    return trainer, checkpoints


def entries(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def assert_equal_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        assert torch.equal(actual[k], expected[k]), f"{k} differs"


@pytest.mark.timeout(90)
def test_lightning_fit_keeps_top_k_committed_and_resumes(daemon, root: Path) -> None:
    torch.manual_seed(0)
    first = Recorder()
    trainer, checkpoints = make_trainer(root, daemon.run_dir, 3, first)
    trainer.fit(TinyModel(), loader(), loader())

    # exactly the two best (epochs 1 and 2) remain, committed; epoch 0 was pruned; nothing half-written
    best_two = ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert entries(root) == best_two
    assert sorted(Path(p).name for p in checkpoints.best_k_models) == best_two
    for name in best_two:
        index = ckptd.read_index(root / name)
        assert index.world_size == 1
        assert index.step == int(name.split("step=")[1].removesuffix(".ckpt"))
    assert not [p for p in root.rglob("*") if p.name.endswith(".incomplete")]
    assert Path(checkpoints.best_model_path).name == "epoch=2-step=12.ckpt"

    # the whole Lightning dict round-trips, non-tensor entries included
    saved = ckptd.load(checkpoints.best_model_path)
    assert saved["epoch"] == 2 and saved["global_step"] == 12
    assert saved["pytorch-lightning_version"] == L.__version__
    assert saved["hyper_parameters"] == {"lr": 0.05, "hidden": 8}
    assert saved["lr_schedulers"][0]["last_epoch"] == 3
    assert any(k.startswith("ModelCheckpoint") for k in saved["callbacks"])
    assert_equal_tensors(saved["state_dict"], first.saved[2]["weights"])

    # a fresh trainer resumes from the best checkpoint with the saved weights and optimizer state
    torch.manual_seed(1)  # different initial weights: only the checkpoint can make them equal
    second = Recorder()
    trainer2, checkpoints2 = make_trainer(root, daemon.run_dir, 4, second)
    trainer2.fit(TinyModel(), loader(), loader(), ckpt_path=checkpoints.best_model_path)

    assert second.at_start["global_step"] == 12 and second.at_start["epoch"] == 3
    assert_equal_tensors(second.at_start["weights"], first.saved[2]["weights"])
    for actual, expected in zip(second.at_start["exp_avg"], first.saved[2]["exp_avg"], strict=True):
        assert torch.equal(actual, expected)
    assert second.at_start["lr"] == pytest.approx(0.05 * 0.5**3)  # StepLR state came back too
    # training went on, and the restored ModelCheckpoint state pruned epoch 1 for the better epoch 3
    assert trainer2.global_step == 16
    assert not torch.equal(second.saved[3]["weights"]["net.0.weight"], first.saved[2]["weights"]["net.0.weight"])
    assert entries(root) == ["epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"]
    assert ckptd.read_index(root / "epoch=3-step=16.ckpt").step == 16


@pytest.mark.timeout(60)
def test_remove_checkpoint_waits_for_the_save_in_flight_to_that_path(daemon_factory, root: Path) -> None:
    daemon = daemon_factory(faults=[{"op": "rename", "match": "slow.ckpt", "errno": 0, "delay": 1.0}])
    io = CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False, timeout=10.0)
    path = root / "slow.ckpt"
    try:
        io.save_checkpoint({"w": torch.ones(1000), "global_step": 3}, path)
        wait_until(lambda: (root / "slow.ckpt" / "ckptd.json").exists() or (root / "slow.ckpt.incomplete").is_dir())
        assert not (root / "slow.ckpt").exists()  # in flight: the daemon holds the rename for a second
        io.remove_checkpoint(path)
        assert entries(root) == []

        io.remove_checkpoint(root / "never-saved.ckpt")  # absent: nothing to do, no error
        (root / "not-ours.ckpt").write_bytes(b"a torch.save file")
        with pytest.warns(UserWarning, match="not a ckptd checkpoint"):
            io.remove_checkpoint(root / "not-ours.ckpt")
        assert (root / "not-ours.ckpt").read_bytes() == b"a torch.save file"
    finally:
        io.teardown()


@pytest.mark.timeout(60)
def test_load_checkpoint_waits_for_the_save_in_flight_and_a_failed_save_is_raised(daemon_factory, root: Path) -> None:
    daemon = daemon_factory(faults=[
        {"op": "rename", "match": "slow.ckpt", "errno": 0, "delay": 1.0},
        {"op": "write", "match": "doomed", "errno": errno.EIO},
    ])
    io = CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False, max_inflight=2, timeout=10.0)
    weights = torch.arange(1000, dtype=torch.float32)
    try:
        io.save_checkpoint({"w": weights, "global_step": 7, "nested": {"t": (1, "a")}}, root / "slow.ckpt")
        loaded = io.load_checkpoint(root / "slow.ckpt")
        assert torch.equal(loaded["w"], weights) and loaded["global_step"] == 7 and loaded["nested"] == {"t": (1, "a")}
        assert torch.equal(io.load_checkpoint(root / "slow.ckpt", map_location="cpu")["w"], weights)
        mapped = io.load_checkpoint(root / "slow.ckpt", map_location=lambda t, location: t.double())
        assert mapped["w"].dtype == torch.float64 and torch.equal(mapped["w"], weights.double())

        io.save_checkpoint({"w": weights}, root / "doomed.ckpt")
        with pytest.raises(ckptd.WriteFailed):
            io.load_checkpoint(root / "doomed.ckpt")  # waits, then raises the save's own error

        io.save_checkpoint({"w": weights}, root / "doomed-again.ckpt")
        with pytest.raises(ckptd.WriteFailed, match="doomed-again.ckpt failed in the background"):
            io.teardown()  # a background failure nobody has seen yet is never dropped
    finally:
        with contextlib.suppress(ckptd.CkptdError):
            io.teardown()  # after a failure above: close the client all the same
    # the daemon removes a failed save's .incomplete just after replying
    wait_until(lambda: entries(root) == ["slow.ckpt"], 60, lambda: f"the failed save's files went: {entries(root)}")


class Mode(enum.Enum):
    FAST = "fast"


@pytest.mark.timeout(60)
def test_paths_namespaces_and_enums_in_hyperparameters_load_as_plain_values_and_others_are_refused(
        daemon, root: Path) -> None:
    io = CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False, timeout=10.0)
    hparams = {"data": Path("/data/train"), "args": argparse.Namespace(depth=3, out=Path("/o")), "mode": Mode.FAST}
    try:
        with pytest.warns(UserWarning, match=r"checkpoint\['hyper_parameters'\]\['data'\]: pathlib"):
            io.save_checkpoint({"hyper_parameters": hparams, "global_step": 1}, root / "h.ckpt")
        assert io.load_checkpoint(root / "h.ckpt")["hyper_parameters"] == {
            "data": "/data/train", "args": {"depth": 3, "out": "/o"}, "mode": "fast"}

        with pytest.raises(TypeError, match=r"state_dict\['hyper_parameters'\]\['fn'\] holds a builtins.function"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                io.save_checkpoint({"hyper_parameters": {"fn": lambda: 0}}, root / "refused.ckpt")
        with pytest.raises(ValueError, match="keep_last"):
            CkptdCheckpointIO(run_dir=daemon.run_dir, keep_last=2)
    finally:
        io.teardown()
    assert entries(root) == ["h.ckpt"]


class WorseAtEpochTwo(TinyModel):
    """Scores 0.9, 0.5, then 0.7: a run resumed for epoch 2 saves no top-k checkpoint."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("score", torch.tensor([0.9, 0.5, 0.7][self.current_epoch]))


@pytest.mark.timeout(120)
def test_save_last_link_links_on_the_first_save_and_a_resume_from_the_link_saves_over_it(daemon, root: Path) -> None:
    """``last.ckpt`` links to each new best; the resumed run's epoch 2 is no better, and its callback (restored
    from the link's target) has linked nothing yet, so it saves ``last.ckpt`` itself, where the link is: the
    link gives way to the checkpoint, as Lightning's own CheckpointIO replaces it with the file."""
    dirpath = root / "run"  # not there yet: the first save's link is made before the daemon writes

    def trainer_for(max_epochs: int, recorder: Recorder) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=dirpath, monitor="score", mode="min", save_top_k=1, save_last="link"),
                       recorder],
            plugins=[CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False, timeout=10.0)])

    torch.manual_seed(0)
    first = Recorder()
    trainer_for(2, first).fit(WorseAtEpochTwo(), loader(), loader())
    last = dirpath / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=1-step=8.ckpt"
    assert entries(dirpath) == ["epoch=1-step=8.ckpt", "last.ckpt"]

    torch.manual_seed(1)  # different initial weights: only the checkpoint can make them equal
    second = Recorder()
    trainer_for(3, second).fit(WorseAtEpochTwo(), loader(), loader(), ckpt_path="last")  # read through the link
    assert second.at_start["global_step"] == 8 and second.at_start["epoch"] == 2
    assert_equal_tensors(second.at_start["weights"], first.saved[1]["weights"])
    assert entries(dirpath) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert not last.is_symlink() and ckptd.read_index(last).step == 12  # the link gave way to the checkpoint
    (resaved,) = second.saved.values()  # the resumed run saved only last.ckpt
    assert resaved["global_step"] == 12
    assert_equal_tensors(ckptd.load(last)["state_dict"], resaved["weights"])
    assert ckptd.read_index(dirpath / "epoch=1-step=8.ckpt").step == 8  # the link's target is untouched


@pytest.mark.timeout(120)
def test_fit_resumes_from_an_s3_url_and_load_checkpoint_reads_it(s3, bucket, daemon_factory, root: Path) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/run/resume.ckpt"
    torch.manual_seed(0)
    first = Recorder()
    trainer, _ = make_trainer(root, daemon.run_dir, 2, first)
    trainer.fit(TinyModel(), loader(), loader())
    trainer.save_checkpoint(url)  # through the plugin, straight to the bucket
    trainer.strategy.checkpoint_io.teardown()  # committed (fit's own teardown ran before this save)

    io = CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False, timeout=10.0)
    loaded = io.load_checkpoint(url)
    assert loaded["global_step"] == 8 and loaded["epoch"] == 2  # saved after fit: the next epoch is 2
    assert_equal_tensors(loaded["state_dict"], first.saved[1]["weights"])
    with pytest.raises(ckptd.InvalidCheckpoint, match=f"no checkpoint at s3://{bucket}/run/never.ckpt"):
        io.load_checkpoint(f"s3://{bucket}/run/never.ckpt")

    torch.manual_seed(1)  # different initial weights: only the checkpoint can make them equal
    second = Recorder()
    trainer2, _ = make_trainer(root, daemon.run_dir, 3, second)
    trainer2.fit(TinyModel(), loader(), loader(), ckpt_path=url)
    assert second.at_start["global_step"] == 8 and second.at_start["epoch"] == 2
    assert_equal_tensors(second.at_start["weights"], first.saved[1]["weights"])


@pytest.fixture
def s3_for_fsspec(aws, monkeypatch: pytest.MonkeyPatch) -> Any:
    """fsspec's ``s3://`` filesystem, which ``ModelCheckpoint`` asks whether a checkpoint exists: obstore's (ckptd's
    own S3 library) on ``aws``'s plain-HTTP endpoint; fsspec's registry is left as the test found it."""
    import fsspec.config
    import obstore.fsspec
    from fsspec.registry import _registry

    monkeypatch.setitem(fsspec.config.conf, "s3", {"client_options": {"allow_http": True}})
    before = _registry.get("s3")
    obstore.fsspec.register("s3")
    try:
        yield aws
    finally:
        if before is None:
            del _registry["s3"]
        else:
            _registry["s3"] = before


@pytest.mark.timeout(120)
def test_save_top_k_into_a_bucket_deletes_the_displaced_checkpoint_from_the_bucket(
        s3_for_fsspec, bucket: str, daemon_factory, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ModelCheckpoint(dirpath="s3://...", save_top_k=2)``: the epoch it displaces is gone from the bucket (the
    plugin once read the URL as a local path under the working directory and deleted nothing)."""
    daemon = daemon_factory("--root", f"s3://{bucket}")
    torch.manual_seed(0)
    trainer, checkpoints = make_trainer(f"s3://{bucket}/run", daemon.run_dir, 3, Recorder())
    monkeypatch.chdir(root)  # where a URL misread as a local path would land
    trainer.fit(TinyModel(), loader(), loader())
    trainer.strategy.checkpoint_io.teardown()

    best_two = ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert sorted({k.split("/")[1] for k in keys(s3_for_fsspec, bucket, "run/")}) == best_two
    assert sorted(checkpoints.best_k_models) == [f"s3://{bucket}/run/{name}" for name in best_two]
    for name in best_two:
        assert ckptd.read_index(f"s3://{bucket}/run/{name}").step == int(name.split("step=")[1].removesuffix(".ckpt"))
    with pytest.raises(ckptd.InvalidCheckpoint, match=f"no checkpoint at s3://{bucket}/run/epoch=0-step=4.ckpt"):
        ckptd.read_index(f"s3://{bucket}/run/epoch=0-step=4.ckpt")
    assert entries(root) == []  # nothing was made, or looked for, under the working directory
