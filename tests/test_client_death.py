"""A trainer that dies never costs a staged checkpoint, and never leaks its shared memory.

The trainers here are real subprocesses, SIGKILLed at the moments that
matter: right after ``save_async`` returned (the state is staged and the
commit handed over), while the daemon is writing the shard, and in the middle
of background staging (nothing was handed over). The daemon notices the
dead pid and unlinks the trainer's slots within seconds; what was handed
over is committed whole, what was not leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest


from helpers import segments_of, wait_until
from trainers import Trainer, assert_loads_as, expected_state


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mib", [16, 80], ids=["16MiB", "80MiB-streamed"])
def test_trainers_killed_right_after_save_async_returns_still_get_their_checkpoints_committed(
    daemon, root, run_dir, mib
) -> None:
    # three at once: the window between save_async returning and the commit reaching the daemon is short.
    # 80 MiB is above the client's streaming threshold: committed first, then "staged" notices
    trainers = [Trainer(run_dir, root / f"ckpt-{n}", "die-on-return", mib=mib) for n in range(3)]
    slots = []
    for t in trainers:
        slots += t.until("returned")["slots"]
        assert t.reap() == -signal.SIGKILL
    assert len(slots) == 3
    paths = [root / f"ckpt-{n}" for n in range(3)]
    wait_until(lambda: all(p.exists() for p in paths), 8,
               lambda: f"{sum(not p.exists() for p in paths)} of 3 checkpoints staged by trainers SIGKILLed right "
                       f"after save_async returned were never committed (root holds {sorted(os.listdir(root))}, "
                       f"daemon errors {daemon.status()['errors']})")
    for p in paths:
        assert_loads_as(p, expected_state(mib))
    wait_until(lambda: not any((Path("/dev/shm") / s).exists() for s in slots), 60,
               f"the daemon unlinks the dead trainers' slots {slots}")
    assert not [seg for t in trainers for seg in segments_of(t.pid)]
    wait_until(lambda: daemon.status()["clients"] == [], 60, "the daemon forgets the dead trainers")


@pytest.mark.timeout(90)
def test_a_trainer_killed_while_the_daemon_writes_its_shard_still_gets_it_committed(daemon_factory, root, run_dir) -> None:
    daemon = daemon_factory(faults=[{"op": "write", "match": "/slow.incomplete/", "errno": 0, "delay": 0.5}])
    trainer = Trainer(run_dir, root / "slow", "stay", mib=24)  # three write calls of 0.5 s
    returned = trainer.until("returned")
    wait_until(lambda: daemon.status()["saves"], 60, "the daemon is writing the shard")
    trainer.kill()
    assert trainer.reap() == -signal.SIGKILL
    (slot,) = returned["slots"]
    # the slot's name goes at once; the daemon's mapping keeps the bytes until the write is done
    wait_until(lambda: not (Path("/dev/shm") / slot).exists(), 60, f"the daemon unlinks the dead trainer's slot {slot}")
    wait_until(lambda: (root / "slow").exists(), 15, "the save is committed after its trainer died")
    assert_loads_as(root / "slow", expected_state(24))
    wait_until(lambda: daemon.status()["shm_mapped_bytes"] == 0, 60, "the daemon drops the dead trainer's mapping")


@pytest.mark.timeout(90)
def test_a_trainer_killed_while_staging_in_the_background_commits_nothing_and_its_slots_are_reclaimed(
    daemon, root, run_dir
) -> None:
    trainer = Trainer(run_dir, root / "never", "background", mib=1024)
    returned = trainer.until("returned")
    assert returned["staged"] is False
    wait_until(lambda: segments_of(trainer.pid), 60, "the trainer's staging thread creates its slot")
    trainer.kill()  # filling a GiB slot takes far longer than this
    assert trainer.reap() == -signal.SIGKILL
    assert not any(e["event"] == "staged" for e in trainer.events), "the trainer finished staging before the kill"
    wait_until(lambda: not segments_of(trainer.pid), 60,
               lambda: f"the daemon reclaims the dead trainer's slots: {segments_of(trainer.pid)}")
    # a commit sent before staging ended (overlapped staging) is failed and its directory removed
    wait_until(lambda: not os.listdir(root), 60, lambda: f"nothing is left in the root: {os.listdir(root)}")
    wait_until(lambda: (lambda s: not (s["clients"] or s["saves"] or s["checkpoints"]))(daemon.status()), 60,
               "the daemon forgets the dead trainer and its save")
