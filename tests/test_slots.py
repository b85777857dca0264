"""Shared-memory slots: created once, reused, grown only when needed, never leaked."""

from __future__ import annotations

import os
import resource
import signal
import textwrap
import time

import torch

from ckptd.client.slots import Slot
from helpers import SHM, own_segments
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
    deadline = time.monotonic() + 60
    while any((SHM / n).exists() for n in names) or daemon.status()["clients"]:
        assert time.monotonic() < deadline, f"slots {names} not reclaimed, or the client not forgotten"
        time.sleep(0.1)
