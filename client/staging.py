"""Copying a flattened state into a slot as a finished safetensors file.

This is the part of a save the training step may wait on, so it does one
pass of ``copy_`` per tensor into the slot's pre-faulted memory and nothing
else: no intermediate buffers, no per-element Python work. ``copy_`` handles
non-contiguous tensors, other devices (a device-to-host copy) and dtypes of
any element size.
"""

from __future__ import annotations

import torch

from ckptd.protocol.layout import ShardLayout, plan_layout

from .dtypes import SAFETENSORS_DTYPES
from .flatten import Flat
from .slots import Slot


def layout_for(flat: Flat) -> ShardLayout:
    """Where each tensor of ``flat`` goes in the shard."""
    specs = [(name, SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for name, t in flat.tensors]
    return plan_layout(specs, flat.metadata())


def stage(flat: Flat, layout: ShardLayout, slot: Slot) -> None:
    """Write header and tensor bytes of the shard into ``slot``."""
    assert slot.size >= layout.nbytes, "slot too small for the shard"
    buf = slot.tensor
    start = layout.data_start
    buf[:start].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
    by_name = dict(flat.tensors)
    for entry in layout.entries:
        if entry.nbytes == 0:
            continue
        src = by_name[entry.name].detach()
        dst = buf[start + entry.begin : start + entry.end].view(src.dtype).view(src.shape)
        dst.copy_(src)
