"""The daemon's reads of checkpoints: the protocol's one reader stack, over the storage seam.

The client and the CLI read checkpoints with ``ckptd.protocol`` (``index``,
``inspect``) straight from local files and objects; the daemon reads them
with the same functions through its ``Storage`` (``SeamFiles``), so commit,
retention, the mirror, the sweep and ``ckptd list`` parse and judge
checkpoints exactly as a loader does, on any storage the daemon was started
with.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.reading import no_index_message

from ckptd.storage.contract import Files, Kind


class SeamFiles:
    """``ckptd.protocol.reading.CheckpointFiles`` through the daemon's storage seam.

    A failure to answer is no error here: what the daemon cannot read it skips (retention deletes nothing it could not judge).
    """

    unanswered_is_error = False

    def __init__(self, storage: Files) -> None:
        self.storage = storage

    def subdirs(self, directory: Path) -> list[Path]:
        return [e.path for e in self.storage.scandir(directory) if e.kind is Kind.DIR]

    def read_index_file(self, path: Path, *, max_bytes: int) -> bytes:
        st = self.storage.stat(path, follow=True)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if st.kind is not Kind.FILE or st.size > max_bytes:
            raise InvalidCheckpoint(f"{path} is not an index ckptd wrote")
        return self.storage.read(path, 0, st.size)

    def no_index(self, checkpoint: Path) -> str:
        return no_index_message(checkpoint, True)  # the daemon reads only what it listed or found there

    def file_stat(self, path: Path) -> tuple[bool, int]:
        st = self.storage.stat(path, follow=True)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return st.kind is Kind.FILE, st.size

    def read(self, path: Path, offset: int, size: int) -> bytes:
        return self.storage.read(path, offset, size)


def tree_bytes(storage: Files, path: Path) -> int:
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
