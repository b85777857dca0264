"""Copying a flattened state into a slot as a finished safetensors file.

This is the part of a save the training step may wait on, so it does one
pass of ``copy_`` per tensor into the slot's pre-faulted memory and nothing
else: no intermediate buffers, no per-element Python work. ``copy_`` handles
non-contiguous tensors and every element size.

CUDA tensors are copied on a side stream, non-blocking, into the slot after
it has been registered as pinned memory (``cudaHostRegister``), so the
copies run at full PCIe speed while the caller goes on. ``stage`` then
returns ``DeviceCopies``; the save is staged (and may be committed) only once
``wait()`` returns. The side stream first waits for the caller's current
stream, so the copies see the values the training step produced. Tensors on
other devices are copied synchronously.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from ckptd.protocol.layout import CheckedTable, ShardLayout, plan_layout, validate_entries

from .dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES
from .flatten import Flat
from .slots import Slot

_side_streams: dict[torch.device, "torch.cuda.Stream"] = {}

STREAM_MIN_BYTES = 64 * 1024 * 1024
"""Shards at least this big are committed before the copy and streamed (see ``stage``)."""
PROGRESS_EVERY = 64 * 1024 * 1024
"""Bytes copied between progress reports while streaming."""


class LayoutCache:
    """The last layout, and the slot views of its tensors, reused while the state's structure is unchanged.

    A training loop saves the same structure every time; planning the layout,
    encoding the header and making one view per tensor cost a millisecond per
    few hundred tensors, more than copying small ones. The key is everything
    the layout depends on: the packed structure (names, nesting, plain
    values), each tensor's dtype and shape, and the chunk metadata.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._layout: ShardLayout | None = None
        self._table: CheckedTable | None = None
        self._order: list[int] = []
        """For each entry of the layout, the index of its tensor in ``Flat.tensors``."""
        self._on_host = False
        """Every tensor of the layout is on the host: one batched copy stages them all."""
        self._views: dict[int, tuple[Slot, list[torch.Tensor]]] = {}

    def layout(self, flat: Flat) -> ShardLayout:
        """Where each tensor of ``flat`` goes in the shard."""
        key = (flat.structure, tuple((name, t.dtype, t.shape, t.is_cpu) for name, t in flat.tensors),
               tuple(sorted(flat.chunks.items())), tuple(sorted(flat.global_shapes.items())))
        if key != self._key:
            specs = [(name, SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for name, t in flat.tensors]
            layout = plan_layout(specs, flat.metadata())
            index = {name: i for i, (name, _) in enumerate(flat.tensors)}
            self._key, self._layout, self._table, self._views = key, layout, None, {}
            self._order = [index[e.name] for e in layout.entries]
            self._on_host = all(t.is_cpu for _, t in flat.tensors)
        assert self._layout is not None
        return self._layout

    def copy(self, flat: Flat, layout: ShardLayout, slot: Slot) -> bool:
        """Stage ``flat`` into ``slot`` in one batched host copy (no Python per tensor) if ``layout`` is the cached
        one and every tensor is on the host; False where ``stage`` must do it."""
        if layout is not self._layout or not self._on_host or slot.fresh:
            return False
        tensors, views = flat.tensors, self.views(layout, slot)
        if views:
            with torch.no_grad():
                torch._foreach_copy_(views, [tensors[i][1] for i in self._order])
        return True

    def table(self, layout: ShardLayout) -> CheckedTable:
        """``layout``'s tensor table, checked (as the daemon checks it) once per layout; its digest names it."""
        if layout is not self._layout:
            return validate_entries(layout.entries, layout.nbytes - layout.data_start)
        if self._table is None:
            self._table = validate_entries(layout.entries, layout.nbytes - layout.data_start)
        return self._table

    def views(self, layout: ShardLayout, slot: Slot) -> list[torch.Tensor]:
        """Typed views of ``slot`` for each entry of ``layout``, in entry order; the header written.

        Cached per slot while the layout is unchanged: a slot whose views are
        cached holds this layout's header already (the cache is dropped when
        the layout changes).
        """
        cached = self._views.get(id(slot))
        if cached is None or cached[0] is not slot or layout is not self._layout:
            write_header(layout, slot)
            buf, start = slot.tensor, layout.data_start
            cached = (slot, [buf[start + e.begin : start + e.end].view(TORCH_DTYPES[e.dtype]).view(e.shape)
                             for e in layout.entries])
            if layout is self._layout:
                self._views[id(slot)] = cached
        return cached[1]


def layout_for(flat: Flat) -> ShardLayout:
    """Where each tensor of ``flat`` goes in the shard (no cache)."""
    return LayoutCache().layout(flat)


@dataclass
class DeviceCopies:
    """Device-to-host copies still in flight on side streams."""

    events: list

    def wait(self) -> None:
        """Block until every copy has landed in the slot."""
        for event in self.events:
            event.synchronize()


def write_header(layout: ShardLayout, slot: Slot) -> None:
    """The shard's header into ``slot``: written to the file while the slot is fresh (its mapping untouched)."""
    assert slot.size >= layout.nbytes, "slot too small for the shard"
    if slot.fresh:
        slot.write(0, layout.header)
    else:
        slot.tensor[: layout.data_start].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))


