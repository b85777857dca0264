"""Finding this node's daemon, and starting one when none runs.

Every rank on a node may call ``Client()`` at the same moment. A file lock
in the run directory decides: the first rank to hold it starts the daemon
(``python -m ckptd start``, which detaches into its own session and so
outlives a crashed trainer long enough to finish what was staged), the
others wait on the lock and then find the daemon running. A spawned daemon
exits by itself once it has had no clients and no work for a while.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path

from ckptd.protocol.endpoint import LOG_NAME, SOCKET_NAME, SPAWN_LOCK_NAME, running_daemon_pid
from ckptd.protocol.errors import DaemonUnavailable
from ckptd.protocol.request import answers

SPAWNED_IDLE_EXIT_S = 120.0
SPAWN_START_S = 30.0
"""The least time a spawned daemon gets to come up: starting Python on a loaded node takes seconds,
so a client's short silence ``timeout`` (meant for a daemon that stops answering) must not cut it short."""


def ensure_daemon(run_dir: Path, endpoint: str, *, spawn: bool, timeout: float = 30.0) -> None:
    """Return once a daemon answers on ``endpoint``, spawning one if allowed (waiting up to
    ``max(timeout, SPAWN_START_S)`` for it to start)."""
    # A running daemon gets the client's own silence timeout to answer (a loaded node can take
    # seconds); an absent one is told at once by its missing socket or dead pid (``no_daemon_at``).
    if answers(endpoint, timeout=timeout):
        return
    if not spawn:
        pid = running_daemon_pid(endpoint)
        if pid is not None:  # alive but silent: starting one would not help, waiting may
            raise DaemonUnavailable(
                f"the ckptd daemon at {endpoint} (pid {pid}) is running but did not answer within {timeout:g} s: "
                f"it is stopped or starved of CPU; see {run_dir / LOG_NAME}, and retry once it answers"
            )
        raise DaemonUnavailable(
            f"no ckptd daemon answers at {endpoint}; start one with `ckptd start --run-dir {run_dir}` "
            "or create the client with spawn=True"
        )
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(run_dir / SPAWN_LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks wait here while one spawns
        if answers(endpoint, timeout=timeout):
            return
        cmd = [sys.executable, "-m", "ckptd", "start", "--run-dir", str(run_dir),
               "--exit-when-idle", str(SPAWNED_IDLE_EXIT_S)]
        timeout = max(timeout, SPAWN_START_S)
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DaemonUnavailable(
                f"started a ckptd daemon on {run_dir}, but it did not finish starting within {timeout:.0f} s; "
                f"see {run_dir / LOG_NAME}, or start one yourself with `ckptd start --run-dir {run_dir}`"
            ) from None
        # Another start may have won the run directory meanwhile (a supervisor restarting the daemon this client
        # lost): that daemon is the one to reach, and it is waited for below like one spawned here.
        if proc.returncode != 0 and running_daemon_pid(endpoint) is None:
            raise DaemonUnavailable(f"could not start a ckptd daemon on {run_dir}: {proc.stderr.strip()}")
    deadline = time.monotonic() + timeout
    while not answers(endpoint, timeout=1.0):
        if time.monotonic() > deadline:
            raise DaemonUnavailable(f"a ckptd daemon was started but nothing answers at {endpoint} "
                                    f"({run_dir / SOCKET_NAME}); see {run_dir / LOG_NAME}")
