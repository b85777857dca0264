"""The daemon process: run directory, pid lock, logging, signals, detaching.

``run_foreground`` is what ``ckptd start --foreground`` runs and what a
supervisor (or a test) should run. ``start_detached`` starts that same
command in a new session, so the daemon outlives the shell or the trainer
that started it, and returns once the daemon answers.
"""

from __future__ import annotations

import fcntl
import logging
import logging.handlers
import os
import signal
import subprocess
import sys
import time
from pathlib import Path, PurePath

import psutil

from ckptd.protocol.names import DRAIN_FAILED_NAME, ERR_NAME, LOG_NAME, PID_NAME, SOCKET_NAME
from ckptd.protocol.errors import CkptdError
from ckptd.protocol.objects import display

from ckptd.core.config import DaemonConfig
from ckptd.loop.server import Server
from ckptd.storage.backends import check_stores, load_storage
from ckptd.tools.control import probe

log = logging.getLogger("ckptd")
"""Written when a drain could not persist held snapshots (one line each): ``ckptd stop`` reports it."""
LOG_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3
"""How long a start waits for a store to say whether a bucket exists."""


class AlreadyRunning(CkptdError):
    """A daemon already holds this run directory's pid lock."""


class StartFailed(CkptdError):
    """A detached daemon exited before it answered: its own one-line error, and its exit code, which ``ckptd start``
    exits with too (2 usage, 3 error), so a start fails alike detached and in the foreground."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


FILE_ONLY = "ckptd_file_only"
"""A log record's ``extra`` key: the record goes to the log file only, never to stderr (``--foreground``), where
every error is one line (a start's traceback is kept in the log)."""


def prepare_run_dir(run_dir: Path) -> None:
    """Create the run directory private to this user, or refuse a foreign one."""
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CkptdError(f"cannot use {run_dir} as the run directory: {exc.strerror or exc}; "
                         "give another with --run-dir or CKPTD_RUN_DIR") from None
    st = run_dir.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"run directory {run_dir} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        os.chmod(run_dir, 0o700)


def acquire_pid_lock(run_dir: Path) -> int:
    """Lock and fill the pid file; the lock lives as long as the process."""
    fd = os.open(run_dir / PID_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise AlreadyRunning(f"a ckptd daemon (pid {other}) is already running on {run_dir}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def setup_logging(run_dir: Path, *, to_stderr: bool) -> None:
    """One key=value line per event in the run directory, rotated."""
    fmt = logging.Formatter("%(asctime)s level=%(levelname)s %(message)s")
    handlers: list[logging.Handler] = [
        logging.handlers.RotatingFileHandler(run_dir / LOG_NAME, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS)
    ]
    if to_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
        handlers[-1].addFilter(lambda record: not getattr(record, FILE_ONLY, False))
    for h in handlers:
        h.setFormatter(fmt)
        h.addFilter(_object_urls)
        log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


def _object_urls(record: logging.LogRecord) -> bool:
    """Log an object's name as its URL (``s3://bucket/key``), as every message does, never as ``Path`` prints it."""
    if isinstance(record.args, tuple):
        record.args = tuple(display(a) if isinstance(a, PurePath) else a for a in record.args)
    return True


STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
"""Each begins a drain (``Server.request_stop``)."""


def run_foreground(config: DaemonConfig) -> list[str]:
    """Serve until stopped (``ckptd stop``, SIGTERM or SIGINT drain first); returns the held snapshots the drain
    could not persist (``path: why``), which are lost."""
    prepare_run_dir(config.run_dir)
    lock_fd = acquire_pid_lock(config.run_dir)
    setup_logging(config.run_dir, to_stderr=config.log_to_stderr)
    sock = config.run_dir / SOCKET_NAME
    if sock.exists():  # we hold the lock, so it is a dead daemon's socket
        sock.unlink()
    try:  # a start that fails (metrics port in use...) leaves no socket or pid file behind
        server = _started(config)
        (config.run_dir / DRAIN_FAILED_NAME).unlink(missing_ok=True)
        try:
            server.serve_forever()
        finally:
            server.close()
            # Drained and closed: a later SIGTERM has nothing to stop. Ignored, not left to the interpreter's
            # exit, which restores the default action and would end a clean stop as "killed by SIGTERM".
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        if server.holding.drain_failures:
            (config.run_dir / DRAIN_FAILED_NAME).write_text("".join(f"{f}\n" for f in server.holding.drain_failures))
        return server.holding.drain_failures
    finally:
        for name in (SOCKET_NAME, PID_NAME):
            try:
                (config.run_dir / name).unlink()
            except FileNotFoundError:
                pass
        os.close(lock_fd)


def _started(config: DaemonConfig) -> Server:
    """The server, serving once ``serve_forever`` runs, with its stop signals handled.

    A user's error (``ValueError``, ``CkptdError``, ``OSError``) goes to the CLI, which says it in one line (and
    to the log file, ``event=start_refused``). Any
    other exception is a defect: its traceback goes to the log file, and the CLI's one line names it and the log,
    where a traceback on stderr was all a detached start showed, flattened into one line.
    """
    try:
        check_stores(config.roots, config.mirrors)
        # From the socket's bind (in Server) to the handlers, a SIGTERM would kill the daemon undrained: held
        # until they are in place (the threads Server starts inherit the block, so the main thread takes it).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            server = Server(config, load_storage(config.storage))
            for sig in STOP_SIGNALS:
                signal.signal(sig, lambda *_: server.request_stop())
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    except (CkptdError, OSError, ValueError) as exc:  # the CLI's line; the log keeps it too (a detached start's
        log.error("event=start_refused error=%s", exc, extra={FILE_ONLY: True})  # reader may only look there)
        raise
    except Exception as exc:  # noqa: BLE001 - a defect: logged whole, told in one line
        log.error("event=start_failed error=%r", exc, exc_info=True, extra={FILE_ONLY: True})
        raise CkptdError(f"the daemon failed to start: {type(exc).__name__}: {exc} (a defect of ckptd; its "
                         f"traceback is in {config.run_dir / LOG_NAME})") from None
    return server


SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()
"""The detached daemon's interpreter does not put the current directory first on its path (``-m`` would): started
from a checkout of another release, or any folder holding a ``ckptd`` directory, it would import that instead of
the ckptd that was asked to start it. (Python 3.10 has no such switch.)"""


def start_detached(argv: list[str], run_dir: Path, *, timeout: float = 30.0) -> int:
    """Start ``ckptd start --foreground`` with ``argv`` in a new session; return its pid."""
    prepare_run_dir(run_dir)
    err_path = run_dir / ERR_NAME
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, *SAFE_PATH, "-m", "ckptd", "start", "--foreground", "--quiet", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise StartFailed(_start_error(err_path, code, run_dir), code if code in (2, 3) else 3)
        if probe(run_dir, timeout=0.5) and _pid_in(run_dir) == proc.pid:
            return proc.pid
        time.sleep(0.05)
    proc.terminate()
    raise CkptdError(f"daemon did not answer within {timeout:.0f} s; see {run_dir / LOG_NAME}")


def _start_error(err_path: Path, code: int, run_dir: Path) -> str:
    """What a daemon that exited at start said: its one-line error (``ckptd: ...``, the last such line of its
    stderr), never lines of a traceback joined into one; else where to look."""
    lines = [line for line in err_path.read_text(errors="replace").splitlines() if line.strip()]
    said = next((line.removeprefix("ckptd: ") for line in reversed(lines) if line.startswith("ckptd: ")), None)
    if said is not None:
        return said
    return (f"the daemon exited at start (code {code}) without saying why; see {run_dir / LOG_NAME} and "
            f"{err_path}")


def _pid_in(run_dir: Path) -> int | None:
    try:
        return int((run_dir / PID_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def wait_for_exit(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited (a zombie counts: its parent just has not reaped it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
