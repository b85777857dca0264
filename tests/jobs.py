"""A job: ``world`` real rank processes (forked from the zygote), one incarnation of a training launch.

Each rank holds a real ``ckptd.Client(rank=, world_size=)`` and obeys JSON
commands the test writes to its FIFO (save, dcp, persist, resume, exit), printing
one JSON line per event (ready, returned, done), so a test can drive several ranks
of one job in the order it chooses and SIGKILL any of them at a chosen moment.
A ``Launch`` says how the job was started, as a launcher would have: its
environment (torchrun's or Slurm's variables, or none), an explicit ``job=``,
and whether the ranks are under ``torch.distributed`` (a gloo group, as torchrun
ranks are), which several nodes (one daemon each) and DCP saves need.
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
from dataclasses import dataclass, field
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
from concurrent.futures import ThreadPoolExecutor
run_dir, fifo, rank, world, inc, commit_timeout, launch = sys.argv[1:8]
rank, world, inc, launch = int(rank), int(world), int(inc), json.loads(launch)
for k in LAUNCHER_VARS:  # the zygote's environment is not the launch's
    os.environ.pop(k, None)
os.environ.update(launch["env"])
import ckptd
if launch["init"]:
    import torch.distributed as dist
    os.environ["LOCAL_RANK"] = str(launch["local_rank"])
    dist.init_process_group("gloo", init_method="file://" + launch["init"], rank=rank, world_size=world)
lock = threading.Lock()

def say(**kw):
    with lock:
        print(json.dumps(kw), flush=True)

def error(exc):
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]}

client = ckptd.Client(run_dir=run_dir, spawn=False, rank=rank, world_size=world, timeout=10.0, heartbeat=0.2,
                      commit_timeout=float(commit_timeout), job=launch["job"])
dcp_saves = ThreadPoolExecutor(1)  # dcp.save blocks (collectives): one at a time, in order, off the command loop

def dcp_save(cmd, cid):
    import torch.distributed.checkpoint as dcp
    from ckptd.dcp import StorageWriter
    try:
        state = {f"rank{rank}": tagged_state(inc, cmd["sid"], rank, cmd["step"])}
        dcp.save(state, storage_writer=StorageWriter(cmd["path"], client=client, step=cmd["step"],
                                                     overwrite=cmd["overwrite"], keep_last=cmd["keep_last"]))
        say(event="done", id=cid, ok=True)
    except BaseException as exc:
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: (error, trace) by rank
        cause = failures.get(rank, next(iter(failures.values())))[0] if failures else exc
        say(event="done", id=cid, **error(cause), wrapped=type(exc).__name__)

say(event="ready", pid=os.getpid(), job=client.job)
for line in open(fifo):
    cmd = json.loads(line)
    op, cid = cmd["op"], cmd["id"]
    if op == "exit":
        dcp_saves.shutdown()
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
        elif op == "dcp":
            dcp_saves.submit(dcp_save, cmd, cid)
            say(event="returned", id=cid)
        elif op == "persist":
            client.persist(cmd["path"], timeout=60)
            say(event="done", id=cid, ok=True)
        elif op == "resume":  # as a restarted trainer resumes: collective under torch.distributed, so answer first
            say(event="returned", id=cid)
            found = ckptd.latest(cmd["root"], run_dir=run_dir)
            if found is None:
                say(event="done", id=cid, ok=True, path=None)
                continue
            state = tagged_state(0, 0, rank, -1)  # every save's shapes; every byte is overwritten by the load
            ckptd.load_into(state, found, rank=rank, run_dir=run_dir)  # ranks without torch.distributed say theirs
            import torch
            tag = state["tag"].tolist()
            want = tagged_state(*tag)
            bitwise = all(torch.equal(state["model"][k], want["model"][k]) for k in ("w", "b")) and (
                state["step"] == want["step"] and torch.equal(state["tag"], want["tag"]))
            say(event="done", id=cid, ok=True, path=str(found), tag=tag, bitwise=bitwise)
    except Exception as exc:
        say(event="returned", id=cid)
        say(event="done", id=cid, **error(exc))
'''
LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_STEP_ID",
                 "SLURM_RESTART_COUNT")
RANK = f"LAUNCHER_VARS = {LAUNCHER_VARS!r}\n" + RANK


@dataclass(frozen=True)
class Launch:
    """How a job was launched: what its ranks find in their environment and pass to ``Client``."""

    env: dict[str, str] = field(default_factory=dict)
    """The launcher's variables (``TORCHELASTIC_*``, ``SLURM_*``); every other launcher variable is unset."""
    job: str | None = None
    """``Client(job=...)``."""
    dist: bool = False
    """The ranks join one gloo group (``torch.distributed``) before their clients start, as torchrun's do."""


class Rank:
    """One rank process and the events it printed (read on a thread, so its pipe never fills)."""

    def __init__(self, run_dir: Path, fifo: Path, rank: int, world: int, inc: int, commit_timeout: float,
                 launch: dict[str, Any]) -> None:
        """Start the process; ``connect`` waits until its client is up (under torch.distributed, every rank's
        ``Client()`` is collective: start them all first)."""
        os.mkfifo(fifo)
        self.rank = rank
        self._fifo_path = fifo
        self.proc = Script(RANK, str(run_dir), str(fifo), str(rank), str(world), str(inc), str(commit_timeout),
                           json.dumps(launch))
        self.seen: dict[tuple[str, int], dict] = {}
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def connect(self) -> None:
        """Wait for the rank's client, then open its command FIFO."""
        self.job = self.wait_for("ready", -1)["job"]
        self._fifo = open(_open_writer(self._fifo_path, self.proc), "w", buffering=1)

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
        except (OSError, AttributeError):  # AttributeError: killed before it connected
            pass
        return code

    def exit(self, cid: int) -> None:
        self.send(op="exit", id=cid)
        self.wait_for("done", cid, timeout=120)
        self.proc.wait(60)
        self._fifo.close()


class Job:
    """``world`` ranks of one incarnation ``inc``, saving through the daemon on ``run_dir`` (or, given several run
    dirs, one per node: the ranks split evenly over them in order, as a launcher places them)."""

    def __init__(self, run_dir: Path | list[Path], fifo_dir: Path, world: int, inc: int,
                 commit_timeout: float = 120.0, launch: Launch = Launch()) -> None:
        self.inc = inc
        self.launch = launch
        run_dirs = run_dir if isinstance(run_dir, list) else [run_dir]
        per_node = -(-world // len(run_dirs))
        assert launch.dist or len(run_dirs) == 1, "ranks on several nodes agree over torch.distributed"
        init = str(fifo_dir / f"inc{inc}-init") if launch.dist else ""
        self.ranks = [Rank(run_dirs[r // per_node], fifo_dir / f"inc{inc}-rank{r}", r, world, inc, commit_timeout,
                           {"env": launch.env, "job": launch.job, "init": init, "local_rank": r % per_node})
                      for r in range(world)]
        try:
            for r in self.ranks:
                r.connect()
        except BaseException:
            self.kill()
            raise
        self.node_of = [r // per_node for r in range(world)]
        """Which run dir (node) each rank saves through."""
        self._ids = iter(range(10**9))

    @property
    def job(self) -> str:
        """The name the ranks' clients chose for this run (``Client.job``; "" for none)."""
        return self.ranks[0].job

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
