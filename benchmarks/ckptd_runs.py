"""ckptd itself: a dedicated daemon, and steady-state saves through a client.

The benchmark starts its own daemon (``ckptd start --foreground``) on a
private run directory instead of using or spawning the node's daemon, so
that its settings are known, nothing else writes through it, and its pid is
at hand for RSS sampling. It is stopped with SIGTERM, which drains first.

Steady state is what a training run sees after its first checkpoint: the
client's slot already exists and is pre-faulted, the daemon has it mapped.
So each mode does one warm-up save, then ``repeat`` timed saves, each to a
new checkpoint path; the previous checkpoint is removed untimed, keeping
disk use at one or two checkpoints.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ckptd
from ckptd.protocol.endpoint import LOG_NAME

from .measure import Series

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0


class BenchDaemon:
    """A ``ckptd`` daemon for this run only; use as a context manager."""

    def __init__(self, root: Path, *extra: str) -> None:
        self.root = root
        self.extra = extra
        # Short and under /tmp: the socket path must fit in 107 bytes.
        self.run_dir = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/tmp"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "daemon not started"
        return self.proc.pid

    def _ckptd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ckptd", *args, "--run-dir", str(self.run_dir)]

    def start(self) -> "BenchDaemon":
        err = open(self.run_dir / "bench-daemon.err", "wb")
        self.proc = subprocess.Popen(
            self._ckptd("start", "--foreground", "--quiet", "--root", str(self.root), *self.extra),
            stdin=subprocess.DEVNULL, stdout=err, stderr=err, close_fds=True,
        )
        err.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ckptd daemon exited at start (code {self.proc.returncode}): {self._err_tail()}")
            status = subprocess.run(self._ckptd("status", "--timeout", "1"), capture_output=True)
            if status.returncode == 0:
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"ckptd daemon did not answer within {START_TIMEOUT_S:.0f} s: {self._err_tail()}")

    def _err_tail(self) -> str:
        text = (self.run_dir / "bench-daemon.err").read_text(errors="replace").strip()
        return " | ".join(text.splitlines()[-5:]) or "no output"

    def stop(self) -> None:
        """SIGTERM (the daemon drains, then exits); SIGKILL only if it hangs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "BenchDaemon":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def daemon_committed_seconds(run_dir: Path, path: Path) -> float | None:
    """The daemon's own accepted-to-committed time for ``path``, from its log.

    Best effort: the log is for people, so a changed format only loses
    this breakdown, never the benchmark.
    """
    try:
        text = (Path(run_dir) / LOG_NAME).read_text(errors="replace")
    except OSError:
        return None
    pattern = re.compile(rf"event=committed path={re.escape(str(path))} .*?seconds=([0-9.]+)")
    found = pattern.findall(text)
    return float(found[-1]) if found else None


@dataclass
class CkptdResult:
    """Per-repetition timings of one client mode, in seconds from the call."""

    background: bool
    returned: Series = field(default_factory=Series)
    """``save_async`` returned: what the training step is blocked for."""
    staged: Series = field(default_factory=Series)
    """``future.staged`` resolved: the tensors may change from here."""
    durable: Series = field(default_factory=Series)
    """The future resolved: fsync'd, renamed, parent directory fsync'd."""
    reported: Series = field(default_factory=Series)
    """``SaveResult.seconds`` as the client measured it, for cross-checking."""
    daemon: Series = field(default_factory=Series)
    """The daemon's accepted-to-committed time (write, fsync, index, rename), from its log."""
    bytes_written: int = 0

    def to_json(self) -> dict:
        return {"background": self.background, "returned": self.returned.values, "staged": self.staged.values,
                "durable": self.durable.values, "reported": self.reported.values, "daemon": self.daemon.values,
                "bytes_written": self.bytes_written}


def client_accepts(option: str) -> bool:
    """Whether this ckptd's ``Client`` takes keyword ``option`` (the library moves; features are detected)."""
    import inspect

    return option in inspect.signature(ckptd.Client).parameters


def run_client(run_dir: Path, state: Any, scratch: Path, *, background: bool, repeat: int, prefix: str = "ckptd",
               on_steady: Callable[[], None] | None = None, **client_options: Any) -> CkptdResult:
    """One warm-up save and ``repeat`` timed ones through a fresh client.

    ``on_steady`` runs after the warm-up (the slot exists from then on), right
    before the first timed save. ``client_options`` go to ``ckptd.Client``.
    """
    result = CkptdResult(background)
    mode = "background" if background else "sync"
    previous: Path | None = None
    client = ckptd.Client(run_dir=run_dir, spawn=False, max_inflight=1, background_staging=background,
                          rank=0, world_size=1, **client_options)
    try:
        for i in range(1 + repeat):
            if i == 1 and on_steady is not None:
                on_steady()
            path = scratch / f"{prefix}-{mode}-{i}"
            t0 = time.perf_counter()
            fut = client.save_async(state, path, step=i)
            t_returned = time.perf_counter()
            fut.wait_staged()
            t_staged = time.perf_counter()
            saved = fut.result()
            t_durable = time.perf_counter()
            if previous is not None:
                shutil.rmtree(previous, ignore_errors=True)
            previous = path
            result.bytes_written = saved.bytes_written
            if i >= 1:
                result.returned.add(t_returned - t0)
                result.staged.add(t_staged - t0)
                result.durable.add(t_durable - t0)
                result.reported.add(saved.seconds)
                in_daemon = daemon_committed_seconds(run_dir, saved.path)
                if in_daemon is not None:
                    result.daemon.add(in_daemon)
    finally:
        client.close()
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
    return result


PREFIXES = ("ckptd-", "torch-save-", "raw-", "dcp-", "scale-", "multi-", "load-", "rank4-", "logs", "last-run.pkl")


def clean_scratch(scratch: Path, *, keep_logs: bool = False) -> None:
    """Remove what a run (or an interrupted earlier one) left in ``scratch`` (ours only)."""
    for entry in scratch.iterdir() if scratch.exists() else ():
        if entry.name.startswith(PREFIXES) and not (keep_logs and entry.name in ("logs", "last-run.pkl")):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    os.makedirs(scratch, exist_ok=True)
