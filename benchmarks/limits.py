"""What this machine can do at best with the state's bytes.

ckptd's numbers only mean something next to the limits it is built on:

* ``memcpy_reused``: one ``copy_`` per tensor into a buffer that was touched
  before. This is the floor for ``save_async``'s blocking time (staging does
  exactly this into its slot, plus a header).
* ``memcpy_fresh_shm``: the same copy into a new ``/dev/shm`` file, mapped
  and faulted during the copy: what staging would cost without reused,
  pre-faulted slots.
* ``odirect_write``: a sequential O_DIRECT write of the same number of bytes
  from a page-aligned buffer in 8 MiB ``pwrite`` calls, then ``fsync``: the
  floor for ckptd's time to durable.
* ``buffered_write``: the same through the page cache, then ``fsync``.
* ``parallel_direct_write``: several O_DIRECT writers at once (threads,
  ``pwrite`` releases the GIL), for the four-clients comparison.
* ``read_file``: a sequential read of a file in 8 MiB ``readinto`` calls
  into one reused buffer, through the page cache or with O_DIRECT: the
  floor for loading a checkpoint from that file.

Write targets are new files in the scratch directory, removed untimed after
each repetition; buffered data is dropped from the page cache so the next
measurement starts from the same state.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

from .measure import Series, timed

CHUNK = 8 << 20
PAGE = 4096
SHM_DIR = Path("/dev/shm")


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def copy_into(buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` back to back into the uint8 tensor ``buf`` (as staging does)."""
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += n


def memcpy_reused(tensors: list[torch.Tensor], nbytes: int, repeat: int) -> Series:
    """Copy into one preallocated, already-touched buffer, reused every time."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    return timed(lambda: copy_into(buf, tensors), repeat=repeat)


def memcpy_fresh_shm(tensors: list[torch.Tensor], nbytes: int, repeat: int) -> Series:
    """New ``/dev/shm`` file, ``mmap`` and copy: page faults included in the time."""
    path = SHM_DIR / f"ckbench-{os.getpid()}"
    held: list[mmap.mmap] = []

    def once() -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        held.append(m)
        copy_into(torch.frombuffer(m, dtype=torch.uint8), tensors)

    def cleanup() -> None:
        for m in held:
            m.close()
        held.clear()
        path.unlink(missing_ok=True)

    try:
        return timed(once, repeat=repeat, cleanup=cleanup)
    finally:
        cleanup()


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned, touched anonymous buffer of ``nbytes`` rounded up to a page."""
    m = mmap.mmap(-1, round_up(nbytes), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    torch.frombuffer(m, dtype=torch.uint8).fill_(0xA5)
    return m


def _write_file(path: Path, data: memoryview, nbytes: int, *, direct: bool) -> None:
    """Create ``path``, write ``data`` in ``CHUNK`` pieces, cut to ``nbytes``, fsync."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        end = len(data) if direct else nbytes
        offset = 0
        while offset < end:
            offset += os.pwrite(fd, data[offset : min(offset + CHUNK, end)], offset)
        if end != nbytes:
            os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cached(path: Path) -> None:
    """Evict ``path``'s (clean, fsync'd) pages from the page cache, then remove it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    path.unlink()


def _write_series(scratch: Path, nbytes: int, repeat: int, *, direct: bool) -> Series:
    buf = _aligned_buffer(nbytes)
    view = memoryview(buf)
    target = scratch / f"raw-{'direct' if direct else 'buffered'}.bin"
    try:
        return timed(lambda: _write_file(target, view, nbytes, direct=direct), repeat=repeat,
                     cleanup=lambda: drop_cached(target))
    finally:
        view.release()
        buf.close()
        drop_cached(target)


def odirect_write(scratch: Path, nbytes: int, repeat: int) -> Series:
    """Sequential O_DIRECT write of ``nbytes`` plus ``fsync``, 8 MiB per call."""
    return _write_series(scratch, nbytes, repeat, direct=True)


def buffered_write(scratch: Path, nbytes: int, repeat: int) -> Series:
    """Sequential buffered write of ``nbytes`` plus ``fsync``, 8 MiB per call."""
    return _write_series(scratch, nbytes, repeat, direct=False)


def parallel_direct_write(scratch: Path, nbytes_each: int, writers: int, repeat: int) -> Series:
    """``writers`` O_DIRECT writes of ``nbytes_each`` at once (one thread each), + fsync each."""
    buf = _aligned_buffer(nbytes_each)
    view = memoryview(buf)
    targets = [scratch / f"raw-parallel-{i}.bin" for i in range(writers)]

    def once() -> None:
        threads = [threading.Thread(target=_write_file, args=(t, view, nbytes_each), kwargs={"direct": True})
                   for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def cleanup() -> None:
        for t in targets:
            drop_cached(t)

    try:
        return timed(once, repeat=repeat, cleanup=cleanup)
    finally:
        view.release()
        buf.close()
        cleanup()


def read_file(paths: list[Path], *, direct: bool = False) -> int:
    """Read ``paths`` sequentially in ``CHUNK`` pieces into one reused buffer; returns bytes read."""
    buf = _aligned_buffer(CHUNK)
    view = memoryview(buf)
    total = 0
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
            try:
                while True:
                    n = os.readv(fd, [view])
                    total += n
                    if n < CHUNK:
                        break
            finally:
                os.close(fd)
    finally:
        view.release()
        buf.close()
    return total
