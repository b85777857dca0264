"""The storage seam: checkpoint operations, and the file operations beneath them.

Commit, writer, retention, admission and the memory tier speak to storage
in checkpoint operations (``ckptd/storage/checkpoints.py``'s ``Checkpoints``:
resolve a path, admit a save, begin an attempt, open a shard writer, check
the shards, publish under the final name (replacing or not), discard, delete,
list). They never ask which backend they are on. Two implementations exist:
a local filesystem publishes by rename (``ckptd/storage/local.py``), an
object store by writing the index last (``ckptd/storage/store.py``);
``ckptd/storage/backends.py`` chooses one per checkpoint from its name.

Both rest on file operations by name (``Files``): the POSIX calls of the
local filesystem (``LocalStorage``, a ``Storage``: with the descriptors a
local shard is written through) and their object-store counterparts
(``ObjectStorage``). Ownership checks, listing and the sweep read through
them. Tests load a fault-injecting ``Storage`` that lives with them
(``tests/faults.py``) with ``ckptd start --storage module:Class``; its
faults act inside the checkpoint operations built on it. Production code
carries no test switch.

The file contract:

- Paths are ``pathlib.Path`` names in one namespace; ``p.incomplete`` and
  ``p`` are siblings. Nothing outside this seam opens, stats or lists them.
- ``open_new``/``pwrite``/``truncate``/``fsync``/``close`` write one file
  (a ``Storage`` only); after ``fsync`` returns, its bytes are durable. ``write_file`` writes a
  small file durably in one call (the index).
- ``rename(src, dst)`` makes a whole checkpoint visible at once, and
  ``exchange`` swaps two names at once; ``fsync_dir`` makes a name durable.
  A store has neither: it publishes by writing the index last (``write_file``
  of ``ckptd.json``, create-only), and its ``p.incomplete`` names the same
  prefix as ``p``; readers never see a name without a valid index as a
  checkpoint.
- ``remove_tree`` removes what is there and ignores what is not.
- ``scandir``/``stat`` describe entries without following links unless
  asked (``follow=True``); ``stat`` returns None for a missing name.
- ``space`` reports the free and total bytes where a path would go, and an
  identity for the device, so admission can sum what is promised per device.
- Every failure is an ``OSError`` with an ``errno``; callers turn it into a
  ckptd error that names the path.

The daemon's own run directory (socket, pid lock, log) is process plumbing
on the local machine, not checkpoint storage, and stays in ``daemon.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import stat as stat_mod
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol, runtime_checkable

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.names import OWNER_PREFIX
from ckptd.protocol.reading import CheckpointFiles, no_index_message

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
MOUNTINFO = Path("/proc/self/mountinfo")


class Kind(str, Enum):
    """What a name holds (links are reported as such, never followed unless asked)."""

    DIR = "dir"
    FILE = "file"
    LINK = "link"
    OTHER = "other"


@dataclass(frozen=True)
class Entry:
    """One name in a directory."""

    name: str
    path: Path
    kind: Kind


@dataclass(frozen=True)
class Stat:
    kind: Kind
    size: int
    mtime: float


UNLIMITED = 1 << 62
"""The free and total bytes a store reports (``Space``): it enforces its own quotas, and has no free space to show."""


@dataclass(frozen=True)
class Space:
    """Room where a path would be written (its nearest existing ancestor)."""

    device: int
    free: int
    total: int
    kind: str = ""
    """The filesystem's type, looked up only when it holds no storage (``proc``, ``sysfs``: for the message)."""
    bounded: bool = True
    """Whether ``free`` and ``total`` are a size to show: a store enforces its own quotas and reports
    ``UNLIMITED`` for both (status shows it as an object store, not as free bytes)."""


@runtime_checkable
class Files(CheckpointFiles, Protocol):
    """The file operations by name, on any backend (see the module docstring), and the reads of committed
    checkpoints every reader makes (``CheckpointFiles``: ``CheckpointReads`` builds them from these)."""

    def write_file(self, path: Path, data: bytes) -> None: ...
    def read(self, path: Path, offset: int, size: int) -> bytes: ...
    def mkdir(self, path: Path, *, parents: bool = False, exist_ok: bool = False) -> None: ...
    def touch(self, path: Path) -> None: ...
    def rename(self, src: Path, dst: Path) -> None: ...
    def exchange(self, a: Path, b: Path) -> None: ...
    def fsync_dir(self, path: Path) -> None: ...
    def unlink(self, path: Path) -> None: ...
    def remove_tree(self, path: Path) -> None: ...
    def scandir(self, path: Path) -> list[Entry]: ...
    def stat(self, path: Path, *, follow: bool = False) -> Stat | None: ...
    def resolve(self, path: Path) -> Path: ...
    def space(self, path: Path) -> Space: ...


@runtime_checkable
class Storage(Files, Protocol):
    """A filesystem's file operations, with the descriptors a local shard is written through
    (``--storage module:Class`` names one)."""

    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]: ...
    def reopen(self, path: Path) -> int: ...
    def pwrite(self, fd: int, data: memoryview, offset: int) -> int: ...
    def truncate(self, fd: int, size: int) -> None: ...
    def fsync(self, fd: int) -> None: ...
    def close(self, fd: int) -> None: ...


class PublishedNotDurable(OSError):
    """The checkpoint took its name, but making the name durable failed: it is visible and whole, and may not
    survive a power loss (the caller says so; it is never discarded)."""


