"""Reading checkpoints through the storage seam: indexes, shard headers, what a directory holds.

The client reads checkpoints with ``ckptd.protocol`` straight from local
files; the daemon reads them only through its ``Storage`` (so commit,
retention, the sweep and ``ckptd list`` work the same on any
implementation). The parsing itself is the protocol's, in one place.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ckptd.protocol.errors import BadMessage, InvalidCheckpoint
from ckptd.protocol.index import INCOMPLETE_SUFFIX, INDEX_NAME, MAX_INDEX_BYTES, CheckpointIndex
from ckptd.protocol.index import missing_or_truncated as shard_problem
from ckptd.protocol.layout import HEADER_GUESS, MAX_HEADER_BYTES, TensorEntry, parse_header

from .storage import Kind, Storage

def read_index(storage: Storage, path: Path) -> CheckpointIndex:
    """The index of the committed checkpoint at ``path``, or ``InvalidCheckpoint``."""
    if path.name.endswith(INCOMPLETE_SUFFIX):
        raise InvalidCheckpoint(f"{path} is an unfinished checkpoint (.incomplete) and is never loaded")
    index_file = path / INDEX_NAME
    try:
        st = storage.stat(index_file, follow=True)
        if st is None:
            raise InvalidCheckpoint(f"{path} has no {INDEX_NAME}: it is not a committed ckptd checkpoint")
        if st.kind is not Kind.FILE or st.size > MAX_INDEX_BYTES:
            raise InvalidCheckpoint(f"{index_file} is not an index ckptd wrote")
        data = storage.read(index_file, 0, st.size)
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read {index_file}: {exc.strerror or exc}") from None
    return CheckpointIndex.from_json(data, str(index_file))


def committed_in(storage: Storage, directory: Path) -> list[tuple[tuple[int, float], Path]]:
    """Committed checkpoints directly under ``directory``, oldest first, keyed by (step, created).

    The same order as ``ckptd.protocol.index.committed_in`` (what ``latest()`` uses).
    """
    try:
        entries = storage.scandir(directory)
    except OSError:
        return []
    found = []
    for entry in entries:
        if entry.name.endswith(INCOMPLETE_SUFFIX) or entry.kind is not Kind.DIR:
            continue
        try:
            index = read_index(storage, entry.path)
        except InvalidCheckpoint:
            continue
        found.append(((index.step if index.step is not None else -1, index.created), entry.path))
    return sorted(found)


def missing_or_truncated(storage: Storage, path: Path, index: CheckpointIndex) -> str | None:
    """What is wrong with the shard files of ``path`` at a glance (one stat per shard), or None."""

    def file_stat(shard: Path) -> tuple[bool, int]:
        st = storage.stat(shard, follow=True)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(shard))
        return st.kind is Kind.FILE, st.size

    return shard_problem(path, index, file_stat)


def read_shard_header(storage: Storage, path: Path, size: int) -> tuple[list[TensorEntry], dict[str, str], int]:
    """Parse a shard's header; ``InvalidCheckpoint`` naming the file if it is wrong."""
    try:
        prefix = storage.read(path, 0, min(size, HEADER_GUESS))  # one read (an object store's request) for most
        if len(prefix) >= 8:
            want = 8 + min(int.from_bytes(prefix[:8], "little"), MAX_HEADER_BYTES, max(size - 8, 0))
            if want > len(prefix):
                prefix += storage.read(path, len(prefix), want - len(prefix))
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read shard {path}: {exc.strerror or exc}") from None
    try:
        return parse_header(prefix, size)
    except BadMessage as exc:
        raise InvalidCheckpoint(f"shard {path} has a bad header: {exc.message}") from None


def tree_bytes(storage: Storage, path: Path) -> int:
    """Bytes held by the files under ``path`` (what a leftover costs on disk)."""
    total = 0
    try:
        entries = storage.scandir(path)
    except OSError:
        return 0
    for entry in entries:
        if entry.kind is Kind.DIR:
            total += tree_bytes(storage, entry.path)
        else:
            st = storage.stat(entry.path)
            total += st.size if st is not None else 0
    return total
