"""Writing one staged shard from its slot to a file, durably.

The slot already holds the exact file bytes, page-aligned, so the write is
one pass of large ``pwrite`` calls straight from the shared mapping (O_DIRECT
where the filesystem allows it: no copy through the page cache). The
checksum runs at the same time on another thread over the same bytes
(``zlib.crc32`` releases the GIL), so it costs no wall time while it is
faster than the disk.

A write goes through the states below; ``ckptd status`` shows them::

    queued -> writing -> fsync -> durable      (or -> failed)
"""

from __future__ import annotations

import errno
import os
import time
import zlib
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.protocol.errors import CkptdError, WriteFailed
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.messages import Commit

from .slots import MappedSlot
from .storage import Storage

PAGE = 4096


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


@dataclass
class WriteJob:
    """One rank's shard on its way from slot to disk."""

    client: bytes
    commit: Commit
    slot: MappedSlot
    dest: Path
    checkpoint: Path
    """Final path of the checkpoint this shard belongs to."""
    device: int = 0
    """Filesystem the shard goes to (admission control sums bytes per device)."""
    state: str = "queued"
    written: int = 0
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    record: ShardRecord | None = None
    error: CkptdError | None = None


def write_shard(job: WriteJob, storage: Storage, checksums: Executor, *, direct: bool, chunk: int) -> ShardRecord:
    """Write ``job``'s shard to ``job.dest``, fsync it, and return its record."""
    job.state, job.started_at = "writing", time.monotonic()
    nbytes = job.commit.nbytes
    view = memoryview(job.slot.map)
    crc = checksums.submit(zlib.crc32, view[:nbytes])
    fd = -1
    try:
        fd, direct = storage.open_new(job.dest, direct=direct)
        # O_DIRECT needs whole pages; the slot is page-sized, and the padding
        # past nbytes is cut off again by the truncate below.
        end = round_up(nbytes) if direct else nbytes
        offset = 0
        while offset < end:
            n = min(chunk, end - offset)
            try:
                offset += storage.pwrite(fd, view[offset : offset + n], offset)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                # The filesystem took O_DIRECT at open but refuses the write:
                # carry on buffered from the same offset.
                storage.close(fd)
                fd = -1
                fd, direct = os.open(job.dest, os.O_WRONLY | os.O_CLOEXEC), False
                end = nbytes
            job.written = min(offset, nbytes)
        if end != nbytes:
            storage.truncate(fd, nbytes)
        job.state = "fsync"
        storage.fsync(fd)
    except OSError as exc:
        raise WriteFailed(f"writing {job.dest} failed: {exc.strerror or exc}") from None
    finally:
        if fd >= 0:
            storage.close(fd)
        checksum = crc.result()
        view.release()
    job.state = "durable"
    return ShardRecord(
        file=job.dest.name,
        rank=job.commit.rank,
        size=nbytes,
        checksum=checksum,
        tensors=len(job.commit.tensors),
    )
