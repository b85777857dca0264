"""The storage seam on an object store (``s3://``): shards uploaded straight from the slot.

An object store has no directories, no rename and no fsync, so the seam's
operations mean this here (``ckptd/storage.py`` holds the contract):

- A checkpoint ``p`` is the prefix ``p/``; its ``p.incomplete`` is the same
  prefix (names ending in ``.incomplete`` map to the name without it), and
  ``can_rename`` is False: commit writes the index ``ckptd.json`` last and
  create-only, and that write is the publication. A prefix without an index
  is no checkpoint for any reader.
- ``open_new`` starts a multipart upload on its own thread; each ``pwrite``
  hands it the next bytes of the shard (parts go up in parallel), ``fsync``
  completes it, and ``close`` before ``fsync`` aborts it (so no part stays
  behind). A failed save then removes its prefix with ``remove_tree``.
- ``rename`` and ``exchange`` raise ``OSError(EXDEV)``: nothing on a store is
  renamed (a failed save is removed in place, retention deletes the index
  first, an existing checkpoint is never replaced).
- ``space`` reports no limit (the store enforces its own quotas).

``Routed`` puts it beside the local filesystem: a name spelled ``s3://...``
goes to the object store, everything else to the local storage.
"""

from __future__ import annotations

import errno
import itertools
import queue
import threading
from pathlib import Path
from typing import Iterator

from ckptd.protocol import objects
from ckptd.protocol.index import INCOMPLETE_SUFFIX, INDEX_NAME

from .storage import Entry, Kind, Space, Stat, Storage

OBJECT_FDS = 1 << 40
"""Upload handles count up from here, far above any file descriptor, so ``Routed`` tells them apart."""
QUEUED_CHUNKS = 4
"""Chunks handed to an upload and not yet taken by it (bounds the copy the daemon holds)."""
UNLIMITED = 1 << 62


def key_path(path: Path) -> Path:
    """The object name of ``path``: a ``.incomplete`` part names the same prefix as the checkpoint."""
    return Path(*(part[: -len(INCOMPLETE_SUFFIX)] if part.endswith(INCOMPLETE_SUFFIX) else part
                  for part in path.parts))


class _Abort(Exception):
    """Raised inside an upload's input so the library aborts its multipart upload."""


class _Upload:
    """One shard's multipart upload, fed chunk by chunk from the writer thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.chunks: queue.Queue[bytes | None | _Abort] = queue.Queue(QUEUED_CHUNKS)
        self.error: OSError | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name="ckptd-upload", daemon=True).start()

    def _input(self) -> Iterator[bytes]:
        while True:
            chunk = self.chunks.get()
            if chunk is None:
                return
            if isinstance(chunk, _Abort):
                raise chunk
            yield chunk

    def _run(self) -> None:
        try:
            objects.put(self.path, self._input())
        except _Abort:
            pass
        except OSError as exc:
            self.error = exc
        except Exception as exc:  # the library's own failure: still an OSError for the writer
            self.error = OSError(errno.EIO, str(exc), objects.object_url(self.path))
        finally:
            self.done.set()

    def send(self, item: bytes | None | _Abort) -> None:
        """Hand the upload its next item; raises its error if it failed (never blocks on a dead one)."""
        while not self.done.is_set():
            try:
                self.chunks.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        if self.error is not None:
            raise self.error
        raise OSError(errno.EIO, "the upload ended early", objects.object_url(self.path))


class ObjectStorage:
    """``Storage`` for ``s3://`` names (see the module docstring)."""

    def __init__(self) -> None:
        self._uploads: dict[int, _Upload] = {}
        self._fds = itertools.count(OBJECT_FDS)
        self._lock = threading.Lock()

    def can_rename(self, path: Path) -> bool:
        return False

    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]:
        upload = _Upload(key_path(path))
        with self._lock:
            fd = next(self._fds)
            self._uploads[fd] = upload
        return fd, False

    def reopen(self, path: Path) -> int:
        raise OSError(errno.ENOTSUP, "an object cannot be reopened", objects.object_url(path))

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self._uploads[fd].send(bytes(data))  # a copy: the slot's view is released when this returns
        return len(data)

    def truncate(self, fd: int, size: int) -> None:
        raise OSError(errno.ENOTSUP, "an object cannot be truncated")

    def fsync(self, fd: int) -> None:
        """Complete the upload: after this the object is whole on the store."""
        upload = self._uploads[fd]
        upload.send(None)
        upload.done.wait()
        if upload.error is not None:
            raise upload.error

    def close(self, fd: int) -> None:
        """Forget the upload; one not completed by ``fsync`` is aborted first."""
        with self._lock:
            upload = self._uploads.pop(fd)
        if not upload.done.is_set():
            try:
                upload.send(_Abort())
            except OSError:
                pass
            upload.done.wait()

    def write_file(self, path: Path, data: bytes) -> None:
        """One small object; the index is written create-only (the commit must not replace another)."""
        objects.put(key_path(path), data, create_only=path.name == INDEX_NAME)

    def read(self, path: Path, offset: int, size: int) -> bytes:
        return objects.read(key_path(path), offset, size)

    def mkdir(self, path: Path, *, parents: bool = False, exist_ok: bool = False) -> None:
        """Prefixes need no making; one that holds objects already exists."""
        if not exist_ok and self.stat(path) is not None:
            raise FileExistsError(errno.EEXIST, "already exists", objects.object_url(path))

    def touch(self, path: Path) -> None:
        objects.put(key_path(path), b"")

    def rename(self, src: Path, dst: Path) -> None:
        raise OSError(errno.EXDEV, "an object store has no rename", objects.object_url(src))

    def exchange(self, a: Path, b: Path) -> None:
        raise OSError(errno.EXDEV, "an object store has no rename", objects.object_url(a))

    def fsync_dir(self, path: Path) -> None:
        """Nothing to do: an object is durable when its upload completes."""

    def unlink(self, path: Path) -> None:
        objects.delete(key_path(path))

    def remove_tree(self, path: Path) -> None:
        try:
            objects.remove_prefix(key_path(path))
        except FileNotFoundError:
            pass

    def scandir(self, path: Path) -> list[Entry]:
        prefixes, found = objects.listing(key_path(path))
        entries = [Entry(name, path / name, Kind.DIR) for name in prefixes]
        return entries + [Entry(m["path"].rsplit("/", 1)[-1], path / m["path"].rsplit("/", 1)[-1], Kind.FILE)
                          for m in found]

    def stat(self, path: Path, *, follow: bool = False) -> Stat | None:
        """An object is a file; a prefix is a directory once it holds an index or a sub-prefix.

        A prefix holding only a save's shards and markers (no index yet) is
        there only under its ``.incomplete`` name: for ``p`` itself it is not
        there, so the ranks of one save do not find their own checkpoint in
        their way, and a reader does not find one.
        """
        name = key_path(path)
        if len(name.parts) > 2:  # a bucket alone is never an object
            meta = objects.head(name)
            if meta is not None:
                return Stat(Kind.FILE, meta["size"], meta["last_modified"].timestamp())
        prefixes, found = objects.listing(name)
        named = {m["path"].rsplit("/", 1)[-1] for m in found}
        if prefixes or (found and (path.name.endswith(INCOMPLETE_SUFFIX) or INDEX_NAME in named)):
            return Stat(Kind.DIR, 0, max((m["last_modified"].timestamp() for m in found), default=0.0))
        return None

    def resolve(self, path: Path) -> Path:
        return path

    def space(self, path: Path) -> Space:
        return Space(device=-1, free=UNLIMITED, total=UNLIMITED, kind="s3")


