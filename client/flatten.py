"""State dict <-> (named tensors, structure description).

A state dict is a tree of dicts, lists and tuples whose leaves are tensors or
plain values. ``flatten`` names every tensor by its key path (``model.fc.
weight``, ``optimizer.state.0.exp_avg``) and describes the tree in msgpack,
with tensors replaced by references to their names. The description travels
in the shard's safetensors ``__metadata__``; ``unflatten`` rebuilds the same
tree with the same Python types: ``OrderedDict`` and ``torch.Size`` have
extension types of their own; other dict and tuple subclasses come back as
plain ``dict`` and ``tuple`` (named tuples are refused).

Anything msgpack cannot carry faithfully is refused with the key path that
holds it, before a byte is staged.

Global tensors (DTensors, and every tensor under a ``replicated`` top-level
key) are referenced as ``EXT_GLOBAL``: their chunks are listed in the index,
and this rank stages only the chunk it owns (see ``sharding``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch

from ckptd.protocol.chunks import Box, chunk_metadata
from ckptd.protocol.messages import REPLICATED_DIGEST_LEN
from ckptd.protocol.structure import (
    EXT_DTYPE,
    EXT_GLOBAL,
    EXT_ORDERED_DICT,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    STRUCTURE_KEY,
)

from .dtypes import SAFETENSORS_DTYPES
from .sharding import LocalChunk, dtensor_chunk, global_rank, is_dtensor, whole_chunk

_KEY_TYPES = (str, int, float, bool, type(None))
_MSGPACK_INT = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class Flat:
    """A flattened state: tensors by unique name, and the packed structure."""

    tensors: list[tuple[str, torch.Tensor]]
    """What this rank stages: per-rank tensors and the global chunks it owns."""
    structure: bytes
    chunks: dict[str, Box] = field(default_factory=dict)
    """Owned chunks of global tensors among ``tensors``: name -> (offsets, sizes)."""
    global_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    """Per ``replicated=`` key, a digest of its tensors' names, shapes and dtypes: the daemon checks that
    every rank sends the same (rank 0 writes them for all)."""

    def metadata(self) -> dict[str, str]:
        dims = ((name, t.dim()) for name, t in self.tensors)
        return {"format": "pt", STRUCTURE_KEY: base64.b64encode(self.structure).decode(),
                **chunk_metadata(dims, self.chunks, self.global_shapes)}


def _describe(path: list[Any]) -> str:
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


def flatten(state: Any, *, replicated: tuple[str, ...] = (), rank: int = 0,
            written_elsewhere: dict[int, str] | None = None) -> Flat:
    """Split ``state`` into named tensors and a structure description.

    Tensors under the top-level keys in ``replicated`` are global tensors
    written by rank 0 only; DTensors anywhere are global tensors whose
    chunks their owners write. ``written_elsewhere`` (tensor id -> name):
    global tensors whose chunks another plan places (DCP's, for
    ``ckptd.dcp.StorageWriter``); the structure only names them.
    """
    _check_replicated(state, replicated)
    this_rank = global_rank()  # once per save, not per DTensor
    tensors: list[tuple[str, torch.Tensor]] = []
    names: set[str] = set()
    by_identity: dict[int, msgpack.ExtType] = {}
    chunks: dict[str, Box] = {}
    global_shapes: dict[str, tuple[int, ...]] = {}
    under_replicated: dict[str, list[tuple[str, str, list[int]]]] = {key: [] for key in replicated}
    inside: set[int] = set()
    """The containers on the path being walked: one met again inside itself is a cycle, refused."""

    def global_ref(chunk: LocalChunk, path: list[Any]) -> msgpack.ExtType:
        check_tensor(chunk.local, path)
        name = name_for(path)
        if chunk.owned:
            tensors.append((name, chunk.local))
            chunks[name] = chunk.box
            global_shapes[name] = chunk.global_shape
        return msgpack.ExtType(EXT_GLOBAL, name.encode())

    def name_for(path: list[Any]) -> str:
        base = ".".join(map(str, path)) or "tensor"
        name, n = base, 1
        while name in names:
            name, n = f"{base}#{n}", n + 1
        names.add(name)
        return name

    def walk(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            if written_elsewhere is not None and id(obj) in written_elsewhere:
                return msgpack.ExtType(EXT_GLOBAL, written_elsewhere[id(obj)].encode())
            if id(obj) in by_identity:  # the same tensor object twice: stored once
                return by_identity[id(obj)]
            if type(obj) is not torch.Tensor and is_dtensor(obj):  # a plain tensor needs no isinstance
                ref = global_ref(dtensor_chunk(obj, lambda: _describe(path), this_rank), path)
            elif path and path[0] in replicated:
                ref = global_ref(whole_chunk(obj, rank), path)
                under_replicated[path[0]].append((ref.data.decode(), str(obj.dtype), list(obj.shape)))
            else:
                check_tensor(obj, path)
                name = name_for(path)
                tensors.append((name, obj))
                ref = _tensor_ref(name)
            by_identity[id(obj)] = ref
            return ref
        if isinstance(obj, (dict, list)) or isinstance(obj, tuple) and not isinstance(obj, torch.Size):
            if id(obj) in inside:
                raise TypeError(f"{_describe(path)} is a container that holds itself (a reference cycle), which "
                                f"ckptd cannot save")
            inside.add(id(obj))
            walked = container(obj, path)
            inside.discard(id(obj))
            return walked
        if isinstance(obj, torch.Size):
            return msgpack.ExtType(EXT_SIZE, msgpack.packb(list(obj)))
        return leaf(obj, path)

    def container(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, dict):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, _KEY_TYPES):
                    raise TypeError(f"{_describe(path)} has a key of type {type(k).__name__}; keys must be str, int, float, bool or None")
                out[k] = walk(v, path + [k])
            if isinstance(obj, OrderedDict):  # module.state_dict() is one; it loads back as one
                return msgpack.ExtType(EXT_ORDERED_DICT, msgpack.packb(out, use_bin_type=True))
            return out
        if isinstance(obj, list):
            return [walk(v, path + [i]) for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):  # a named tuple: refused, naming its type
            return leaf(obj, path)
        items = [walk(v, path + [i]) for i, v in enumerate(obj)]
        return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))

    def leaf(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, torch.dtype):
            return msgpack.ExtType(EXT_DTYPE, str(obj).removeprefix("torch.").encode())
        if obj is None or type(obj) in (bool, float, str, bytes):
            return obj
        if type(obj) is int:
            if not _MSGPACK_INT[0] <= obj <= _MSGPACK_INT[1]:
                raise ValueError(f"{_describe(path)} holds an int outside the 64-bit range: {obj}")
            return obj
        raise TypeError(
            f"{_describe(path)} holds a {type(obj).__module__}.{type(obj).__qualname__}, which ckptd cannot save; "
            "use tensors, dicts, lists, tuples, str, bytes, int, float, bool, None or torch.dtype"
        )

    packed = msgpack.packb(walk(state, []), use_bin_type=True)
    digests = {key: _digest(rows) for key, rows in under_replicated.items()}
    return Flat(tensors, packed, chunks, global_shapes, digests)


def _digest(rows: list[tuple[str, str, list[int]]]) -> str:
    """What ranks must agree on under one replicated key, in ``REPLICATED_DIGEST_LEN`` hex characters."""
    return hashlib.blake2b(json.dumps(rows).encode(), digest_size=REPLICATED_DIGEST_LEN // 2).hexdigest()


def _check_replicated(state: Any, replicated: tuple[str, ...]) -> None:
    if isinstance(replicated, (str, bytes)) or not all(isinstance(k, str) for k in replicated):
        raise TypeError(f"replicated must be a tuple of top-level keys (str), got {replicated!r}")
    if replicated and not isinstance(state, dict):
        raise TypeError(f"replicated={tuple(replicated)!r} needs a dict state, got {type(state).__name__}")
    missing = [k for k in replicated if k not in state]
    if missing:
        raise ValueError(f"replicated names keys the state does not hold: {missing} (it holds {list(state)})")


@functools.lru_cache(maxsize=1 << 16)
def _tensor_ref(name: str) -> msgpack.ExtType:
    """The structure's reference to tensor ``name``: the same names every save, made once (they are immutable)."""
    return msgpack.ExtType(EXT_TENSOR, name.encode())


