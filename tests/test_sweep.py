"""The start-up sweep: a daemon removes what dead writers left (``.incomplete`` directories, owner markers,
shared-memory slots), on this host only, and nothing a live process or another node still owns.

First on its own (``ckptd.upkeep.sweep``, ``ckptd.lifecycle.slot_maps``: real directories, no daemon): owner markers name this host
and a live or a dead pid. Then real daemons starting over what an earlier one, or a killed one, left."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.storage.ownership import owner_marker
from ckptd.protocol.index import shard_name
from ckptd.protocol.names import OWNER_PREFIX, SWEPT_DIR
from ckptd.storage.backends import Backends
from ckptd.lifecycle.slot_maps import reclaim_orphaned_slots
from ckptd.storage.contract import LocalStorage
from ckptd.upkeep.sweep import KnownDirs, MAX_KNOWN_DIRS, is_orphaned, sweep_incomplete

from helpers import SHM, checkpoint, dead_pid, wait_until

HOST = socket.gethostname()


# -- real daemons starting over what others left -------------------------------


def leftover(root: Path, name: str, host: str, pid: int | None) -> Path:
    d = root / f"{name}.incomplete"
    d.mkdir()
    (d / "rank-00000-of-00001.safetensors").write_bytes(b"partial")
    if pid is not None:
        (d / f".ckptd-owner-{host}-{pid}").touch()
    return d


def test_start_removes_incomplete_dirs_of_dead_local_writers_only(daemon_factory, root) -> None:
    here = socket.gethostname()
    dead = leftover(root, "dead", here, dead_pid())
    alive = leftover(root, "alive", here, os.getpid())
    remote = leftover(root, "remote", "some-other-node", dead_pid())
    unmarked = leftover(root, "unmarked", here, None)
    daemon_factory()
    wait_until(lambda: not dead.exists(), 60, f"the start-up sweep removes {dead}")
    assert alive.exists() and remote.exists() and unmarked.exists()


def test_start_can_move_leftovers_aside_or_leave_them(daemon_factory, root, run_dir) -> None:
    dead = leftover(root, "dead", socket.gethostname(), dead_pid())
    d = daemon_factory("--sweep", "off")
    d.stop()  # its start-up sweep has run by the time it exits
    assert dead.exists()
    daemon_factory("--sweep", "move")
    wait_until(lambda: not dead.exists(), 60, f"the start-up sweep moves {dead} aside")
    (moved,) = (root / ".ckptd-swept").iterdir()
    assert moved.name.startswith("dead.incomplete-")
    assert ckptd.latest(root) is None


def test_start_reclaims_slots_of_dead_clients(daemon_factory) -> None:
    orphan = SHM / f"ckptd-{os.getuid()}-{dead_pid()}-0"
    orphan.write_bytes(b"\0" * 4096)
    mine = SHM / f"ckptd-{os.getuid()}-{os.getpid()}-999"
    mine.write_bytes(b"\0" * 4096)
    try:
        daemon_factory()
        wait_until(lambda: not orphan.exists(), 60, f"the start-up sweep unlinks {orphan}")
        assert mine.exists(), "a live process's slot must never be reclaimed"
    finally:
        orphan.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def test_start_also_sweeps_directories_it_committed_into_before(daemon_factory, client_factory, root) -> None:
    run = root / "deep" / "run-1"
    d = daemon_factory()
    client_factory().save_async({"x": 1}, run / "step-1").result(30)
    d.stop()
    dead = leftover(run, "step-2", socket.gethostname(), dead_pid())
    daemon_factory()
    wait_until(lambda: not dead.exists(), 60, "a directory the daemon wrote into before was not swept")
    assert ckptd.latest(run) == run / "step-1"


@pytest.mark.timeout(120)
def test_a_daemon_killed_mid_save_in_a_new_directory_leaves_nothing_a_restart_does_not_sweep(
        daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory(faults=[{"op": "write", "match": "/deep/ckpt.incomplete/", "kill": True}])
    client = client_factory(timeout=5.0)
    future = client.save_async({"w": torch.ones(1000)}, root / "deep" / "ckpt")
    assert daemon.proc.wait(60) == -9, "the fault must have killed the daemon mid-write"
    with pytest.raises(ckptd.CkptdError):
        future.result(60)
    client.close()
    leftover = root / "deep" / "ckpt.incomplete"
    assert leftover.is_dir()
    daemon_factory()  # same run dir: the restart sweeps
    wait_until(lambda: not leftover.exists(), 30, f"the restarted daemon never swept {leftover}")


# -- on its own: real directories, no daemon -----------------------------------


def marker(directory: Path, pid: int, host: str = HOST) -> Path:
    m = directory / f"{OWNER_PREFIX}{host}-{pid}"
    m.touch()
    return m


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
    assert sweep_incomplete(Backends(LocalStorage()), [tmp_path, tmp_path / "missing"], "remove") == [leftover]
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-2.incomplete"]
    assert live_marker.exists() and mine.exists() and not stale.exists()


def test_the_sweep_moves_leftovers_aside_when_asked_and_does_nothing_when_off(tmp_path: Path) -> None:
    leftover = tmp_path / "step-1.incomplete"
    leftover.mkdir()
    marker(leftover, dead_pid())
    assert sweep_incomplete(Backends(LocalStorage()), [tmp_path], "off") == []
    assert leftover.exists()
    assert sweep_incomplete(Backends(LocalStorage()), [tmp_path], "move") == [leftover]
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
