"""Which shard files this process has already verified, so a second load of one checkpoint skips the checksum.

A shard is checked against its index once per process. What makes skipping
the check later safe is that the file is the very same, unchanged: same
device and inode (not a new file under the old name), same size, same
modification and inode-change times (any write through the kernel moves
both; ``ctime`` cannot be set back by a user), and the same recorded
checksum. A file changed behind the kernel's back (a bit flipped on the
medium) is not caught by a second load: ``ckptd verify`` and ``verify=True``
in a fresh process still read every byte.

File times have a coarse granularity (a kernel tick; a second on some
filesystems), so a write right after the check could leave them as they
were: a file changed less than ``SETTLED_S`` before it was opened is never
remembered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ckptd.protocol.index import ShardRecord
from ckptd.protocol.mapped import Identity

MAX_REMEMBERED = 4096
"""Files remembered; the oldest is forgotten first (and then simply checked again)."""

SETTLED_S = 2.0
"""A file last changed this recently when opened is checked every time."""

_verified: "OrderedDict[tuple, None]" = OrderedDict()
_lock = threading.Lock()


def _key(ident: Identity, record: ShardRecord, algorithm: str) -> tuple:
    return (*ident[:5], record.size, record.checksum, algorithm)


def is_verified(ident: Identity | None, record: ShardRecord, algorithm: str) -> bool:
    """Whether the file with ``ident`` matched ``record``'s checksum before; never for no identity (an object,
    checked on every read: ``protocol/shard_reads.py``)."""
    if ident is None:
        return False
    with _lock:
        return _key(ident, record, algorithm) in _verified


def remember(ident: Identity | None, record: ShardRecord, algorithm: str) -> None:
    """Record that the file with ``ident`` matched ``record``'s checksum (unless it had just changed, or has no
    identity to remember it by)."""
    if ident is None:
        return
    *_, mtime, ctime, seen = ident
    if seen - max(mtime, ctime) < SETTLED_S * 1e9:
        return
    with _lock:
        _verified[_key(ident, record, algorithm)] = None
        while len(_verified) > MAX_REMEMBERED:
            _verified.popitem(last=False)


def forget() -> None:
    """Forget every file verified so far: the next load of each checks it again (a fresh process's first load)."""
    with _lock:
        _verified.clear()
