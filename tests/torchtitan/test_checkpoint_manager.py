"""ckptd's torchtitan ``CheckpointManager`` against torchtitan 0.3 itself, on gloo FSDP2 ranks and a real daemon.

Collected only by ``make test-torchtitan`` (its venv has torchtitan). The
first test is the whole story; the others each check one more of
torchtitan's options (a load_step rollback, a switch from its DCP manager
and back, its per-rank dataloader, the Hugging Face export, a model-only last
step, a remote folder). Two ranks train the way torchtitan's ``Trainer``
does and save every 2 steps in each of torchtitan's async modes; halfway
through step 5 rank 1 kills itself
(the test sees its exit by SIGKILL) and rank 0 is stopped while it waits for
it. Three ranks then resume: the model and optimizer (resharded), the LR
scheduler, the dataloader and the train state must equal what rank 0
gathered at step 4, and the resumed run's own saves must work on the new
world size, with torchtitan's ``keep_latest_k`` kept by the daemon.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.integrations.torchtitan import CheckpointManager

from helpers import wait_until
from sharded_ranks import run_ranks
from titan_ranks import (PERSISTED, ROLLED_BACK_TO, SAVED, SNAPSHOTTED, export_last_step_in_hf, parallel_aware,
                         resume, resume_from_snapshot, train_with_snapshots_until_killed,
                         resume_after_model_only_last_step, resume_at, carry_over, roll_back, same, switch_back,
                         train_to_saved,
                         train_until_killed)
from zygote import start_ranks


def kill_mid_training(daemon, folder: Path, mode: str | None, out: Path) -> list[dict]:
    """Two ranks train and save (``mode``: torchtitan's async mode; None: snapshotting between persists); rank 1
    dies by SIGKILL mid-step. Their logs.

    Rank 0 waits for it in a collective: gloo may fail that wait (the peer's
    connection closed), else the test kills it.
    """
    common = (2, str(out / "init-train"), str(daemon.run_dir), str(folder))
    ctx = (start_ranks(train_until_killed, (*common, mode, str(out)), 2) if mode is not None
           else start_ranks(train_with_snapshots_until_killed, (*common, str(out)), 2))
    try:
        wait_until(lambda: ctx.processes[1].exitcode is not None, timeout=300,
                   what=lambda: f"rank 1 is still alive: {[p.exitcode for p in ctx.processes]}")
        assert ctx.processes[1].exitcode == -signal.SIGKILL, f"rank 1 exited {ctx.processes[1].exitcode}"
    finally:
        for p in ctx.processes:
            p.kill()
            p.join(60)
    return [json.loads((out / f"train-{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_killed_run_resumes_on_three_ranks_with_every_stateful_restored(daemon, root: Path, tmp_path: Path,
                                                                       mode: str) -> None:
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    first = kill_mid_training(daemon, folder, mode, out)
    for log in first:
        assert log["loaded"] is False
        assert [s["step"] for s in log["saves"]] == [2, SAVED]
        for save in log["saves"]:
            if mode == "disabled":  # torchtitan's synchronous save: committed when save() returns
                assert save["committed_on_return"] and not save["save_future"]
            else:  # the trainer waits on save_future before the next save
                assert save["save_future"]
            assert save["staging_future"] == (mode == "async_with_pinned_mem")  # waited on before optimizer.step()
    index = ckptd.read_index(folder / f"step-{SAVED}")
    assert (index.step, index.world_size) == (SAVED, 2)
    assert "0.weight" in index.tensors and "optimizer" not in index.tensors  # torchtitan's layout: model keys on top

    check_resumed(daemon, folder, mode, tmp_path, out)
    committed = lambda: sorted(p.name for p in folder.iterdir())  # noqa: E731
    wait_until(lambda: committed() == [f"step-{SAVED}", f"step-{SAVED + 2}"], timeout=60,
               what=lambda: f"keep_latest_k=2 left {committed()}")


def check_resumed(daemon, folder: Path, mode: str, tmp_path: Path, out: Path) -> None:
    """Three ranks resume from step ``SAVED``: everything restored as ``out/reference.pt``; then they save."""
    logs = run_ranks(resume, 3, tmp_path, "resume", str(daemon.run_dir), str(folder), mode, str(out))
    for log in logs:
        assert log["loaded"] is True and log["step"] == SAVED
        assert log["differ"] == [], f"restored differently from what was saved: {log['differ']}"
        assert [s["step"] for s in log["saves"]] == [SAVED + 2]
        assert log["purge_thread"] is False  # the daemon keeps keep_latest_k, not torchtitan's purge thread
    resumed = ckptd.read_index(folder / f"step-{SAVED + 2}")
    assert (resumed.step, resumed.world_size) == (SAVED + 2, 3)


@pytest.mark.timeout(600)
def test_a_run_killed_between_two_persists_resumes_from_its_newest_memory_snapshot(daemon_factory, root: Path,
                                                                                  tmp_path: Path) -> None:
    """``memory_interval=1`` beside ``interval=4``: step 4 persisted, steps 5 and 6 snapshots in node memory; the
    daemon persists nothing on the trainer's death (``--persist-on-exit never``), so the resume at step 6 can only
    come from memory; ``keep_latest_k`` then counts the persisted checkpoints alone."""
    daemon = daemon_factory("--persist-on-exit", "never")
    folder, out = root / "titan-memory", tmp_path / "out"
    out.mkdir()
    first = kill_mid_training(daemon, folder, None, out)
    for log in first:
        assert [s["step"] for s in log["saves"]] == list(range(1, SNAPSHOTTED + 1))
        assert [s["step"] for s in log["saves"] if s["committed_on_return"]] in ([], [PERSISTED])
    on_disk = lambda: sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []  # noqa: E731
    assert on_disk() == [f"step-{PERSISTED}"], f"only the persisted step is on disk: {on_disk()}"
    assert ckptd.latest(folder, run_dir=daemon.run_dir) == folder / f"step-{SNAPSHOTTED}"

    logs = run_ranks(resume_from_snapshot, 2, tmp_path, "resume", str(daemon.run_dir), str(folder), str(out))
    for log in logs:
        assert log["loaded"] is True and log["step"] == SNAPSHOTTED, log
        assert log["differ"] == [], f"restored differently from what was held: {log['differ']}"
        assert [s["step"] for s in log["saves"]] == [SNAPSHOTTED + 1, 2 * PERSISTED]
    assert (folder / f"step-{2 * PERSISTED}" / "ckptd.json").exists()
    wait_until(lambda: on_disk() == [f"step-{PERSISTED}", f"step-{2 * PERSISTED}"], timeout=60,
               what=lambda: f"the persisted checkpoints alone on disk (keep_latest_k=2): {on_disk()}")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("manager", ["torchtitan", "ckptd"])
def test_a_run_rolled_back_by_load_step_saves_over_the_later_steps_as_torchtitan_does(daemon, root: Path,
                                                                                    tmp_path: Path,
                                                                                    manager: str) -> None:
    """``checkpoint.load_step`` back to step 2 of 2, 4, 6 and training on: each later save replaces that step's
    folder with the new run's state (torchtitan's own manager, DCP's writer, overwrites; ckptd's once refused every
    rank with ``CheckpointExists``, and the job died one interval after the rollback)."""
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    args = (str(daemon.run_dir), str(folder), manager)
    first = run_ranks(roll_back, 2, tmp_path, "train", *args, "train", str(out))
    assert [log["saves"] for log in first] == [[2, SAVED, SAVED + 2]] * 2
    logs = run_ranks(roll_back, 2, tmp_path, "rollback", *args, "rollback", str(out))
    for log in logs:
        assert (log["loaded"], log["step"]) == (True, ROLLED_BACK_TO), log
        assert "error" not in log, log
        assert log["saves"] == [SAVED, SAVED + 2]
    later = [SAVED, SAVED + 2]
    for step in later:
        again = torch.load(out / f"rollback-step-{step}.pt")
        assert not same(again["model"], torch.load(out / f"train-step-{step}.pt")["model"])  # another trajectory
    checks = run_ranks(resume_at, 2, tmp_path, "load", *args, later, str(out))
    for log in checks:  # each later folder holds the rolled-back run's state
        assert log["differ"] == {str(step): [] for step in later}, log
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", f"step-{SAVED}", f"step-{SAVED + 2}"]


@pytest.mark.timeout(300)
def test_run_switched_from_torchtitans_own_manager_resumes_from_its_dcp_checkpoint(daemon, root: Path,
                                                                                   tmp_path: Path) -> None:
    """A run saved by torchtitan's DCP manager, switched to ckptd's: it resumes from the newest DCP checkpoint."""
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    run_ranks(train_to_saved, 2, tmp_path, "train", str(daemon.run_dir), str(folder), "torchtitan", str(out))
    assert (folder / f"step-{SAVED}" / ".metadata").is_file()
    check_resumed(daemon, folder, "async", tmp_path, out)
    assert (folder / f"step-{SAVED}" / ".metadata").is_file()  # ckptd's retention leaves DCP's checkpoints alone


@pytest.mark.timeout(400)
def test_a_step_folder_torchtitans_own_manager_wrote_into_after_ckptd_is_refused(daemon, root: Path,
                                                                                tmp_path: Path) -> None:
    """Switched back, torchtitan's own manager resumes from its own newest step (it sees no ``ckptd.json``) and
    writes its DCP files into the step folder ckptd committed after it; ckptd's manager then loads that folder
    neither as the resume step nor by number, naming the folder and the DCP files."""
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    run_ranks(train_to_saved, 2, tmp_path, "train", str(daemon.run_dir), str(folder), "torchtitan", str(out))
    check_resumed(daemon, folder, "async", tmp_path, out)  # ckptd's manager commits step SAVED + 2 on 3 ranks
    logs = run_ranks(switch_back, 2, tmp_path, "back", str(daemon.run_dir), str(folder), str(out))
    mixed = folder / f"step-{SAVED + 2}"
    assert (mixed / ".metadata").is_file() and ckptd.read_index(mixed).world_size == 3  # two runs in one folder
    assert ckptd.verify_checkpoint(mixed).ok  # ckptd's own files are intact: only a load can tell
    for log in logs:
        assert log["own_resumed_at"] == SAVED  # torchtitan's own manager ignored ckptd's step SAVED + 2
        for name in ("resume", "load_step"):
            assert log[f"{name}_step"] == 0, log  # nothing was loaded
            assert log.get(name) == (
                f"checkpoint {mixed} holds two runs' checkpoints: ckptd's (ckptd.json and the shards it lists) and a "
                f"DCP checkpoint ckptd did not write (.metadata and 2 *.distcp files), as torchtitan's own "
                "CheckpointManager leaves when it saves into a folder of ckptd's checkpoints; ckptd will not guess "
                f"which to load. Move the files of the run you do not want out of {mixed}, or resume from another "
                "step (checkpoint.load_step)"), log


@pytest.mark.timeout(300)
def test_a_ckptd_step_carried_over_with_dcp_resumes_in_torchtitans_own_manager(daemon, root: Path,
                                                                              tmp_path: Path) -> None:
    """The way back docs/integrations.md gives: a new folder, ckptd's step read through ``ckptd.dcp.StorageReader``
    and written by ``dcp.save``; torchtitan's own manager resumes from it with every Stateful restored."""
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    run_ranks(train_to_saved, 2, tmp_path, "train", str(daemon.run_dir), str(folder), "ckptd", str(out))
    assert (folder / f"step-{SAVED}" / "ckptd.json").is_file()
    logs = run_ranks(carry_over, 2, tmp_path, "carry", str(daemon.run_dir), str(folder), str(root / "titan-dcp"),
                     str(out))
    for log in logs:
        assert (log["loaded"], log["step"], log["differ"]) == (True, SAVED, []), log
    assert (root / "titan-dcp" / f"step-{SAVED}" / ".metadata").is_file()


