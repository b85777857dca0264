"""Checkpoints on an object store (``s3://``): shards uploaded straight from the slot, published by the index.

An object store has no directories, no rename and no fsync, so the seam's
operations mean this here (``ckptd/storage/contract.py`` holds the contract):

- A checkpoint ``p`` is the prefix ``p/``; its ``p.incomplete`` is the same
  prefix (names ending in ``.incomplete`` map to the name without it).
  Publishing writes the index ``ckptd.json`` last and create-only, and that
  write is the publication. A prefix without an index is no checkpoint for
  any reader. Nothing is replaced atomically: the new shards would land on
  the old checkpoint's before its index could change. So a version is
  replaced in one way only (``ObjectCheckpoints.publish``): retired first
  (its index deleted), then overwritten, then published with the objects
  the new index does not name removed; a trainer's save never replaces
  one, the mirror (whose local original stays meanwhile) does.
- ``open_shard`` starts a multipart upload on its own thread; each ``write``
  hands it the next bytes of the shard (parts go up in parallel),
  ``finish`` completes it, and ``close`` before that aborts it (so no part
  stays behind). A failed save's prefix is removed in place; a deleted
  checkpoint loses its index first.
- ``space`` reports no limit (the store enforces its own quotas).

``ObjectStorage`` holds the file operations beneath (objects, prefixes,
ranged reads); ``ObjectCheckpoints`` the checkpoint operations on top.
"""

from __future__ import annotations

import errno
import queue
import threading
from pathlib import Path
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Iterator

from ckptd.protocol import objects
from ckptd.protocol.errors import CheckpointExists
from ckptd.protocol.index import INCOMPLETE_SUFFIX, INDEX_NAME, CheckpointIndex
from ckptd.protocol.objects import display

from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import UNLIMITED, CheckpointReads, Entry, Kind, Space, Stat

QUEUED_CHUNKS = 4
"""Chunks handed to an upload and not yet taken by it (bounds the copy the daemon holds)."""


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


class ObjectStorage(CheckpointReads):
    """The file operations of the seam for ``s3://`` names (see the module docstring); a shard is uploaded
    through ``ObjectCheckpoints.open_shard``, never opened."""

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
        return Space(device=-1, free=UNLIMITED, total=UNLIMITED, kind="s3", bounded=False)



class ShardUpload:
    """One shard's multipart upload (see ``_Upload``)."""

    aligned = False
    finishing = "completing"

    def __init__(self, path: Path) -> None:
        self._upload = _Upload(key_path(path))

    def write(self, data: memoryview, offset: int) -> int:
        self._upload.send(bytes(data))  # a copy: the slot's view is released when this returns
        return len(data)

    def finish(self, size: int) -> None:
        """Complete the upload: after this the object is whole on the store."""
        upload = self._upload
        upload.send(None)
        upload.done.wait()
        if upload.error is not None:
            raise upload.error

    def close(self) -> None:
        """An upload not completed is aborted first."""
        upload = self._upload
        if not upload.done.is_set():
            try:
                upload.send(_Abort())
            except OSError:
                pass
            upload.done.wait()


class ObjectCheckpoints(Checkpoints):
    """``Checkpoints`` where the index written last publishes (see the module docstring).

    Only ``open_shard`` needs a store; the rest goes through ``files`` (an
    ``ObjectStorage``, or any storage a test runs this protocol on). What is at
    a name is asked in ``begin``, after Accepted (two requests fewer in
    ``save_async``), and never replaced by a trainer's save.
    """

    _early = False

    def _replace_refusal(self, final: Path) -> str | None:
        return (f"{display(final)} already exists on the object store, where a save does not replace a checkpoint "
                f"(no atomic rename: a crash would leave neither version); save under another path, or delete it "
                f"first")

    def _guard(self, publishing: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
        return nullcontext()  # nothing is replaced in place here (and a store's requests may stall)

    def _listed_attempt(self, listed: Path) -> Path | None:
        """A prefix without an index is an attempt's: ``p.incomplete`` names ``p``'s prefix."""
        return listed.with_name(listed.name + INCOMPLETE_SUFFIX)

    def _outside_roots_hint(self, final: Path) -> str:
        if len(final.parts) < 3:  # s3://bucket: a bucket, no checkpoint name in it
            return "; a checkpoint on an object store is named s3://BUCKET/NAME (a bucket is no checkpoint)"
        return (f"; to save there, start the daemon with --root {display(final.parent)} (a daemon the client "
                f"spawns reads its roots from $CKPTD_ROOTS)")

    def open_shard(self, path: Path, *, direct: bool) -> ShardUpload:
        return ShardUpload(path)

    def publish(self, attempt: Path, final: Path, index: bytes, *, overwrite: bool,
                publishing: AbstractContextManager[Any]) -> None:
        """The index, written create-only, is the commit (no name changes hands: ``publishing`` is not needed).

        A store replaces nothing atomically, so it replaces in one way only: the old version is retired first
        (``set_aside``: its index goes, and it is gone for readers before any of its objects changes), the new
        shards are written over it, and this publish, with ``overwrite``, then removes the objects the new
        index does not name. A crash in between leaves no index, never a mix. A trainer's save does not
        replace on a store (``_replace_refusal``: that crash would leave neither version); the mirror does,
        since its local original stays until the new version is up.
        """
        try:
            self.files.write_file(attempt / INDEX_NAME, index)
        except FileExistsError:
            raise CheckpointExists(f"checkpoint {display(final)} appeared while this one was written") from None
        if overwrite:
            named = {record.file for record in CheckpointIndex.from_json(index, display(final)).files}
            for entry in self.files.scandir(attempt):  # an older version's (or an interrupted upload's) objects
                if entry.kind is Kind.FILE and entry.name not in named | {INDEX_NAME}:
                    self.files.unlink(entry.path)

    def discard(self, attempt: Path, final: Path) -> Path | None:
        """Nothing can be renamed away: the attempt's prefix is removed in place, before any retry."""
        self._remove_attempt(attempt)
        return None

    def _remove_attempt(self, attempt: Path) -> None:
        """Remove an attempt's prefix, unless it holds an index: ``p.incomplete`` is ``p``'s own prefix, so with
        an index there it is a committed checkpoint (this save was refused by it, or another run committed it
        after this attempt began), and it stays whole. A dead attempt's markers left in it harm no reader."""
        if self.files.stat(attempt / INDEX_NAME) is not None:
            return
        self.files.remove_tree(attempt)

    def set_aside(self, checkpoint: Path, *, marker: str | None) -> Path | None:
        """Delete the index first: without it the checkpoint is gone for readers."""
        files = self.files
        if files.stat(checkpoint / INDEX_NAME) is None:
            return None
        if marker is not None:  # first: a crash after the index went leaves shards the start-up sweep removes
            files.touch(checkpoint / marker)
        files.unlink(checkpoint / INDEX_NAME)
        return checkpoint

    def sweep(self, attempt: Path, *, move_to: Path | None) -> None:
        self._remove_attempt(attempt)  # nothing can be moved on a store
