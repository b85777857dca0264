"""A trainer that dies never costs a staged checkpoint, and never leaks its shared memory.

The trainers here are real subprocesses, SIGKILLed at the moments that
matter: right after ``save_async`` returned (the state is staged and the
commit handed over), while the daemon is writing the shard, and in the middle
of background staging (nothing was handed over). The daemon notices the
dead pid and unlinks the trainer's slots within seconds; what was handed
over is committed whole, what was not leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd

STATE_SRC = r'''
def expected_state(mib):
    import torch
    g = torch.Generator().manual_seed(77)
    if mib >= 256:  # big enough that staging takes a while; content does not matter
        return {"big": torch.ones(mib * 2**18), "step": 7}
    return {"w": torch.randn(mib * 2**18, generator=g), "i": torch.arange(10, dtype=torch.int16), "step": 7}
'''
exec(STATE_SRC)  # defines expected_state here too: the test knows the bytes the trainer saved

TRAINER = STATE_SRC + r'''
import json, os, signal, sys, time
import ckptd
run_dir, path, mode, mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def say(**kw):
    print(json.dumps(kw), flush=True)

state = expected_state(mib)
client = ckptd.Client(run_dir=run_dir, spawn=False, background_staging=(mode == "background"))
say(event="ready", pid=os.getpid())
fut = client.save_async(state, path, step=7)
if mode == "die-on-return":
    say(event="returned", slots=client.slot_names)
    os.kill(os.getpid(), signal.SIGKILL)  # right after save_async returned
fut.staged.add_done_callback(lambda f: say(event="staged"))
say(event="returned", slots=client.slot_names, staged=fut.staged.done())
time.sleep(120)  # the test kills us
'''


def wait_until(cond, timeout: float, what) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")
        time.sleep(0.05)


class Trainer:
    """A training process saving one checkpoint; reads its JSON event lines."""

    def __init__(self, run_dir: Path, path: Path, mode: str, mib: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir), str(path), mode, str(mib)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[dict] = []

    def next_event(self, timeout: float = 60) -> dict:
        line = self.proc.stdout.readline()  # the trainer prints promptly or dies (then: "")
        assert line, f"trainer exited early: {self.proc.wait(timeout)} {self.proc.stderr.read()[-2000:]}"
        self.events.append(json.loads(line))
        return self.events[-1]

    def until(self, event: str) -> dict:
        while True:
            e = self.next_event()
            if e["event"] == event:
                return e

    def kill(self) -> None:
        self.proc.kill()

    def reap(self, timeout: float = 30) -> int:
        """Wait for the exit (a dead child stays a zombie, and "alive" to the daemon, until reaped)."""
        code = self.proc.wait(timeout)
        self.events += [json.loads(line) for line in self.proc.stdout.read().splitlines() if line.strip()]
        return code

    @property
    def pid(self) -> int:
        return self.proc.pid


def segments_of(pid: int) -> list[str]:
    prefix = f"ckptd-{os.getuid()}-{pid}-"
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix))


def assert_loads_as(path: Path, state: dict) -> None:
    assert ckptd.read_index(path).world_size == 1
    loaded = ckptd.load(path, rank=0)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


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
    wait_until(lambda: not any((Path("/dev/shm") / s).exists() for s in slots), 5,
               f"the daemon unlinks the dead trainers' slots {slots}")
    assert not [seg for t in trainers for seg in segments_of(t.pid)]
    wait_until(lambda: daemon.status()["clients"] == [], 5, "the daemon forgets the dead trainers")


@pytest.mark.timeout(90)
def test_a_trainer_killed_while_the_daemon_writes_its_shard_still_gets_it_committed(daemon_factory, root, run_dir) -> None:
    daemon = daemon_factory(faults=[{"op": "write", "match": "/slow.incomplete/", "errno": 0, "delay": 0.5}])
    trainer = Trainer(run_dir, root / "slow", "stay", mib=24)  # three write calls of 0.5 s
    returned = trainer.until("returned")
    wait_until(lambda: daemon.status()["saves"], 10, "the daemon is writing the shard")
    trainer.kill()
    assert trainer.reap() == -signal.SIGKILL
    (slot,) = returned["slots"]
    # the slot's name goes at once; the daemon's mapping keeps the bytes until the write is done
    wait_until(lambda: not (Path("/dev/shm") / slot).exists(), 5, f"the daemon unlinks the dead trainer's slot {slot}")
    wait_until(lambda: (root / "slow").exists(), 15, "the save is committed after its trainer died")
    assert_loads_as(root / "slow", expected_state(24))
    wait_until(lambda: daemon.status()["shm_mapped_bytes"] == 0, 5, "the daemon drops the dead trainer's mapping")


@pytest.mark.timeout(90)
def test_a_trainer_killed_while_staging_in_the_background_commits_nothing_and_its_slots_are_reclaimed(
    daemon, root, run_dir
) -> None:
    trainer = Trainer(run_dir, root / "never", "background", mib=1024)
    returned = trainer.until("returned")
    assert returned["staged"] is False
    wait_until(lambda: segments_of(trainer.pid), 10, "the trainer's staging thread creates its slot")
    trainer.kill()  # filling a GiB slot takes far longer than this
    assert trainer.reap() == -signal.SIGKILL
    assert not any(e["event"] == "staged" for e in trainer.events), "the trainer finished staging before the kill"
    wait_until(lambda: not segments_of(trainer.pid), 5,
               lambda: f"the daemon reclaims the dead trainer's slots: {segments_of(trainer.pid)}")
    # a commit sent before staging ended (overlapped staging) is failed and its directory removed
    wait_until(lambda: not os.listdir(root), 10, lambda: f"nothing is left in the root: {os.listdir(root)}")
    wait_until(lambda: (lambda s: not (s["clients"] or s["saves"] or s["checkpoints"]))(daemon.status()), 10,
               "the daemon forgets the dead trainer and its save")
