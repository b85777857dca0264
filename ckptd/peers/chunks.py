"""Send only what changed: a shard's chunks that its buddy already holds are built there, not sent.

A snapshot's shard is cut into ``CHUNK_BYTES`` chunks (256 KiB; the last may
be shorter). The origin takes the SHA-256 of each (``digests``) on its stream's
thread, once the snapshot is held, so a rank's blocking time does not change,
and sends them with the offer. The buddy looks each digest up among the chunks
of the replicas it holds *from the same origin* (the same CURVE key) *in the
same directory* (``Index``), whose digests that origin sent with them, and
answers with a bitmap of the chunks it will copy from them (``Ticket.reused``);
the origin then sends only the others, in order (``spans``). A frozen base
model under a LoRA adapter is sent once; each later snapshot sends the
adapter, its optimizer state and the header (the step in its metadata).

Nothing is taken on trust from the digests: the buddy builds the shard in
order, copying each reused chunk from its replica's file and writing each
sent one as its frame passes its tag, with the crc32c of every byte of it
running as it goes; the shard is held only if that is the checksum the origin
took when it held the snapshot, the same check as for a shard sent whole. A
chunk of a replica that was corrupted in the buddy's memory, or a replica
dropped while the build reads it, fails that build; the origin then sends
the whole snapshot again, digests left out, so nothing is built (``link.py``).
A 256-bit digest makes two different chunks that match as good as
impossible; a 32-bit CRC would not, which is why it is not what is compared.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from ckptd.protocol.peer_messages import CHUNK_BYTES, DIGEST_BYTES, MAX_DIGESTS_BYTES, chunk_count


HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that hash one shard's chunks at once (hashlib releases the GIL): a GPU node's cores are mostly idle
while it trains, and SHA-256 runs at 1.7 GB/s on one core here, slower than a fast link."""
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hashers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="ckptd-hash")
        return _pool


def digests(data: memoryview, threads: int = HASH_THREADS) -> bytes:
    """The SHA-256 of each ``CHUNK_BYTES`` chunk of ``data``, concatenated; ``threads`` runs of chunks at once."""
    count = chunk_count(len(data))
    out = bytearray(DIGEST_BYTES * count)

    def run(first: int, last: int) -> None:
        for i in range(first, last):
            out[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] = hashlib.sha256(
                data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]).digest()
    if threads <= 1 or count < 2 * threads:
        run(0, count)
    else:
        step = -(-count // threads)
        for part in [_hashers().submit(run, first, min(first + step, count)) for first in range(0, count, step)]:
            part.result()
    return bytes(out)


def digestible(nbytes: int) -> bool:
    """Whether a shard of ``nbytes`` is offered with its digests (``MAX_DIGESTS_BYTES``; a larger one is sent whole)."""
    return DIGEST_BYTES * chunk_count(nbytes) <= MAX_DIGESTS_BYTES


def split(blob: bytes) -> list[bytes]:
    """``Offer.digests`` as one digest a chunk."""
    return [blob[i:i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES)]


def chunk_span(index: int, nbytes: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` of a shard of ``nbytes``."""
    offset = index * CHUNK_BYTES
    return offset, min(CHUNK_BYTES, nbytes - offset)


def bitmap(reused: set[int], nbytes: int) -> bytes:
    """``Ticket.reused`` for the chunks ``reused`` of a shard of ``nbytes`` (empty when none is)."""
    if not reused:
        return b""
    out = bytearray(-(-chunk_count(nbytes) // 8))
    for i in reused:
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def reused_of(bits: bytes, nbytes: int) -> set[int]:
    """The chunks ``Ticket.reused`` names; ``ValueError`` if it is no bitmap of a shard of ``nbytes``."""
    if not bits:
        return set()
    count = chunk_count(nbytes)
    if len(bits) != -(-count // 8):
        raise ValueError(f"a bitmap of {len(bits)} bytes for a shard of {count} chunks")
    reused = {i for i in range(len(bits) * 8) if bits[i // 8] >> (i % 8) & 1}
    if reused and max(reused) >= count:
        raise ValueError(f"a bitmap naming chunk {max(reused)} of a shard of {count} chunks")
    return reused


def runs(reused: set[int], nbytes: int) -> Iterator[tuple[int, int, bool]]:
    """The shard of ``nbytes`` in order as (offset, length, built here) runs: consecutive chunks alike merged."""
    start, kind = 0, None
    for i in range(chunk_count(nbytes)):
        here = i in reused
        if kind is not None and here != kind:
            yield start, i * CHUNK_BYTES - start, kind
            start = i * CHUNK_BYTES
        kind = here
    if kind is not None:
        yield start, nbytes - start, kind


def spans(reused: set[int], nbytes: int) -> list[tuple[int, int]]:
    """What is sent of a shard of ``nbytes`` whose chunks ``reused`` its buddy builds: ``bulk.send``'s spans."""
    return [(offset, length) for offset, length, built in runs(reused, nbytes) if not built]
