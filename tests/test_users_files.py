"""ckptd deletes only what it wrote: nothing of the user's is destroyed by a save, an overwrite or retention.

Overwrite, retention and the removal of a dead save's leftover may only ever
delete what ckptd wrote; anything else at the path is refused with an error
that names the path and why, and is left bitwise as it was. An owner marker
that cannot be removed does not fail the save that committed.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

import ckptd

from helpers import filled_state as state, wait_until

DEAD_PID = 4_194_304
"""Above any pid_max: a marker naming it names a process that cannot be running."""


def tree(path: Path) -> dict[str, str]:
    """Every entry below ``path`` (itself included) with its kind and content digest."""
    out = {}
    for p in sorted([path, *path.rglob("*")]) if path.is_dir() and not path.is_symlink() else [path]:
        rel = str(p.relative_to(path.parent))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- overwrite replaces only a committed ckptd checkpoint ---------------------


def _run_folder(client, root: Path) -> Path:
    """A run directory holding two checkpoints and a notes file (what `exp1` meant)."""
    run = root / "exp1"
    client.save_async(state(1), run / "step-1", step=1).result(30)
    client.save_async(state(2), run / "step-2", step=2).result(30)
    (run / "notes.txt").write_text("lr 3e-4 looked best\n")
    return run


def _checkpoint_with_notes(client, root: Path) -> Path:
    path = root / "annotated"
    client.save_async(state(3), path, step=3).result(30)
    (path / "notes.txt").write_text("keep this one\n")
    return path


def _file(client, root: Path) -> Path:
    path = root / "results.csv"
    path.write_text("step,loss\n1,0.5\n")
    return path


def _empty_dir(client, root: Path) -> Path:
    path = root / "empty"
    path.mkdir()
    return path


def _fake_index(client, root: Path) -> Path:
    path = root / "fake"
    path.mkdir()
    (path / "ckptd.json").write_text('{"format": "something else"}')
    (path / "data.bin").write_bytes(b"\x00" * 100)
    return path


def _foreign_subdir(client, root: Path) -> Path:
    path = root / "with-subdir"
    client.save_async(state(4), path, step=4).result(30)
    (path / "eval").mkdir()
    (path / "eval" / "scores.json").write_text("{}")
    return path


NOT_CHECKPOINTS = [
    ("run-folder-with-checkpoints-and-notes", _run_folder, "not a committed ckptd checkpoint: it has no ckptd.json"),
    ("checkpoint-with-a-notes-file", _checkpoint_with_notes, "holds entries ckptd did not write: 'notes.txt'"),
    ("checkpoint-with-a-subdirectory", _foreign_subdir, "holds entries ckptd did not write: 'eval'"),
    ("plain-file", _file, "is a file"),
    ("empty-directory", _empty_dir, "has no ckptd.json"),
    ("directory-with-a-foreign-index", _fake_index, "not a valid ckptd index"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,make,why", NOT_CHECKPOINTS, ids=[c[0] for c in NOT_CHECKPOINTS])
def test_overwrite_refuses_anything_but_a_committed_ckptd_checkpoint_and_leaves_it_untouched(
    daemon, client, root, case, make, why
) -> None:
    path = make(client, root)
    before = tree(path)
    with pytest.raises(ckptd.CheckpointExists, match="refusing to replace") as info:
        client.save_async(state(9), path, step=9, overwrite=True).result(30)
    assert str(path) in str(info.value) and why in str(info.value), info.value
    # without overwrite the advice must not be "pass overwrite=True"
    with pytest.raises(ckptd.CheckpointExists, match="would not replace it either") as info:
        client.save_async(state(9), path, step=9).result(30)
    assert why in str(info.value)
    wait_until(lambda: not (root / f"{path.name}.incomplete").exists(), 15, "the refused save leaves nothing")
    assert tree(path) == before, f"{case}: the refused overwrite changed what was at {path}"
    if case == "run-folder-with-checkpoints-and-notes":
        assert ckptd.load(path / "step-2")["step"] == 2


@pytest.mark.timeout(60)
def test_overwrite_through_a_symlink_at_the_path_is_refused_and_the_link_and_its_target_stay(
    daemon, client, root
) -> None:
    client.save_async(state(1), root / "real", step=1).result(30)
    (root / "link").symlink_to(root / "real")
    before = {**tree(root / "link"), **tree(root / "real")}
    with pytest.raises(ckptd.PathNotAllowed, match="symbolic link"):
        client.save_async(state(2), root / "link", step=2, overwrite=True).result(30)
    assert {**tree(root / "link"), **tree(root / "real")} == before
    assert ckptd.load(root / "real")["step"] == 1


@pytest.mark.timeout(60)
def test_a_foreign_file_added_while_the_new_checkpoint_is_written_stops_the_overwrite_at_commit(
    daemon_factory, client_factory, root
) -> None:
    daemon_factory(faults=[{"op": "write", "match": "/ckpt.incomplete/", "errno": 0, "delay": 2.0}])
    client = client_factory()
    client.save_async(state(1), root / "ckpt", step=1).result(30)
    fut = client.save_async(state(2), root / "ckpt", step=2, overwrite=True)  # admitted: the old one was ours
    (root / "ckpt" / "notes.txt").write_text("added by hand meanwhile\n")
    before = tree(root / "ckpt")
    with pytest.raises(ckptd.CheckpointExists, match="holds entries ckptd did not write: 'notes.txt'"):
        fut.result(30)
    wait_until(lambda: not (root / "ckpt.incomplete").exists(), 15, "the new checkpoint's directory is removed")
    assert tree(root / "ckpt") == before
    assert ckptd.load(root / "ckpt")["step"] == 1


@pytest.mark.timeout(60)
def test_overwrite_still_replaces_a_checkpoint_that_holds_a_dead_daemons_owner_marker(daemon, client, root) -> None:
    client.save_async(state(1), root / "ckpt", step=1).result(30)
    (root / "ckpt" / f".ckptd-owner-{socket.gethostname()}-{DEAD_PID}").touch()
    client.save_async(state(2), root / "ckpt", step=2, overwrite=True).result(30)
    assert ckptd.load(root / "ckpt")["step"] == 2
    assert sorted(os.listdir(root)) == ["ckpt"]


@pytest.mark.timeout(60)
def test_a_save_refuses_to_remove_an_incomplete_directory_holding_the_users_files(daemon, client, root) -> None:
    mine = root / "model.incomplete"
    mine.mkdir()
    (mine / "draft.txt").write_text("not a checkpoint\n")
    before = tree(mine)
    with pytest.raises(ckptd.CheckpointExists, match="is in the way of this save") as info:
        client.save_async(state(1), root / "model", step=1).result(30)
    assert str(mine) in str(info.value) and "'draft.txt'" in str(info.value)
    assert tree(mine) == before
    assert not (root / "model").exists()


@pytest.mark.timeout(60)
def test_a_save_removes_a_dead_saves_leftover_and_commits(daemon, client, root) -> None:
    leftover = root / "model.incomplete"
    leftover.mkdir()
    (leftover / "rank-00000-of-00002.safetensors").write_bytes(b"\x00" * 4096)
    (leftover / f".ckptd-owner-{socket.gethostname()}-{DEAD_PID}").touch()
    client.save_async(state(1), root / "model", step=1).result(30)
    assert ckptd.load(root / "model")["step"] == 1
    assert sorted(os.listdir(root)) == ["model"]


# -- retention deletes only what ckptd wrote -----------------------------------------


@pytest.mark.timeout(60)
def test_retention_keeps_a_checkpoint_that_holds_the_users_files(daemon, client, root) -> None:
    client.save_async(state(1), root / "step-1", step=1).result(30)
    (root / "step-1" / "notes.txt").write_text("the good run\n")
    before = tree(root / "step-1")
    client.save_async(state(2), root / "step-2", step=2).result(30)
    client.save_async(state(3), root / "step-3", step=3, keep_last=1).result(30)
    wait_until(lambda: sorted(os.listdir(root)) == ["step-1", "step-3"], 15,
               "retention deletes step-2 (and its aside name)")
    wait_until(lambda: "event=retention_skip" in (daemon.run_dir / "ckptd.log").read_text(), 15,
               "retention logs why it kept step-1")
    assert sorted(os.listdir(root)) == ["step-1", "step-3"]
    assert tree(root / "step-1") == before


# -- an owner marker that cannot be removed does not fail a committed save ---------


@pytest.mark.timeout(60)
def test_a_committed_save_whose_owner_marker_cannot_be_removed_succeeds_and_the_marker_is_swept_later(
    daemon_factory, client_factory, root
) -> None:
    daemon = daemon_factory(faults=[{"op": "unlink", "match": "/ckpt/.ckptd-owner-", "errno": 5}])
    client = client_factory(heartbeat=0.2, timeout=5.0)
    result = client.save_async(state(1), root / "ckpt", step=1).result(30)
    assert result.path == root / "ckpt"
    marker = f".ckptd-owner-{socket.gethostname()}-{daemon.proc.pid}"
    assert sorted(os.listdir(root / "ckpt")) == sorted([marker, "ckptd.json", "rank-00000-of-00001.safetensors"])
    assert "event=marker_left" in (daemon.run_dir / "ckptd.log").read_text()
    assert ckptd.latest(root) == root / "ckpt"
    assert ckptd.load(root / "ckpt")["step"] == 1
    assert daemon.status()["errors_total"] == 0
    daemon.stop()  # the marker's owner is now dead: the next daemon's sweep removes it
    daemon_factory()
    wait_until(lambda: marker not in os.listdir(root / "ckpt"), 15, "the start-up sweep removes the dead marker")
    assert ckptd.load(root / "ckpt")["step"] == 1
