"""The ``ckptd.structure`` metadata of a shard, read and checked without torch.

A shard's safetensors ``__metadata__`` holds the nested state as base64
msgpack, with tensors, tuples and torch dtypes as msgpack extension types.
The client builds it (``client/flatten.py``) and rebuilds the state from it
on load; ``ckptd verify`` must accept exactly what load accepts. So the
extension codes, the dtype names a structure may use, and the one check of a
structure against the tensors its shard holds all live here, where both the
loader and verify (which never imports torch) use them.
"""

from __future__ import annotations

import base64
import binascii
from typing import Iterable

import msgpack

from .errors import BadMessage

STRUCTURE_KEY = "ckptd.structure"
"""safetensors ``__metadata__`` key holding the base64 msgpack structure."""

EXT_TENSOR = 1
"""A reference to a tensor of the shard, by name (UTF-8)."""
EXT_TUPLE = 2
"""A tuple: its items, msgpack-packed."""
EXT_DTYPE = 3
"""A ``torch.dtype`` leaf, by its name without ``torch.`` (``float32``)."""
EXT_SIZE = 4
"""A ``torch.Size``: its dimensions, msgpack-packed."""
EXT_ORDERED_DICT = 5
"""An ``OrderedDict``: its map, msgpack-packed."""
EXT_GLOBAL = 6
"""A reference to a global tensor (DTensor, ``replicated=``) listed in the index, by name."""

TORCH_DTYPE_NAMES = frozenset({
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32",
    "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4",
    "int5", "int6", "int64", "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1",
    "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
})
"""Names a dtype leaf may carry: every ``torch.dtype`` (a test checks the
installed torch has no other), so verify needs no torch to check them."""


def structure_bytes(metadata: dict[str, str]) -> bytes:
    """The packed structure in a shard's metadata; ``BadMessage`` if absent or not base64."""
    raw = metadata.get(STRUCTURE_KEY)
    if raw is None:
        raise BadMessage(f"the header holds no {STRUCTURE_KEY} metadata (not written by ckptd?)")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadMessage(f"{STRUCTURE_KEY} is not base64: {exc}") from None


def check_structure(structure: bytes, tensor_names: Iterable[str], global_names: Iterable[str] = ()) -> None:
    """Check that ``structure`` decodes and references exactly what the shard holds.

    ``tensor_names`` are the tensors of the shard's header, ``global_names``
    the global tensors of the index. Every reference must name one of them,
    and every tensor of the header must be referenced (plainly, or as the
    chunk of a global tensor this rank owns). Raises ``BadMessage`` naming
    what is wrong: undecodable msgpack, an unknown extension type or dtype
    name, a tensor that is not there, or a tensor that nothing references.
    """
    present, known_globals = set(tensor_names), set(global_names)
    referenced: set[str] = set()

    def ext_hook(code: int, data: bytes) -> None:
        if code == EXT_TENSOR:
            name = data.decode()
            if name not in present:
                raise BadMessage(f"the structure names tensor {name!r}, which the header lacks")
            referenced.add(name)
        elif code == EXT_GLOBAL:
            name = data.decode()
            if name not in known_globals:
                raise BadMessage(f"the structure names global tensor {name!r}, which the index does not list")
            referenced.add(name)
        elif code in (EXT_TUPLE, EXT_SIZE, EXT_ORDERED_DICT):
            unpack(data)
        elif code == EXT_DTYPE:
            if data.decode() not in TORCH_DTYPE_NAMES:
                raise BadMessage(f"the structure names unknown torch dtype {data.decode()!r:.80}")
        else:
            raise BadMessage(f"the structure holds unknown extension type {code}")

    def unpack(data: bytes) -> None:
        msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook)

    try:
        unpack(structure)
    except BadMessage as exc:
        raise BadMessage(f"{STRUCTURE_KEY}: {exc.message}") from None
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        # UnicodeDecodeError is a ValueError; an unhashable map key is a TypeError
        raise BadMessage(f"{STRUCTURE_KEY} is not a valid structure: {exc or type(exc).__name__}") from None
    finally:
        del unpack  # ext_hook and unpack refer to each other: break the cycle
    unreferenced = sorted(present - referenced)
    if unreferenced:
        raise BadMessage(f"{STRUCTURE_KEY} references none of the tensors {unreferenced[:5]!r} that the header holds")
