"""What this machine can do at best with the state's bytes: the floors ckptd is measured against.

Blocking: a ``copy_`` per tensor into a buffer touched before (pinned for CUDA), as staging does (into a new
``/dev/shm`` file: without reused slots). Durable: an O_DIRECT write in 8 MiB ``pwrite`` calls + ``fsync``. Loading: a
sequential read into one reused buffer.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from .probe import evict

CHUNK = 8 << 20
PAGE = 4096


def timed(fn: Callable[[], object], repeat: int, cleanup: Callable[[], None] | None = None) -> list[float]:
    """Seconds of ``repeat`` calls of ``fn`` after one warm-up; ``cleanup`` runs untimed after each."""
    out = []
    for _ in range(1 + repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if cleanup is not None:
            cleanup()
    return out[1:]


def copy_into(buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` back to back into the uint8 tensor ``buf``, as staging does."""
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=t.is_cuda)
        offset += n
    if any(t.is_cuda for t in tensors[:1]):
        torch.cuda.synchronize()


def memcpy_reused(tensors: list[torch.Tensor], nbytes: int, repeat: int,
                  cleanup: Callable[[], None] | None = None) -> list[float]:
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=tensors[0].is_cuda)
    buf.fill_(0)
    return timed(lambda: copy_into(buf, tensors), repeat, cleanup)


def memcpy_fresh_shm(tensors: list[torch.Tensor], nbytes: int, repeat: int) -> list[float]:
    path = Path(f"/dev/shm/ckbench-{os.getpid()}")

    def once() -> None:
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            with mmap.mmap(f.fileno(), nbytes) as m:
                copy_into(torch.frombuffer(m, dtype=torch.uint8), tensors)
    return timed(once, repeat, cleanup=lambda: path.unlink(missing_ok=True))


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned, touched anonymous buffer of ``nbytes`` rounded up to a page."""
    m = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE)
    torch.frombuffer(m, dtype=torch.uint8).fill_(0xA5)
    return m


def write_file(path: Path, data: memoryview, nbytes: int, *, direct: bool = True) -> None:
    """Create ``path``, write ``nbytes`` of ``data`` in ``CHUNK`` pieces, fsync."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    with open(path, "wb", buffering=0, opener=lambda p, _: os.open(p, flags, 0o644)) as f:
        end, offset = len(data) if direct else nbytes, 0
        while offset < end:
            offset += os.pwrite(f.fileno(), data[offset:min(offset + CHUNK, end)], offset)
        os.ftruncate(f.fileno(), nbytes)
        os.fsync(f.fileno())


def parallel_writes(scratch: Path, nbytes: int, writers: int, repeat: int, *, direct: bool = True) -> list[float]:
    """``writers`` threads each writing ``nbytes // writers`` to its own file at once (one writer: a plain write)."""
    each = nbytes // writers
    targets = [scratch / f"raw-{direct}-{i}.bin" for i in range(writers)]

    def once() -> None:
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(lambda t: write_file(t, view, each, direct=direct), targets))

    def cleanup() -> None:  # evicted and removed: the next write starts alike
        evict(targets)
        for t in targets:
            t.unlink()
    with aligned_buffer(each) as buf, memoryview(buf) as view:
        return timed(once, repeat, cleanup)


def read_files(paths: list[Path], *, direct: bool = False) -> int:
    """Read ``paths`` sequentially in ``CHUNK`` pieces into one reused buffer; returns the bytes read."""
    total = 0
    with aligned_buffer(CHUNK) as buf, memoryview(buf) as view:
        for path in paths:
            with open(path, "rb", buffering=0, opener=lambda p, f: os.open(p, f | (os.O_DIRECT if direct else 0))) as f:
                while (n := os.readv(f.fileno(), [view])) > 0:
                    total += n
    return total
