"""Trainers, scripts, ranks and the torchrun launcher forked from a zygote that imported torch once.

A fresh interpreter pays a torch import (one to three seconds of CPU) before
it does anything; the suite starts dozens of trainers and ranks. Each test
process (each ``pytest -n`` worker) starts one multiprocessing *forkserver*
on first use, which imports ``PRELOAD`` and nothing else: it runs no torch
op, so it has started no threads, and every process forked from it is a
whole, fresh process (its own pid, memory, ZeroMQ context and client) that
starts in milliseconds. Death, crash, fork and multi-rank tests still run
against real processes; only the import is shared.

A forked process inherits the zygote's environment (the one this module was
imported with, at collection, before any test changed it) and ``sys.path``,
not the calling test's: pass what differs as arguments.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import traceback
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch.multiprocessing as torch_mp

PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "ckptd.client"]
"""What the zygote imports: everything the ranks and trainers of the tests import that costs CPU."""


_ENVIRON = dict(os.environ)
"""The environment at import: the zygote's, whatever a test had set when it first used the zygote."""


def context() -> Any:
    """The forkserver context, its server running (started on first use, preloading ``PRELOAD``)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts; later calls change nothing
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(_ENVIRON)
    try:
        forkserver.ensure_running()  # a no-op once it runs
    finally:
        os.environ.clear()
        os.environ.update(now)
    return ctx


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> Any:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` with the ranks forked from the zygote;
    the returned context is joined as usual. ``fn`` must be importable by name (a module-level function)."""
    context()
    return torch_mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")


def _exec(script: str, argv: list[str], stdout: Connection, stderr: Connection) -> None:
    """In the forked process: ``python -c script *argv`` with stdout and stderr on the parent's pipes, ending as
    an interpreter does (non-daemon threads joined, then the atexit hooks: a client's slot cleanup runs), also in
    a child the script forks itself."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout.fileno(), 1)
    os.dup2(stderr.fileno(), 2)
    stdout.close()
    stderr.close()
    sys.argv = ["-c", *argv]
    code: object = 0
    try:
        exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's own exit does, in its order
    atexit._run_exitfuncs()
    sys.exit(code)


def _text_reader(conn: Connection) -> Any:
    """The read end of a one-way ``Pipe`` as a text file (its bytes, not its messages)."""
    fd = os.dup(conn.fileno())
    conn.close()
    return open(fd, "r")


class Script:
    """``python -c script *argv`` forked from the zygote; what the tests use of a ``subprocess.Popen``.

    ``stdout`` and ``stderr`` are text pipes, as with ``Popen(..., stdout=PIPE, stderr=PIPE, text=True)``;
    ``returncode`` is negative for a signal, as with ``Popen``. The zygote reaps the process as soon as it exits,
    so a killed one is gone at once (no zombie a daemon would still take for alive)."""

    def __init__(self, script: str, *argv: str) -> None:
        ctx = context()
        (out_r, out_w), (err_r, err_w) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_exec, args=(script, list(argv), out_w, err_w), daemon=True)
        self._proc.start()  # daemon: terminated at exit if a failed test left it running
        out_w.close()
        err_w.close()
        self.stdout, self.stderr = _text_reader(out_r), _text_reader(err_r)
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"zygote script (pid {self.pid})", timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both outputs in full once the process exited (read on threads: neither pipe fills up)."""
        out: list[str] = []
        err: list[str] = []
        readers = [threading.Thread(target=lambda f=f, into=into: into.append(f.read()), daemon=True)
                   for f, into in ((self.stdout, out), (self.stderr, err))]
        for r in readers:
            r.start()
        self.wait(timeout)
        for r in readers:
            r.join(timeout)
        return "".join(out), "".join(err)


def run_script(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-c", script, *argv], capture_output=True, text=True)``, forked from the zygote."""
    proc = Script(script, *argv)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return subprocess.CompletedProcess(["-c", script, *argv], proc.returncode, out, err)


_RUN_MODULE = """
import json, os, runpy, sys
os.chdir(sys.argv[1])
os.environ.clear()
os.environ.update(json.loads(sys.argv[2]))
sys.argv = sys.argv[3:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_module(module: str, *argv: str, env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", module, *argv], env=env, cwd=cwd, capture_output=True, text=True)``, forked
    from the zygote (``torch.distributed.run``: the launcher; the ranks it starts are fresh interpreters)."""
    return run_script(_RUN_MODULE, cwd, json.dumps(env), module, *argv, timeout=timeout)
