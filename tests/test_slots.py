"""Shared-memory slots: created once, reused, grown only when needed, never leaked, and unmapped by the daemon
once their client gives them back or leaves.

Where a small shared-memory directory is the point, the test mounts a tmpfs of
that size; write failures are injected through the storage seam
(``tests/faults.py``).
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import textwrap
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.client.slots import Slot
from ckptd.lifecycle.slot_maps import SlotMaps
from helpers import SHM, floats, own_segments, tmpfs, wait_until
from zygote import Script


def test_a_new_slot_is_faulted_in_for_writing_before_any_save_copies_into_it() -> None:
    slot = Slot(64 << 20)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        slot.tensor.fill_(7)  # 16,384 pages
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 1000, f"writing a new slot took {faults} page faults: it was not populated"
        assert bytes(slot.map[-4:]) == b"\x07" * 4
    finally:
        slot.close()


def test_second_save_of_the_same_size_creates_no_new_segment(client, root) -> None:
    state = {"w": torch.randn(256, 256), "step": 1}
    client.save_async(state, root / "a").result(30)
    first = own_segments()
    assert len(first) == 1
    inode = os.stat(SHM / next(iter(first))).st_ino
    for i in range(3):
        client.save_async(state, root / f"b{i}").result(30)
    assert own_segments() == first
    assert os.stat(SHM / next(iter(first))).st_ino == inode


def test_a_larger_state_grows_the_slot_and_unlinks_the_old_one(client_factory, daemon, root) -> None:
    client = client_factory(max_inflight=1)
    client.save_async({"w": torch.randn(1024)}, root / "small").result(30)
    small = own_segments()
    client.save_async({"w": torch.randn(1024, 1024)}, root / "big").result(30)
    client.save_async({"w": torch.randn(1024, 1024), "v": torch.randn(8)}, root / "big2").result(30)
    segments = own_segments()
    assert len(segments) == 1 and segments != small  # the small slot was replaced, not kept
    assert (SHM / next(iter(segments))).stat().st_size >= 4 * 1024 * 1024


def test_close_leaves_nothing_in_dev_shm(client_factory, daemon, root) -> None:
    client = client_factory(max_inflight=2)
    futs = [client.save_async({"w": torch.randn(512, 512)}, root / f"c{i}") for i in range(4)]
    for f in futs:
        f.result(30)
    assert own_segments()
    client.close()
    assert own_segments() == set()
    assert daemon.status()["clients"] == []


def test_a_killed_trainers_slots_are_reclaimed_by_the_daemon(daemon, root) -> None:
    script = textwrap.dedent(f"""
        import os, sys, time, torch, ckptd
        c = ckptd.Client(run_dir={str(daemon.run_dir)!r}, spawn=False)
        c.save_async({{"w": torch.ones(1000)}}, {str(root / 'k')!r}).result(30)
        print(" ".join(c.slot_names), flush=True)
        time.sleep(60)
    """)
    proc = Script(script)
    names = proc.stdout.readline().split()
    assert names and all((SHM / n).exists() for n in names)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    wait_until(lambda: not any((SHM / n).exists() for n in names) and not daemon.status()["clients"], 60,
               f"slots {names} not reclaimed, or the client not forgotten")


def test_a_held_slot_given_back_stays_mapped_for_its_clients_next_save() -> None:
    """A snapshot's slot is renamed to the daemon's name while held and back when dropped; the client's next save
    into it must find the daemon's mapping (a fresh MAP_POPULATE of a big slot cost each snapshot tens of ms)."""
    slot, maps = Slot(1 << 20), SlotMaps()
    try:
        mapped = maps.acquire(slot.name, pid=os.getpid(), nbytes=4096)
        maps.adopt(mapped, f"{slot.name}-held")
        assert not slot.path.exists()
        maps.give_back(mapped, slot.name)
        assert slot.path.exists() and not mapped.map.closed
        assert maps.acquire(slot.name, pid=os.getpid(), nbytes=4096) is mapped
    finally:
        slot.close()


# -- the daemon's mappings of slots --------------------------------------------


def slot_mappings(pid: int) -> list[str]:
    """Lines of the daemon's /proc maps that map a ckptd slot."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/ckptd-" in line]


def internal_errors(daemon) -> list[str]:
    return [e["message"] for e in daemon.status()["errors"] if "internal error" in e["message"]]


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


def test_a_held_snapshots_next_slot_is_prepared_at_once_and_the_next_snapshot_lands_in_it(
        client_factory, daemon, root, run_dir) -> None:
    """A snapshot lends its slot to the daemon; the next save would otherwise make a fresh slot on its caller's
    thread (tmpfs allocating every page as the copy writes it). It is made when the slot is lent, every page
    allocated on a helper thread, and the next snapshot is staged into it, its bytes intact."""
    client = client_factory()
    first = {"w": torch.randn(4 << 20)}  # 16 MiB
    client.save_async(first, root / "s1", step=1, persist=False).result(30)

    def prepared() -> list[str]:
        return [n for n in own_segments() if os.stat(SHM / n).st_blocks * 512 >= os.stat(SHM / n).st_size > 16 << 20]
    wait_until(lambda: len(prepared()) == 1, 10, lambda: f"one prepared slot of ours; /dev/shm holds {own_segments()}")
    ahead = prepared()[0]
    second = {"w": torch.randn(4 << 20)}
    client.save_async(second, root / "s2", step=2, persist=False).result(30)
    assert ahead not in own_segments()  # the daemon's now: s2 is held in it (and s1's slot came back)
    assert len(own_segments()) == 1
    assert torch.equal(ckptd.load(root / "s2", run_dir=run_dir)["w"], second["w"])
