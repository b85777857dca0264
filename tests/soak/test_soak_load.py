"""Soak: eight trainer subprocesses × 300 saves of up to 16 MiB, with retention, while
``ckptd status`` is polled; the daemon returns to its footprint afterwards (``make soak``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from helpers import Footprint, StatusPoller, wait_until

pytestmark = pytest.mark.skipif(os.environ.get("CKPTD_SOAK") != "1",
                                reason="soak test: run with `make soak` (CKPTD_SOAK=1)")
TRAINERS = 8
SAVES = int(os.environ.get("CKPTD_SOAK_SAVES", "300"))
MAX_BYTES = 16 * 2**20
KEEP = 4

TRAINER = r'''
import json, random, sys, time
import torch, ckptd
from pathlib import Path
run_dir, root, k, saves, max_bytes, keep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
rng = random.Random(k)

def state(i, nbytes):
    g = torch.Generator().manual_seed(k * 100_003 + i)
    return {"w": torch.randn(nbytes // 4, generator=g), "i": i, "tail": torch.arange(nbytes % 4 + 1, dtype=torch.uint8)}

client = ckptd.Client(run_dir=run_dir, spawn=False, max_inflight=2, timeout=60.0, keep_last=keep)
pending, written, errors = [], 0, []

def settle(i, fut, want):
    global written
    try:
        fut.result(300)
        got = ckptd.load(root / f"c{k}" / f"s{i}", rank=0)  # the newest: retention keeps it
        if not (torch.equal(got["w"], want["w"]) and got["i"] == i and torch.equal(got["tail"], want["tail"])):
            errors.append(f"s{i} does not load back bitwise")
        written += want["w"].nbytes + want["tail"].nbytes
    except Exception as exc:
        errors.append(f"s{i}: {exc!r}")

started = time.monotonic()
for i in range(saves):
    nbytes = rng.choice([0, 4096, rng.randrange(1, max_bytes)])
    want = state(i, nbytes)
    pending.append((i, client.save_async(want, root / f"c{k}" / f"s{i}", step=i), want))
    while len(pending) > 1:
        settle(*pending.pop(0))
for p in pending:
    settle(*p)
client.close()
print(json.dumps({"saves": saves, "bytes": written, "errors": errors[:5], "seconds": time.monotonic() - started}))
'''


@pytest.mark.timeout(3600)
def test_eight_trainer_processes_saving_hundreds_of_checkpoints_all_commit_and_leave_no_trace(
    daemon, client_factory, root, run_dir
) -> None:
    warm = client_factory()
    warm.save_async({"w": __import__("torch").ones(2**18)}, root / "warm").result(30)
    warm.close()
    wait_until(lambda: not daemon.status()["clients"], 10, "the warm-up client is gone")
    baseline = Footprint.of(daemon.proc.pid)
    poller = StatusPoller(daemon)
    poller.start()
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir), str(root), str(k), str(SAVES),
                               str(MAX_BYTES), str(KEEP)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(TRAINERS)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=3000)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    elapsed = time.monotonic() - started
    poller.stop()
    assert not [e for r in results for e in r["errors"]], [r["errors"] for r in results]
    assert not poller.failures, poller.failures[:3]
    assert max(poller.latencies) < 5.0
    # retention runs after each commit, on the daemon's maintenance thread: wait for it to catch up
    want = sorted(f"s{i}" for i in range(SAVES - KEEP, SAVES))
    kept = lambda k: sorted(p.name for p in (root / f"c{k}").iterdir())  # noqa: E731
    for k in range(TRAINERS):
        wait_until(lambda: kept(k) == want, 60, lambda: f"retention in c{k} caught up; it holds {kept(k)}")
    pids = tuple(p.pid for p in procs)
    wait_until(lambda: Footprint.of(daemon.proc.pid, pids).back_to(baseline), 30,
               lambda: f"back to the footprint before the load: {baseline} -> {Footprint.of(daemon.proc.pid, pids)}")
    status = daemon.status()
    assert status["clients"] == [] and status["saves"] == [] and status["shm_mapped_bytes"] == 0
    assert status["completed"]["count"] == TRAINERS * SAVES + 1
    total = sum(r["bytes"] for r in results)
    print(f"\nsoak load: {TRAINERS * SAVES} saves, {total / 2**30:.2f} GiB in {elapsed:.0f} s, "
          f"{len(poller.latencies)} status polls (slowest {max(poller.latencies):.2f} s), "
          f"at most {poller.busiest} saves in flight; footprint {baseline} -> {Footprint.of(daemon.proc.pid, pids)}")