def check_tensor(t: torch.Tensor, path: list[Any]) -> None:
    if t.layout is torch.strided and t.dtype in SAFETENSORS_DTYPES and not t.is_meta:
        return  # what nearly every tensor is: three reads instead of four
    if t.layout != torch.strided:
        raise TypeError(f"{_describe(path)} is a {t.layout} tensor; only dense (strided) tensors can be saved")
    if t.dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"{_describe(path)} has dtype {t.dtype}, which safetensors cannot hold")
    if t.device.type == "meta":
        raise TypeError(f"{_describe(path)} is on the meta device and holds no data")
    if t.is_quantized:
        raise TypeError(f"{_describe(path)} is a quantized tensor; dequantize it first")


def unflatten(structure: bytes, tensor_for: Callable[[str], torch.Tensor],
              global_for: Callable[[str], Any] | None = None) -> Any:
    """Rebuild the tree described by ``structure``.

    ``tensor_for(name)`` supplies this shard's tensors, ``global_for(name)``
    global tensors (or what stands for them).
    """

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            return tensor_for(data.decode())
        if code == EXT_GLOBAL:
            if global_for is None:
                raise ValueError(f"structure names global tensor {data.decode()!r} but nothing resolves it")
            return global_for(data.decode())
        if code == EXT_TUPLE:
            return tuple(_unpack(data))
        if code == EXT_SIZE:
            return torch.Size(_unpack(data))
        if code == EXT_ORDERED_DICT:
            return OrderedDict(_unpack(data))
        if code == EXT_DTYPE:
            dtype = getattr(torch, data.decode(), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"structure names unknown torch dtype {data.decode()!r}")
            return dtype
        raise ValueError(f"structure holds unknown extension type {code}")

    def _unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook)

    try:
        return _unpack(structure)
    finally:
        del _unpack  # ext_hook and _unpack refer to each other: break the cycle, or the tensors wait for gc
