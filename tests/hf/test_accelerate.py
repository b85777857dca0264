"""ckptd's ``CkptdAccelerator`` against a real ``accelerate.Accelerator`` (1.16) on CPU, one process and two under
``accelerate launch``.

Collected only by ``make test-hf`` (its venv has accelerate). The runs are ``tests/hf/accelerate_run.py``
(``examples/accelerate_train.py``: a small network with dropout, shuffled by accelerate's seedable sampler) in
processes of their own, against the test's daemon. A run killed in the middle of a save and resumed with
``load_state()`` must take the same batches, compute the same losses and end with the same parameters and
optimizer state as the run never interrupted, bit for bit. The misuse cases use an ``Accelerator`` in this process.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import SeedableRandomSampler
from accelerate.utils import ProjectConfiguration

import ckptd
from ckptd.integrations.accelerate import CkptdAccelerator, require_supported

from helpers import REPO, equal_states, free_port, start_daemon, wait_until

RUN = REPO / "tests" / "hf" / "accelerate_run.py"
COMMON = ("--steps", "9", "--save-every", "3", "--total-limit", "2")
"""Saves at steps 3, 6 and 9: checkpoint_0, _1 and _2, of which the daemon's retention keeps the newest two."""


def run(daemon, out: Path, project: Path, *args: str, procs: int = 1, timeout: float = 300
        ) -> subprocess.CompletedProcess:
    """``tests/hf/accelerate_run.py`` on ``procs`` processes (``accelerate launch`` for two) into ``out``."""
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1", HF_HOME=str(out / "hf-home"))
    launcher = [sys.executable] if procs == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port())]
    return subprocess.run([*launcher, str(RUN), "--out", str(out), "--project-dir", str(project), *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def saved(project: Path) -> list[str]:
    folder = project / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def steps(out: Path, rank: int = 0) -> dict[int, dict[str, str]]:
    return {int(k): v for k, v in json.loads((out / f"steps-{rank}.json").read_text()).items()}


def same_end(a: Path, b: Path) -> None:
    """The two runs' final parameters and optimizer states are the same, bit for bit."""
    x, y = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert equal_states(x["model"], y["model"]), "the parameters differ"
    assert equal_states(x["optimizer"], y["optimizer"]), "the optimizer states differ"


def test_only_the_supported_accelerate_release_is_accepted_and_another_is_named() -> None:
    require_supported("1.16.0")
    require_supported("1.16.3")
    for version in ("1.15.0", "1.17.0", "0.34.2", "2.0.0.dev0"):
        with pytest.raises(ImportError, match=rf"supports accelerate 1\.16\.x, and accelerate {version} is"):
            require_supported(version)


@pytest.mark.timeout(600)
def test_one_process_killed_with_its_daemon_mid_save_resumes_bitwise_with_and_without_a_path(
        daemon_factory, run_dir: Path, root: Path, tmp_path: Path) -> None:
    """The uninterrupted run saves at steps 3, 6, 9 (``total_limit=2``: the daemon keeps checkpoint_1 and _2), each
    holding what accelerate's own files hold. A second run dies in checkpoint_1's save: the daemon is killed at the
    shard's write (a fault), the process by SIGKILL once its save failed. Only checkpoint_0 is complete, and
    ``load_state()`` through a new daemon resumes from it: steps 4 to 9 see the same batches and losses, and the
    run ends with the same parameters and optimizer state, bit for bit. ``load_state(path)`` of the uninterrupted
    run's checkpoint_1, in a new project, does the same from step 7."""
    daemon = daemon_factory(faults=[{"op": "write", "match": "/killed/checkpoints/checkpoint_1.incomplete/",
                                     "kill": True}])
    ref, killed = root / "ref", root / "killed"
    ok(run(daemon, tmp_path / "ref", ref, *COMMON))
    wait_until(lambda: saved(ref) == ["checkpoint_1", "checkpoint_2"], timeout=60,
               what=lambda: f"total_limit=2 through the daemon's retention left {saved(ref)}")
    state = ckptd.load(ref / "checkpoints" / "checkpoint_2")
    assert {"models", "optimizers", "schedulers", "dataloaders", "custom", "rng", "step", "iteration"} <= state.keys()
    assert state["custom"] == [{"step": 9}] and state["iteration"] == 2
    assert state["schedulers"][0]["last_epoch"] == 9 and state["optimizers"][0]["state"]
    assert state["dataloaders"][0]["sampler"]["initial_seed"] == 0 and set(state["rng"]) >= {"python", "numpy", "cpu"}
    assert ckptd.read_index(ref / "checkpoints" / "checkpoint_2").step == 2

    died = run(daemon, tmp_path / "killed", killed, *COMMON, "--die-at-save", "1")
    assert died.returncode == -signal.SIGKILL, f"exited {died.returncode}\n{died.stderr[-4000:]}"
    assert daemon.proc.wait(30) == -signal.SIGKILL  # the fault: killed at checkpoint_1's write
    facts = json.loads((tmp_path / "killed" / "died-0.json").read_text())
    assert facts == {"save": 1, "incomplete": True, "committed": False, "error": "DaemonUnavailable"}, facts
    assert saved(killed) == ["checkpoint_0", "checkpoint_1.incomplete"]

    daemon = start_daemon(run_dir, root)  # a new daemon; it sweeps what the dead one left
    try:
        resumed = tmp_path / "resumed"
        assert "rank 0: trained to step 9" in ok(run(daemon, resumed, killed, *COMMON))
        assert steps(resumed) == {s: v for s, v in steps(tmp_path / "ref").items() if s > 3}
        same_end(tmp_path / "ref", resumed)
        wait_until(lambda: saved(killed) == ["checkpoint_1", "checkpoint_2"], timeout=60,
                   what=lambda: f"after the resume: {saved(killed)}")

        by_path = tmp_path / "by-path"
        ok(run(daemon, by_path, root / "elsewhere", *COMMON, "--resume-from",
               str(ref / "checkpoints" / "checkpoint_1")))
        assert steps(by_path) == {s: v for s, v in steps(tmp_path / "ref").items() if s > 6}
        same_end(tmp_path / "ref", by_path)
        assert saved(root / "elsewhere") == ["checkpoint_2"]  # numbered on from the checkpoint loaded
    finally:
        daemon.kill()


@pytest.mark.timeout(600)
def test_two_processes_one_killed_mid_save_resume_bitwise_under_accelerate_launch(
        daemon, root: Path, tmp_path: Path) -> None:
    """``accelerate launch``, two processes (DDP on gloo). Process 1 dies by SIGKILL in checkpoint_1's save once
    process 0's shard of it is on disk and before handing over its own: checkpoint_1 is never committed, and two
    processes resume with ``load_state()`` from checkpoint_0 to the uninterrupted run's batches, losses (on each
    process), parameters and optimizer state, bit for bit; ``total_limit=2`` holds on both runs."""
    ref, killed = root / "ref2", root / "killed2"
    ok(run(daemon, tmp_path / "ref", ref, *COMMON, procs=2))
    wait_until(lambda: saved(ref) == ["checkpoint_1", "checkpoint_2"], timeout=60,
               what=lambda: f"total_limit=2 through the daemon's retention left {saved(ref)}")
    index = ckptd.read_index(ref / "checkpoints" / "checkpoint_2")
    assert index.world_size == 2 and index.step == 2
    assert steps(tmp_path / "ref", 0) != steps(tmp_path / "ref", 1)  # each process its own share of the data

    died = run(daemon, tmp_path / "killed", killed, *COMMON, "--die-at-save", "1", "--die-rank", "1", procs=2)
    assert died.returncode != 0
    facts = json.loads((tmp_path / "killed" / "died-1.json").read_text())
    assert facts == {"save": 1, "other_shard_written": True, "committed": False}, facts
    assert "Signals.SIGKILL" in died.stderr or "exitcode  : -9" in died.stderr, died.stderr[-4000:]
    assert ckptd.latest(killed / "checkpoints", run_dir=daemon.run_dir) == killed / "checkpoints" / "checkpoint_0"

    resumed = tmp_path / "resumed"
    out = ok(run(daemon, resumed, killed, *COMMON, procs=2))
    assert "rank 0: trained to step 9" in out and "rank 1: trained to step 9" in out
    for rank in (0, 1):
        assert steps(resumed, rank) == {s: v for s, v in steps(tmp_path / "ref", rank).items() if s > 3}
    same_end(tmp_path / "ref", resumed)
    wait_until(lambda: saved(killed) == ["checkpoint_1", "checkpoint_2"], timeout=60,
               what=lambda: f"after the resume: {saved(killed)}")


class Counter:
    """A registered object (``register_for_checkpointing``)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def prepared(cls: type, daemon, **kwargs):
    """An accelerator of ``cls`` in this process with a model, optimizer, scheduler and shuffled dataloader
    (accelerate's seedable sampler) prepared and a ``Counter`` registered."""
    extra = {"ckptd_run_dir": daemon.run_dir} if cls is CkptdAccelerator else {}
    accelerator = cls(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True), **extra,
                      **kwargs)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    loader = torch.utils.data.DataLoader(torch.arange(16.0), batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, counter, loader


def train_step(accelerator, model, optimizer) -> None:
    accelerator.backward(model(torch.randn(3, 4)).square().sum())
    optimizer.step()
    optimizer.zero_grad()


def test_a_path_round_trip_memory_snapshots_and_misuse_each_say_what_is_wrong(daemon, root: Path) -> None:
    """In this process: ``save_state(path)`` then ``load_state(path)`` restores parameters, optimizer and registered
    object bitwise, and the dataloader's epoch with its sampler's (the same shuffle again); a memory snapshot
    (``persist=False``) is what ``load_state()`` then finds; and every misuse is refused naming what was wrong,
    leaving what is on disk as it was: a folder of accelerate's own files as the target (which ``load_state`` still
    reads, through accelerate's own), a ``.incomplete``, missing or empty folder, a file, a checkpoint saved with
    other objects registered, save hooks, DeepSpeed and ``torch.load`` options, no ``output_dir``."""
    accelerator, model, optimizer, counter, loader = prepared(CkptdAccelerator, daemon)
    try:
        train_step(accelerator, model, optimizer)
        counter.value = 7
        loader.set_epoch(4)  # the shuffle of epoch 4 is the sampler's seed plus 4
        order = [batch.tolist() for batch in loader]
        loader.set_epoch(4)  # a pass ends at the next epoch: back at 4, saved so
        mine = root / "mine"
        assert accelerator.save_state(mine) == mine
        accelerator.wait_for_checkpoints()
        assert sorted(p.name for p in mine.iterdir()) == ["ckptd.json", "rank-00000-of-00001.safetensors"]
        train_step(accelerator, model, optimizer)
        counter.value = 8
        at_save = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
        accelerator.save_state(mine)  # replaces its own earlier checkpoint, as accelerate writes over its files
        accelerator.wait_for_checkpoints()
        assert ckptd.load(mine)["custom"] == [{"value": 8}]
        train_step(accelerator, model, optimizer)
        counter.value = 0
        loader.set_epoch(0)
        assert not equal_states(model.state_dict(), at_save[0])
        accelerator.load_state(mine)
        assert equal_states(model.state_dict(), at_save[0]) and equal_states(optimizer.state_dict(), at_save[1])
        assert counter.value == 8
        assert isinstance(loader.get_sampler(), SeedableRandomSampler) and loader.get_sampler().epoch == 4
        assert loader.iteration == 4 and [batch.tolist() for batch in loader] == order  # epoch 4's shuffle again

        theirs = root / "theirs"  # accelerate's own checkpoint of the same objects
        plain, plain_model, plain_optimizer, plain_counter, _ = prepared(Accelerator, daemon)
        plain_counter.value = 3
        plain.save_state(theirs)
        files = sorted(p.name for p in theirs.iterdir())
        with pytest.raises(FileExistsError, match=f"{theirs} exists and is not a ckptd checkpoint"):
            accelerator.save_state(theirs)
        assert sorted(p.name for p in theirs.iterdir()) == files
        accelerator.load_state(theirs)  # a run switched over resumes from its own files
        assert counter.value == 3 and equal_states(model.state_dict(), plain_model.state_dict())

        with pytest.raises(ValueError, match="is a ckptd save that never completed"):
            accelerator.load_state(root / "mine.incomplete")
        with pytest.raises(ValueError, match=f"Tried to find {root / 'nowhere'} but folder does not exist"):
            accelerator.load_state(root / "nowhere")
        (root / "notes.txt").write_text("mine")
        with pytest.raises(FileExistsError, match=f"{root / 'notes.txt'} is a file: save_state writes a checkpoint"):
            accelerator.save_state(root / "notes.txt")
        with pytest.raises(ValueError, match=f"{root / 'notes.txt'} is a file, not a checkpoint folder"):
            accelerator.load_state(root / "notes.txt")
        assert (root / "notes.txt").read_text() == "mine"
        (root / "empty").mkdir()
        with pytest.raises(ValueError, match=f"{root / 'empty'} holds no checkpoint: neither ckptd's"):
            accelerator.load_state(root / "empty")
        with pytest.raises(ValueError, match="No input_dir provided and automatic checkpoint naming is disabled"):
            accelerator.load_state()
        with pytest.raises(ValueError, match="save_state needs output_dir unless"):
            accelerator.save_state()
        with pytest.raises(TypeError, match=r"got \['tag'\]: those are DeepSpeed's save_checkpoint options"):
            accelerator.save_state(root / "other", tag="x")
        with pytest.raises(TypeError, match=r"got \['weights_only'\]: those are options of torch.load"):
            accelerator.load_state(mine, load_kwargs={"weights_only": True})

        accelerator.register_for_checkpointing(Counter(5))
        counter.value, weights = 99, {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"does not match this accelerator: 1 objects registered with "
                                             r"register_for_checkpointing saved, 2 now"):
            accelerator.load_state(mine)
        assert counter.value == 99 and equal_states(model.state_dict(), weights)  # nothing changed

        handle = accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: None)
        with pytest.raises(ValueError, match="does not run hooks given to register_save_state_pre_hook"):
            accelerator.save_state(root / "hooked")
        handle.remove()
        assert not (root / "hooked").exists() and not (root / "other").exists()
    finally:
        accelerator.end_training()

    project = root / "project"
    automatic = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=1)
    accelerator, model, optimizer, counter, _ = prepared(CkptdAccelerator, daemon, project_config=automatic)
    try:
        counter.value = 1
        accelerator.save_state()  # checkpoint_0, on disk
        counter.value = 2
        assert accelerator.save_state(persist=False).name == "checkpoint_1"  # held in node memory
        accelerator.wait_for_checkpoints()
        assert saved(project) == ["checkpoint_0"]  # total_limit counts persisted checkpoints only
        counter.value = 0
        accelerator.load_state()
        assert counter.value == 2 and accelerator.save_iteration == 2
        with pytest.raises(ValueError, match=r"checkpoint_1 \(1\) already exists"):
            accelerator.project_configuration.iteration = 1
            accelerator.save_state()
    finally:
        accelerator.end_training()
