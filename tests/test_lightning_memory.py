"""Lightning and Fabric reach the memory tier: ``CkptdSnapshots`` snapshots ``last.ckpt`` into node memory between the
checkpoints ``ModelCheckpoint`` persists, a Trainer killed between two persists resumes from the newest snapshot with
``fit(ckpt_path="last")``, and ``CkptdCheckpointIO.in_memory()`` makes a Fabric save a snapshot, so a Fabric loop
killed between two persists resumes from its newest snapshot too.

The killed Trainer (and Fabric loop) runs in a process of its own that SIGKILLs itself once the snapshot of step 6
is held (the test sees its exit by SIGKILL), against a daemon started with ``--persist-on-exit never``, so the snapshot can
reach no disk: the resume at step 6 can only come from memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import ckptd
from ckptd.integrations.lightning import CkptdCheckpointIO, CkptdSnapshots
from helpers import REPO, own_segments, wait_until
from test_lightning import TinyModel, loader

KILLED_AT = 6
PERSIST_EVERY = 4

KILLED_RUN = """
import os, signal, sys
from pathlib import Path
import torch
from lightning.pytorch.callbacks import Callback
from test_lightning_memory import trainer_for
from test_lightning import TinyModel, loader

root, run_dir, out, killed_at = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])

class KillOnceHeld(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == killed_at:  # after CkptdSnapshots took this step's snapshot
            trainer.strategy.checkpoint_io.wait(root / "last.ckpt")  # held by the daemon
            torch.save({k: v.clone() for k, v in pl_module.state_dict().items()}, out / "reference.pt")
            os.kill(os.getpid(), signal.SIGKILL)

trainer_for(root, run_dir, 100, KillOnceHeld()).fit(TinyModel(), loader())
"""


FABRIC_RUN = """
import os, signal, sys
from pathlib import Path
import torch
import lightning as L
from ckptd.integrations.lightning import CkptdCheckpointIO

root, run_dir, out, killed_at, persist_every = (Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]),
                                                int(sys.argv[4]), int(sys.argv[5]))
io = CkptdCheckpointIO(run_dir=run_dir, spawn=False)
fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
torch.manual_seed(0)
module = torch.nn.Linear(16, 4)
model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=0.01))
for step in range(1, 100):
    loss = model(torch.randn(8, 16)).square().mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    state = {"model": model, "optimizer": optimizer, "global_step": step}
    path = root / f"step-{step}"
    if step % persist_every == 0:
        fabric.save(path, state)
    else:
        with io.in_memory():
            fabric.save(path, state)
    if step == killed_at:
        io.wait(path)  # held by the daemon
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "reference.pt")
        os.kill(os.getpid(), signal.SIGKILL)
"""


def trainer_for(root: Path, run_dir: Path, max_steps: int, *extra: Callback) -> L.Trainer:
    """Persist every ``PERSIST_EVERY`` steps (the newest two by step, and ``last.ckpt``), snapshot every step."""
    keeper = ModelCheckpoint(dirpath=root, every_n_train_steps=PERSIST_EVERY, save_last=True, save_top_k=2,
                             monitor="step", mode="max")
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                     callbacks=[CkptdSnapshots(every_n_train_steps=1), keeper, *extra],
                     plugins=[CkptdCheckpointIO(run_dir=run_dir, spawn=False, timeout=10.0)])


def slots_given_back(before: set[str]) -> None:
    """Wait until the daemon has unlinked the slots it owed this process's closed clients (snapshots dropped after
    their last HeldInMemory: ``ModelCheckpoint``'s closing save of ``last.ckpt`` drops the held one), on its maintenance
    pool after the client's goodbye."""
    wait_until(lambda: not own_segments() - before, 30, lambda: f"slots left: {sorted(own_segments() - before)}")


class AtStart(Callback):
    def __init__(self) -> None:
        self.step, self.weights = -1, {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


@pytest.mark.timeout(300)
def test_a_trainer_killed_between_two_persists_resumes_from_its_snapshot_and_top_k_counts_persisted_ones(
        daemon_factory, root: Path, run_dir: Path, tmp_path: Path) -> None:
    daemon_factory("--persist-on-exit", "never")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", KILLED_RUN, str(root), str(run_dir), str(tmp_path), str(KILLED_AT)],
                         env=env, cwd=str(REPO), capture_output=True, text=True, timeout=240)
    assert run.returncode == -signal.SIGKILL, f"the trainer exited {run.returncode}: {run.stderr[-4000:]}"
    last = root / "last.ckpt"
    assert ckptd.read_index(last).step == PERSIST_EVERY, "on disk, last.ckpt is the persisted step"
    assert ckptd.load(last, run_dir=run_dir)["global_step"] == KILLED_AT, "in memory, last.ckpt is the snapshot"

    start, before = AtStart(), own_segments()
    trainer_for(root, run_dir, 3 * PERSIST_EVERY, start).fit(TinyModel(), loader(), ckpt_path="last")
    slots_given_back(before)
    assert start.step == KILLED_AT
    reference = torch.load(tmp_path / "reference.pt")
    assert start.weights.keys() == reference.keys()
    assert all(torch.equal(start.weights[k], reference[k]) for k in reference), "resumed other weights than held"
    # top-k (2, by step) counted the persisted checkpoints alone: step 4's was displaced by steps 8 and 12
    wait_until(lambda: sorted(os.listdir(root)) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"],
               timeout=60, what=lambda: f"the persisted top-2 and last.ckpt: {sorted(os.listdir(root))}")


