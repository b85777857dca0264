"""A local shard file, mapped copy-on-write, and reads of byte ranges from it into targets.

The counterpart of ``protocol/ranged.py`` (an object's shard): both answer
the same calls (``protocol/shard_reads.py``' ``ShardReader``), so a loader or
``ckptd export`` never asks where a shard is. Here ``mapping`` is the file
itself, so the page cache brings in what a copy out of it touches and
``header`` and ``read_whole`` fetch nothing. ``read`` lands byte ranges in
their targets with ``preadv`` instead: one pass over the bytes and no page
faults on the mapping. A checksum that follows the reads runs on a thread of
its own, each range checksummed right after the read that brought it into
the cache, while the next one is read.
"""

from __future__ import annotations

import mmap as _mmap
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .checksums import Behind, checksum
from .errors import InvalidCheckpoint
from .files import open_regular
from .shard_reads import Span, check_checksum, check_header_room, check_shard_size

if TYPE_CHECKING:  # a type only: the index module reads through the reader stack
    from .index import ShardRecord

Identity = tuple[int, ...]
"""Device, inode, size, mtime and ctime of an open file, and when they were taken (``identity``)."""

MAX_READ = 1 << 30
"""Bytes asked of one read(2); Linux returns at most ~2 GiB per call anyway."""
GAP_READ = 16 << 20
"""Bytes per read of a range only the checksum needs."""
FOLD_READ = 8 << 20
"""Bytes per read straight into a target whose checksum follows: the checksum thread reads each piece while the next
is read, from the cache rather than from memory."""


def identity(fd: int) -> Identity:
    """What tells this open file apart from any other or from itself after a change (and when it was taken)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, time.time_ns()


class MappedShard:
    """One local shard file: its copy-on-write ``mapping``, its ``identity``, and reads of ranges into targets."""

    fetches = False
    """``mapping`` already holds every byte (the page cache brings them in): nothing is fetched into it."""
    maps_file = True

    def __init__(self, shard: Path, record: "ShardRecord", algorithm: str, *,
                 mapped: tuple[_mmap.mmap, Identity] | None = None) -> None:
        """Map ``shard`` after checking that it is a regular file of the index's size; or, with ``mapped`` (a
        mapping and the file's identity), read a file its caller mapped and checked itself (a held snapshot's
        slot, shared with the daemon)."""
        self.shard, self.record, self.algorithm, self.where = shard, record, algorithm, shard
        self.verified = False
        if mapped is not None:
            self.mapping, self.identity = mapped
            return
        check_header_room(shard, record)
        with open_regular(shard, "shard") as f:
            check_shard_size(shard, os.fstat(f.fileno()).st_size, record)
            self.identity = identity(f.fileno())
            self.mapping = _mmap.mmap(f.fileno(), record.size, _mmap.MAP_PRIVATE, _mmap.PROT_READ | _mmap.PROT_WRITE)

    def header(self) -> None:
        """Nothing to fetch: the header is read through the mapping when touched."""

    def read_whole(self, *, verify: bool) -> None:
        """With ``verify`` (once), check the checksum of the mapped bytes; the mapping is closed if it fails."""
        if verify and not self.verified:
            try:
                check_checksum(self.shard, checksum(self.mapping, self.algorithm), self.record, self.algorithm)
            except BaseException:
                self.mapping.close()
                raise
            self.verified = True

    def read(self, spans: list[Span], *, verify: bool) -> None:
        """Read each span's bytes into its memory (a span into ``mapping`` is there already); with ``verify``
        (once) check the checksum of every byte, the bytes no span reads read for it alone.

        ``InvalidCheckpoint`` when the file changed since it was mapped, ended
        early, or fails its checksum (the targets then hold what was read).
        """
        check = verify and not self.verified
        done = 0
        with open_regular(self.shard, "shard") as f, memoryview(self.mapping) as mapped, Behind(self.algorithm) as crc:
            fd = f.fileno()
            if identity(fd)[:5] != self.identity[:5]:
                raise InvalidCheckpoint(f"shard {self.where} changed while it was being loaded")
            for begin, end, into in sorted(spans, key=lambda s: s[0]):
                if check and begin > done:  # bytes no span reads: the header, skipped tensors
                    self._read_for(crc, fd, done, begin)
                    done = begin
                if into is None:
                    into = mapped[begin:end]
                else:
                    for lo in range(0, len(into), FOLD_READ):  # each piece checksummed while in cache
                        piece = into[lo : lo + FOLD_READ]
                        self._pread_into(fd, piece, begin + lo)
                        if check and begin + lo + len(piece) > done:
                            crc.add(piece[max(done, begin + lo) - begin - lo :])
                            done = begin + lo + len(piece)
                if check and end > done:
                    crc.add(into[max(done, begin) - begin :])
                done = max(done, end)
            if check:
                self._read_for(crc, fd, done, self.record.size)
                check_checksum(self.shard, crc.value(), self.record, self.algorithm)
                self.verified = True

    def _read_for(self, crc: Behind, fd: int, begin: int, end: int) -> None:
        """Bytes ``[begin, end)`` read in large pieces (no page faults on the mapping) for the checksum alone."""
        for offset in range(begin, end, GAP_READ):
            piece = memoryview(bytearray(min(GAP_READ, end - offset)))  # a fresh buffer: the checksum may lag behind
            self._pread_into(fd, piece, offset)
            crc.add(piece)

    def _pread_into(self, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done : done + MAX_READ]], offset + done)
            if n <= 0:
                raise InvalidCheckpoint(f"shard {self.where} ended early while being read (changed under the reader?)")
            done += n
