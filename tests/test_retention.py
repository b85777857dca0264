"""Retention: ``keep_last`` and ``--keep`` delete only older committed checkpoints, never the newest.

First on its own, on real directories with no daemon: checkpoints written by
hand (an index and the shard it lists), and a storage that fails one call
standing in for a disk error, through the storage seam. Then through a real
daemon: per save and per directory, catching up after falling behind, and
never holding up the next commit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.storage.ownership import owner_marker
from ckptd.protocol.endpoint import LOG_NAME
from ckptd.protocol.index import INDEX_NAME, CheckpointIndex, shard_name
from ckptd.upkeep.retention import apply_retention
from ckptd.storage.store import ObjectCheckpoints
from ckptd.storage.local import LocalCheckpoints
from ckptd.storage.contract import LocalStorage

from helpers import checkpoint, wait_until


class FailingRename(LocalStorage):
    """Local storage whose renames of paths containing ``match`` fail with EIO."""

    def __init__(self, match: str) -> None:
        self.match = match

    def rename(self, src: Path, dst: Path) -> None:
        if self.match in str(src):
            raise OSError(5, "Input/output error", str(src))
        super().rename(src, dst)


def index_last(files: LocalStorage) -> ObjectCheckpoints:
    """Local checkpoints deleted as on an object store: the index first, no rename."""
    return ObjectCheckpoints(files)


class CrashAfterIndexGone(LocalStorage):
    """Local files whose process "dies" right after a checkpoint's index is deleted: under ``index_last``, what a
    daemon killed inside retention on a bucket leaves."""

    def unlink(self, path: Path) -> None:
        super().unlink(path)
        if path.name == INDEX_NAME:
            raise SystemExit("killed")


# -- on its own: real directories, no daemon -----------------------------------


def test_retention_keeps_the_newest_by_step_and_never_the_one_just_committed(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        checkpoint(tmp_path, f"step-{step}", step)
    newest = checkpoint(tmp_path, "rerun", 0)  # just committed with a lower step: kept all the same
    deleted = apply_retention(LocalCheckpoints(LocalStorage()), newest, 2, set())
    assert sorted(p.name for p in deleted) == ["step-1", "step-2", "step-3"]
    assert sorted(os.listdir(tmp_path)) == ["rerun", "step-4"]


def test_retention_passes_over_saves_in_flight_and_directories_that_are_not_checkpoints(tmp_path: Path) -> None:
    old = checkpoint(tmp_path, "step-1", 1)
    busy = checkpoint(tmp_path, "step-2", 2)
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-0.incomplete").mkdir()
    newest = checkpoint(tmp_path, "step-3", 3)
    assert apply_retention(LocalCheckpoints(LocalStorage()), newest, 1, {busy}) == [old]
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-0.incomplete", "step-2", "step-3"]


def test_retention_keeps_a_checkpoint_holding_a_file_ckptd_did_not_write(tmp_path: Path, caplog) -> None:
    kept = checkpoint(tmp_path, "step-1", 1)
    (kept / "README").write_text("the good run")
    newest = checkpoint(tmp_path, "step-2", 2)
    with caplog.at_level("WARNING", logger="ckptd"):
        assert apply_retention(LocalCheckpoints(LocalStorage()), newest, 1, set()) == []
    assert (kept / "README").read_text() == "the good run"
    assert "event=retention_skip" in caplog.text and "'README'" in caplog.text


def test_a_failed_rename_keeps_the_victim_whole_and_takes_its_owner_marker_back(tmp_path: Path, caplog) -> None:
    victim = checkpoint(tmp_path, "step-1", 1)
    newest = checkpoint(tmp_path, "step-2", 2)
    with caplog.at_level("WARNING", logger="ckptd"):
        assert apply_retention(LocalCheckpoints(FailingRename("step-1")), newest, 1, set()) == []
    assert sorted(os.listdir(victim)) == [INDEX_NAME, shard_name(0, 1)]
    assert "event=retention_skip" in caplog.text and "Input/output error" in caplog.text


def test_retention_refuses_to_keep_fewer_than_one() -> None:
    with pytest.raises(ValueError, match="keep_last must be at least 1, got 0"):
        apply_retention(LocalCheckpoints(LocalStorage()), Path("/nonexistent/step-1"), 0, set())


def test_retention_on_a_store_without_rename_marks_its_victim_before_the_index_goes(tmp_path: Path) -> None:
    """Killed between the index and the shards, a victim on an object store must carry this daemon's owner
    marker, or the start-up sweep (which removes an index-less prefix only when its markers name dead daemons)
    leaves its shards in the bucket for good."""
    old, newest = checkpoint(tmp_path, "step-1", 1), checkpoint(tmp_path, "step-2", 2)
    with pytest.raises(SystemExit):
        apply_retention(index_last(CrashAfterIndexGone()), newest, 1, set())
    left = sorted(os.listdir(old))
    assert INDEX_NAME not in left and owner_marker() in left, left


def test_retention_never_deletes_a_version_saved_while_it_asked_the_mirror_about_the_one_before(tmp_path: Path) -> None:
    """Asking the mirror's store whether a victim is uploaded can take seconds (an outage); a save with
    overwrite=True may commit a new version meanwhile. The mirror's answer was about the old version: the new
    one, on no mirror yet, must stay."""
    checkpoint(tmp_path, "last", 8, created=1.0)
    newest = checkpoint(tmp_path, "epoch-12", 12, created=2.0)

    def keep(victim: Path) -> bool:  # "mirrored", said of the old version, while the overwrite commits
        replacement = checkpoint(tmp_path / "new", "last", 20, created=3.0)
        os.rename(victim, tmp_path / "old")
        os.rename(replacement, victim)
        return False

    assert apply_retention(LocalCheckpoints(LocalStorage()), newest, 1, set(), keep) == []
    assert CheckpointIndex.from_json((tmp_path / "last" / INDEX_NAME).read_bytes(), "last").step == 20


# -- through a real daemon -----------------------------------------------------


def test_keep_last_deletes_only_older_committed_checkpoints(client, root) -> None:
    (root / "notes").mkdir()  # foreign: never touched
    (root / "old.incomplete").mkdir()
    for step in (1, 2, 3, 4):
        client.save_async({"s": step}, root / f"step-{step}", step=step, keep_last=2).result(30)
    wait_until(lambda: sorted(p.name for p in root.iterdir()) == ["notes", "old.incomplete", "step-3", "step-4"])


def test_retention_never_deletes_the_checkpoint_just_committed(client, root) -> None:
    client.save_async({"s": 10}, root / "step-10", step=10).result(30)
    client.save_async({"s": 5}, root / "rewound-5", step=5, keep_last=1).result(30)
    wait_until(lambda: [p.name for p in root.iterdir()] == ["rewound-5"])


def test_retention_that_fell_behind_the_commits_catches_up_in_one_run_for_the_newest(
    daemon_factory, client_factory, root, tmp_path
) -> None:
    # The one maintenance thread is held in the first retention's listing of run/ (until ``gate`` exists)
    # while twenty more commits there ask for retention: a busy node's thread falling behind.
    run, gate = root / "run", tmp_path / "gate"
    run.mkdir()
    daemon = daemon_factory(faults=[{"op": "scandir", "match": str(run.resolve()), "exact": True, "errno": 0,
                                     "wait_for": str(gate)}])
    log = daemon.run_dir / "ckptd.log"
    listings = lambda: log.read_text().count("event=fault op=scandir")  # noqa: E731  one per retention run
    client = client_factory()
    client.save_async({"s": 0}, run / "s0", step=0, keep_last=2).result(30)
    wait_until(lambda: listings() == 1, 30, "the first retention is held in its listing of run/")
    for step in range(1, 21):
        client.save_async({"s": step}, run / f"s{step}", step=step, keep_last=2).result(30)
    gate.touch()
    wait_until(lambda: sorted(p.name for p in run.iterdir()) == ["s19", "s20"], 60,
               lambda: f"retention caught up: run/ holds {sorted(p.name for p in run.iterdir())}")
    # the held run, one for the newest request, and at most one asked for while that one ran
    assert listings() <= 3, f"{listings()} retention runs for 21 commits: the backlog grew with every commit"


def test_daemon_configured_retention_applies_per_directory(daemon_factory, client_factory, root) -> None:
    (root / "run-a").mkdir()
    (root / "run-b").mkdir()
    daemon_factory("--keep", f"{root / 'run-a'}=1")
    c = client_factory()
    for step in (1, 2, 3):
        c.save_async({"s": step}, root / "run-a" / f"s{step}", step=step).result(30)
        c.save_async({"s": step}, root / "run-b" / f"s{step}", step=step).result(30)
    wait_until(lambda: sorted(p.name for p in (root / "run-a").iterdir()) == ["s3"])
    assert sorted(p.name for p in (root / "run-b").iterdir()) == ["s1", "s2", "s3"]


@pytest.mark.timeout(120)
def test_a_slow_retention_removal_does_not_hold_up_the_next_commit(daemon_factory, client_factory, root,
                                                                    tmp_path) -> None:
    go = tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "remove_tree", "match": "/old.deleting.incomplete", "errno": 0,
                                     "wait_for": str(go)}])
    client = client_factory()
    client.save_async({"w": torch.ones(10)}, root / "old", step=1).result(30)
    client.save_async({"w": torch.ones(10)}, root / "new", step=2, keep_last=1).result(30)
    wait_until(lambda: "event=fault op=remove_tree" in (daemon.run_dir / "ckptd.log").read_text(), 20,
               "the removal fault fired")
    # the removal is held; a commit must not wait for it
    assert client.save_async({"w": torch.ones(10)}, root / "other", step=3).result(30).path == root / "other"
    assert (root / "old.deleting.incomplete").exists(), "the removal must still be held"
    go.touch()
    wait_until(lambda: sorted(os.listdir(root)) == ["new", "other"], 20, "retention removed the old one")


def test_start_refuses_a_keep_rule_outside_every_root(root, run_dir, tmp_path) -> None:
    """A ``--keep`` rule no save can ever meet is a mistake (a typo in the directory): refused, not ignored."""
    outside = tmp_path / "elsewhere"
    done = subprocess.run([sys.executable, "-m", "ckptd", "start", "--foreground", "--run-dir", str(run_dir),
                           "--root", str(root), "--keep", f"{root}/run=2", "--keep", f"{outside}=3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--keep {outside}=3: the directory is outside every --root" in done.stderr, done.stderr
    assert not (run_dir / "ckptd.sock").exists()


def test_client_delete_removes_a_committed_checkpoint_through_the_daemon_and_nothing_else(
        daemon_factory, client_factory, root, tmp_path) -> None:
    """``Client.delete``: the daemon's two-phase delete, refused for what is not a ckptd checkpoint, for a save in
    flight to the path and outside the roots; nothing there is fine."""
    daemon = daemon_factory(faults=[{"op": "rename", "match": "held", "errno": 0,
                                     "wait_for": str(tmp_path / "go")}])
    client = client_factory()
    client.save_async({"w": torch.ones(8)}, root / "step-1", step=1).result(30)
    client.delete(root / "step-1")
    assert not (root / "step-1").exists() and not list(root.iterdir())
    client.delete(root / "step-1")  # gone already: nothing to do
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ckptd.InvalidCheckpoint, match="not a committed ckptd checkpoint"):
        client.delete(root / "notes")
    assert (root / "notes" / "todo.txt").read_text() == "mine"
    with pytest.raises(ckptd.PathNotAllowed):
        client.delete(tmp_path / "elsewhere")
    fut = client.save_async({"w": torch.ones(8)}, root / "held", step=2)
    wait_until(lambda: "event=fault op=rename" in (daemon.run_dir / LOG_NAME).read_text(), 30,
               "the save's publish held by the fault")
    with pytest.raises(ckptd.Conflict, match="a save to it is in progress"):
        client.delete(root / "held")
    (tmp_path / "go").touch()
    fut.result(30)
    assert ckptd.load(root / "held")["w"].tolist() == [1.0] * 8


def test_client_delete_of_a_snapshot_path_drops_the_held_snapshot_too(daemon_factory, client_factory, root,
                                                                       run_dir) -> None:
    """A memory snapshot, persisted or in memory only, is deleted everywhere: it is no longer listed or loaded,
    and nothing writes it back on exit (it was unpersisted by the delete and persisted again at close)."""
    daemon = daemon_factory()
    client = client_factory()
    persisted, in_memory = root / "a" / "step-1", root / "b" / "step-2"  # two directories: both stay held
    for path in (persisted, in_memory):
        path.parent.mkdir()
        client.save_async({"w": torch.ones(4)}, path, step=1, persist=False).result(30)
    client.persist(persisted)
    for path in (persisted, in_memory):
        client.delete(path)
        assert ckptd.latest(path.parent, run_dir=run_dir) is None
    client.close()
    wait_until(lambda: daemon.status()["memory"]["snapshots"] == [], 30, "the snapshots dropped")
    log = (daemon.run_dir / LOG_NAME).read_text()
    assert log.count("reason=deleted") == 2, log[-2000:]
    assert list(persisted.parent.iterdir()) == [] and list(in_memory.parent.iterdir()) == []


def test_a_daemon_killed_inside_a_deletion_leaves_what_its_restart_sweeps(daemon_factory, client_factory,
                                                                          root) -> None:
    """Killed after a victim's shard went but before the rest (the fault kills the daemon right after that
    unlink, proven by its exit status): the set-aside directory still holds the daemon's owner marker (removed
    last), so the next start sweeps it; before, the marker often went first and the leftover stayed for good."""
    daemon = daemon_factory(faults=[{"op": "unlink", "match": "step-1.deleting", "errno": 0, "kill": True,
                                     "after": True}])
    client = client_factory()
    client.save_async({"w": torch.ones(1000)}, root / "step-1", step=1).result(30)
    client.save_async({"w": torch.ones(1000)}, root / "step-2", step=2, keep_last=1).result(30)
    assert daemon.proc.wait(30) == -9  # died inside the removal of step-1
    aside = root / "step-1.deleting.incomplete"
    left = sorted(p.name for p in aside.iterdir())
    assert any(n.startswith(".ckptd-owner-") for n in left) and len(left) < 3, left
    client.close()
    daemon_factory()
    wait_until(lambda: not aside.exists(), 30, lambda: f"the restart sweeps {aside}: {sorted(root.iterdir())}")
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]
    assert ckptd.load(root / "step-2")["w"].tolist() == [1.0] * 1000


def test_a_persisted_snapshot_that_retention_deletes_leaves_memory_too_and_no_drain_brings_it_back(
        daemon_factory, client_factory, root, run_dir) -> None:
    """step-14 snapshotted and persisted, then step-15 and step-20 saved with keep_last=2: retention deletes
    step-14's disk copy, and the held snapshot goes with it. Before, it was held on as "in memory only", the drain
    at SIGTERM persisted it again as its directory's newest snapshot, and that persist's keep_last=2 deleted
    step-15 (found by a new-user pass)."""
    daemon = daemon_factory()
    client = client_factory()
    client.save_async({"w": torch.full((8,), 14.0)}, root / "step-14", step=14, keep_last=2, persist=False).result(30)
    client.persist(root / "step-14")
    for step in (15, 20):
        client.save_async({"w": torch.full((8,), float(step))}, root / f"step-{step}", step=step,
                          keep_last=2).result(30)
    wait_until(lambda: not (root / "step-14").exists(), 30, "retention to delete step-14")
    wait_until(lambda: daemon.status()["memory"]["snapshots"] == [], 30, "the held step-14 to be dropped too")
    assert ckptd.latest(root, run_dir=run_dir) == root / "step-20"
    client.close()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0
    assert sorted(p.name for p in root.iterdir()) == ["step-15", "step-20"]
    assert "reason=retention_deleted_disk_copy" in (daemon.run_dir / LOG_NAME).read_text()
