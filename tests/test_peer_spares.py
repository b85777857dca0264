"""A buddy writes a directory's next replica into the file of the one it replaced (``ckptd/peers/spares.py``): with
real daemons as two nodes on 127.0.0.1 the file is the same (its inode), the replica restores bitwise whatever its
size, and the spare gives its room to a snapshot of the buddy's own; and the spares' own rules on real files."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.peers.spares import SPARE_S, Spare, Spares, adopt

from helpers import SHM, segments_of
from test_peers import _pair, _replace_origin

MIB = 1 << 20


def _state(mib: float, seed: int) -> dict:
    return {"w": torch.randn(int(mib * MIB) // 4, generator=torch.Generator().manual_seed(seed))}


def _files(pid: int) -> dict[int, str]:
    """The inodes of a daemon's files in /dev/shm, and their names."""
    return {os.stat(SHM / name).st_ino: name for name in segments_of(pid)}


@pytest.mark.timeout(180)
def test_the_next_replica_of_a_directory_lands_in_the_file_the_last_one_left_and_restores_bitwise(
        root: Path, tmp_path: Path) -> None:
    pair = _pair(root, tmp_path, origin_extra=("--persist-on-exit", "never"))
    run = root / "run"
    states = {1: _state(4, 1), 2: _state(4, 2), 3: _state(3, 3)}  # the third is smaller: its file is cut to size
    client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
    try:
        client.save_async(states[1], run / "step-1", step=1, persist=False).wait_replicated(60)
        first = _files(pair.buddy.proc.pid)
        assert len(first) == 1 and pair.buddy.status()["peers"]["replicas_held"]["spare_bytes"] == 0
        client.save_async(states[2], run / "step-2", step=2, persist=False).wait_replicated(60)
        second = _files(pair.buddy.proc.pid)
        held = pair.buddy.status()["peers"]["replicas_held"]
        assert [h["path"] for h in held["held"]] == [str(run / "step-2")]
        assert held["spare_bytes"] > 4 * MIB and set(first) < set(second)  # step 1's file waits, step 2's is new
        assert "spare files 4." in pair.buddy.cli("status").stdout  # the human status shows them too
        client.save_async(states[3], run / "step-3", step=3, persist=False).wait_replicated(60)
        third = _files(pair.buddy.proc.pid)
        assert set(third) == set(second)  # no new file: step 3 took step 1's, and step 2's waits in its turn
        (spare_inode,) = first
        assert third[spare_inode] != first[spare_inode]  # renamed to the new shard's name
        assert os.stat(SHM / third[spare_inode]).st_size < 4 * MIB  # and cut to its size
        assert "event=replica_dropped" in (pair.buddy_dir / "ckptd.log").read_text()
        client.close()  # before its node is lost: its slots go with it
        new_dir = _replace_origin(pair, "--persist-on-exit", "never")
        assert ckptd.latest(run, run_dir=new_dir) == run / "step-3"
        back = {"w": torch.zeros_like(states[3]["w"])}
        ckptd.load_into(back, run / "step-3", run_dir=new_dir)
        assert torch.equal(back["w"], states[3]["w"])
    finally:
        client.close()
        pair.kill()


@pytest.mark.timeout(180)
def test_a_spare_gives_its_room_to_a_snapshot_of_the_buddys_own(root: Path, tmp_path: Path) -> None:
    """The buddy's budget fits one replica and its spare, or one of each with a snapshot of its own: the snapshot
    is held (the spare let go first), where counting the spare as held would have refused it."""
    pair = _pair(root, tmp_path, origin_extra=("--persist-on-exit", "never"), buddy_extra=("--memory-budget", "9MiB"))
    run = root / "run"
    client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
    own = ckptd.Client(run_dir=pair.buddy_dir, spawn=False)
    try:
        for step in (1, 2):
            client.save_async(_state(4, step), run / f"step-{step}", step=step, persist=False).wait_replicated(60)
        assert pair.buddy.status()["peers"]["replicas_held"]["spare_bytes"] > 4 * MIB
        own.save_async(_state(4, 9), root / "own" / "step-9", step=9, persist=False).result(60)
        status = pair.buddy.status()
        assert status["peers"]["replicas_held"]["spare_bytes"] == 0
        assert [s["path"] for s in status["memory"]["snapshots"]] == [str(root / "own" / "step-9")]
        assert [h["path"] for h in status["peers"]["replicas_held"]["held"]] == [str(run / "step-2")]
    finally:
        own.close()
        client.close()
        pair.kill()


def _spare(shm: Path, name: str, size: int, fill: int) -> Spare:
    fd = os.open(shm / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.pwrite(fd, bytes([fill]) * size, 0)
    return Spare(name, fd, mmap.mmap(fd, size), size)


def test_spares_go_oldest_first_when_room_is_needed_and_when_unused_for_their_time(tmp_path: Path, caplog) -> None:
    caplog.set_level("INFO", logger="ckptd")
    later: list = []
    spares = Spares(tmp_path, later.append)  # what is let go is unlinked when ``later`` runs, as on the pool
    a, b, c = (_spare(tmp_path, n, s, 1) for n, s in (("a", 4096), ("b", 8192), ("c", 4096)))
    b.since, c.since = a.since + 1, a.since + 2
    spares.keep(("k", Path("/d"), 0), a)
    spares.keep(("k", Path("/d"), 1), b)
    spares.keep(("k", Path("/e"), 0), c)
    assert spares.bytes == 16384
    assert spares.release(5000) == 4096 + 8192  # a, then b: 5000 needs two
    assert spares.bytes == 4096 and (tmp_path / "a").exists()  # unlinked only once the work runs
    for work in later:
        work()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and a.fd == -1 and a.map.closed
    spares.expire(c.since + SPARE_S - 1)
    assert spares.bytes == 4096
    spares.expire(c.since + SPARE_S + 1)
    assert spares.bytes == 0 and spares.take(("k", Path("/e"), 0)) is None
    later[-1]()
    assert [r.getMessage() for r in caplog.records] == [  # each release said, with why
        "event=replica_spares_released count=2 bytes=12288 reason=room",
        "event=replica_spares_released count=1 bytes=4096 reason=unused"]
    assert not (tmp_path / "c").exists()


def test_a_spare_taken_is_renamed_cut_or_grown_and_a_second_for_its_key_replaces_the_first(tmp_path: Path) -> None:
    later: list = []
    spares = Spares(tmp_path, later.append)
    key = ("k", Path("/d"), 0)
    spares.keep(key, _spare(tmp_path, "old", 8192, 7))
    spares.keep(key, _spare(tmp_path, "newer", 8192, 8))  # the one kept before for the same key goes
    for work in later:
        work()
    assert not (tmp_path / "old").exists()
    spare = spares.take(key)
    assert spare is not None and spare.name == "newer" and spares.take(key) is None
    fd, mapping = adopt(spare, tmp_path, "shard", 4096)
    assert not (tmp_path / "newer").exists() and os.fstat(fd).st_size == 4096 and len(mapping) == 4096
    assert mapping[:4096] == bytes([8]) * 4096  # its pages as they were: written over by the stream, not zeroed
    mapping.close()
    os.close(fd)
    spare2 = _spare(tmp_path, "more", 4096, 1)
    fd, mapping = adopt(spare2, tmp_path, "grown", 3 * 4096)
    assert len(mapping) == 3 * 4096 and mapping[4096:] == bytes(2 * 4096)
    mapping.close()
    os.close(fd)
