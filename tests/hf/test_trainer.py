"""ckptd's ``CkptdTrainer`` against a real ``transformers.Trainer`` (5.25) on CPU, one process and two under torchrun.

Collected only by ``make test-hf`` (its venv has transformers and accelerate). Every run is
``tests/hf/trainer.py`` (``examples/hf_train.py``: a 2-layer GPT-2 built from a config, nothing downloaded) in
processes of its own, against the test's daemon. A run killed in the middle of a save, resumed with
``resume_from_checkpoint=True``, must end with the weights of the run never interrupted, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel
from transformers.trainer_utils import get_last_checkpoint

import ckptd
from ckptd.integrations.hf import require_supported

from helpers import REPO, start_daemon, wait_until

TRAINER = REPO / "tests" / "hf" / "trainer.py"


def run(daemon, out: Path, name: str, *args: str, procs: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    """``tests/hf/trainer.py`` on ``procs`` processes (torchrun for two) with ``args``; its final weights go to
    ``out/<name>.pt``."""
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1")
    launcher = [sys.executable] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--standalone"]
    return subprocess.run([*launcher, str(TRAINER), "--final", str(out / f"{name}.pt"), *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def checkpoints(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.iterdir()), key=lambda n: (len(n), n)) if folder.is_dir() else []


def same_weights(a: Path, b: Path) -> list[str]:
    """The names whose tensors differ between two saved state dicts (none: bitwise the same)."""
    x, y = torch.load(a), torch.load(b)
    assert x.keys() == y.keys()
    return [k for k in x if not (x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]))]


def test_only_the_supported_transformers_release_is_accepted_and_another_is_named() -> None:
    require_supported("5.25.0")
    require_supported("5.25.7")
    for version in ("5.24.0", "5.26.0", "4.57.6", "6.0.0.dev0"):
        with pytest.raises(ImportError, match=rf"supports transformers 5\.25\.x, and transformers {version} is"):
            require_supported(version)


@pytest.mark.timeout(600)
def test_one_process_killed_with_its_daemon_mid_save_resumes_bitwise_from_the_last_whole_checkpoint(
        daemon_factory, run_dir: Path, root: Path, tmp_path: Path) -> None:
    """The uninterrupted run saves every 3 steps to step 9 (``save_total_limit=2``: the daemon keeps 6 and 9), and
    its checkpoint-9 holds what the Trainer's files hold and exports to ``from_pretrained``. A second run dies at
    checkpoint-6: the daemon is killed at the shard's write (a fault), the trainer by SIGKILL once its save failed.
    get_last_checkpoint then finds checkpoint-3, not the torn checkpoint-6, and the resume through a new daemon ends
    bitwise where the uninterrupted run did."""
    out = tmp_path
    daemon = daemon_factory(faults=[{"op": "write", "match": "/killed/checkpoint-6.incomplete/", "kill": True}])
    ref, killed = root / "ref", root / "killed"
    common = ("--max-steps", "9", "--save-steps", "3", "--save-total-limit", "2")
    ok(run(daemon, out, "ref", "--output-dir", str(ref), *common))
    wait_until(lambda: checkpoints(ref) == ["checkpoint-6", "checkpoint-9"], timeout=60,
               what=lambda: f"save_total_limit=2 through the daemon's retention left {checkpoints(ref)}")
    assert get_last_checkpoint(str(ref)) == str(ref / "checkpoint-9")
    state = ckptd.load(ref / "checkpoint-9")
    assert {"model", "optimizer", "scheduler", "rng", "trainer_state", "config"} <= state.keys()
    assert set(state["rng"]) >= {"python", "numpy", "cpu"}
    assert json.loads(state["trainer_state"])["global_step"] == 9
    assert state["scheduler"]["last_epoch"] == 9 and state["optimizer"]["state"]
    exported = tmp_path / "pretrained"  # the one command docs/integrations.md gives
    ok(subprocess.run([sys.executable, "-m", "ckptd.integrations.hf", "export", str(ref / "checkpoint-9"),
                       str(exported)], cwd=REPO, capture_output=True, text=True, timeout=120))
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors", "trainer_state.json"]
    pretrained = GPT2LMHeadModel.from_pretrained(exported).state_dict()
    final = torch.load(out / "ref.pt")
    assert [k for k in final if not torch.equal(final[k], pretrained[k])] == []

    died = run(daemon, out, "unused", "--output-dir", str(killed), *common, "--die-at-save", "6")
    assert died.returncode == -signal.SIGKILL, f"exited {died.returncode}\n{died.stderr[-4000:]}"
    assert daemon.proc.wait(30) == -signal.SIGKILL  # the fault: killed at checkpoint-6's write
    facts = json.loads((out / "died-0.json").read_text())
    assert facts == {"step": 6, "incomplete": True, "committed": False, "error": "DaemonUnavailable"}, facts
    assert (killed / "checkpoint-6.incomplete").is_dir() and not (killed / "checkpoint-6").exists()
    assert get_last_checkpoint(str(killed)) == str(killed / "checkpoint-3")

    daemon = start_daemon(run_dir, root)  # a new daemon; it sweeps what the dead one left
    try:
        resumed = ok(run(daemon, out, "resumed", "--output-dir", str(killed), *common))
        assert "trained to step 9" in resumed
        assert same_weights(out / "ref.pt", out / "resumed.pt") == []
        wait_until(lambda: checkpoints(killed) == ["checkpoint-6", "checkpoint-9"], timeout=60,
                   what=lambda: f"after the resume: {checkpoints(killed)}")
    finally:
        daemon.kill()


@pytest.mark.timeout(600)
def test_two_processes_one_killed_mid_save_resume_bitwise_under_torchrun(daemon, root: Path, tmp_path: Path) -> None:
    """torchrun, two processes (DDP on gloo). Process 1 dies by SIGKILL at checkpoint-6 once process 0's shard of
    it is on disk and before handing over its own: checkpoint-6 is never committed, get_last_checkpoint finds
    checkpoint-3, and two processes resume from it to the uninterrupted run's weights, bit for bit;
    ``save_total_limit=2`` holds on both runs."""
    out = tmp_path
    ref, killed = root / "ref2", root / "killed2"
    common = ("--max-steps", "9", "--save-steps", "3", "--save-total-limit", "2")
    ok(run(daemon, out, "ref", "--output-dir", str(ref), *common, procs=2))
    wait_until(lambda: checkpoints(ref) == ["checkpoint-6", "checkpoint-9"], timeout=60,
               what=lambda: f"save_total_limit=2 through the daemon's retention left {checkpoints(ref)}")
    index = ckptd.read_index(ref / "checkpoint-9")
    assert index.world_size == 2 and index.step == 9

    died = run(daemon, out, "unused", "--output-dir", str(killed), *common, "--die-at-save", "6", "--die-rank", "1",
               procs=2)
    assert died.returncode != 0
    facts = json.loads((out / "died-1.json").read_text())
    assert facts == {"step": 6, "other_shard_written": True, "committed": False}, facts
    assert "Signals.SIGKILL" in died.stderr or "exitcode  : -9" in died.stderr, died.stderr[-4000:]
    assert get_last_checkpoint(str(killed)) == str(killed / "checkpoint-3")
    assert ckptd.latest(killed, run_dir=daemon.run_dir) == killed / "checkpoint-3"

    resumed = ok(run(daemon, out, "resumed", "--output-dir", str(killed), *common, procs=2))
    assert "rank 0: trained to step 9" in resumed and "rank 1: trained to step 9" in resumed
    assert same_weights(out / "ref.pt", out / "resumed.pt") == []
    wait_until(lambda: checkpoints(killed) == ["checkpoint-6", "checkpoint-9"], timeout=60,
               what=lambda: f"after the resume: {checkpoints(killed)}")


@pytest.mark.timeout(400)
def test_save_total_limit_never_deletes_the_best_checkpoint_and_the_best_is_loaded_at_the_end(
        daemon, root: Path, tmp_path: Path) -> None:
    """``save_total_limit=2`` with ``load_best_model_at_end`` and a metric whose best is the first evaluation
    (step 2): the daemon deletes every checkpoint but the best and the newest, and the run ends with the best
    checkpoint's weights."""
    folder = root / "best"
    ok(run(daemon, tmp_path, "final", "--output-dir", str(folder), "--max-steps", "8", "--save-steps", "2",
           "--save-total-limit", "2", "--best-first"))
    assert checkpoints(folder) == ["checkpoint-2", "checkpoint-8"]
    trainer_state = json.loads(ckptd.load(folder / "checkpoint-8")["trainer_state"])
    assert trainer_state["best_model_checkpoint"] == str(folder / "checkpoint-2")
    best = ckptd.load(folder / "checkpoint-2")["model"]
    final = torch.load(tmp_path / "final.pt")
    assert [k for k in final if not torch.equal(final[k], best[k])] == []


