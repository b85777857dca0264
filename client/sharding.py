"""Which chunk of a global tensor this rank holds, and whether it writes it.

A DTensor's local shard is one rectangular chunk of its global tensor; torch
computes the chunk's offsets from the mesh and the placements, so nothing is
gathered and no rank needs to talk to another. A chunk that several ranks
hold (``Replicate`` on some mesh dimension, HSDP replicas) is written by one
owner only, decided locally: the rank at coordinate 0 along every replicated
mesh dimension. So every element is stored exactly once.

Tensors under a top-level key saved with ``replicated=`` are global tensors
too: one chunk, the whole tensor, owned by rank 0.

Loading uses the same arithmetic in reverse: ``target_region`` says which
part of the global tensor a target DTensor's local shard is.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

try:  # torch builds without distributed support have no DTensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate, Shard
except ImportError:  # pragma: no cover - every supported torch has it
    DTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class LocalChunk:
    """This rank's part of a global tensor."""

    local: torch.Tensor
    """The chunk's elements (a DTensor's local tensor, or the whole tensor)."""
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    owned: bool
    """True when this rank is the one that writes the chunk."""

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, tuple(self.local.shape)


def is_dtensor(obj: object) -> bool:
    return DTensor is not None and isinstance(obj, DTensor)


Where = str | Callable[[], str]
"""A key path for error messages, or what makes it (a save builds it only when it reports an error)."""


def _named(where: Where) -> str:
    return where() if callable(where) else where


def dtensor_chunk(t: "DTensor", where: Where, rank: int | None = None) -> LocalChunk:
    """This rank's chunk of ``t``; ``where`` names its key path in errors; ``rank``: this process's global rank
    (``global_rank()``), which a save of many DTensors asks once."""
    rank = global_rank() if rank is None else rank
    shape = tuple(t.shape)
    sizes, offsets, owned = _chunk_layout(t.device_mesh, tuple(t.placements), shape, rank, where)
    local = _local(t)
    if tuple(local.shape) != sizes:
        raise ValueError(f"{_named(where)}: the DTensor's local shape {tuple(local.shape)} disagrees with the {sizes} "
                         "its mesh and placements give")
    return LocalChunk(local, offsets, shape, owned)


_layouts: dict[tuple, tuple[object, tuple[int, ...], tuple[int, ...], bool]] = {}
"""``_chunk_layout``'s answers by (mesh id, placements, shape, rank), each with its mesh (an id is reused only after
its mesh is gone: the entry is then a miss). A save of FSDP2 state asks for hundreds of DTensors each time; hashing a
``DeviceMesh`` (its ``__hash__``) and checking the placements again cost more than the copy of a small tensor."""
MAX_LAYOUTS = 65536


def _chunk_layout(mesh: object, placements: tuple, shape: tuple[int, ...], rank: int,
                  where: Where) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(sizes, offsets, owned) of this rank's chunk of a DTensor of this layout; the placements checked once."""
    key = (id(mesh), placements, shape, rank)
    hit = _layouts.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2], hit[3]
    _check_placements(placements, where)
    sizes, offsets = _region(mesh, placements, shape, rank)
    owned = _owned(mesh, placements, shape, rank)
    if len(_layouts) >= MAX_LAYOUTS:
        _layouts.clear()
    _layouts[key] = (mesh, sizes, offsets, owned)
    return sizes, offsets, owned


def global_rank() -> int:
    """Part of every cache key: a process that joins a new group under another rank must not reuse layouts."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _local(t: "DTensor") -> torch.Tensor:
    """The local shard without the autograd round trip of ``to_local()`` (a save reads, never differentiates)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


@functools.lru_cache(maxsize=65536)
def _owned(mesh: object, placements: tuple, shape: tuple[int, ...], rank: int) -> bool:
    """Whether this rank writes its chunk: decided by arithmetic alone, so it is cached per layout."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the tensor's mesh: it holds nothing
        return False
    sizes, _ = _region(mesh, placements, shape, rank)
    if math.prod(sizes) == 0:  # uneven sharding leaves some ranks nothing; an empty tensor still needs one chunk
        return math.prod(shape) == 0 and all(c == 0 for c in coordinate)
    return all(c == 0 for c, p in zip(coordinate, placements) if isinstance(p, Replicate))


def whole_chunk(t: torch.Tensor, rank: int) -> LocalChunk:
    """A tensor identical on every rank (``replicated=``): one chunk, written by rank 0."""
    return LocalChunk(t, (0,) * t.dim(), tuple(t.shape), owned=rank == 0)


def target_region(t: "DTensor", where: Where) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of ``t``'s local shard in its global tensor.

    Only ``Shard(d)`` and ``Replicate()`` placements describe a plain
    rectangular chunk; ``Partial`` (pending reduction) holds no saved value
    yet, and strided shards are not supported; both are refused naming the key.
    """
    placements = tuple(t.placements)
    _check_placements(placements, where)
    sizes, offsets = _region(t.device_mesh, placements, tuple(t.shape), global_rank())
    return offsets, sizes


def _check_placements(placements: tuple, where: Where) -> None:
    for p in placements:
        if p.is_partial():
            raise ValueError(f"{_named(where)} is a DTensor with a Partial placement ({p}): its value is a pending "
                             "reduction; redistribute it to Shard or Replicate before saving or loading")
        if type(p) not in (Shard, Replicate):
            raise TypeError(f"{_named(where)} is a DTensor with placement {p!r}; ckptd handles Shard(d) and Replicate()")


@functools.lru_cache(maxsize=65536)
def _region(mesh: object, placements: tuple, shape: tuple[int, ...],
            rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, offsets) of this rank's chunk: a pure function of the layout and this process's global rank,
    cached so a save of hundreds of DTensors pays torch's arithmetic once per layout, not per tensor per save."""
    if mesh.get_coordinate() is None:
        return (0,) * len(shape), (0,) * len(shape)
    sizes, offsets = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(sizes), tuple(offsets)
