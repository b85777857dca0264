"""The storage seam: every filesystem call the daemon makes on checkpoints.

Commit, writer, retention, sweep, ownership checks, admission and listing
never call ``os`` or ``shutil`` for files; they call a ``Storage``. This
module holds the contract (``Storage``) and its one production
implementation, the local filesystem (``LocalStorage``). Tests load a
fault-injecting implementation that lives with them (``tests/faults.py``)
with ``ckptd start --storage module:Class``; production code carries no
test switch.

The contract, for whoever writes the next implementation (an object store):

- Paths are ``pathlib.Path`` names in one namespace; ``p.incomplete`` and
  ``p`` are siblings. Nothing outside this seam opens, stats or lists them.
- ``open_new``/``pwrite``/``truncate``/``fsync``/``close`` write one shard;
  after ``fsync`` returns, its bytes are durable. ``write_file`` writes a
  small file durably in one call (the index).
- ``rename(src, dst)`` makes a whole checkpoint visible at once, and
  ``exchange`` swaps two names at once; ``fsync_dir`` makes a name durable.
  A store without rename (``can_rename`` False: ``ckptd/objects.py``)
  commits by writing the index last (``write_file`` of ``ckptd.json``,
  create-only), and its ``p.incomplete`` names the same prefix as ``p``;
  readers never see a name without a valid index as a checkpoint.
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
import importlib
import os
import re
import shutil
import stat as stat_mod
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol, runtime_checkable

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


@dataclass(frozen=True)
class Space:
    """Room where a path would be written (its nearest existing ancestor)."""

    device: int
    free: int
    total: int
    kind: str = ""
    """The filesystem's type, looked up only when it holds no storage (``proc``, ``sysfs``: for the message)."""


@runtime_checkable
class Storage(Protocol):
    """Every checkpoint file operation the daemon makes (see the module docstring)."""

    def can_rename(self, path: Path) -> bool: ...
    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]: ...
    def reopen(self, path: Path) -> int: ...
    def pwrite(self, fd: int, data: memoryview, offset: int) -> int: ...
    def truncate(self, fd: int, size: int) -> None: ...
    def fsync(self, fd: int) -> None: ...
    def close(self, fd: int) -> None: ...
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


def _kind(mode: int) -> Kind:
    if stat_mod.S_ISDIR(mode):
        return Kind.DIR
    if stat_mod.S_ISREG(mode):
        return Kind.FILE
    if stat_mod.S_ISLNK(mode):
        return Kind.LINK
    return Kind.OTHER


class LocalStorage:
    """Plain POSIX I/O on the local filesystem, with O_DIRECT where it is allowed."""

    def can_rename(self, path: Path) -> bool:
        """Whether ``rename`` publishes a checkpoint (False on an object store: the index written last does)."""
        return True

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


def load_storage(spec: str | None) -> Storage:
    """The storage for ``s3://`` names and, for all others, the one named ``module:Class`` (None: the local filesystem).

    A class that needs settings reads them itself (``tests/faults.py`` reads
    ``CKPTD_FAULTS``), so the daemon's options stay free of them.
    """
    from .objects import Routed  # it builds on this module

    return Routed(_local_storage(spec))


def _local_storage(spec: str | None) -> Storage:
    """The storage named ``module:Class`` (None: the local filesystem), created without arguments."""
    if not spec:
        return LocalStorage()
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"--storage must be module:Class, got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--storage {spec!r} cannot be loaded: {exc}") from None
    if not isinstance(cls, type):
        raise ValueError(f"--storage {spec!r} names a {type(cls).__name__}, not a class implementing "
                         "ckptd.storage.Storage")
    try:
        storage = cls()
    except Exception as exc:
        raise ValueError(f"--storage {spec!r} could not be created without arguments: {exc!r}") from None
    if not isinstance(storage, Storage):
        raise ValueError(f"--storage {spec!r} does not implement ckptd.storage.Storage")
    return storage