@pytest.mark.timeout(400)
def test_a_trainer_killed_between_two_persists_resumes_bitwise_from_its_memory_snapshot(
        daemon_factory, root: Path, tmp_path: Path) -> None:
    """``memory_steps=1`` beside ``save_steps=4``: checkpoint-4 persisted, 5 and 6 held in node memory; the trainer
    dies by SIGKILL after step 6's snapshot is held, and the daemon persists nothing on its death
    (``--persist-on-exit never``), so the resume at step 6 can only come from memory. It ends bitwise as the run
    never killed (which took the same snapshots)."""
    daemon = daemon_factory("--persist-on-exit", "never")
    ref, killed = root / "mref", root / "mkilled"
    common = ("--max-steps", "8", "--save-steps", "4", "--memory-steps", "1")
    ok(run(daemon, tmp_path, "ref", "--output-dir", str(ref), *common))
    died = run(daemon, tmp_path, "unused", "--output-dir", str(killed), *common, "--die-after-snapshot", "6")
    assert died.returncode == -signal.SIGKILL, f"exited {died.returncode}\n{died.stderr[-4000:]}"
    assert json.loads((tmp_path / "died-0.json").read_text()) == {"step": 6, "held": True, "on_disk": False}
    assert checkpoints(killed) == ["checkpoint-4"]
    assert get_last_checkpoint(str(killed)) == str(killed / "checkpoint-4")  # the Trainer's own sees the disk only
    assert ckptd.latest(killed, run_dir=daemon.run_dir) == killed / "checkpoint-6"

    resumed = ok(run(daemon, tmp_path, "resumed", "--output-dir", str(killed), *common))
    assert "trained to step 8" in resumed
    assert same_weights(tmp_path / "ref.pt", tmp_path / "resumed.pt") == []
    assert checkpoints(killed) == ["checkpoint-4", "checkpoint-8"]


