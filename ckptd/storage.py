"""The storage seam: every filesystem call the daemon makes on checkpoints.

The writer and the commit logic never call ``os`` directly for checkpoint
files; they call a ``Storage``. Tests inject slow or failing I/O by starting
the daemon with ``CKPTD_FAULTS`` set, which swaps in ``FaultyStorage`` (this
is the only place a fault can enter, and production never sets it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path


log = logging.getLogger("ckptd")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class Storage:
    """Plain POSIX I/O, with O_DIRECT where the filesystem allows it."""

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

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def mkdir(self, path: Path) -> None:
        os.mkdir(path, 0o755)

    def touch(self, path: Path) -> None:
        """Create an empty advisory file (no fsync: losing it loses nothing)."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))

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

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def exchange(self, a: Path, b: Path) -> None:
        """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``)."""
        if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(b))

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.fsync(fd)
        finally:
            os.close(fd)

    def remove_tree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class Fault:
    """Fail, delay or kill the daemon at calls of ``op`` whose path contains ``match``.

    ``op`` is one of open, write, fsync, write_file, fsync_dir, rename,
    exchange (the swap of an overwrite; its path is the final name), touch
    (owner markers), unlink, remove_tree. Each fault that acts logs
    ``event=fault`` first, so a test can tell which call it hit.
    """

    op: str
    match: str = ""
    errno: int = errno.EIO
    """Raise this OSError (0: do not raise)."""
    delay: float = 0.0
    """Seconds to sleep first."""
    kill: bool = False
    """SIGKILL the daemon itself: a crash at exactly this point."""
    after: bool = False
    """Act after the call succeeded instead of before it."""


class FaultyStorage(Storage):
    """Storage that injects the faults listed in ``CKPTD_FAULTS`` (tests only)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self._paths: dict[int, str] = {}

    @classmethod
    def from_env(cls, raw: str) -> "FaultyStorage":
        return cls([Fault(**f) for f in json.loads(raw)])

    def _inject(self, op: str, where: str, *, after: bool = False) -> None:
        for f in self.faults:
            if f.op == op and f.match in where and f.after == after:
                action = "kill" if f.kill else (f"errno={f.errno}" if f.errno else f"delay={f.delay:g}")
                log.warning("event=fault op=%s after=%s action=%s path=%s", op, after, action, where)
                if f.delay:
                    time.sleep(f.delay)
                if f.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                if f.errno:
                    raise OSError(f.errno, f"{os.strerror(f.errno)} (injected)", where)

    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]:
        self._inject("open", str(path))
        fd, is_direct = super().open_new(path, direct=direct)
        self._paths[fd] = str(path)
        return fd, is_direct

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        where = self._paths.get(fd, "")
        self._inject("write", where)
        n = super().pwrite(fd, data, offset)
        self._inject("write", where, after=True)
        return n

    def fsync(self, fd: int) -> None:
        where = self._paths.get(fd, "")
        self._inject("fsync", where)
        super().fsync(fd)
        self._inject("fsync", where, after=True)

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)

    def write_file(self, path: Path, data: bytes) -> None:
        self._inject("write_file", str(path))
        super().write_file(path, data)
        self._inject("write_file", str(path), after=True)

    def fsync_dir(self, path: Path) -> None:
        self._inject("fsync_dir", str(path))
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._inject("fsync_dir", str(path), after=True)

    def rename(self, src: Path, dst: Path) -> None:
        self._inject("rename", str(dst))
        super().rename(src, dst)
        self._inject("rename", str(dst), after=True)

    def exchange(self, a: Path, b: Path) -> None:
        self._inject("exchange", str(b))
        super().exchange(a, b)
        self._inject("exchange", str(b), after=True)

    def touch(self, path: Path) -> None:
        self._inject("touch", str(path))
        super().touch(path)
        self._inject("touch", str(path), after=True)

    def unlink(self, path: Path) -> None:
        self._inject("unlink", str(path))
        super().unlink(path)
        self._inject("unlink", str(path), after=True)

    def remove_tree(self, path: Path) -> None:
        self._inject("remove_tree", str(path))
        super().remove_tree(path)
        self._inject("remove_tree", str(path), after=True)


def storage_from_env() -> Storage:
    raw = os.environ.get("CKPTD_FAULTS")
    return FaultyStorage.from_env(raw) if raw else Storage()
