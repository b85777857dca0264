"""Keeping only the newest K checkpoints in a directory, safely.

Runs on the daemon that committed, after the commit, off the socket thread.
A directory is only ever deleted if it is a committed ckptd checkpoint (its
index reads back), it is not the newest, and no save is writing it. A
victim is first renamed to a ``.incomplete`` name, so readers see it vanish
at once, and only then removed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ckptd.protocol.index import INCOMPLETE_SUFFIX, committed_in

from .storage import Storage

log = logging.getLogger("ckptd")


def apply_retention(storage: Storage, newest: Path, keep_last: int, in_flight: set[Path]) -> list[Path]:
    """Delete committed checkpoints beside ``newest`` beyond the newest ``keep_last``.

    ``newest`` (the checkpoint just committed) is never deleted, whatever its
    step; neither is anything in ``in_flight``. Returns what was deleted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    others = [path for _, path in committed_in(newest.parent) if path != newest]
    victims = [p for p in others[: max(0, len(others) - (keep_last - 1))] if p not in in_flight]
    deleted = []
    for victim in victims:
        doomed = victim.with_name(f"{victim.name}.deleting{INCOMPLETE_SUFFIX}")
        try:
            storage.rename(victim, doomed)
        except OSError as exc:
            log.warning("event=retention_skip path=%s error=%s", victim, exc.strerror)
            continue
        storage.remove_tree(doomed)
        deleted.append(victim)
        log.info("event=retention_deleted path=%s", victim)
    return deleted