@pytest.mark.timeout(300)
def test_last_step_is_exported_in_hugging_face_format_as_torchtitan_does(daemon, root: Path, tmp_path: Path) -> None:
    """``last_save_in_hf``: the last step is torchtitan's Hugging Face export, beside ckptd's checkpoints."""
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    logs = run_ranks(export_last_step_in_hf, 2, tmp_path, "export", str(daemon.run_dir), str(folder), str(out))
    assert [log["resumed_at"] for log in logs] == [2, 2]  # the export is no resume point
    reference = torch.load(out / "reference.pt")
    exported = {}
    for f in (folder / f"step-{SAVED}").glob("*.safetensors"):
        exported.update(load_file(f))
    assert exported.keys() == {f"model.{k}" for k in reference}
    for k, v in reference.items():
        assert exported[f"model.{k}"].dtype == torch.bfloat16 and torch.equal(exported[f"model.{k}"], v.bfloat16()), k
    assert ckptd.latest(folder, run_dir=daemon.run_dir) == folder / "step-2"


@pytest.mark.timeout(400)
def test_torchtitans_per_rank_dataloader_resumes_and_is_left_out_on_more_ranks(daemon, root: Path,
                                                                               tmp_path: Path) -> None:
    """torchtitan's ``ParallelAwareDataloader`` (state per data-parallel rank) comes back on as many ranks; on
    more, torchtitan cannot move it (``exclude_from_loading=["dataloader"]``), and the rest still resumes. Not
    excluded, every rank is refused naming the world-size change (it once told the rank whose ``dp_rank_N`` was never
    saved to look for a model-only checkpoint, and failed the others in torchtitan's own check after the model
    loaded)."""
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    run_ranks(parallel_aware, 2, tmp_path, "save", str(daemon.run_dir), str(folder), "save", str(out))
    for phase, world, differ in (("resume", 2, []), ("grow", 3, ["next_batch"])):
        logs = run_ranks(parallel_aware, world, tmp_path, phase, str(daemon.run_dir), str(folder), phase, str(out))
        for rank, log in enumerate(logs):
            assert log["loaded"] is True
            assert log["differ"] == differ, (phase, rank, log)
    logs = run_ranks(parallel_aware, 3, tmp_path, "grow-all", str(daemon.run_dir), str(folder), "grow-all", str(out))
    for log in logs:  # every rank names the world-size change, before anything is loaded
        assert log == {"step": 0, "error": (
            f"ValueError: checkpoint {folder}/step-{SAVED} was saved at a data-parallel degree of 2 (2 ranks) and "
            "this run's is 3 (3 ranks): torchtitan's ParallelAwareDataloader keeps its state per data-parallel rank "
            "and cannot move it to another degree; to resume the rest on this world size, name it in "
            'checkpoint.exclude_from_loading (["dataloader"])')}, log