def test_snapshots_need_the_plugin_and_a_last_checkpoint_to_be(daemon, root: Path, run_dir: Path) -> None:
    with pytest.raises(ValueError, match="every_n_train_steps"):
        CkptdSnapshots(every_n_train_steps=0)
    bare = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[CkptdSnapshots(every_n_train_steps=1)],
                     plugins=[CkptdCheckpointIO(run_dir=run_dir, spawn=False)])
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(save_last=True\)"):
        bare.fit(TinyModel(), loader())
    plain = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[CkptdSnapshots(every_n_train_steps=1),
                                                             ModelCheckpoint(dirpath=root, save_last=True)])
    with pytest.raises(ValueError, match=r"plugins=\[CkptdCheckpointIO\(\)\]"):
        plain.fit(TinyModel(), loader())
    two = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, plugins=[CkptdCheckpointIO(run_dir=run_dir, spawn=False)],
                    callbacks=[CkptdSnapshots(every_n_train_steps=1),
                               ModelCheckpoint(dirpath=root / "a", save_last=True, every_n_train_steps=5),
                               ModelCheckpoint(dirpath=root / "b", save_last=True, every_n_train_steps=6)])
    with pytest.raises(ValueError, match="2 with save_last"):
        two.fit(TinyModel(), loader())


def test_a_snapshot_taken_before_any_last_checkpoint_is_on_disk_warns_that_a_crash_would_resume_from_nothing(
        daemon, root: Path, run_dir: Path) -> None:
    keeper = ModelCheckpoint(dirpath=root, every_n_train_steps=100, save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[CkptdSnapshots(every_n_train_steps=1), keeper],
                        plugins=[CkptdCheckpointIO(run_dir=run_dir, spawn=False)])
    before = own_segments()
    with pytest.warns(UserWarning, match="has persisted no last.ckpt there yet") as caught:
        trainer.fit(TinyModel(), loader())
    assert sum("persisted no last.ckpt" in str(w.message) for w in caught) == 1, "warned once"
    slots_given_back(before)


def test_a_fabric_save_in_memory_is_held_loaded_back_from_memory_and_persisted_on_request(
        daemon, root: Path, run_dir: Path) -> None:
    io = CkptdCheckpointIO(run_dir=run_dir, spawn=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup_module(torch.nn.Linear(4, 3))
    path = root / "fabric" / "step-3"
    with io.in_memory():
        fabric.save(path, {"model": model, "step": 3})
    io.wait(path)
    assert not path.exists(), "a snapshot was written to disk"
    fresh = fabric.setup_module(torch.nn.Linear(4, 3))
    state = {"model": fresh, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert ckptd.latest(path.parent, run_dir=run_dir) == path
    assert io.client.persist(path, timeout=60) == path and ckptd.read_index(path).step is None
    io.teardown()
    with pytest.raises(FileNotFoundError, match="neither on disk nor held in node memory"):
        io.load_checkpoint(root / "fabric" / "never")


@pytest.mark.timeout(300)
def test_a_fabric_loop_killed_between_two_persists_resumes_from_its_newest_snapshot(daemon_factory, root: Path,
                                                                                   run_dir: Path,
                                                                                   tmp_path: Path) -> None:
    daemon_factory("--persist-on-exit", "never")
    run = subprocess.run([sys.executable, "-c", FABRIC_RUN, str(root), str(run_dir), str(tmp_path), str(KILLED_AT),
                          str(PERSIST_EVERY)], cwd=str(REPO), capture_output=True, text=True, timeout=240)
    assert run.returncode == -signal.SIGKILL, f"the loop exited {run.returncode}: {run.stderr[-4000:]}"
    assert sorted(p.name for p in root.iterdir()) == [f"step-{PERSIST_EVERY}"], "only the persisted step on disk"
    newest = ckptd.latest(root, run_dir=run_dir)
    assert newest == root / f"step-{KILLED_AT}" and not newest.exists()

    io = CkptdCheckpointIO(run_dir=run_dir, spawn=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup_module(torch.nn.Linear(16, 4))
    state = {"model": model, "global_step": 0}
    fabric.load(newest, state, strict=False)  # the optimizer's state is left out here
    assert state["global_step"] == KILLED_AT
    reference = torch.load(tmp_path / "reference.pt")
    assert all(torch.equal(model.state_dict()[k], reference[k]) for k in reference), "resumed other weights"
    io.teardown()
