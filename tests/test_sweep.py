"""Start-up sweep of dead writers' leftovers, and admission control for space."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ckptd

from helpers import SHM, dead_pid


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
    deadline = time.monotonic() + 60
    while dead.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert alive.exists() and remote.exists() and unmarked.exists()


def test_start_can_move_leftovers_aside_or_leave_them(daemon_factory, root, run_dir) -> None:
    dead = leftover(root, "dead", socket.gethostname(), dead_pid())
    d = daemon_factory("--sweep", "off")
    time.sleep(0.5)
    assert dead.exists()
    d.stop()
    daemon_factory("--sweep", "move")
    deadline = time.monotonic() + 60
    while dead.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
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
        deadline = time.monotonic() + 60
        while orphan.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert mine.exists(), "a live process's slot must never be reclaimed"
    finally:
        orphan.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 256 MiB tmpfs (needs root; without it the test says so and does not run)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_save_that_cannot_fit_is_refused_up_front_and_the_daemon_serves_on(run_dir, small_fs, client_factory) -> None:
    from helpers import start_daemon

    daemon = start_daemon(run_dir, small_fs, faults=[{"op": "fsync", "match": "slow", "errno": 0, "delay": 2.0}])
    try:
        c = client_factory(max_inflight=2)
        big = {"w": torch.zeros(300 * 2**20, dtype=torch.uint8)}
        with pytest.raises(ckptd.NoSpace, match="not enough space"):
            c.save_async(big, small_fs / "big").result(30)
        assert list(small_fs.iterdir()) == []
        # two saves of 100 MiB: the second does not fit beside the first, still in flight
        half = {"w": torch.zeros(100 * 2**20, dtype=torch.uint8)}
        first = c.save_async(half, small_fs / "slow-1")
        with pytest.raises(ckptd.NoSpace, match="saves in flight"):
            c.save_async(half, small_fs / "slow-2").result(30)
        assert first.result(30).path == small_fs / "slow-1"
        assert ckptd.load(small_fs / "slow-1")["w"].shape == (100 * 2**20,)
    finally:
        daemon.stop()


def test_start_also_sweeps_directories_it_committed_into_before(daemon_factory, client_factory, root) -> None:
    run = root / "deep" / "run-1"
    d = daemon_factory()
    client_factory().save_async({"x": 1}, run / "step-1").result(30)
    d.stop()
    dead = leftover(run, "step-2", socket.gethostname(), dead_pid())
    daemon_factory()
    deadline = time.monotonic() + 60
    while dead.exists():
        assert time.monotonic() < deadline, "a directory the daemon wrote into before was not swept"
        time.sleep(0.05)
    assert ckptd.latest(run) == run / "step-1"
