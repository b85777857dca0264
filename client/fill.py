"""Filling a fresh slot with ``pwritev`` instead of through its mapping: the first save without the page work.

A new slot is an empty tmpfs file. Copied into through its mapping, every
4 KiB page costs three passes of kernel work before the copy itself:
``posix_fallocate`` allocates it, the first touch zeroes it, and a fault maps
it. Measured on 256 MiB here (2 cores, no huge pages in ``/dev/shm``):
allocate 0.05 s, zero and map 0.08 s, against 0.03 s for the copy into reused
pages, so a client's first save blocked 5-9 times as long as the next ones.

``pwritev`` from the tensors' own memory into the file does one pass: tmpfs
allocates each page and copies the bytes into it, with no zeroing (a whole
page is written) and no page-table entries. Measured in the same run: 0.09 s
on two threads, 0.12 s on one. A full ``/dev/shm`` is still an error in the
client (``ENOSPC`` from the write, then ``NoSpace``, the slot unlinked), and
the slot's tail is reserved with ``posix_fallocate`` so no later copy through
the mapping can fault on a missing page (SIGBUS).

The mapping is populated afterwards on a helper thread (``Slot.warm``) while
training goes on; the next save into the slot waits for it if it comes first.
Only host tensors are written this way: CUDA copies need the pinned mapping.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from ckptd.protocol.layout import ShardLayout

from .flatten import Flat

IOV_MAX = 1024
"""Buffers per ``pwritev`` call (Linux's ``UIO_MAXIOV``)."""
MAX_CALL_BYTES = 1 << 30
"""Bytes per ``pwritev`` call; Linux writes at most 2 GiB - 4 KiB in one."""
MAX_WRITERS = 4
"""Threads writing one slot at most: page allocation stops scaling beyond a few cores."""

Segment = tuple[int, memoryview]
"""Bytes to write at a file offset."""


def writers() -> int:
    """Threads to write with: as many as torch copies with (its intra-op threads), so a rank that torchrun gave one
    thread keeps to one core, within the cores this process may use."""
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)), MAX_WRITERS))


def host_only(flat: Flat) -> bool:
    """Every tensor of ``flat`` lives in host memory (only those are written with ``pwritev``)."""
    return all(t.device.type == "cpu" for _, t in flat.tensors)


def raw_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """The bytes of ``t`` as the slot stores them (row-major, conjugation and negation applied), and the tensor that
    owns them (a contiguous copy where ``t`` is not already such a block: a view of a sharded chunk, say)."""
    t = t.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().contiguous()
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b""), t


def segments(flat: Flat, layout: ShardLayout) -> Iterator[tuple[Segment, torch.Tensor | None]]:
    """The shard's bytes in file order, header first, back to back from offset 0 to ``layout.nbytes``, each with
    the tensor whose memory it is (to keep alive until written). Lazily: a tensor is read only when its turn comes."""
    by_name = dict(flat.tensors)
    yield (0, memoryview(layout.header)), None
    for entry in layout.entries:
        if entry.nbytes:
            view, owner = raw_bytes(by_name[entry.name])
            assert len(view) == entry.nbytes, f"{entry.name}: {len(view)} bytes, the layout says {entry.nbytes}"
            yield (layout.data_start + entry.begin, view), owner


def split(parts: list[Segment], cuts: list[int]) -> list[list[Segment]]:
    """``parts`` (contiguous, in order) cut at the file offsets ``cuts`` (ascending): one list per piece."""
    pieces: list[list[Segment]] = [[] for _ in range(len(cuts) + 1)]
    i = 0
    for offset, view in parts:
        while len(view):
            while i < len(cuts) and offset >= cuts[i]:
                i += 1
            take = len(view) if i == len(cuts) else min(len(view), cuts[i] - offset)
            pieces[i].append((offset, view[:take]))
            offset, view = offset + take, view[take:]
    return pieces


def write_segments(fd: int, parts: list[Segment]) -> None:
    """Write contiguous ``parts`` with as few ``pwritev`` calls as the kernel allows, resuming after short writes."""
    queue = deque(parts)
    while queue:
        offset, batch, total = queue[0][0], [], 0
        while queue and len(batch) < IOV_MAX and total < MAX_CALL_BYTES:
            at, view = queue.popleft()
            room = MAX_CALL_BYTES - total
            if len(view) > room:  # the rest of this part starts the next call
                queue.appendleft((at + room, view[room:]))
                view = view[:room]
            batch.append(view)
            total += len(view)
        done = os.pwritev(fd, batch, offset)
        if done == 0:
            raise OSError(errno.EIO, f"pwritev wrote nothing of {total} bytes at offset {offset} of a slot")
        rest, at = [], offset
        for view in batch:  # a short write: what is left of this call goes first in the next
            if done < len(view):
                rest.append((at + done, view[done:]))
            done = max(0, done - len(view))
            at += len(view)
        queue.extendleft(reversed(rest))


def fill(fd: int, flat: Flat, layout: ShardLayout, progress: Callable[[int], None] | None = None,
         batch_bytes: int = 64 << 20, threads: int | None = None) -> None:
    """Write the whole shard (header and every tensor) into the slot file ``fd`` from offset 0.

    With ``progress``, in batches of at least ``batch_bytes`` (whole tensors),
    each followed by ``progress(upto)``: the file offset below which the slot
    is final. Each batch is split over ``threads`` (default ``writers()``).
    """
    threads = writers() if threads is None else threads
    pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="ckptd-fill") if threads > 1 else None
    batch: list[Segment] = []
    owners: list[torch.Tensor] = []
    try:
        for (offset, view), owner in segments(flat, layout):
            batch.append((offset, view))
            if owner is not None:
                owners.append(owner)
            upto = offset + len(view)
            if upto == layout.nbytes or (progress is not None and upto - batch[0][0] >= batch_bytes):
                _write_batch(fd, batch, threads, pool)
                batch, owners = [], []
                if progress is not None:
                    progress(upto)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)


def _write_batch(fd: int, batch: list[Segment], threads: int, pool: ThreadPoolExecutor | None) -> None:
    """Write contiguous ``batch`` split into ``threads`` equal byte ranges, one per thread (this one included)."""
    lo = batch[0][0]
    share = -(-(batch[-1][0] + len(batch[-1][1]) - lo) // threads)
    pieces = [p for p in split(batch, [lo + k * share for k in range(1, threads)]) if p]
    pending = [pool.submit(write_segments, fd, p) for p in pieces[1:]] if pool is not None else []
    for piece in pieces if pool is None else pieces[:1]:
        write_segments(fd, piece)
    for f in pending:
        f.result()
