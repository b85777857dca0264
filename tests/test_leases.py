"""Load leases cap how many processes of a node read checkpoints at once.

The bookkeeping on its own (``ckptd.core.leases``: no daemon, no socket), then
leases held by real processes through a real daemon: a limit caps the loads
that overlap, a holder that dies frees its lease, and the daemon's default
applies to a load that names no limit of its own.
"""

from __future__ import annotations

import signal
import textwrap
import threading
import time
from typing import Callable

import pytest
import torch

import ckptd
from ckptd.client.lease import load_lease
from ckptd.core.leases import LoadLeases

from zygote import Script

A, B, C, D = b"client-a", b"client-b", b"client-c", b"client-d"


def granted(grants) -> list[tuple[bytes, int]]:
    return [(g.client, g.request_id) for g in grants]


def test_leases_are_granted_first_come_first_served_up_to_the_limit() -> None:
    leases = LoadLeases(default_limit=2)
    assert granted(leases.request(A, 1, pid=10, limit=None)) == [(A, 1)]
    assert granted(leases.request(B, 2, pid=11, limit=None)) == [(B, 2)]
    assert leases.request(C, 3, pid=12, limit=None) == []
    assert leases.request(D, 4, pid=13, limit=None) == []
    assert granted(leases.release(B)) == [(C, 3)]
    assert granted(leases.release(A)) == [(D, 4)]
    snap = leases.status()
    assert snap["default_limit"] == 2 and sorted(h["pid"] for h in snap["held"]) == [12, 13] and snap["waiting"] == []


def test_a_request_naming_its_own_limit_overrides_the_daemon_default() -> None:
    leases = LoadLeases(default_limit=None)  # no default: every request is granted at once
    assert granted(leases.request(A, 1, pid=10, limit=None)) == [(A, 1)]
    assert leases.request(B, 2, pid=11, limit=1) == []  # asks for at most one holder; A holds
    assert [w["pid"] for w in leases.status()["waiting"]] == [11]
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
    assert len(leases.status()["held"]) == 1


def test_a_gone_client_loses_its_lease_and_its_queued_requests_and_the_next_waiter_is_granted() -> None:
    leases = LoadLeases(default_limit=1)
    leases.request(A, 1, pid=10, limit=None)
    leases.request(B, 2, pid=10, limit=None)  # the same process, a second connection: queued
    leases.request(C, 3, pid=12, limit=None)
    assert granted(leases.drop_client(B)) == []  # the daemon tears down each connection of a dead process
    assert granted(leases.drop_client(A)) == [(C, 3)]
    snap = leases.status()
    assert [h["pid"] for h in snap["held"]] == [12] and snap["waiting"] == []


def test_releasing_a_lease_never_held_changes_nothing() -> None:
    leases = LoadLeases(default_limit=1)
    leases.request(A, 1, pid=10, limit=None)
    assert leases.release(B) == []
    assert [h["pid"] for h in leases.status()["held"]] == [10]


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _loads_at_once(limit: int | None, run_dir, ranks: int, work: Callable[[], object]) -> list[tuple[float, float]]:
    """``ranks`` threads each doing ``work`` under a load lease at once: when each held its lease."""
    intervals: list[tuple[float, float]] = []

    def rank() -> None:
        with load_lease(limit, run_dir=run_dir, spawn=False):
            start = time.monotonic()
            work()
            intervals.append((start, time.monotonic()))

    threads = [threading.Thread(target=rank) for _ in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return intervals


@pytest.mark.parametrize("limit", [1, 2])
def test_load_leases_cap_concurrent_loads_on_a_node(daemon, limit) -> None:
    intervals = _loads_at_once(limit, daemon.run_dir, 4, lambda: time.sleep(0.3))  # a load that takes a while
    assert len(intervals) == 4 and _max_overlap(intervals) == limit


def test_a_dead_lease_holder_frees_its_lease(daemon) -> None:
    script = textwrap.dedent(f"""
        import time
        from ckptd.client.lease import load_lease
        with load_lease(1, run_dir={str(daemon.run_dir)!r}, spawn=False):
            print("held", flush=True)
            time.sleep(60)
    """)
    holder = Script(script)
    assert holder.stdout.readline().strip() == "held"
    assert len(daemon.status()["loads"]["held"]) == 1
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    started = time.monotonic()
    with load_lease(1, run_dir=daemon.run_dir, spawn=False) as waited:
        assert waited is not None and time.monotonic() - started < 5


def test_daemon_default_load_limit_applies_when_the_load_asks_for_none(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory("--max-concurrent-loads", "1")
    client_factory().save_async({"w": torch.ones(1000)}, root / "c").result(30)

    def load() -> None:
        ckptd.load(root / "c", map_location="cpu")
        time.sleep(0.2)  # and the work that follows it under the lease

    intervals = _loads_at_once(None, daemon.run_dir, 3, load)
    assert len(intervals) == 3 and _max_overlap(intervals) == 1
