"""Chunks of global tensors: how a shard header describes them, and how they overlap.

A global tensor (a DTensor, or a tensor under a ``replicated=`` key) is saved
as chunks, each stored once, in the shard of the rank that owns it, under the
tensor's name. The shard header says which of its tensors are chunks:

* ``DCP_SHARDING_INFO`` (JSON, torch.distributed.checkpoint's safetensors
  convention): ``{name: {"saved_offsets": [...]}}`` for *every* tensor of the
  shard, per-rank tensors at offset zero, as DCP's ``HuggingFaceStorageReader``
  expects; ``DCP_VERSION`` is ``"1.0"``.
* ``ckptd.global`` (JSON): ``{name: [global shape...]}`` for the chunks only,
  which tells them apart from per-rank tensors and gives the full shape even
  when the chunk does not reach the tensor's end.

The committing daemon reads every shard's header and builds the index's
tensor table from them (``tensor_table``); loaders plan reads with
``overlap``. No torch here: the daemon uses it too.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping, Sequence

from .index import ChunkRecord, TensorRecord, check_chunk, check_tiling
from .layout import TensorEntry

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
SAVED_OFFSETS_KEY = "saved_offsets"
DCP_VERSION_KEY = "DCP_VERSION"
DCP_VERSION = "1.0"
GLOBAL_KEY = "ckptd.global"

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A region of a tensor: (offsets, sizes)."""


def chunk_metadata(entries: Iterable[tuple[str, int]], chunks: Mapping[str, Box],
                   global_shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Header metadata for a shard holding ``chunks`` (name -> box) among ``entries`` ((name, ndim)).

    Empty when the shard holds no chunk, so per-rank-only shards keep the
    version-1 header.
    """
    if not chunks:
        return {}
    info = {name: {SAVED_OFFSETS_KEY: list(chunks[name][0]) if name in chunks else [0] * ndim}
            for name, ndim in entries}
    return {
        SHARDING_INFO_KEY: json.dumps(info, separators=(",", ":")),
        DCP_VERSION_KEY: DCP_VERSION,
        GLOBAL_KEY: json.dumps({name: list(global_shapes[name]) for name in chunks}, separators=(",", ":")),
    }


def tensor_table(shards: Iterable[tuple[str, int, Sequence[TensorEntry], Mapping[str, str], int]]
                 ) -> dict[str, TensorRecord]:
    """The index's global tensors from every shard's ``(file, size, entries, metadata, data_start)``.

    Raises ``ValueError`` naming the file and tensor when a header's chunk
    metadata is malformed, two shards disagree on a tensor's shape or dtype,
    or the chunks do not tile the tensor exactly once.
    """
    shards = list(shards)
    sizes = {file: size for file, size, *_ in shards}
    found: dict[str, tuple[str, tuple[int, ...], list[ChunkRecord]]] = {}
    for file, _, entries, metadata, data_start in shards:
        if GLOBAL_KEY not in metadata:
            continue
        try:
            shapes = json.loads(metadata[GLOBAL_KEY])
            info = json.loads(metadata[SHARDING_INFO_KEY])
        except (KeyError, ValueError, RecursionError) as exc:
            raise ValueError(f"{file}: chunk metadata is not readable ({exc})") from None
        if not isinstance(shapes, dict) or not isinstance(info, dict):
            raise ValueError(f"{file}: {GLOBAL_KEY} and {SHARDING_INFO_KEY} must be JSON objects")
        by_name = {e.name: e for e in entries}
        for name, shape in shapes.items():
            entry, offsets = by_name.get(name), (info.get(name) or {}).get(SAVED_OFFSETS_KEY)
            if entry is None or not _ints(shape) or not _ints(offsets):
                raise ValueError(f"{file}: chunk {name!r} lacks a tensor, a global shape or saved_offsets")
            chunk = ChunkRecord(file, tuple(offsets), entry.shape, data_start + entry.begin, data_start + entry.end)
            check_chunk(name, entry.dtype, tuple(shape), chunk, sizes)
            dtype, known_shape, chunks = found.setdefault(name, (entry.dtype, tuple(shape), []))
            if (dtype, known_shape) != (entry.dtype, tuple(shape)):
                raise ValueError(f"{file}: {name!r} is {entry.dtype}{list(shape)} here but "
                                 f"{dtype}{list(known_shape)} in another shard")
            chunks.append(chunk)
    for name, (_, shape, chunks) in found.items():
        check_tiling(name, shape, chunks)
    return {name: TensorRecord(dtype, shape, tuple(chunks)) for name, (dtype, shape, chunks) in sorted(found.items())}


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def overlap(a: Box, b: Box) -> Box | None:
    """The region two boxes share, or None when they share no element."""
    starts = tuple(max(ao, bo) for ao, bo in zip(a[0], b[0]))
    ends = tuple(min(ao + an, bo + bn) for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]))
    if any(e <= s for s, e in zip(starts, ends)):
        return None
    return starts, tuple(e - s for s, e in zip(starts, ends))
