"""Backpressure: a client past its in-flight limit waits (or is told Busy), and the node writes at most its
write slots at once, first come first served."""

from __future__ import annotations

import time

import pytest
import torch

import ckptd

from helpers import wait_until

SLOW = [{"op": "write", "match": "slow", "errno": 0, "delay": 1.0}]


def test_backpressure_blocks_or_raises_busy_and_status_shows_the_wait(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory(faults=SLOW)
    c = client_factory(max_inflight=1)
    first = c.save_async({"w": torch.ones(10)}, root / "slow-1")
    with pytest.raises(ckptd.Busy, match="still in flight"):
        c.save_async({"w": torch.ones(10)}, root / "slow-x", block=False)
    started = time.monotonic()
    second = c.save_async({"w": torch.ones(10)}, root / "slow-2")  # waits for the first
    assert first.done() and time.monotonic() - started > 0.3
    second.result(30)
    (client,) = daemon.status()["clients"]
    assert client["waited_s"] > 0.3 and client["saves"] == 2
    c.wait()
    assert not (root / "slow-x").exists()


def test_write_slots_cap_concurrent_writes_node_wide_fifo(daemon_factory, client_factory, root, tmp_path) -> None:
    gate = tmp_path / "gate"  # the first write waits for it: the other two queue behind it however slow the node
    daemon = daemon_factory("--max-concurrent-writes", "1",
                            faults=[{"op": "write", "match": "slow-0", "errno": 0, "wait_for": str(gate)}, *SLOW])
    clients = [client_factory() for _ in range(3)]
    futures = [c.save_async({"w": torch.ones(10)}, root / f"slow-{i}") for i, c in enumerate(clients)]
    writes = lambda: {k: daemon.status()["writes"][k] for k in ("max_concurrent", "writing", "queued")}  # noqa: E731
    wait_until(lambda: writes() == {"max_concurrent": 1, "writing": 1, "queued": 2}, 30,
               lambda: f"one write at a time, two queued: {writes()}")
    gate.touch()
    finished = []
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: finished.append(i))
    for f in futures:
        f.result(30)
    assert finished == [0, 1, 2]
