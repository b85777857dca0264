"""Every name ckptd gives a file or directory: in a checkpoint, beside one, and in the run directory.

One module, so the code that makes a name and the code that recognises it
(the start-up sweep, ``ckptd list``, retention, the ownership checks) can
never disagree. Standard library only: the client, the daemon and the
readers all use it.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

# -- a checkpoint and the names beside it ---------------------------------------

INDEX_NAME = "ckptd.json"
"""The index, written last: a directory holding it is a committed checkpoint."""
INCOMPLETE_SUFFIX = ".incomplete"
"""A checkpoint being written (``p.incomplete``), never loaded; also every name below that ckptd removes."""
DISCARDED_INFIX = ".discarded-"
"""A failed attempt set aside for removal (``p.discarded-<id>.incomplete``), so a retry can reuse ``p`` at once."""
DELETING_INFIX = ".deleting"
"""A checkpoint retention is deleting (``p.deleting.incomplete``)."""
OWNER_PREFIX = ".ckptd-owner-"
"""Marker naming the host and daemon pid writing a directory (``.ckptd-owner-<host>-<pid>``)."""
SWEPT_DIR = ".ckptd-swept"
"""Where ``--sweep move`` puts orphaned ``.incomplete`` directories."""
_SHARD = re.compile(r"rank-(\d+)-of-(\d+)\.safetensors")


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(rank, world size) of a shard file name ``shard_name`` made, else None."""
    m = _SHARD.fullmatch(name)
    return (int(m[1]), int(m[2])) if m else None


def incomplete_path(path: Path) -> Path:
    return path.with_name(path.name + INCOMPLETE_SUFFIX)


def discarded_path(path: Path) -> Path:
    """A fresh name to set a failed attempt of ``path`` aside under."""
    return path.with_name(f"{path.name}{DISCARDED_INFIX}{uuid.uuid4().hex[:12]}{INCOMPLETE_SUFFIX}")


def deleting_path(path: Path) -> Path:
    return path.with_name(f"{path.name}{DELETING_INFIX}{INCOMPLETE_SUFFIX}")


def owner_marker_name(host: str, pid: int) -> str:
    return f"{OWNER_PREFIX}{host}-{pid}"


def parse_owner_marker(name: str) -> tuple[str, int | None] | None:
    """(host, pid) an owner marker names (pid None: unreadable); None if ``name`` is no marker."""
    if not name.startswith(OWNER_PREFIX):
        return None
    host, _, pid = name[len(OWNER_PREFIX):].rpartition("-")
    return host, int(pid) if pid.isdigit() else None


# -- the run directory ------------------------------------------------------------

SOCKET_NAME = "ckptd.sock"
PID_NAME = "ckptd.pid"
LOG_NAME = "ckptd.log"
ERR_NAME = "ckptd.err"
"""A detached daemon's stderr (what it printed before its log was open)."""
DRAIN_FAILED_NAME = "ckptd.drain-failed"
"""Written by a drain that could not persist every snapshot: ``ckptd stop`` reports it."""
KNOWN_DIRS_NAME = "ckptd.dirs"
"""The directories this daemon wrote checkpoints into, for the start-up sweep."""
SPAWN_LOCK_NAME = "spawn.lock"
"""Taken by the client that spawns the node's daemon (the first rank wins)."""