class ShardWriter(Protocol):
    """One shard on its way to storage: ranges written in order, then made durable in one step."""

    aligned: bool
    """Whether writes must cover whole pages (O_DIRECT): the writer then writes the slot's page padding too,
    and ``finish`` cuts it off."""
    finishing: str
    """What ``finish`` waits for, as ``ckptd status`` names it: ``fsync`` (a file) or ``completing`` (an
    upload's last parts and the request that makes the object whole)."""

    def write(self, data: memoryview, offset: int) -> int:
        """Write ``data`` at ``offset``; returns how many bytes were taken."""
        ...

    def finish(self, size: int) -> None:
        """Cut the shard to ``size`` bytes and make it durable: after this it is whole on storage."""
        ...

    def close(self) -> None:
        """Let go of the shard; one not finished is abandoned (an upload is aborted, no part stays behind)."""
        ...


def _kind(mode: int) -> Kind:
    if stat_mod.S_ISDIR(mode):
        return Kind.DIR
    if stat_mod.S_ISREG(mode):
        return Kind.FILE
    if stat_mod.S_ISLNK(mode):
        return Kind.LINK
    return Kind.OTHER


class CheckpointReads:
    """``ckptd.protocol.reading.CheckpointFiles`` from a ``Files``' own ``scandir``, ``stat`` and ``read``: so
    commit, retention, the mirror, the sweep and ``ckptd list`` read checkpoints with the protocol's one reader
    stack (``read_index``, ``committed_in``, shard headers), exactly as a loader does, through whatever storage
    the daemon was started with (a fault-injecting one included).

    A failure to answer is no error here: what the daemon cannot read it skips (retention deletes nothing it
    could not judge).
    """

    unanswered_is_error = False

    def subdirs(self: Files, directory: Path) -> list[Path]:
        return [e.path for e in self.scandir(directory) if e.kind is Kind.DIR]

    def read_index_file(self: Files, path: Path, *, max_bytes: int) -> bytes:
        st = self.stat(path, follow=True)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if st.kind is not Kind.FILE or st.size > max_bytes:
            raise InvalidCheckpoint(f"{path} is not an index ckptd wrote")
        return self.read(path, 0, st.size)

    def no_index(self, checkpoint: Path) -> str:
        return no_index_message(checkpoint, True)  # the daemon reads only what it listed or found there

    def file_stat(self: Files, path: Path) -> tuple[bool, int]:
        st = self.stat(path, follow=True)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return st.kind is Kind.FILE, st.size


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


class LocalStorage(CheckpointReads):
    """Plain POSIX I/O on the local filesystem, with O_DIRECT where it is allowed."""

    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]:
        """Create ``path`` for writing; returns the fd and whether it is O_DIRECT."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        if direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: filesystem without O_DIRECT
                    raise
        return os.open(path, flags, 0o644), False

    def reopen(self, path: Path) -> int:
        """Open an existing file buffered (a write that O_DIRECT refused carries on here)."""
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def write_file(self, path: Path, data: bytes) -> None:
        """Write a small file and make it durable."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[self.pwrite(fd, view, len(data) - len(view)) :]
            self.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: Path, offset: int, size: int) -> bytes:
        """At most ``size`` bytes of the regular file ``path`` from ``offset``.

        O_NONBLOCK: a FIFO planted under a checkpoint's name must not block the daemon.
        """
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", str(path))
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def mkdir(self, path: Path, *, parents: bool = False, exist_ok: bool = False) -> None:
        if parents:
            os.makedirs(path, 0o755, exist_ok=exist_ok)
            return
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            if not (exist_ok and os.path.isdir(path)):
                raise

    def touch(self, path: Path) -> None:
        """Create an empty advisory file (no fsync: losing it loses nothing)."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``)."""
        if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(b))

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def remove_tree(self, path: Path) -> None:
        """Remove ``path`` and everything under it, its owner markers last: a removal cut short (a crash) leaves
        a directory its markers still name, which the start-up sweep removes. In ``shutil``'s order a marker
        often went first, and a crash then left shards no daemon claimed, for good."""
        try:
            with os.scandir(path) as it:
                entries = [(e.name.startswith(OWNER_PREFIX), e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except OSError:
            entries = []
        for marker, name, is_dir in sorted(entries):
            if marker:
                break
            try:
                if is_dir:
                    shutil.rmtree(path / name, ignore_errors=True)
                else:
                    self.unlink(path / name)
            except OSError:
                pass  # what is left goes with the tree below
        shutil.rmtree(path, ignore_errors=True)

    def scandir(self, path: Path) -> list[Entry]:
        with os.scandir(path) as it:
            return [Entry(e.name, Path(e.path), _kind(e.stat(follow_symlinks=False).st_mode)) for e in it]

    def stat(self, path: Path, *, follow: bool = False) -> Stat | None:
        try:
            st = os.stat(path, follow_symlinks=follow)
        except (FileNotFoundError, NotADirectoryError):  # no such name can exist there
            return None
        return Stat(_kind(st.st_mode), st.st_size, st.st_mtime)

    def resolve(self, path: Path) -> Path:
        return Path(os.path.realpath(path))

    def space(self, path: Path) -> Space:
        while not os.path.lexists(path) and path != path.parent:
            path = path.parent
        st = os.statvfs(path)
        kind = filesystem_type(path) if st.f_blocks == 0 else ""
        return Space(os.stat(path).st_dev, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, kind)


def filesystem_type(path: Path) -> str:
    """The type of the filesystem mounted at the deepest mount point above ``path`` (for messages)."""
    best, kind = "", "unknown"
    target = os.path.realpath(path)
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # space is \040
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, tail.split()[0]
    return kind
