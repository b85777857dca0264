"""Daemon defects new users found: slot mappings, shared-memory headroom, sweeps, late ranks, refusals.

Real daemon subprocesses, real shared memory, real files. Where a small
filesystem is the point (a 64 MiB shared-memory directory, a nearly full
checkpoint filesystem), the test mounts a tmpfs of that size (the tests run
as root); write failures and crashes are injected through the storage seam
(``tests/faults.py``).
"""

from __future__ import annotations

import errno
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

import ckptd
from helpers import wait_until

MiB = 1 << 20


@contextmanager
def tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` MiB mounted at ``path`` (created if needed), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def slot_mappings(pid: int) -> list[str]:
    """Lines of the daemon's /proc maps that map a ckptd slot."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/ckptd-" in line]


def floats(mib: int) -> torch.Tensor:
    return torch.ones(mib * MiB // 4)


def internal_errors(daemon) -> list[str]:
    return [e["message"] for e in daemon.status()["errors"] if "internal error" in e["message"]]


# 1 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_failed_write_releases_its_slot_mapping_and_the_client_leaves_cleanly(daemon_factory, client_factory,
                                                                                 root) -> None:
    daemon = daemon_factory(faults=[{"op": "write", "match": "/full.incomplete/", "errno": errno.ENOSPC}])
    client = client_factory(stream_commit=True)
    with pytest.raises(ckptd.WriteFailed, match="No space left"):
        client.save_async({"w": floats(70)}, root / "full").result(60)
    assert slot_mappings(daemon.proc.pid), "the daemon maps the client's slot while the client lives"
    client.close()  # says Bye: the daemon drops the client's mappings
    assert slot_mappings(daemon.proc.pid) == [], "a failed save's slot must not stay mapped after its client left"
    assert internal_errors(daemon) == []
    log = (daemon.run_dir / "ckptd.log").read_text()
    assert "BufferError" not in log
    # the daemon still serves: a new client saves
    assert client_factory().save_async({"w": torch.ones(4)}, root / "after").result(30).path == root / "after"


# 2 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_slot_the_client_unlinked_is_unmapped_so_a_bigger_state_fits(daemon_factory, client_factory, tmp_path,
                                                                         monkeypatch) -> None:
    with tmpfs(tmp_path / "shm", 64) as shm:
        monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
        daemon = daemon_factory()
        client = client_factory()
        client.save_async({"w": floats(30)}, daemon.root / "small").result(30)
        try:  # the client gives its 30 MiB slot back and asks for 40 MiB; the daemon may still map the old one
            client.save_async({"w": floats(40)}, daemon.root / "big").result(30)
        except ckptd.NoSpace:
            wait_until(lambda: not any("(deleted)" in m for m in slot_mappings(daemon.proc.pid)), 30,
                       "the daemon keeps mapping a slot its client unlinked")
            client.save_async({"w": floats(40)}, daemon.root / "big").result(30)
        assert torch.equal(ckptd.load(daemon.root / "big")["w"], floats(40))
        assert not any("(deleted)" in m for m in slot_mappings(daemon.proc.pid))
        client.close()
        daemon.stop()


# 3 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_shm_headroom_counts_the_saves_own_slot_as_free_and_names_remedies(daemon_factory, client_factory,
                                                                                tmp_path, monkeypatch) -> None:
    with tmpfs(tmp_path / "shm", 64) as shm:
        monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
        daemon = daemon_factory()
        client = client_factory()
        # a 56 MiB state leaves ~7 MiB of the 64 MiB free once its slot exists: it still fits
        result = client.save_async({"w": floats(56)}, daemon.root / "most").result(30)
        assert result.path == daemon.root / "most"
        client.close()
        # something else fills the directory: now the node really is short of shared memory
        (shm / "other").write_bytes(b"\0" * 50 * MiB)
        with pytest.raises(ckptd.NoSpace) as short:
            client_factory().save_async({"w": floats(4)}, daemon.root / "short").result(30)
        message = str(short.value)
        assert str(shm) in message and "--shm-size" in message and "emptyDir" in message
        assert "CKPTD_SHM_DIR" in message
        daemon.stop()


# 4 ---------------------------------------------------------------------------------------------


def test_a_slot_the_daemon_cannot_find_names_both_sides_shm_directory(daemon_factory, client_factory, tmp_path,
                                                                      monkeypatch) -> None:
    elsewhere = tmp_path / "daemon-shm"
    elsewhere.mkdir()
    monkeypatch.setenv("CKPTD_SHM_DIR", str(elsewhere))
    daemon = daemon_factory()
    monkeypatch.delenv("CKPTD_SHM_DIR")
    with pytest.raises(ckptd.BadSlot) as missing:
        client_factory().save_async({"w": torch.ones(4)}, daemon.root / "x").result(30)
    assert str(elsewhere) in str(missing.value)
    assert "CKPTD_SHM_DIR" in str(missing.value)


# 5 ---------------------------------------------------------------------------------------------


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


# 6 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_late_rank_of_a_failed_checkpoint_gets_the_same_error_at_once(daemon, client_factory, root) -> None:
    rank0 = client_factory(rank=0, world_size=2, commit_timeout=3.0)
    with pytest.raises(ckptd.RanksMissing, match=r"ranks \[1\] of 2") as first:
        rank0.save_async({"w": torch.ones(4)}, root / "late", step=1).result(30)
    time.sleep(4)  # past the failed checkpoint's own commit timeout
    rank1 = client_factory(rank=1, world_size=2, commit_timeout=3.0)
    with pytest.raises(ckptd.RanksMissing) as late:
        rank1.save_async({"w": torch.ones(4)}, root / "late", step=1).result(30)
    assert str(late.value) == str(first.value), "the late rank must get the checkpoint's own error, not blame rank 0"
    assert not (root / "late").exists()


# 7 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_resaving_an_existing_path_on_a_nearly_full_filesystem_says_it_exists(daemon_factory, client_factory,
                                                                              root) -> None:
    with tmpfs(root, 100):  # 100 MiB, of which 64 MiB are kept free: a 40 MiB shard does not fit
        daemon = daemon_factory()
        client = client_factory()
        client.save_async({"w": torch.ones(4)}, root / "there").result(30)
        with pytest.raises(ckptd.CheckpointExists, match="already exists"):
            client.save_async({"w": floats(40)}, root / "there").result(30)
        with pytest.raises(ckptd.NoSpace):  # a new path still gets the room check
            client.save_async({"w": floats(40)}, root / "new").result(30)
        client.close()
        daemon.stop()
