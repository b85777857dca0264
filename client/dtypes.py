"""torch dtypes and the safetensors names they are stored under."""

from __future__ import annotations

import torch

from ckptd.protocol.layout import TensorEntry

_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
}

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): st for name, st in _NAMES.items() if hasattr(torch, name)
}
"""Every torch dtype this torch build has and safetensors can hold."""

TORCH_DTYPES: dict[str, torch.dtype] = {st: dt for dt, st in SAFETENSORS_DTYPES.items()}


def typed_view(raw: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` describes, viewing ``raw`` (its bytes, as uint8) without a copy."""
    return raw.view(TORCH_DTYPES[entry.dtype]).view(entry.shape)
