"""The daemon's load leases and admission checks on their own: no daemon, no socket.

Leases are pure bookkeeping (``ckptd.leases``); admission reads real
``statvfs`` figures of the test's own directories, with the margins set so a
case is decided by the numbers the test chose, and a fake mount table where
the filesystem type is what matters.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.admission import check_room
from ckptd.storage import LocalStorage, filesystem_type
from ckptd.leases import LoadLeases
from ckptd.protocol.errors import NoSpace, PathNotAllowed

A, B, C, D = b"client-a", b"client-b", b"client-c", b"client-d"


def granted(grants) -> list[tuple[bytes, int]]:
    return [(g.client, g.request_id) for g in grants]


# -- leases --------------------------------------------------------------------


def test_leases_are_granted_first_come_first_served_up_to_the_limit() -> None:
    leases = LoadLeases(default_limit=2)
    assert granted(leases.request(A, 1, pid=10, limit=None)) == [(A, 1)]
    assert granted(leases.request(B, 2, pid=11, limit=None)) == [(B, 2)]
    assert leases.request(C, 3, pid=12, limit=None) == []
    assert leases.request(D, 4, pid=13, limit=None) == []
    assert granted(leases.release(B)) == [(C, 3)]
    assert granted(leases.release(A)) == [(D, 4)]
    snap = leases.snapshot()
    assert snap["default_limit"] == 2 and sorted(h["pid"] for h in snap["held"]) == [12, 13] and snap["waiting"] == []


def test_a_request_naming_its_own_limit_overrides_the_daemon_default() -> None:
    leases = LoadLeases(default_limit=None)  # no default: every request is granted at once
    assert granted(leases.request(A, 1, pid=10, limit=None)) == [(A, 1)]
    assert leases.request(B, 2, pid=11, limit=1) == []  # asks for at most one holder; A holds
    assert [w["pid"] for w in leases.snapshot()["waiting"]] == [11]
    assert granted(leases.release(A)) == [(B, 2)]


def test_the_queue_stays_in_order_behind_a_request_that_must_wait() -> None:
    leases = LoadLeases(default_limit=1)
    leases.request(A, 1, pid=10, limit=None)
    assert leases.request(B, 2, pid=11, limit=None) == []
    assert leases.request(C, 3, pid=12, limit=5) == []  # a looser limit does not jump the queue
    assert granted(leases.release(A)) == [(B, 2), (C, 3)]


def test_a_second_request_from_the_same_client_gives_back_its_first_lease() -> None:
    leases = LoadLeases(default_limit=1)
    leases.request(A, 1, pid=10, limit=None)
    assert granted(leases.request(A, 2, pid=10, limit=None)) == [(A, 2)]
    assert len(leases.snapshot()["held"]) == 1


def test_a_gone_client_loses_its_lease_and_its_queued_requests_and_the_next_waiter_is_granted() -> None:
    leases = LoadLeases(default_limit=1)
    leases.request(A, 1, pid=10, limit=None)
    leases.request(B, 2, pid=10, limit=None)  # the same process, a second connection: queued
    leases.request(C, 3, pid=12, limit=None)
    assert granted(leases.drop_client(B)) == []  # the daemon tears down each connection of a dead process
    assert granted(leases.drop_client(A)) == [(C, 3)]
    snap = leases.snapshot()
    assert [h["pid"] for h in snap["held"]] == [12] and snap["waiting"] == []


def test_releasing_a_lease_never_held_changes_nothing() -> None:
    leases = LoadLeases(default_limit=1)
    leases.request(A, 1, pid=10, limit=None)
    assert leases.release(B) == []
    assert [h["pid"] for h in leases.snapshot()["held"]] == [10]


# -- admission -----------------------------------------------------------------


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
    monkeypatch.setattr("ckptd.storage.MOUNTINFO", table)
    assert filesystem_type(inner / "ckpt") == "tmpfs"
    assert filesystem_type(tmp_path) == "ext4"
    monkeypatch.setattr("ckptd.storage.MOUNTINFO", tmp_path / "missing")
    assert filesystem_type(tmp_path) == "unknown"
