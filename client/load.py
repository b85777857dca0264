"""Reading a committed checkpoint back into the structure that was saved.

By default the shard is memory-mapped copy-on-write and tensors are views of
the mapping: no read into a temporary buffer and no copy, the page cache
serves the bytes (reclaimable, so eight ranks mapping big checkpoints do not
run a node out of memory), and writing to a loaded tensor changes only this
process's copy, never the file. With ``map_location`` each tensor is copied
straight from the mapping to that device instead, one tensor at a time.

The checksum from the index is verified first (one pass over the mapping)
unless ``verify=False``. Every failure is an ``InvalidCheckpoint`` that
names the file and what is wrong; nothing partial is returned.
"""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from ckptd.protocol.errors import BadMessage, InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ShardRecord, read_index
from ckptd.protocol.layout import parse_header

from .dtypes import TORCH_DTYPES
from .flatten import structure_from_metadata, unflatten
from .lease import load_lease
from .ranks import detect_ranks
from .reshard import ChunkFiles, read_full, structure_rank

MapLocation = str | torch.device | None


def load(
    path: str | os.PathLike,
    *,
    rank: int | Literal["all"] | None = None,
    map_location: MapLocation = None,
    verify: bool = True,
    max_concurrent_per_node: int | None = None,
    run_dir: str | os.PathLike | None = None,
) -> Any:
    """The state saved by ``rank`` at ``path`` (``rank="all"``: a list, one per rank).

    Global tensors of a sharded checkpoint (DTensors, ``replicated=`` keys)
    come back whole, assembled from their chunks, so one plain process can
    read what many ranks saved; with ``rank="all"`` the ranks' states share
    those tensors.

    Args:
        rank: default this process's rank (0 for a one-rank checkpoint).
        map_location: None keeps tensors backed by the file (zero-copy,
            copy-on-write); a device (``"cpu"``, ``"cuda:0"``) copies each
            tensor there and lets go of the file.
        verify: check the shard's checksum from the index first.
        max_concurrent_per_node: hold a lease from this node's daemon so at
            most this many ranks load at once (None: the daemon's default,
            if a daemon runs and has one).
        run_dir: the daemon to ask for the lease.
    """
    path = Path(path)
    index = read_index(path)
    files = ChunkFiles(path, index, verify=verify)
    assembled: dict[str, torch.Tensor] = {}
    device = torch.device(map_location) if map_location is not None else None

    def full_tensor(name: str) -> torch.Tensor:  # a global tensor, assembled once however many ranks name it
        if name not in assembled:
            assembled[name] = read_full(files, files.ref(name), device)
        return assembled[name]

    with load_lease(max_concurrent_per_node, run_dir=run_dir):
        if rank == "all":
            return [_load_rank(path, index, r, map_location, verify, full_tensor) for r in range(index.world_size)]
        if rank is None:
            rank = structure_rank(index, detect_ranks().rank) if index.world_size > 1 else 0
        return _load_rank(path, index, rank, map_location, verify, full_tensor)


def _load_rank(path: Path, index: CheckpointIndex, rank: int, map_location: MapLocation, verify: bool,
               global_for: Callable[[str], Any] | None = None) -> Any:
    record = index.shard(rank)
    mapping, shard = map_shard(path, record, verify=verify, algorithm=index.checksum_algorithm)
    try:
        entries, metadata, data_start = parse_header(memoryview(mapping), record.size)
    except BadMessage as exc:
        raise InvalidCheckpoint(f"shard {shard} has a bad header: {exc.message}") from None
    structure = structure_from_metadata(metadata)
    if structure is None:
        raise InvalidCheckpoint(f"shard {shard} holds no ckptd structure in its metadata")
    buf = torch.frombuffer(mapping, dtype=torch.uint8)
    by_name = {e.name: e for e in entries}
    made: dict[str, torch.Tensor] = {}
    device = torch.device(map_location) if map_location is not None else None

    def tensor_for(name: str) -> torch.Tensor:
        if name in made:  # one tensor referenced twice (tied weights) loads as one object
            return made[name]
        e = by_name.get(name)
        if e is None:
            raise InvalidCheckpoint(f"shard {shard}: structure names tensor {name!r}, which the header lacks")
        t = buf[data_start + e.begin : data_start + e.end].view(TORCH_DTYPES[e.dtype]).view(e.shape)
        made[name] = t if device is None else t.to(device, copy=True)
        return made[name]

    try:
        return unflatten(structure, tensor_for, global_for)
    except (ValueError, TypeError) as exc:
        raise InvalidCheckpoint(f"shard {shard} has a structure that cannot be read: {exc}") from None


def map_shard(path: Path, record: ShardRecord, *, verify: bool, algorithm: str = "crc32") -> tuple[mmap.mmap, Path]:
    """Map a shard copy-on-write after checking its size (and checksum)."""
    shard = path / record.file
    try:
        fd = os.open(shard, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot open shard {shard}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size != record.size:
            raise InvalidCheckpoint(f"shard {shard} holds {size} bytes; the index says {record.size} (truncated?)")
        mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if verify:
        crc = zlib.crc32(mapping)
        if crc != record.checksum:
            raise InvalidCheckpoint(
                f"shard {shard} fails its checksum ({algorithm} {crc:#010x}, index says "
                f"{record.checksum:#010x}): the file is corrupt"
            )
    return mapping, shard
