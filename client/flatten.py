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
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import torch

from ckptd.protocol.index import STRUCTURE_KEY

from .dtypes import SAFETENSORS_DTYPES

EXT_TENSOR = 1
EXT_TUPLE = 2
EXT_DTYPE = 3
EXT_SIZE = 4
EXT_ORDERED_DICT = 5
_KEY_TYPES = (str, int, float, bool, type(None))
_MSGPACK_INT = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class Flat:
    """A flattened state: tensors by unique name, and the packed structure."""

    tensors: list[tuple[str, torch.Tensor]]
    structure: bytes

    def metadata(self) -> dict[str, str]:
        return {"format": "pt", STRUCTURE_KEY: base64.b64encode(self.structure).decode()}


def _describe(path: list[Any]) -> str:
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


def flatten(state: Any) -> Flat:
    """Split ``state`` into named tensors and a structure description."""
    tensors: list[tuple[str, torch.Tensor]] = []
    names: set[str] = set()
    by_identity: dict[int, str] = {}

    def name_for(path: list[Any]) -> str:
        base = ".".join(str(p) for p in path) or "tensor"
        name, n = base, 1
        while name in names:
            name, n = f"{base}#{n}", n + 1
        names.add(name)
        return name

    def walk(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in by_identity:  # the same tensor object twice: stored once
                return msgpack.ExtType(EXT_TENSOR, by_identity[id(obj)].encode())
            _check_tensor(obj, path)
            name = name_for(path)
            by_identity[id(obj)] = name
            tensors.append((name, obj))
            return msgpack.ExtType(EXT_TENSOR, name.encode())
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
        if isinstance(obj, torch.Size):
            return msgpack.ExtType(EXT_SIZE, msgpack.packb(list(obj)))
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            items = [walk(v, path + [i]) for i, v in enumerate(obj)]
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
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
    return Flat(tensors, packed)


def _check_tensor(t: torch.Tensor, path: list[Any]) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{_describe(path)} is a {t.layout} tensor; only dense (strided) tensors can be saved")
    if t.dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"{_describe(path)} has dtype {t.dtype}, which safetensors cannot hold")
    if t.device.type == "meta":
        raise TypeError(f"{_describe(path)} is on the meta device and holds no data")
    if t.is_quantized:
        raise TypeError(f"{_describe(path)} is a quantized tensor; dequantize it first")


def unflatten(structure: bytes, tensor_for: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild the tree described by ``structure``; ``tensor_for(name)`` supplies tensors."""

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            return tensor_for(data.decode())
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


def structure_from_metadata(metadata: dict[str, str]) -> bytes | None:
    raw = metadata.get(STRUCTURE_KEY)
    return base64.b64decode(raw) if raw is not None else None
