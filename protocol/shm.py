"""Where staging slots live: the node's shared-memory directory.

Client (creating slots), daemon (mapping, reclaiming, admitting) and
``ckptd status`` all ask this module, so ``CKPTD_SHM_DIR`` means the same
thing everywhere. Containers matter here: Docker gives ``/dev/shm`` 64 MiB
unless told otherwise, and Kubernetes pods often no more, so running out of
it gets an error that says how much is needed, how much there is, and how
to get more.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

SLOT_PREFIX = "ckptd-"
SLOT_NAME = re.compile(r"ckptd-(\d+)-(\d+)-(\d+)")
"""A slot's name: ``ckptd-<uid>-<pid>-<n>``, the uid and pid of the client that owns it."""
SHM_DIR_ENV = "CKPTD_SHM_DIR"
DEFAULT_SHM_DIR = Path("/dev/shm")


def shm_dir() -> Path:
    """``$CKPTD_SHM_DIR`` if set, else ``/dev/shm``."""
    explicit = os.environ.get(SHM_DIR_ENV)
    return Path(explicit) if explicit else DEFAULT_SHM_DIR


def slot_name(uid: int, pid: int, n: int) -> str:
    return f"{SLOT_PREFIX}{uid}-{pid}-{n}"


def slot_owner(name: str) -> tuple[int, int] | None:
    """``(uid, pid)`` encoded in a slot name, or None if it is not a slot name."""
    m = SLOT_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def shm_usage(directory: Path | None = None) -> dict[str, object]:
    """``dir``, ``total_bytes`` and ``free_bytes`` of the shared-memory directory (None when unreadable)."""
    directory = directory if directory is not None else shm_dir()
    try:
        usage = shutil.disk_usage(directory)
        return {"dir": str(directory), "total_bytes": usage.total, "free_bytes": usage.free}
    except OSError:
        return {"dir": str(directory), "total_bytes": None, "free_bytes": None}


def shm_shortage_message(needed: int, directory: Path, reason: str) -> str:
    """Why a slot of ``needed`` bytes did not fit in ``directory``, and how to make room."""
    usage = shm_usage(directory)
    free, total = usage["free_bytes"], usage["total_bytes"]
    there = (f"only {_amount(free)} are free of {_amount(total)}" if free is not None
             else "its free space cannot be read")
    return f"this save needs {_amount(needed)} of shared memory in {directory}, but {there} ({reason}). {SHM_REMEDIES}"


SHM_REMEDIES = (
    "Give the node or container more shared memory: `docker run --shm-size=<size>` "
    "(Docker's default is 64 MiB), in Kubernetes a memory-backed emptyDir (medium: Memory) mounted at "
    f"/dev/shm, or point {SHM_DIR_ENV} at a larger tmpfs for both the trainer and the daemon."
)
"""How to get more shared memory (the client's and the daemon's shortage messages both end with it)."""


def _amount(n: object) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)" if isinstance(n, int) else "?"
