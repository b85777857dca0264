"""Faulting fresh tensors' memory in on a helper thread, ahead of the read that fills them.

A tensor that owns its memory starts as untouched pages: the first write to
each 4 KiB page takes a page fault that zeroes it. Reading a shard into new
tensors pays that fault for every page, inside ``read(2)``, on the reading
thread: measured here, reading 0.55 GB from the page cache takes 0.28-0.31 s
into new tensors and 0.07 s into a reused buffer. From a cold cache the
reader mostly waits for the disk, so a second thread that populates the
pages ahead of it (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14 and later)
moves that work into the wait, onto another core.

It is only an optimization: where the call is missing or refused (an older
kernel, another OS) the thread stops and the reader faults the pages in
itself, as it would without it. The helper skips what the reader has
reached, so the two never fault the same range twice on purpose.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Sequence

import torch

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
"""From linux/mman.h (Python's ``mmap`` module lacks them before 3.13)."""
STEP = 8 << 20
"""Bytes populated per call: small enough that the helper notices the reader passing it."""

try:
    _libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL for the call
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # no libc madvise here: the reader faults pages in itself
    _madvise = None


def populate(start: int, end: int, advice: int = MADV_POPULATE_WRITE) -> bool:
    """Populate for writing (or with ``MADV_POPULATE_READ``, for reading) every page holding a byte of [start, end);
    False if the kernel refused or lacks the call.

    Rounding outward is safe: a page holding any byte of a tensor is mapped, and populating a page already
    present changes nothing (a missing one reads as zeros either way).
    """
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    hi = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
    return _madvise is not None and _madvise(lo, hi - lo, advice) == 0


class Prefault:
    """Populates the memory of ``tensors`` (back to back in the file, in order) on a thread, ahead of the reader.

    The reader calls ``reading(end)`` before each read: the data offset
    (within the tensors' bytes) that read ends at. The helper skips what lies
    before it, so it always works ahead of the reader, never behind. Use it as
    a context manager: the thread ends when the block does, on an error too.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._keep = list(tensors)  # their memory stays theirs while the thread works on it
        self._tensors, offset = [], 0
        for t in tensors:
            self._tensors.append((offset, t.data_ptr(), t.nbytes))
            offset += t.nbytes
        self._reader = 0
        self._stop = False
        self._thread = None
        if _madvise is not None and offset >= STEP:
            self._thread = threading.Thread(target=self._run, name="ckptd-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for offset, address, nbytes in self._tensors:
            for lo in range(0, nbytes, STEP):
                if self._stop:
                    return
                lo = max(lo, self._reader - offset)  # what the reader reached is its to fault in
                hi = min(nbytes, lo + STEP)
                if lo < hi and not populate(address + lo, address + hi):
                    return  # refused (an old kernel, no memory): the reader faults pages in itself

    def reading(self, end: int) -> None:
        """The reader's next read ends at data offset ``end``."""
        self._reader = end

    def __enter__(self) -> "Prefault":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join()
