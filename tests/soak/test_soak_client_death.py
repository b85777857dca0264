"""Soak: trainers SIGKILLed right after ``save_async`` returned, many times (``make soak``).

The fast test (``tests/test_client_death.py``) kills three; this kills forty and counts how
many checkpoints were lost (none may be)."""

from __future__ import annotations

import os
import signal

import pytest

from helpers import segments_of, wait_until
from trainers import Trainer, assert_loads_as, expected_state

pytestmark = pytest.mark.skipif(os.environ.get("CKPTD_SOAK") != "1",
                                reason="soak test: run with `make soak` (CKPTD_SOAK=1)")
KILLS = int(os.environ.get("CKPTD_SOAK_KILLS", "40"))


@pytest.mark.timeout(3600)
def test_forty_trainers_killed_right_after_save_async_returned_lose_no_checkpoint(daemon, root, run_dir) -> None:
    lost = []
    for batch in range(0, KILLS, 4):
        trainers = [Trainer(run_dir, root / f"ckpt-{n}", "die-on-return", mib=8) for n in range(batch, batch + 4)]
        for t in trainers:
            t.until("returned")
            assert t.reap() == -signal.SIGKILL
        for n, t in zip(range(batch, batch + 4), trainers):
            try:
                wait_until(lambda: (root / f"ckpt-{n}").exists(), 5, "committed")
                assert_loads_as(root / f"ckpt-{n}", expected_state(8))
            except AssertionError:
                lost.append(n)
            wait_until(lambda: not segments_of(t.pid), 5, f"slots of trainer {t.pid} reclaimed")
    assert not lost, f"{len(lost)} of {KILLS} staged checkpoints were lost when their trainer died: {lost}"
