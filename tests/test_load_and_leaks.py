"""Many clients saving at once all commit, the daemon's status answers throughout, and nothing leaks.

Eight clients save fifty checkpoints each, of random sizes, at the same
time, while another thread asks the daemon for its status the whole while. Every
checkpoint must load back bitwise (CRC checked), and once the clients have
closed, the daemon's open file descriptors, its resident memory and the
node's ``/dev/shm`` segments return to what they were before the load.
The bigger variant (trainer subprocesses, more and larger saves) is in
``tests/soak/``.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import ckptd

from helpers import RSS_TOLERANCE, Footprint, StatusPoller, wait_until



def sizes_for(client: int, saves: int, max_bytes: int) -> list[int]:
    rng = random.Random(client)
    return [rng.choice([0, 1, 4096, rng.randrange(1, max_bytes)]) for _ in range(saves)]


def state_for(client: int, i: int, nbytes: int) -> dict:
    g = torch.Generator().manual_seed(client * 100_003 + i)
    n = nbytes // 4
    return {
        "w": torch.randn(n, generator=g),
        "b": torch.randint(0, 255, (nbytes % 4 + 1,), dtype=torch.uint8, generator=g),
        "i": i,
    }


@dataclass
class Saver:
    """One client saving its checkpoints one after another (max_inflight=2)."""

    index: int
    sizes: list[int]
    root: Path
    make_client: object
    done: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __call__(self) -> None:
        try:
            client = self.make_client(max_inflight=2, timeout=60.0)
            futures = []
            for i, nbytes in enumerate(self.sizes):
                futures.append((i, client.save_async(state_for(self.index, i, nbytes), self.root / f"c{self.index}" / f"s{i}", step=i)))
            for i, fut in futures:
                fut.result(120)
                self.done.append(i)
            client.close()
        except Exception as exc:  # reported by the test
            self.errors.append(repr(exc))


def run_load(daemon, client_factory, root: Path, *, clients: int, saves: int, max_bytes: int) -> dict:
    warm = client_factory()
    warm.save_async(state_for(99, 0, 2**20), root / "warm").result(30)
    warm.close()
    wait_until(lambda: not daemon.status()["clients"], 60, "the warm-up client is gone")
    baseline = Footprint.of(daemon.proc.pid)

    poller = StatusPoller(daemon)
    poller.start()
    savers = [Saver(k, sizes_for(k, saves, max_bytes), root, client_factory) for k in range(clients)]
    threads = [threading.Thread(target=s, name=f"saver-{s.index}") for s in savers]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    elapsed = time.monotonic() - started
    poller.stop()

    assert not any(t.is_alive() for t in threads), "a client never finished"
    assert not [e for s in savers for e in s.errors], [e for s in savers for e in s.errors][:3]
    assert poller.latencies, "ckptd status was never polled"
    assert not poller.failures, f"ckptd status failed under load: {poller.failures[:3]}"
    assert max(poller.latencies) < 5.0, f"ckptd status took {max(poller.latencies):.1f} s under load"
    total = 0
    for s in savers:
        assert s.done == list(range(saves))
        for i, nbytes in enumerate(s.sizes):
            path = root / f"c{s.index}" / f"s{i}"
            assert ckptd.read_index(path).step == i
            loaded, want = ckptd.load(path, rank=0), state_for(s.index, i, nbytes)
            assert torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"]) and loaded["i"] == i
            total += loaded["w"].nbytes + loaded["b"].nbytes

    status = daemon.status()
    assert status["completed"]["count"] == clients * saves + 1
    wait_until(lambda: Footprint.of(daemon.proc.pid).back_to(baseline), 15,
               lambda: f"the daemon returns to its footprint before the load: {baseline} -> "
                       f"{Footprint.of(daemon.proc.pid)} (RSS tolerance {RSS_TOLERANCE >> 20} MiB)")
    after = daemon.status()
    assert after["clients"] == [] and after["saves"] == [] and after["checkpoints"] == []
    assert after["shm_mapped_bytes"] == 0
    return {"saves": clients * saves, "bytes": total, "seconds": round(elapsed, 1),
            "status_polls": len(poller.latencies), "slowest_status_s": round(max(poller.latencies), 2),
            "most_saves_in_flight": poller.busiest, "baseline": baseline, "after": Footprint.of(daemon.proc.pid)}


@pytest.mark.timeout(180)
def test_eight_clients_saving_at_once_all_commit_and_the_daemon_returns_to_its_baseline(
    daemon, client_factory, root
) -> None:
    report = run_load(daemon, client_factory, root, clients=8, saves=50, max_bytes=8 * 2**20)
    print(f"\nload: {report}")
    assert report["bytes"] <= 2 * 2**30
