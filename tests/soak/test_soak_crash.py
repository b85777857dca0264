"""Soak: every kill point of ``tests/test_crash_consistency.py``, many times, with two ranks,
random sizes and overwrites (``make soak``)."""

from __future__ import annotations

import os
import random
import signal

import pytest

import ckptd

from helpers import start_daemon, wait_until
from crashes import KILL_POINTS, NAME, assert_whole, digests, leftovers, make_state

pytestmark = pytest.mark.skipif(os.environ.get("CKPTD_SOAK") != "1",
                                reason="soak test: run with `make soak` (CKPTD_SOAK=1)")
ROUNDS = int(os.environ.get("CKPTD_SOAK_ROUNDS", "5"))


def two_ranks(run_dir) -> list:
    return [ckptd.Client(run_dir=run_dir, spawn=False, rank=r, world_size=2, heartbeat=0.2, timeout=5.0)
            for r in (0, 1)]


def save_both(clients, states, path, step, overwrite=False) -> list:
    return [c.save_async(states[c.rank], path, step=step, overwrite=overwrite) for c in clients]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("point,fault,outcome", KILL_POINTS, ids=[k[0] for k in KILL_POINTS])
def test_two_rank_saves_killed_at_the_same_point_again_and_again_never_leave_a_broken_checkpoint(
    run_dir, root, point, fault, outcome
) -> None:
    rng = random.Random(point)
    final = root / NAME
    earlier = {0: make_state(100), 1: make_state(101)}
    daemon = start_daemon(run_dir, root)
    clients = two_ranks(run_dir)
    try:
        for f in save_both(clients, earlier, root / "earlier", 1):
            f.result(30)
        earlier_bytes = digests(root / "earlier")
        prior: dict | None = None  # what the path held before this round (each round overwrites it)
        for n in range(ROUNDS):
            for c in clients:
                c.close()
            daemon.kill()
            daemon = start_daemon(run_dir, root, faults=[{**fault, "kill": True, "errno": 0}])
            clients = two_ranks(run_dir)  # the trainers start again too
            states = {r: make_state(1000 * n + r, mib=rng.choice([9, 17, 30])) for r in (0, 1)}
            futures = save_both(clients, states, final, 100 + n, overwrite=prior is not None)
            wait_until(lambda: daemon.proc.poll() is not None or all(f.done() for f in futures), 60,
                       f"round {n}: the daemon dies at {point} or the save ends")
            died = daemon.proc.poll() is not None
            if died:  # the usual case; an overwrite may not pass through this point (see the fast test)
                assert daemon.proc.returncode == -signal.SIGKILL
                for f in futures:
                    with pytest.raises(ckptd.CkptdError):
                        f.result(15)
            else:
                assert prior is not None, f"round {n}: the daemon did not die at {point}"
                for f in futures:
                    f.result(15)
            if prior is not None:
                assert final.is_dir(), f"round {n}, killed at {point}: the checkpoint it was overwriting is gone"
            if final.exists():
                assert_whole(final, states if ckptd.read_index(final).step == 100 + n else prior)
            assert digests(root / "earlier") == earlier_bytes
            assert_whole(root / "earlier", earlier)
            if not died:
                daemon.kill()
            daemon = start_daemon(run_dir, root)
            wait_until(lambda: not leftovers(root), 5,
                       lambda: f"round {n}: the sweep removes the leftovers; still there: {leftovers(root)}")
            prior = {r: make_state(5000 + 1000 * n + r) for r in (0, 1)}
            for f in save_both(clients, prior, final, 1 + n, overwrite=final.exists()):
                f.result(30)
            assert_whole(final, prior)
    finally:
        for c in clients:
            c.close()
        if daemon.proc.poll() is None:
            daemon.kill()
