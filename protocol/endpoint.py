"""Where a node's daemon lives: its run directory and socket address.

Client, CLI and daemon all find each other through this module, so
``CKPTD_RUN_DIR`` and ``CKPTD_ENDPOINT`` mean the same thing everywhere.
The run directory is private (mode 0700): the socket inside it is then
reachable only by the user who owns it, which is the whole trust model for
who may ask the daemon to write.
"""

from __future__ import annotations

import os
from pathlib import Path

from .names import LOG_NAME, PID_NAME, SOCKET_NAME, SPAWN_LOCK_NAME  # noqa: F401 (also named from here)
from .processes import pid_alive

MAX_IPC_PATH = 107
"""sun_path holds 108 bytes including the terminating NUL."""


def default_run_dir() -> Path:
    """``$CKPTD_RUN_DIR``, else ``$XDG_RUNTIME_DIR/ckptd``, else ``/tmp/ckptd-<uid>``."""
    explicit = os.environ.get("CKPTD_RUN_DIR")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "ckptd"
    return Path(f"/tmp/ckptd-{os.getuid()}")


def endpoint_for(run_dir: Path | str | None = None) -> str:
    """The ZeroMQ address of the daemon for ``run_dir`` (``$CKPTD_ENDPOINT`` wins)."""
    explicit = os.environ.get("CKPTD_ENDPOINT")
    if explicit and run_dir is None:
        return explicit
    sock = Path(run_dir if run_dir is not None else default_run_dir()) / SOCKET_NAME
    if len(str(sock)) > MAX_IPC_PATH:
        raise ValueError(
            f"socket path {sock} is {len(str(sock))} bytes; Unix sockets allow {MAX_IPC_PATH}. "
            "Choose a shorter run directory (--run-dir or CKPTD_RUN_DIR)."
        )
    return f"ipc://{sock}"


def no_daemon_at(endpoint: str) -> str | None:
    """Why no daemon can answer at ``endpoint`` (no socket, or a dead daemon's), or None if one may.

    Lets a caller say "not running" at once instead of waiting out a timeout.
    Only ``ipc://`` endpoints can be told apart this way.
    """
    if not endpoint.startswith("ipc://"):
        return None
    sock = Path(endpoint[len("ipc://") :])
    if not sock.exists():
        return f"no socket at {sock}"
    return leftover_socket(sock)


def running_daemon_pid(endpoint: str) -> int | None:
    """The pid of the live daemon that owns ``endpoint``'s socket, or None (none, or not an ``ipc://`` endpoint).

    Tells a daemon that is alive but does not answer (stopped, or starved on
    a loaded node) from one that is gone, so the error can say which.
    """
    if not endpoint.startswith("ipc://") or no_daemon_at(endpoint) is not None:
        return None
    try:
        text = (Path(endpoint[len("ipc://") :]).parent / PID_NAME).read_text().strip()
    except OSError:  # it exited just now
        return None
    return int(text) if text.isdigit() else None


def leftover_socket(sock: Path) -> str | None:
    """Why the daemon socket ``sock`` is a dead daemon's leftover, or None if a daemon may own it.

    A daemon killed outright leaves its socket behind; connecting to it then
    waits for an answer that never comes. The daemon writes its pid beside the
    socket before binding it and removes both on exit, so a missing pid file
    or a pid that no longer runs means nobody is listening.
    """
    pid_file = sock.parent / PID_NAME
    try:
        text = pid_file.read_text().strip()
    except FileNotFoundError:
        return f"{sock} is left over from a daemon that exited (no {pid_file})"
    except OSError:
        return None
    if not text.isdigit():  # a daemon starting up is writing it
        return None
    if not pid_alive(int(text)):
        return f"its pid {text} (from {pid_file}) has exited and left {sock} behind"
    return None