@pytest.mark.timeout(300)
def test_resuming_from_a_model_only_last_step_names_what_it_lacks(daemon, root: Path, tmp_path: Path) -> None:
    """torchtitan's default last step saves the model alone: a resume from it is refused, naming what is missing."""
    folder, out = root / "titan", tmp_path / "out"
    out.mkdir()
    logs = run_ranks(resume_after_model_only_last_step, 2, tmp_path, "model-only", str(daemon.run_dir), str(folder),
                     str(out))
    for log in logs:
        assert log["step"] == 0, log  # nothing was loaded
        assert log["error"] == (f"checkpoint {folder}/step-{SAVED} holds the model alone, as torchtitan's last "
                                "step does with last_save_model_only=True (its default), so it cannot resume training "
                                "(dataloader, lr_scheduler, optimizer, train_state not saved): resume from an earlier "
                                "step (checkpoint.load_step=N), and set last_save_model_only=False in runs you mean to "
                                "continue")


def test_a_remote_folder_is_refused_naming_the_mirror() -> None:
    """torchtitan allows ``s3://`` folders (fsspec); ckptd saves locally and mirrors, and says so at once."""
    config = CheckpointManager.Config(enable=True, folder="s3://bucket/run")
    with pytest.raises(ValueError, match=r"checkpoint.folder s3://bucket/run is remote: .* --mirror DIR=s3://"):
        config.build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={},
                     sd_adapter=None)


@pytest.mark.parametrize("value", [-1, True, 2.5, "10"])
def test_a_memory_interval_that_is_no_whole_number_of_steps_is_refused_as_torchtitan_refuses_its_own(value) -> None:
    with pytest.raises(ValueError, match="[Mm]emory.*interval"):
        CheckpointManager.Config(enable=True, folder="run", memory_interval=value)
    assert CheckpointManager.Config(enable=True, folder="run", memory_interval=0).memory_interval == 0
