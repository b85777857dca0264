"""Reading global tensors back: whole, or only the region a target holds.

A global tensor's chunks are listed in the index with their byte ranges. A
loader maps each file it needs once (copy-on-write, verified once) and views
the chunks in place; copying the part of a chunk that overlaps a target
region touches only the pages holding those bytes, so a rank loading its
shard of a resharded tensor reads its share of the checkpoint, not all of it,
and never builds the full tensor. ``load`` of a sharded checkpoint in one
process assembles full tensors chunk by chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptd.protocol.chunks import Box, overlap
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ChunkRecord, TensorRecord

from .dtypes import TORCH_DTYPES


@dataclass(frozen=True)
class GlobalRef:
    """A global tensor of a checkpoint, not read yet."""

    name: str
    record: TensorRecord

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.record.dtype]

    def describe(self) -> str:
        return f"{self.dtype}{list(self.record.shape)}"


class ChunkFiles:
    """The checkpoint's files, each mapped (and checksummed) at most once, on first use."""

    def __init__(self, path: Path, index: CheckpointIndex, *, verify: bool) -> None:
        self.path, self.index, self.verify = path, index, verify
        self._maps: dict[str, torch.Tensor] = {}

    def ref(self, name: str) -> GlobalRef:
        record = self.index.tensors.get(name)
        if record is None:
            raise InvalidCheckpoint(f"checkpoint {self.path}: structure names global tensor {name!r}, "
                                    "which the index does not list")
        return GlobalRef(name, record)

    def chunk(self, ref: GlobalRef, chunk: ChunkRecord) -> torch.Tensor:
        """The chunk's elements, viewed in the mapped file (no read until touched)."""
        data = self.mapped(chunk.file)
        return data[chunk.begin : chunk.end].view(ref.dtype).view(chunk.sizes)

    def mapped(self, file: str) -> torch.Tensor:
        """The whole file as bytes, mapped and (with ``verify``) checksummed on the first call."""
        if file not in self._maps:
            from .load import map_shard  # imported here: load imports this module

            record = next(f for f in self.index.files if f.file == file)
            mapping = map_shard(self.path / file, record, verify=self.verify, algorithm=self.index.checksum_algorithm)
            self._maps[file] = torch.frombuffer(mapping, dtype=torch.uint8)
        return self._maps[file]


def region(t: torch.Tensor, box: Box, origin: tuple[int, ...]) -> torch.Tensor:
    """The view of ``t`` (which starts at ``origin`` of the global tensor) covering ``box``."""
    for dim, (start, size, base) in enumerate(zip(box[0], box[1], origin)):
        t = t.narrow(dim, start - base, size)
    return t


def plan_region(files: ChunkFiles, ref: GlobalRef, box: Box, dst: torch.Tensor
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
    """Copies that fill ``dst`` (the region ``box`` of the tensor) from the chunks overlapping it.

    The second value says what is wrong when the chunks do not cover the
    region exactly once (a hole, or two chunks holding the same elements).
    """
    copies, pieces = [], []
    for chunk in ref.record.chunks:
        shared = overlap(box, (chunk.offsets, chunk.sizes))
        if shared is None:
            continue
        if any(overlap(shared, other) is not None for other in pieces):
            return [], f"saved chunks of {ref.name!r} overlap at {list(shared[0])}"
        pieces.append(shared)
        copies.append((region(dst, shared, box[0]), region(files.chunk(ref, chunk), shared, chunk.offsets)))
    covered, want = sum(math.prod(p[1]) for p in pieces), math.prod(box[1])
    if covered != want:
        return [], (f"region at {list(box[0])} of size {list(box[1])} of {ref.name!r}: saved chunks hold "
                    f"{covered} of its {want} elements")
    return copies, None


def read_full(files: ChunkFiles, ref: GlobalRef, device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor, assembled from its chunks."""
    shape = ref.record.shape
    out = torch.empty(shape, dtype=ref.dtype, device=device or "cpu")
    copies, problem = plan_region(files, ref, ((0,) * len(shape), shape), out)
    if problem is not None:
        raise InvalidCheckpoint(f"checkpoint {files.path}: {problem}")
    for dst, src in copies:
        dst.copy_(src)
    return out


def structure_rank(index: CheckpointIndex, rank: int) -> int:
    """Whose structure a rank loads: its own; in a larger world, rank 0's (global tensors reshard, per-rank values do not)."""
    return rank if rank < index.world_size or not index.tensors else 0

