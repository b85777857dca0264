"""Admission: a save is taken only if it can finish, and a refusal says why and what to do.

The checks on their own first (no daemon, no socket): room on the target's
filesystem, read from real ``statvfs`` figures of the test's own directories
with the margins set so a case is decided by the numbers the test chose; a
fake mount table where the filesystem type is what matters; a slot's header
checked against every commit that names it. Then through a real daemon on
filesystems of a known size (a tmpfs the test mounts): saves that do not fit,
beside saves in flight, in a short shared-memory directory, or over a
checkpoint that already exists; and the daemon answers while admission's I/O
is held up.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

import ckptd
from ckptd.lifecycle.admission import check_room, examine
from ckptd.client.flatten import flatten
from ckptd.client.slots import Slot
from ckptd.client.staging import layout_for, write_header
from ckptd.protocol.errors import BadSlot, NoSpace, PathNotAllowed
from ckptd.protocol.messages import WriteShard
from ckptd.storage.backends import Backends
from ckptd.lifecycle.slot_maps import SlotMaps
from ckptd.storage.contract import LocalStorage, filesystem_type

from helpers import MiB, floats, tmpfs, wait_until


# -- on its own: no daemon, no socket ------------------------------------------


def free_of(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def room(target: Path, nbytes: int, reserved: int = 0, *, margin_fraction: float = 0.0, margin_min: int = 0,
         shm_min_free: int = 0, shm_free: int | None = None) -> None:
    """Admission's check over what the local storage measures at ``target``."""
    check_room(target, LocalStorage().space(target), nbytes, reserved, margin_fraction=margin_fraction,
               margin_min=margin_min, shm_min_free=shm_min_free, shm_free=shm_free)


def test_a_save_that_fits_with_the_margin_is_admitted_even_into_directories_not_made_yet(tmp_path: Path) -> None:
    target = tmp_path / "run1" / "step-1"
    assert LocalStorage().space(target).device == os.stat(tmp_path).st_dev  # measured at the nearest ancestor
    room(target, 4096)


def test_a_save_beyond_the_free_space_is_refused_naming_the_shard_and_the_free_space(tmp_path: Path) -> None:
    too_big = free_of(tmp_path) + 2**30
    with pytest.raises(NoSpace, match=rf"not enough space for {tmp_path}/x: the shard needs .* only .* is free"):
        room(tmp_path / "x", too_big)


def test_saves_already_in_flight_to_the_filesystem_count_against_a_new_one(tmp_path: Path) -> None:
    free = free_of(tmp_path)
    room(tmp_path / "x", free // 4)
    with pytest.raises(NoSpace, match="saves in flight to the same filesystem need"):
        room(tmp_path / "x", free // 4, free)


def test_the_margin_is_kept_free_whether_given_in_bytes_or_as_a_fraction(tmp_path: Path) -> None:
    free = free_of(tmp_path)
    with pytest.raises(NoSpace, match="is kept free"):
        room(tmp_path / "x", 4096, margin_min=free)
    with pytest.raises(NoSpace, match="is kept free"):
        room(tmp_path / "x", 4096, margin_fraction=1.0)


def test_a_shared_memory_directory_short_of_headroom_refuses_the_save_naming_it(tmp_path: Path, monkeypatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    with pytest.raises(NoSpace, match=f"{shm} is nearly full"):
        room(tmp_path / "x", 4096, shm_min_free=free_of(shm) + 2**30, shm_free=free_of(shm))


def test_a_target_on_a_pseudo_filesystem_is_refused_as_such_not_as_short_of_space() -> None:
    with pytest.raises(PathNotAllowed, match="lies on a proc filesystem, which has no storage"):
        room(Path("/proc/ckptd-test/step-1"), 4096)


def test_the_filesystem_type_comes_from_the_deepest_mount_above_the_path(tmp_path: Path, monkeypatch) -> None:
    inner = tmp_path / "with space"
    inner.mkdir()
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        f"30 22 0:50 / {str(inner).replace(' ', chr(92) + '040')} rw - tmpfs tmpfs rw\n"
        "broken line without a separator\n"
    )
    monkeypatch.setattr("ckptd.storage.contract.MOUNTINFO", table)
    assert filesystem_type(inner / "ckpt") == "tmpfs"
    assert filesystem_type(tmp_path) == "ext4"
    monkeypatch.setattr("ckptd.storage.contract.MOUNTINFO", tmp_path / "missing")
    assert filesystem_type(tmp_path) == "unknown"


def commit_for(slot: Slot, layout, root, **change) -> WriteShard:
    c = WriteShard(1, slot.name, layout.nbytes, layout.data_start, layout.entries, str(root / "ckpt"), 0, 1, None, False,
               False, None, 60.0, 0.0, layout.nbytes)
    return dataclasses.replace(c, **change)


def test_a_reused_slot_header_is_checked_against_every_commit(tmp_path) -> None:
    slot, maps, storage = Slot(1 << 20), SlotMaps(), Backends(LocalStorage())
    try:
        first = layout_for(flatten({f"t{i}": torch.ones(8) for i in range(50)}))
        write_header(first, slot)

        def check(msg: WriteShard) -> tuple | None:
            mapped = examine(storage, maps, msg, pid=os.getpid(), roots=(tmp_path,)).slot
            maps.release(mapped)
            return mapped.header
        parsed = check(commit_for(slot, first, tmp_path))
        assert check(commit_for(slot, first, tmp_path))[2] is parsed[2]  # the same header again: not parsed again
        renamed = tuple(dataclasses.replace(e, name=e.name + "x") if i == 0 else e for i, e in enumerate(first.entries))
        with pytest.raises(BadSlot, match="does not match the commit's tensor table"):
            check(commit_for(slot, first, tmp_path, tensors=renamed))
        second = layout_for(flatten({f"u{i}": torch.ones(8) for i in range(50)}))  # same sizes, other names
        assert (second.nbytes, second.data_start) == (first.nbytes, first.data_start)
        write_header(second, slot)
        with pytest.raises(BadSlot, match="does not match"):  # the old table against the new header
            check(commit_for(slot, first, tmp_path))
        check(commit_for(slot, second, tmp_path))
    finally:
        slot.close()


# -- through a real daemon -----------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 MiB tmpfs: free space that is exact and genuinely runs out."""
    with tmpfs(tmp_path / "small", 256) as mnt:
        yield mnt


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


@pytest.mark.timeout(120)
def test_the_daemon_answers_while_a_checkpoint_directory_is_being_created(daemon_factory, client_factory, root,
                                                                           tmp_path) -> None:
    go = tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "touch", "match": "/held.incomplete/", "errno": 0, "wait_for": str(go)}])
    fut = client_factory().save_async({"w": torch.ones(10)}, root / "held")
    wait_until(lambda: "event=fault op=touch" in (daemon.run_dir / "ckptd.log").read_text(), 20,
               "the touch fault fired")
    status = daemon.status()  # the loop answers while admission's I/O is held on its worker
    assert [c["state"] for c in status["checkpoints"]] == ["preparing"]
    assert not fut.done()
    go.touch()
    assert fut.result(30).path == root / "held"