def streamable(flat: Flat, layout: ShardLayout) -> bool:
    """Big, host-only shards can be committed first and written while they are copied."""
    return layout.nbytes >= STREAM_MIN_BYTES and all(t.device.type != "cuda" for _, t in flat.tensors)


def overlap_pays() -> bool:
    """Whether a streamed commit (the daemon writes while the copy runs) costs the caller nothing here.

    Only where torch's copy leaves a core to the daemon: torch copies on
    ``torch.get_num_threads()`` threads, and a core it shares with the
    daemon's writer holds the whole copy back. Measured on 2 cores (1 GiB,
    fastest of 8-10 saves): with torch on both, streaming blocked 0.103 s
    instead of 0.088 s (durable 0.42 s instead of 0.53 s); with torch on one
    (``torch.set_num_threads(1)``, as torchrun sets for several ranks a node),
    0.115 s either way, durable 0.40 s instead of 0.71 s.
    """
    return torch.get_num_threads() < len(os.sched_getaffinity(0))


def stage(flat: Flat, layout: ShardLayout, slot: Slot, progress: Callable[[int], None] | None = None,
          views: list[torch.Tensor] | None = None) -> DeviceCopies | None:
    """Copy every tensor into ``slot`` (after ``write_header``, or ``views``), in file order.

    Host copies go in batched calls (``torch._foreach_copy_``: no Python per
    tensor); with ``progress``, one batch per ``PROGRESS_EVERY`` bytes, each
    followed by ``progress(upto)``, the file offset below which the slot is
    final. ``views``: the slot's typed views per entry (``LayoutCache.views``).
    Returns the CUDA copies still running, if any. A fresh slot (a host-only
    state's first save into it) is written with ``pwritev`` instead
    (``Slot.fill``): none of its pages is allocated, zeroed or mapped yet.
    """
    if slot.fresh:
        slot.fill(flat, layout, progress)
        return None
    buf = slot.tensor
    start = layout.data_start
    by_name = dict(flat.tensors)
    reported = start
    on_cuda: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for i, entry in enumerate(layout.entries):
        if entry.nbytes == 0:
            continue
        src = by_name[entry.name].detach()
        dst = views[i] if views is not None else buf[start + entry.begin : start + entry.end].view(src.dtype).view(
            src.shape)
        if src.device.type == "cuda":
            on_cuda[src.device].append((dst, src))
            continue
        batch[0].append(dst)
        batch[1].append(src)
        if progress is not None and start + entry.end - reported >= PROGRESS_EVERY:
            torch._foreach_copy_(*batch)
            batch = ([], [])
            reported = start + entry.end
            progress(reported)
    if batch[0]:
        torch._foreach_copy_(*batch)
    if not on_cuda:
        return None
    slot.pin()
    return DeviceCopies([_copy_from_cuda(device, pairs) for device, pairs in on_cuda.items()])


def _copy_from_cuda(device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> "torch.cuda.Event":
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)  # the allocator must not reuse src before the copy ran
        event = torch.cuda.Event()
        event.record(stream)
    return event
