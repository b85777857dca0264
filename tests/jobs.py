"""A job: ``world`` real rank processes (forked from the zygote), one incarnation of a training launch.

Each rank holds a real ``ckptd.Client(rank=, world_size=)`` and obeys JSON
commands the test writes to its FIFO (save, persist, exit), printing one JSON
line per event (ready, returned, done), so a test can drive several ranks of
one job in the order it chooses and SIGKILL any of them at a chosen moment.
Every tensor a rank saves is derived from (incarnation, save id, rank, step),
and carries them, so a checkpoint holding shards of two saves (or of two
incarnations) is detected when it is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from zygote import Script

STATE_SRC = r'''
def tagged_state(inc, sid, rank, step):
    """What rank ``rank`` of incarnation ``inc`` saves in save ``sid``: every byte follows from those four."""
    import torch
    g = torch.Generator().manual_seed(inc * 1_000_003 + sid * 1009 + rank)
    return {"tag": torch.tensor([inc, sid, rank, step], dtype=torch.int64),
            "model": {"w": torch.randn(3000, generator=g),
                      "b": torch.randint(0, 255, (77,), generator=g, dtype=torch.uint8)},
            "step": step}
'''
exec(STATE_SRC)  # defines tagged_state here too: the test knows the bytes every rank saved

RANK = STATE_SRC + r'''
import json, os, sys, threading
import ckptd
run_dir, fifo, rank, world, inc, commit_timeout = sys.argv[1:7]
rank, world, inc = int(rank), int(world), int(inc)
lock = threading.Lock()

def say(**kw):
    with lock:
        print(json.dumps(kw), flush=True)

def error(exc):
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]}

client = ckptd.Client(run_dir=run_dir, spawn=False, rank=rank, world_size=world, timeout=10.0, heartbeat=0.2,
                      commit_timeout=float(commit_timeout))
say(event="ready", pid=os.getpid())
for line in open(fifo):
    cmd = json.loads(line)
    op, cid = cmd["op"], cmd["id"]
    if op == "exit":
        client.close()
        say(event="done", id=cid, ok=True)
        break
    try:
        if op == "save":
            state = tagged_state(inc, cmd["sid"], rank, cmd["step"])
            fut = client.save_async(state, cmd["path"], step=cmd["step"], overwrite=cmd["overwrite"],
                                    keep_last=cmd["keep_last"], persist=cmd["persist"])
            def finished(f, cid=cid):
                exc = f.exception()
                say(event="done", id=cid, **(error(exc) if exc is not None else {"ok": True}))
            fut.add_done_callback(finished)
            say(event="returned", id=cid)
        elif op == "persist":
            client.persist(cmd["path"], timeout=60)
            say(event="done", id=cid, ok=True)
    except Exception as exc:
        say(event="returned", id=cid)
        say(event="done", id=cid, **error(exc))
'''


class Rank:
    """One rank process and the events it printed (read on a thread, so its pipe never fills)."""

    def __init__(self, run_dir: Path, fifo: Path, rank: int, world: int, inc: int, commit_timeout: float) -> None:
        os.mkfifo(fifo)
        self.rank = rank
        self.proc = Script(RANK, str(run_dir), str(fifo), str(rank), str(world), str(inc), str(commit_timeout))
        self.seen: dict[tuple[str, int], dict] = {}
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for("ready", -1)
        self._fifo = open(_open_writer(fifo, self.proc), "w", buffering=1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip():
                e = json.loads(line)
                with self._cond:
                    self.seen[(e["event"], e.get("id", -1))] = e
                    self._cond.notify_all()
        with self._cond:
            self.seen[("exited", -1)] = {}
            self._cond.notify_all()

    def send(self, **cmd: Any) -> None:
        self._fifo.write(json.dumps(cmd) + "\n")

    def wait_for(self, event: str, cid: int, timeout: float = 120) -> dict:
        """The event ``event`` of command ``cid``; fails if the rank exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (event, cid) not in self.seen:
                if ("exited", -1) in self.seen:
                    raise AssertionError(f"rank {self.rank} (pid {self.proc.pid}) exited before {event} of command "
                                         f"{cid}: {self.proc.stderr.read()[-3000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"rank {self.rank} (pid {self.proc.pid}): no {event} of command {cid} "
                                         f"within {timeout:g} s")
                self._cond.wait(left)
            return self.seen[(event, cid)]

    def kill(self) -> int:
        """SIGKILL; returns the exit status, which proves the crash (``-SIGKILL``)."""
        self.proc.kill()
        code = self.proc.wait(30)
        try:
            self._fifo.close()
        except OSError:
            pass
        return code

    def exit(self, cid: int) -> None:
        self.send(op="exit", id=cid)
        self.wait_for("done", cid, timeout=120)
        self.proc.wait(60)
        self._fifo.close()


class Job:
    """``world`` ranks of one incarnation ``inc``, saving through the daemon on ``run_dir``."""

    def __init__(self, run_dir: Path, fifo_dir: Path, world: int, inc: int, commit_timeout: float = 120.0) -> None:
        self.inc = inc
        self.ranks = [Rank(run_dir, fifo_dir / f"inc{inc}-rank{r}", r, world, inc, commit_timeout)
                      for r in range(world)]
        self._ids = iter(range(10**9))

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.ranks]

    def next_id(self) -> int:
        return next(self._ids)

    def kill(self) -> list[int]:
        return [r.kill() for r in self.ranks]

    def exit(self) -> None:
        for r in self.ranks:
            r.exit(self.next_id())


def _open_writer(fifo: Path, proc: Script, timeout: float = 60) -> int:
    """The FIFO's write end, once the rank opened its read end (a rank that died first fails the wait)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            assert proc.poll() is None, f"rank pid {proc.pid} exited: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"rank pid {proc.pid} never opened its command FIFO"
            time.sleep(0.02)
            continue
        os.set_blocking(fd, True)
        return fd


def killed(code: int) -> bool:
    return code == -signal.SIGKILL