class Routed:
    """``s3://`` names to an ``ObjectStorage``, every other name to ``local`` (the daemon's storage)."""

    def __init__(self, local: Storage) -> None:
        self.local = local
        self.objects = ObjectStorage()

    def _by_path(self, path: Path) -> Storage:
        return self.objects if objects.is_object_path(path) else self.local

    def _by_fd(self, fd: int) -> Storage:
        return self.objects if fd >= OBJECT_FDS else self.local

    def can_rename(self, path: Path) -> bool:
        return self._by_path(path).can_rename(path)

    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]:
        return self._by_path(path).open_new(path, direct=direct)

    def reopen(self, path: Path) -> int:
        return self._by_path(path).reopen(path)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return self._by_fd(fd).pwrite(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        self._by_fd(fd).truncate(fd, size)

    def fsync(self, fd: int) -> None:
        self._by_fd(fd).fsync(fd)

    def close(self, fd: int) -> None:
        self._by_fd(fd).close(fd)

    def write_file(self, path: Path, data: bytes) -> None:
        self._by_path(path).write_file(path, data)

    def read(self, path: Path, offset: int, size: int) -> bytes:
        return self._by_path(path).read(path, offset, size)

    def mkdir(self, path: Path, *, parents: bool = False, exist_ok: bool = False) -> None:
        self._by_path(path).mkdir(path, parents=parents, exist_ok=exist_ok)

    def touch(self, path: Path) -> None:
        self._by_path(path).touch(path)

    def rename(self, src: Path, dst: Path) -> None:
        self._by_path(src).rename(src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        self._by_path(a).exchange(a, b)

    def fsync_dir(self, path: Path) -> None:
        self._by_path(path).fsync_dir(path)

    def unlink(self, path: Path) -> None:
        self._by_path(path).unlink(path)

    def remove_tree(self, path: Path) -> None:
        self._by_path(path).remove_tree(path)

    def scandir(self, path: Path) -> list[Entry]:
        return self._by_path(path).scandir(path)

    def stat(self, path: Path, *, follow: bool = False) -> Stat | None:
        return self._by_path(path).stat(path, follow=follow)

    def resolve(self, path: Path) -> Path:
        return self._by_path(path).resolve(path)

    def space(self, path: Path) -> Space:
        return self._by_path(path).space(path)
