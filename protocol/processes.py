"""Whether a process still runs: the one liveness check every part of ckptd uses.

A process killed with SIGKILL stays in the process table as a zombie until
its parent reaps it, and ``kill(pid, 0)`` still succeeds on it. Launchers
reap slowly (and a container without an init may never reap an orphan), so
a dead rank would look alive for seconds or for good: a restarted job's
ranks could join the dead run's checkpoint, a frozen-looking daemon would
not be reported gone. So a zombie counts as dead here.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # gone meanwhile (the next check sees it), or no /proc: kill() said it exists
        return False
    # the state follows the command name, which is in parentheses and may itself hold ") "
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"Z"
