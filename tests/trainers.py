"""A training process of its own (forked from the zygote), saving one checkpoint so a test can kill it.

Shared by ``test_client_death.py`` and its soak variant. The trainer prints
one JSON line per event (ready, returned, staged), so a test can SIGKILL it
at exactly the moment it means to.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ckptd

from zygote import Script

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


class Trainer:
    """A training process saving one checkpoint; reads its JSON event lines."""

    def __init__(self, run_dir: Path, path: Path, mode: str, mib: int) -> None:
        self.proc = Script(TRAINER, str(run_dir), str(path), mode, str(mib))
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


def assert_loads_as(path: Path, state: dict) -> None:
    assert ckptd.read_index(path).world_size == 1
    loaded = ckptd.load(path, rank=0)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key
