"""What every reader of a shard shares, local file (``protocol/mapped.py``) or object (``protocol/ranged.py``).

``ShardReader`` is the one interface a loader or ``ckptd export`` reads a
shard through (``protocol/reading.py`` opens one for a path), so neither asks
where the shard is. The bytes read back must match the index record's size
and checksum, checked with the same words by every reader (load, resharding,
``ckptd verify``, ``ckptd export``).
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .errors import InvalidCheckpoint
from .objects import display

if TYPE_CHECKING:  # a type only: the index module reads through the reader stack, which checks with these
    from .index import ShardRecord

Span = tuple[int, int, "memoryview | None"]
"""Bytes ``[begin, end)`` of the shard and the memory (``end - begin`` bytes) they land in; None: the reader's
own ``mapping``, which then holds them (a copy out of it follows)."""


class ShardReader(Protocol):
    """One shard opened for reading: ``mapping`` holds (or will hold) its bytes, at their offsets."""

    record: "ShardRecord"
    """What the index says of the shard: its size and checksum."""
    algorithm: str
    """The checksum algorithm of the shard's index."""
    mapping: mmap.mmap
    """The shard's bytes as memory: a local file mapped copy-on-write, or an object's anonymous stand-in, whose
    pages hold what was fetched (pages never written cost nothing)."""
    identity: "tuple[int, ...] | None"
    """What tells the unchanged local file apart (``client/verified.py`` remembers a verified one); None for an
    object, which is checked on every read instead."""
    verified: bool
    """Whether this reader checked the shard's checksum already."""
    fetches: bool
    """Whether ``mapping`` lacks bytes until they are fetched (an object not read whole): a copy out of it must be
    a ``read`` then."""
    maps_file: bool
    """Whether ``mapping`` is a file's pages: a copy out of it faults them in, a ``read`` into the target does
    not (one pass over the bytes). False: anonymous memory, where a copy out of what is there is a memcpy."""

    def header(self) -> None:
        """Bring the safetensors header into ``mapping``."""
        ...

    def read_whole(self, *, verify: bool) -> None:
        """Bring every byte into ``mapping``; with ``verify`` (once) check the checksum."""
        ...

    def read(self, spans: list[Span], *, verify: bool) -> None:
        """Land each span's bytes in its memory; with ``verify`` (once) check the checksum of every byte of the
        shard. ``InvalidCheckpoint`` naming the shard when a read fails, it changed since it was opened, or the
        checksum is wrong (the targets then hold what was read)."""
        ...


def check_shard_size(shard: Path, size: int, record: "ShardRecord") -> None:
    """A shard must hold exactly the bytes its index records (load and verify alike)."""
    if size != record.size:
        raise InvalidCheckpoint(f"shard {display(shard)} holds {size} bytes; the index says {record.size} (truncated?)")


def check_checksum(shard: Path, crc: int, record: "ShardRecord", algorithm: str) -> None:
    """A shard's checksum must be the one its index records (load and verify alike)."""
    if crc != record.checksum:
        raise InvalidCheckpoint(
            f"shard {display(shard)} fails its checksum ({algorithm} {crc:#010x}, index says "
            f"{record.checksum:#010x}): its bytes changed after it was written"
        )


def check_header_room(shard: Path, record: "ShardRecord") -> None:
    """A shard listed with fewer bytes than a safetensors header's length cannot be read at all."""
    if record.size < 8:
        raise InvalidCheckpoint(f"shard {display(shard)} of {record.size} bytes is too short for a safetensors header")
