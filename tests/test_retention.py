"""Retention and the start-up sweep on their own: real directories, no daemon.

Checkpoints here are written by hand (an index and the shard it lists), owner
markers name this host and a live or a dead pid, and a storage that fails one
call stands in for a disk error, through the storage seam.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from ckptd.ownership import owner_marker
from ckptd.protocol.names import OWNER_PREFIX, SWEPT_DIR
from ckptd.protocol.index import INDEX_NAME, CheckpointIndex, ShardRecord, shard_name
from ckptd.retention import apply_retention
from ckptd.storage import LocalStorage
from ckptd.slots import reclaim_orphaned_slots
from ckptd.sweep import KnownDirs, MAX_KNOWN_DIRS, is_orphaned, sweep_incomplete

from helpers import dead_pid

HOST = socket.gethostname()


def checkpoint(directory: Path, name: str, step: int | None, *, created: float = 1.0) -> Path:
    """A committed one-rank checkpoint: a 16-byte shard and the index that lists it."""
    path = directory / name
    path.mkdir(parents=True)
    shard = shard_name(0, 1)
    (path / shard).write_bytes(b"\0" * 16)
    index = CheckpointIndex(world_size=1, step=step, created=created,
                            files=(ShardRecord(file=shard, rank=0, size=16, checksum=0, tensors=1),))
    (path / INDEX_NAME).write_bytes(index.to_json())
    return path


def marker(directory: Path, pid: int, host: str = HOST) -> Path:
    m = directory / f"{OWNER_PREFIX}{host}-{pid}"
    m.touch()
    return m


class FailingRename(LocalStorage):
    """Local storage whose renames of paths containing ``match`` fail with EIO."""

    def __init__(self, match: str) -> None:
        self.match = match

    def rename(self, src: Path, dst: Path) -> None:
        if self.match in str(src):
            raise OSError(5, "Input/output error", str(src))
        super().rename(src, dst)


class CrashAfterIndexGone(LocalStorage):
    """A store without rename (as an object store is), whose process "dies" right after a checkpoint's index is
    deleted: what a daemon killed inside retention on a bucket leaves."""

    def can_rename(self, path: Path) -> bool:
        return False

    def unlink(self, path: Path) -> None:
        super().unlink(path)
        if path.name == INDEX_NAME:
            raise SystemExit("killed")


# -- retention -----------------------------------------------------------------


def test_retention_keeps_the_newest_by_step_and_never_the_one_just_committed(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        checkpoint(tmp_path, f"step-{step}", step)
    newest = checkpoint(tmp_path, "rerun", 0)  # just committed with a lower step: kept all the same
    deleted = apply_retention(LocalStorage(), newest, 2, set())
    assert sorted(p.name for p in deleted) == ["step-1", "step-2", "step-3"]
    assert sorted(os.listdir(tmp_path)) == ["rerun", "step-4"]


def test_retention_passes_over_saves_in_flight_and_directories_that_are_not_checkpoints(tmp_path: Path) -> None:
    old = checkpoint(tmp_path, "step-1", 1)
    busy = checkpoint(tmp_path, "step-2", 2)
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-0.incomplete").mkdir()
    newest = checkpoint(tmp_path, "step-3", 3)
    assert apply_retention(LocalStorage(), newest, 1, {busy}) == [old]
    assert sorted(os.listdir(tmp_path)) == ["notes", "step-0.incomplete", "step-2", "step-3"]


def test_retention_keeps_a_checkpoint_holding_a_file_ckptd_did_not_write(tmp_path: Path, caplog) -> None:
    kept = checkpoint(tmp_path, "step-1", 1)
    (kept / "README").write_text("the good run")
    newest = checkpoint(tmp_path, "step-2", 2)
    with caplog.at_level("WARNING", logger="ckptd"):
        assert apply_retention(LocalStorage(), newest, 1, set()) == []
    assert (kept / "README").read_text() == "the good run"
    assert "event=retention_skip" in caplog.text and "'README'" in caplog.text


def test_a_failed_rename_keeps_the_victim_whole_and_takes_its_owner_marker_back(tmp_path: Path, caplog) -> None:
    victim = checkpoint(tmp_path, "step-1", 1)
    newest = checkpoint(tmp_path, "step-2", 2)
    with caplog.at_level("WARNING", logger="ckptd"):
        assert apply_retention(FailingRename("step-1"), newest, 1, set()) == []
    assert sorted(os.listdir(victim)) == [INDEX_NAME, shard_name(0, 1)]
    assert "event=retention_skip" in caplog.text and "Input/output error" in caplog.text


def test_retention_refuses_to_keep_fewer_than_one() -> None:
    with pytest.raises(ValueError, match="keep_last must be at least 1, got 0"):
        apply_retention(LocalStorage(), Path("/nonexistent/step-1"), 0, set())


# -- sweep ---------------------------------------------------------------------


def test_an_incomplete_directory_is_orphaned_only_when_every_marker_names_a_dead_process_here(tmp_path: Path) -> None:
    dead, alive = tmp_path / "a.incomplete", tmp_path / "b.incomplete"
    foreign, unmarked = tmp_path / "c.incomplete", tmp_path / "d.incomplete"
    for d in (dead, alive, foreign, unmarked):
        d.mkdir()
    marker(dead, dead_pid())
    marker(alive, dead_pid())
    marker(alive, os.getpid())
    marker(foreign, dead_pid(), host=HOST + "-elsewhere")
    assert [is_orphaned(LocalStorage(), d) for d in (dead, alive, foreign, unmarked)] == [True, False, False, False]
    assert not is_orphaned(LocalStorage(), tmp_path / "missing.incomplete")


def test_the_sweep_removes_dead_leftovers_and_dead_markers_and_leaves_everything_else(tmp_path: Path) -> None:
    leftover = tmp_path / "step-1.incomplete"
    leftover.mkdir()
    marker(leftover, dead_pid())
    (leftover / shard_name(0, 1)).write_bytes(b"half")
    writing = tmp_path / "step-2.incomplete"
    writing.mkdir()
    live_marker = marker(writing, os.getpid())
    committed = checkpoint(tmp_path, "step-0", 0)
    stale = marker(committed, dead_pid())
    mine = committed / owner_marker()
    mine.touch()
    assert sweep_incomplete(LocalStorage(), [tmp_path, tmp_path / "missing"], "remove") == [leftover]
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-2.incomplete"]
    assert live_marker.exists() and mine.exists() and not stale.exists()


def test_the_sweep_moves_leftovers_aside_when_asked_and_does_nothing_when_off(tmp_path: Path) -> None:
    leftover = tmp_path / "step-1.incomplete"
    leftover.mkdir()
    marker(leftover, dead_pid())
    assert sweep_incomplete(LocalStorage(), [tmp_path], "off") == []
    assert leftover.exists()
    assert sweep_incomplete(LocalStorage(), [tmp_path], "move") == [leftover]
    (moved,) = os.listdir(tmp_path / SWEPT_DIR)
    assert moved.startswith("step-1.incomplete-") and not leftover.exists()


def test_orphaned_slots_of_dead_processes_are_unlinked_and_others_kept(tmp_path: Path) -> None:
    uid = os.getuid()
    dead = f"ckptd-{uid}-{dead_pid()}-0"
    live = f"ckptd-{uid}-{os.getpid()}-0"
    other_user = f"ckptd-{uid + 1}-{dead_pid()}-0"
    for name in (dead, live, other_user, "not-a-slot"):
        (tmp_path / name).write_bytes(b"x")
    assert reclaim_orphaned_slots(tmp_path) == [dead]
    assert sorted(os.listdir(tmp_path)) == sorted([live, other_user, "not-a-slot"])


def test_known_directories_survive_a_restart_once_each_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    known = KnownDirs(LocalStorage(), tmp_path)
    assert known.dirs == []
    known.remember(Path("/ckpts/a"))
    known.remember(Path("/ckpts/a"))
    known.remember(Path("/ckpts/b"))
    assert KnownDirs(LocalStorage(), tmp_path).dirs == [Path("/ckpts/a"), Path("/ckpts/b")]
    for n in range(MAX_KNOWN_DIRS - 1):  # one more than fits: the oldest, /ckpts/a, goes
        known.remember(Path(f"/ckpts/run-{n}"))
    again = KnownDirs(LocalStorage(), tmp_path)
    assert len(again.dirs) == MAX_KNOWN_DIRS and again.dirs[0] == Path("/ckpts/b")


def test_retention_on_a_store_without_rename_marks_its_victim_before_the_index_goes(tmp_path: Path) -> None:
    """Killed between the index and the shards, a victim on an object store must carry this daemon's owner
    marker, or the start-up sweep (which removes an index-less prefix only when its markers name dead daemons)
    leaves its shards in the bucket for good."""
    old, newest = checkpoint(tmp_path, "step-1", 1), checkpoint(tmp_path, "step-2", 2)
    with pytest.raises(SystemExit):
        apply_retention(CrashAfterIndexGone(), newest, 1, set())
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

    assert apply_retention(LocalStorage(), newest, 1, set(), keep) == []
    assert CheckpointIndex.from_json((tmp_path / "last" / INDEX_NAME).read_bytes(), "last").step == 20
