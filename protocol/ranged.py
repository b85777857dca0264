"""A shard on an object store (``s3://``), read by parallel ranged GETs of the bytes a reader needs.

Loads (``client/reshard.py``) and ``ckptd export`` open it through ``protocol/reading.py``; it holds no tensors.

A local shard is mapped and the page cache brings in what a copy touches;
an object has no page cache, so its bytes are fetched by request. The
shard's stand-in is anonymous memory of its size: pages never written cost
nothing. ``header`` fetches the safetensors header alone; ``read`` fetches
the byte ranges a load asks for (coalesced into requests of at most
``objects.READ_PART`` bytes, ``objects.PARALLEL_READS`` in flight) and lands
each response in its target's memory as it arrives. The index's checksum
covers the whole shard, so a verified read fetches every byte once, the
bytes no target needs only for the checksum, which runs in object order on
a thread of its own while later ranges are fetched. Every request names the
version (ETag) the shard had when opened: an object replaced mid-load is an
error, never a mix of two versions.
"""

from __future__ import annotations

import bisect
import mmap as _mmap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import objects
from .checksums import Behind
from .errors import InvalidCheckpoint
from .layout import HEADER_GUESS
from .shard_reads import Span, check_checksum, check_header_room, check_shard_size

if TYPE_CHECKING:  # a type only: the index module reads through the reader stack, which opens shards here
    from .index import ShardRecord


class ObjectShard:
    """One shard object: its anonymous stand-in ``mapping``, and reads of byte ranges into targets."""

    identity = None  # no identity to remember: every read is checked as it arrives
    maps_file = False  # the mapping is anonymous memory: a copy out of what was fetched is a plain memcpy

    def __init__(self, shard: Path, record: "ShardRecord", algorithm: str) -> None:
        self.shard, self.record, self.algorithm = shard, record, algorithm
        self.where = objects.display(shard)
        check_header_room(shard, record)
        try:
            meta = objects.head(shard)
        except OSError as exc:
            raise InvalidCheckpoint(f"cannot read shard {self.where}: {exc.strerror or exc}") from None
        if meta is None:
            raise InvalidCheckpoint(f"shard {self.where} is missing (the index lists it; {record.size} bytes)")
        check_shard_size(self.where, meta["size"], record)
        self.etag: str | None = meta.get("e_tag")
        self.mapping = _mmap.mmap(-1, record.size)
        self.verified = self.whole = False

    @property
    def fetches(self) -> bool:
        """Whether bytes of the shard are not in ``mapping`` yet (until ``read_whole``)."""
        return not self.whole

    def header(self) -> None:
        """Fetch the header (its length, then the JSON) into the mapping."""
        first = min(self.record.size, HEADER_GUESS)
        self.read([(0, first, None)], verify=False)
        end = min(self.record.size, 8 + int.from_bytes(self.mapping[:8], "little"))
        if end > first:
            self.read([(first, end, None)], verify=False)

    def read_whole(self, *, verify: bool) -> None:
        """Fetch the whole shard into the mapping (what ``load`` returns views of)."""
        if not self.whole:
            self.read([(0, self.record.size, None)], verify=verify)
            self.whole = True
        elif verify and not self.verified:
            self.read([], verify=True)

    def read(self, spans: list[Span], *, verify: bool) -> None:
        """Land each span's bytes in its memory (None: ``mapping``); with ``verify`` (once per shard) check the
        checksum of every byte.

        ``InvalidCheckpoint`` naming the object when a request fails, the
        object changed since it was opened, or the checksum is wrong (the
        targets then hold what was fetched).
        """
        check = verify and not self.verified
        spans = sorted(((b, e, memoryview(self.mapping)[b:e] if into is None else into) for b, e, into in spans),
                       key=lambda s: s[0])
        begins = [s[0] for s in spans]
        reach, furthest = [], 0  # reach[i]: the furthest end of spans[:i+1], to skip the spans a response misses
        for _, end, _ in spans:
            furthest = max(furthest, end)
            reach.append(furthest)

        def land(start: int, data: Any) -> None:
            stop, got = start + len(data), memoryview(data)
            for begin, end, into in spans[bisect.bisect_right(reach, start) : bisect.bisect_left(begins, stop)]:
                lo, hi = max(begin, start), min(end, stop)
                if lo < hi:
                    into[lo - begin : hi - begin] = got[lo - start : hi - start]

        ranges = objects.requests([(s[0], s[1]) for s in spans], whole=self.record.size if check else None)
        try:
            with Behind(self.algorithm) as crc:
                objects.fetch(self.shard, ranges, land, etag=self.etag, in_order=crc.add if check else None)
                if check:
                    check_checksum(self.where, crc.value(), self.record, self.algorithm)
                    self.verified = True
        except OSError as exc:
            raise InvalidCheckpoint(f"cannot read shard {self.where}: {exc.strerror or exc}") from None