@pytest.mark.timeout(600)
def test_a_run_switched_from_the_trainers_own_checkpoints_resumes_from_them_and_never_saves_over_them(
        daemon, root: Path, tmp_path: Path) -> None:
    """A run that saved with ``transformers.Trainer`` to step 6 (its own files: checkpoint-3 and 6) switches to
    ``CkptdTrainer``: ``resume_from_checkpoint=True`` takes the Trainer's newest own checkpoint (the ckptd one
    alone would find none), resumes through the Trainer's own loaders and ends bitwise as a run that saved through
    ckptd from the start (to 6, then resumed to 9: the learning rate schedule is the 6-step run's in both);
    checkpoint-9 is ckptd's. A fresh run into a directory holding a Trainer's own checkpoint-3 fails at that
    save, naming it, and writes nothing there (it failed one save later, with the save refused by the daemon)."""
    common = ("--max-steps", "9", "--save-steps", "3")
    ok(run(daemon, tmp_path, "unused", "--output-dir", str(root / "ref3"), "--max-steps", "6", "--save-steps", "3"))
    ok(run(daemon, tmp_path, "ref", "--output-dir", str(root / "ref3"), *common))  # ckptd's own 6, then 9
    switched = root / "switched"
    ok(run(daemon, tmp_path, "unused", "--plain", "--output-dir", str(switched), "--max-steps", "6",
           "--save-steps", "3"))
    assert checkpoints(switched) == ["checkpoint-3", "checkpoint-6"]
    assert not (switched / "checkpoint-6" / "ckptd.json").exists()  # the Trainer's own files
    ok(run(daemon, tmp_path, "switched", "--resume", "--output-dir", str(switched), *common))
    assert same_weights(tmp_path / "ref.pt", tmp_path / "switched.pt") == []
    assert (switched / "checkpoint-9" / "ckptd.json").is_file() and checkpoints(switched) == [
        "checkpoint-3", "checkpoint-6", "checkpoint-9"]

    clash = root / "clash"
    clash.mkdir()
    shutil.copytree(switched / "checkpoint-3", clash / "checkpoint-3")
    before = sorted(p.name for p in (clash / "checkpoint-3").iterdir())
    failed = run(daemon, tmp_path, "unused", "--output-dir", str(clash), "--max-steps", "3", "--save-steps", "3")
    assert failed.returncode != 0
    assert f"{clash / 'checkpoint-3'} exists and is not a ckptd checkpoint" in failed.stderr, failed.stderr[-3000:]
    assert sorted(p.name for p in (clash / "checkpoint-3").iterdir()) == before


def test_the_mixin_after_the_trainer_among_the_bases_is_refused_when_the_class_is_defined() -> None:
    """Placed after ``Trainer``, the mixin's methods never run: the checkpoints would silently be the Trainer's own
    files. The class is refused instead, saying where to put it."""
    from transformers import Trainer

    from ckptd.integrations.hf import CkptdTrainerMixin

    with pytest.raises(TypeError, match="put CkptdTrainerMixin before the Trainer class"):
        type("Backwards", (Trainer, CkptdTrainerMixin), {})

    class Forwards(CkptdTrainerMixin, Trainer):
        pass
    assert Forwards.__mro__.index(CkptdTrainerMixin) < Forwards.__mro__.index(Trainer)


def test_the_export_of_a_bad_path_or_a_snapshot_held_in_memory_says_why_without_a_traceback(
        daemon, root: Path, tmp_path: Path) -> None:
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir))
    client = ckptd.Client(run_dir=daemon.run_dir, spawn=False)
    try:
        client.save_async({"model": {"w": torch.ones(4)}, "trainer_state": "{}"}, root / "held" / "checkpoint-7",
                          step=7, persist=False).result(60)
        for source, says in ((root / "nowhere", "no checkpoint"),
                             (root / "held" / "checkpoint-7", "is held in node memory only")):
            done = subprocess.run([sys.executable, "-m", "ckptd.integrations.hf", "export", str(source),
                                   str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    finally:
        client.close()
