"""Checkpoints on a local filesystem: published by rename, replaced by RENAME_EXCHANGE.

A checkpoint in progress is the directory ``p.incomplete/``; publishing
writes the index, fsyncs the directory, renames it to ``p`` (or swaps it
with the ``p`` it replaces in one ``renameat2(RENAME_EXCHANGE)``, so a crash
leaves either the old or the new checkpoint under the name, never neither)
and fsyncs the parent. Removing anything starts with a rename to a name of
its own, so readers see it vanish at once and a retry never finds it in its
way. Every call goes through the file operations of a ``Storage``, so a
fault-injecting one (``tests/faults.py``) acts inside them.
"""

from __future__ import annotations

import errno
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ckptd.protocol.errors import CheckpointExists, PathNotAllowed
from ckptd.protocol.names import INDEX_NAME, deleting_path, discarded_path

from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import Kind, PublishedNotDurable, Storage
from ckptd.storage.ownership import check_replaceable, owner_marker, remove_markers


class LocalShard:
    """One shard file, written with ``pwrite`` (O_DIRECT where the filesystem takes it) and fsync'd."""

    finishing = "fsync"

    def __init__(self, files: Storage, path: Path, *, direct: bool) -> None:
        self._files, self._path = files, path
        self._fd, self.aligned = files.open_new(path, direct=direct)
        self._end = 0

    def write(self, data: memoryview, offset: int) -> int:
        try:
            n = self._files.pwrite(self._fd, data, offset)
        except OSError as exc:
            if not (self.aligned and exc.errno == errno.EINVAL):
                raise
            # The filesystem took O_DIRECT at open but refuses the write: carry on buffered from the same offset.
            fd, self._fd = self._fd, -1
            self._files.close(fd)
            self._fd, self.aligned = self._files.reopen(self._path), False
            n = self._files.pwrite(self._fd, data, offset)
        self._end = max(self._end, offset + n)
        return n

    def finish(self, size: int) -> None:
        if self._end != size:  # O_DIRECT wrote whole pages: the padding past the shard goes
            self._files.truncate(self._fd, size)
        self._files.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            self._files.close(fd)


class LocalCheckpoints(Checkpoints):
    """``Checkpoints`` on a filesystem with rename (see the module docstring)."""

    files: Storage

    def _blocked(self, path: Path) -> Path | None:
        ancestor = path
        while (st := self.files.stat(ancestor, follow=True)) is None and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        return ancestor if st is not None and st.kind is not Kind.DIR else None

    def _refuse_link(self, final: Path) -> None:
        st = self.files.stat(final)
        if st is not None and st.kind is Kind.LINK:
            raise PathNotAllowed(f"checkpoint path {final} is a symbolic link")

    def open_shard(self, path: Path, *, direct: bool) -> LocalShard:
        return LocalShard(self.files, path, direct=direct)

    def publish(self, attempt: Path, final: Path, index: bytes, *, overwrite: bool,
                publishing: AbstractContextManager[Any]) -> None:
        """Index, rename (or exchange with the checkpoint it replaces), fsync the parent.

        Only a committed checkpoint holding nothing but ckptd's files is ever
        replaced (checked here, under ``publishing``: the path may have
        changed since admission). The old one is marked as ours before the
        swap: after it, it sits at ``attempt``, and if the daemon dies there
        the start-up sweep removes it.
        """
        files = self.files
        files.write_file(attempt / INDEX_NAME, index)
        files.fsync_dir(attempt)
        with publishing:
            replacing = files.stat(final) is not None
            if replacing:
                if not overwrite:
                    raise CheckpointExists(f"checkpoint {final} appeared while this one was written")
                check_replaceable(files, final)
                files.touch(final / owner_marker())
                files.exchange(attempt, final)  # the old checkpoint is now at attempt
            else:
                files.rename(attempt, final)
        try:
            files.fsync_dir(final.parent)
        except OSError as exc:
            raise PublishedNotDurable(exc.errno, exc.strerror or str(exc)) from None
        if replacing:
            files.remove_tree(attempt)

    def discard(self, attempt: Path, final: Path) -> Path | None:
        """Rename the attempt to a name of its own; if the rename fails, remove it in place, before any retry."""
        aside = discarded_path(final)
        try:
            self.files.rename(attempt, aside)
        except FileNotFoundError:
            return None
        except OSError:
            self.files.remove_tree(attempt)
            return None
        return aside

    def set_aside(self, checkpoint: Path, *, marker: str | None) -> Path | None:
        """Rename to ``deleting_path`` (clearing a leftover of an interrupted removal first).

        On an ``OSError`` before the rename, the marker is taken back and the error raised.
        """
        files, doomed = self.files, deleting_path(checkpoint)
        if files.stat(doomed) is not None:
            files.remove_tree(doomed)
        try:
            if marker is not None:
                files.touch(checkpoint / marker)
            files.rename(checkpoint, doomed)
        except FileNotFoundError:
            return None
        except OSError:
            if marker is not None:
                remove_markers(files, checkpoint)
            raise
        return doomed

    def sweep(self, attempt: Path, *, move_to: Path | None) -> None:
        if move_to is None:
            self.files.remove_tree(attempt)
            return
        self.files.mkdir(move_to, exist_ok=True)
        self.files.rename(attempt, move_to / f"{attempt.name}-{int(time.time())}")

