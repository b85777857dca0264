"""The chunk plan both ends of a replication agree on (``ckptd/peers/chunks.py``): which chunks a ticket names, which
spans the origin then sends, and the digests it offers; no daemon."""

from __future__ import annotations

import hashlib

import pytest

from ckptd.peers import chunks
from ckptd.protocol.peer_messages import CHUNK_BYTES, MAX_DIGESTS_BYTES


@pytest.mark.parametrize("nbytes", [1, CHUNK_BYTES, CHUNK_BYTES + 1, 9 * CHUNK_BYTES - 5])
def test_a_bitmap_names_back_the_chunks_it_was_made_of_and_the_rest_is_sent_in_order(nbytes: int) -> None:
    count = -(-nbytes // CHUNK_BYTES)
    for reused in (set(), {0}, set(range(count)), set(range(0, count, 2)), {count - 1}):
        bits = chunks.bitmap(reused, nbytes)
        assert chunks.reused_of(bits, nbytes) == reused
        runs = list(chunks.runs(reused, nbytes))
        assert sum(length for _, length, _ in runs) == nbytes
        assert [offset for offset, _, _ in runs] == sorted(offset for offset, _, _ in runs)
        sent = chunks.spans(reused, nbytes)
        assert sum(length for _, length in sent) == sum(chunks.chunk_span(i, nbytes)[1] for i in range(count)
                                                         if i not in reused)


def test_a_bitmap_of_another_size_or_naming_a_chunk_past_the_end_is_refused() -> None:
    with pytest.raises(ValueError, match="bitmap of 2 bytes"):
        chunks.reused_of(b"\x01\x00", 3 * CHUNK_BYTES)
    with pytest.raises(ValueError, match="naming chunk 3"):
        chunks.reused_of(b"\x08", 3 * CHUNK_BYTES)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_the_digests_are_each_chunks_sha256_on_any_number_of_threads(threads: int) -> None:
    data = bytes(range(256)) * (5 * CHUNK_BYTES // 256) + b"tail"
    want = b"".join(hashlib.sha256(data[o:o + CHUNK_BYTES]).digest() for o in range(0, len(data), CHUNK_BYTES))
    assert chunks.digests(memoryview(data), threads) == want


def test_a_shard_too_large_for_its_digests_to_travel_is_offered_without_them() -> None:
    largest = MAX_DIGESTS_BYTES // 32 * CHUNK_BYTES
    assert chunks.digestible(largest) and not chunks.digestible(largest + 1)
