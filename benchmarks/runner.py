"""The orchestrator's side of a worker: start it, watch it, gate it on a quiet machine.

``Ctx`` is what every section gets: the options, the sampler, the quiet-window
log, the scratch directory and a log function. ``Worker`` is one worker
process; ``run_one`` is the common single-worker life cycle (start, wait for
ready, wait for a quiet machine, go, collect marks and the result, read the
sampled peaks off the series).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .measure import QUIET_CORES, QuietLog, Sampler, Window, wait_quiet

READY_TIMEOUT_S = 300.0
RESULT_TIMEOUT_S = 600.0
REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Ctx:
    """Everything a section needs from the run."""

    scratch: Path
    repeat: int
    limit_repeat: int
    size_gib: float
    sampler: Sampler
    quiet: QuietLog
    quiet_max_wait: float
    logs: Path
    """Directory for worker logs (inside the scratch dir)."""
    evict_mode: str = "fadvise"
    options: dict[str, Any] = field(default_factory=dict)
    retries_left: int = 0
    """Phases that may still be rerun because other work kept the CPUs busy during them."""
    retried: list[tuple[str, float, float | None]] = field(default_factory=list)
    """(phase, other CPU of the discarded run, of the kept run)."""
    soft_deadline: float = float("inf")
    """Monotonic time after which the run stops waiting for quiet windows and rerunning busy phases,
    so that a busy machine cannot push the whole run past its time budget."""

    def patient(self) -> bool:
        return time.monotonic() < self.soft_deadline


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """One ``python -m benchmarks.worker`` process."""

    _count = 0

    def __init__(self, ctx: Ctx, task: str, name: str | None = None, **args: Any) -> None:
        Worker._count += 1
        self.ctx = ctx
        self.name = name or task
        self.log_path = ctx.logs / f"{Worker._count:02d}-{self.name.replace(' ', '_').replace('/', '_')}.log"
        err = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", json.dumps({"task": task, "args": args})],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, close_fds=True,
        )
        err.close()
        self.pid = self.proc.pid
        self.marks: dict[str, float] = {}
        self.watched: dict[str, int] = {}
        self._messages: "queue.Queue[dict | None]" = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"worker-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if msg.get("event") == "mark":
                self.marks[msg["name"]] = msg["t"]
            elif msg.get("event") == "watch":
                self.watched[msg["role"]] = msg["pid"]
                self.ctx.sampler.watch(msg["role"], msg["pid"])
            else:
                self._messages.put(msg)
        self._messages.put(None)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return "\n".join(text[-lines:])

    def next(self, event: str, timeout: float) -> dict:
        """The next message; it must be ``event`` (an ``error`` or an exit raises)."""
        try:
            msg = self._messages.get(timeout=timeout)
        except queue.Empty:
            raise WorkerFailed(f"worker {self.name} sent no {event} within {timeout:.0f} s:\n{self.log_tail()}") from None
        if msg is None:
            self.proc.wait()
            raise WorkerFailed(f"worker {self.name} exited (code {self.proc.returncode}) before {event}:\n"
                               f"{self.log_tail()}")
        if msg.get("event") == "error":
            raise WorkerFailed(f"worker {self.name} failed: {msg.get('error')}\n{self.log_tail()}")
        if msg.get("event") != event:
            raise WorkerFailed(f"worker {self.name} sent {msg.get('event')} where {event} was expected")
        return msg

    def go(self) -> float:
        assert self.proc.stdin is not None
        t = time.monotonic()
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        return t

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"stop\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for role in self.watched:
            self.ctx.sampler.unwatch(role)


@dataclass
class Run:
    """One worker's result, with what the sampler saw."""

    result: dict
    ready: dict
    marks: dict[str, float]
    phase: Window
    """From go to result."""
    steady: Window
    """Between the worker's ``steady`` and ``end`` marks (the timed repetitions)."""
    quiet_wait: float


def run_one(ctx: Ctx, task: str, phase: str, *, writer_pid: int | None = None, **args: Any) -> Run:
    """Start a worker for ``task``, gate it on a quiet machine, collect everything.

    If other work kept more than ``QUIET_CORES`` busy during the phase, the
    phase is run once more (while the run's retry budget lasts) and the run
    with the quieter machine is kept.
    """
    run = _run_one(ctx, task, phase, writer_pid=writer_pid, **args)
    if (run.phase.others is not None and run.phase.others > QUIET_CORES and ctx.retries_left > 0
            and ctx.patient()):
        ctx.retries_left -= 1
        log(f"{phase}: other work used {run.phase.others:.2f} cores during it; running it again")
        again = _run_one(ctx, task, phase, writer_pid=writer_pid, **args)
        kept = again if (again.phase.others or 0.0) <= run.phase.others else run
        ctx.retried.append((phase, run.phase.others if kept is again else (again.phase.others or 0.0),
                            kept.phase.others))
        run = kept
    return run


def _run_one(ctx: Ctx, task: str, phase: str, *, writer_pid: int | None = None, **args: Any) -> Run:
    log(f"{phase}: starting worker")
    w = Worker(ctx, task, name=phase, **args)
    ctx.sampler.watch("trainer", w.pid)
    if writer_pid is not None:
        ctx.sampler.watch("writer", writer_pid)
    try:
        ready = w.next("ready", READY_TIMEOUT_S)
        before = ctx.quiet.spent
        wait_quiet(ctx.sampler, ctx.quiet, phase, max_wait=ctx.quiet_max_wait if ctx.patient() else 0.0)
        t_go = w.go()
        log(f"{phase}: running")
        result = w.next("result", RESULT_TIMEOUT_S)
        t_end = time.monotonic()
        time.sleep(2 * ctx.sampler.interval)  # one more sample past the end
        phase_w = ctx.sampler.window(t_go, t_end)
        steady = ctx.sampler.window(w.marks.get("steady", t_go), w.marks.get("end", t_end))
        return Run(result, ready, dict(w.marks), phase_w, steady, ctx.quiet.spent - before)
    finally:
        w.close()
        ctx.sampler.unwatch("trainer")
        if writer_pid is not None:
            ctx.sampler.unwatch("writer")


class Group:
    """Several workers that start each round together (four ranks on one node)."""

    def __init__(self, ctx: Ctx, task: str, name: str, role: str, args_per_worker: list[dict]) -> None:
        self.ctx = ctx
        self.role = role
        self.workers = [Worker(ctx, task, name=f"{name}-{i}", **a) for i, a in enumerate(args_per_worker)]
        ctx.sampler.watch(role, *(w.pid for w in self.workers))

    def ready(self, timeout: float = READY_TIMEOUT_S) -> list[dict]:
        return [w.next("ready", timeout) for w in self.workers]

    def go(self, phase: str | None = None) -> float:
        """Wait for a quiet machine (if ``phase`` is named), then say go to every worker."""
        if phase is not None:
            wait_quiet(self.ctx.sampler, self.ctx.quiet, phase,
                       max_wait=self.ctx.quiet_max_wait if self.ctx.patient() else 0.0)
        t = time.monotonic()
        for w in self.workers:
            w.go()
        return t

    def collect(self, event: str, timeout: float = RESULT_TIMEOUT_S) -> list[dict]:
        return [w.next(event, timeout) for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.ctx.sampler.unwatch(self.role)
