"""Reading a committed checkpoint back into the structure that was saved.

The shard is memory-mapped copy-on-write and tensors are views of the
mapping: no read into a temporary buffer and no copy, the page cache serves
the bytes, and writing to a loaded tensor changes only this process's copy,
never the file. The checksum from the index is verified first (one pass over
the mapping) unless ``verify=False``.
"""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from ckptd.protocol.errors import BadMessage, InvalidCheckpoint
from ckptd.protocol.index import read_index
from ckptd.protocol.layout import parse_header

from .dtypes import TORCH_DTYPES
from .flatten import structure_from_metadata, unflatten
from .ranks import detect_rank


def load(path: str | os.PathLike, *, rank: int | None = None, verify: bool = True) -> Any:
    """The state saved by ``rank`` (default: this process's rank) at ``path``."""
    path = Path(path)
    index = read_index(path)
    if rank is None:
        rank = detect_rank()[0] if index.world_size > 1 else 0
    record = index.shard(rank)
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
                f"shard {shard} fails its checksum ({index.checksum_algorithm} {crc:#010x}, index says "
                f"{record.checksum:#010x}): the file is corrupt"
            )
    try:
        entries, metadata, data_start = parse_header(memoryview(mapping), size)
    except BadMessage as exc:
        raise InvalidCheckpoint(f"shard {shard} has a bad header: {exc.message}") from None
    structure = structure_from_metadata(metadata)
    if structure is None:
        raise InvalidCheckpoint(f"shard {shard} holds no ckptd structure in its metadata")
    buf = torch.frombuffer(mapping, dtype=torch.uint8)
    by_name = {e.name: e for e in entries}
    made: dict[str, torch.Tensor] = {}

    def tensor_for(name: str) -> torch.Tensor:
        if name in made:  # one tensor referenced twice (tied weights) loads as one object
            return made[name]
        e = by_name.get(name)
        if e is None:
            raise InvalidCheckpoint(f"shard {shard}: structure names tensor {name!r}, which the header lacks")
        flat = buf[data_start + e.begin : data_start + e.end]
        made[name] = flat.view(TORCH_DTYPES[e.dtype]).view(e.shape)
        return made[name]

    try:
        return unflatten(structure, tensor_for)
    except (ValueError, TypeError) as exc:
        raise InvalidCheckpoint(f"shard {shard} has a structure that cannot be read: {exc}") from None
