"""Where a reader finds a committed checkpoint's files: the read side of the storage seam.

Every reader of committed checkpoints (``read_index``, ``committed_in``,
``latest``, ``missing_or_truncated``, shard headers) asks a
``CheckpointFiles``; loads and ``ckptd export`` open each shard they read
as a ``ShardReader`` (``reader``): a local file mapped and read by
``preadv`` (``protocol/mapped.py``), or an object read by ranged GETs
(``protocol/ranged.py``), the same calls either way. The client and the CLI read local files
(``LocalFiles``) and objects (``ObjectFiles``) directly, ``files_for``
picking by name; the daemon reads through its storage seam
(``ckptd/storage/contract.py``' ``CheckpointReads``), so its reads run the same code, through whatever
storage it was started with (a fault-injecting one included).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from . import objects
from .files import open_regular, read_regular
from .mapped import MappedShard
from .names import INDEX_NAME
from .ranged import ObjectShard
from .shard_reads import ShardReader

if TYPE_CHECKING:  # a type only: the index module reads through this one
    from .index import ShardRecord


class CheckpointFiles(Protocol):
    """What a reader of committed checkpoints asks of the place they are in."""

    unanswered_is_error: bool
    """Whether a failure to answer must not read as "absent": on a store, a typo, no credentials or an outage
    must not read as "no checkpoint" (nor skip the newest one). Where False, what cannot be read is skipped."""

    def subdirs(self, directory: Path) -> list[Path]:
        """The directories (never links) directly under ``directory``; ``OSError`` if it cannot be listed."""
        ...

    def read_index_file(self, path: Path, *, max_bytes: int) -> bytes:
        """The whole index file ``path``; ``FileNotFoundError`` when there is none, ``InvalidCheckpoint`` when
        what is there is no index ckptd wrote."""
        ...

    def no_index(self, checkpoint: Path) -> str:
        """Why ``checkpoint`` is none when its index is missing (a message)."""
        ...

    def file_stat(self, path: Path) -> tuple[bool, int]:
        """(a regular file?, size), links followed; ``FileNotFoundError`` when it is missing."""
        ...

    def read(self, path: Path, offset: int, size: int) -> bytes:
        """At most ``size`` bytes of the shard file ``path`` from ``offset``; ``FileNotFoundError`` if missing."""
        ...


def no_index_message(checkpoint: Path, is_dir: bool) -> str:
    """Why ``checkpoint`` is none when its index is missing, as every reader says it."""
    if is_dir:
        return f"{objects.display(checkpoint)} has no {INDEX_NAME}: it is not a committed ckptd checkpoint"
    return f"no checkpoint at {objects.display(checkpoint)}"


class LocalFiles:
    """Local files, opened as regular files only (``protocol/files.py``)."""

    unanswered_is_error = False
    fetched = False
    """A shard read whole stays a mapping of its file: a reader wanting tensors of its own reads them out of it."""

    def subdirs(self, directory: Path) -> list[Path]:
        return [Path(e.path) for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]

    def holds_checkpoints(self, directory: Path) -> bool:
        """Whether checkpoints can be listed in ``directory``: it exists (``ckptd list``)."""
        return directory.is_dir()

    def surely_absent(self, path: Path) -> bool:
        """Whether nothing is at ``path``, not even a dangling link (asking costs nothing here)."""
        return not os.path.lexists(path)

    def unlink_link(self, path: Path) -> bool:
        """Remove ``path`` if it is a symbolic link (never its target); whether it was one. A ``save_last="link"``
        link of Lightning's is replaced or deleted this way, never followed into the checkpoint it names."""
        if not os.path.islink(path):
            return False
        with contextlib.suppress(FileNotFoundError):  # another rank removed it first
            os.unlink(path)
        return True

    def make_parent(self, path: Path) -> None:
        """Create ``path``'s parent directories (what a framework saving to a file expects of its storage)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def read_index_file(self, path: Path, *, max_bytes: int) -> bytes:
        return read_regular(path, "index", max_bytes=max_bytes)

    def no_index(self, checkpoint: Path) -> str:
        return no_index_message(checkpoint, checkpoint.is_dir())

    def file_stat(self, path: Path) -> tuple[bool, int]:
        st = os.stat(path)
        return stat.S_ISREG(st.st_mode), st.st_size

    def read(self, path: Path, offset: int, size: int) -> bytes:
        with open_regular(path, "shard") as f:
            return os.pread(f.fileno(), size, offset)

    def open(self, path: Path) -> BinaryIO:
        """A shard opened for reading whole (verify's checksum)."""
        return open_regular(path, "shard")

    def size(self, f: BinaryIO) -> int:
        return os.fstat(f.fileno()).st_size

    def reader(self, path: Path, record: "ShardRecord", algorithm: str) -> ShardReader:
        """The shard file ``path`` mapped copy-on-write, checked to be a regular file of the index's size."""
        return MappedShard(path, record, algorithm)


class ObjectFiles:
    """Objects on a store (``s3://``): a checkpoint is a prefix, its files are objects."""

    unanswered_is_error = True
    fetched = True
    """A shard read whole is fetched into this process's own memory, which tensors may then view."""

    def subdirs(self, directory: Path) -> list[Path]:
        return [Path(directory) / name for name in objects.listing(directory)[0]]  # a store has no links

    def holds_checkpoints(self, directory: Path) -> bool:
        """A prefix always can: listing it says what is there."""
        return True

    def surely_absent(self, path: Path) -> bool:
        """Never said without a request: the load that follows asks the store, and says what is missing."""
        return False

    def unlink_link(self, path: Path) -> bool:
        """A store has no links."""
        return False

    def make_parent(self, path: Path) -> None:
        """A prefix needs no creating."""

    def read_index_file(self, path: Path, *, max_bytes: int) -> bytes:
        return objects.read_all(path)

    def no_index(self, checkpoint: Path) -> str:
        return f"no checkpoint at {objects.display(checkpoint)} (no {INDEX_NAME} there)"

    def file_stat(self, path: Path) -> tuple[bool, int]:
        meta = objects.head(path)
        if meta is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", objects.display(path))
        return True, meta["size"]

    def read(self, path: Path, offset: int, size: int) -> bytes:
        return objects.read(path, offset, size)

    def open(self, path: Path) -> BinaryIO:
        """A shard read whole by ranged requests (verify's checksum)."""
        return objects.open_object(path)  # type: ignore[return-value]

    def size(self, f: BinaryIO) -> int:
        return f.size  # type: ignore[attr-defined]

    def reader(self, path: Path, record: "ShardRecord", algorithm: str) -> ShardReader:
        """The shard object ``path``, checked to be of the index's size; nothing of it fetched yet."""
        return ObjectShard(path, record, algorithm)


LOCAL_FILES = LocalFiles()
OBJECT_FILES = ObjectFiles()


def files_for(path: Path | str) -> LocalFiles | ObjectFiles:
    """The files a reader outside the daemon reads ``path`` through."""
    return OBJECT_FILES if objects.is_object_path(path) else LOCAL_FILES


def shard_reader(path: Path, record: "ShardRecord", algorithm: str) -> ShardReader:
    """The shard ``path`` opened for reading, local file or object (``files_for``); nothing read yet."""
    return files_for(path).reader(path, record, algorithm)
