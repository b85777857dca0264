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

import ctypes
import os
from collections import defaultdict
from dataclasses import dataclass, field
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


@dataclass
class _Cached:
    """One layout of ``LayoutCache``, with what is derived from it."""

    key: tuple
    layout: ShardLayout
    order: list[int]
    """For each entry of the layout, the index of its tensor in ``Flat.tensors``."""
    on_host: bool
    """Every tensor of the layout is on the host: one batched copy stages them all."""
    table: CheckedTable | None = None
    views: dict[int, tuple[Slot, list[torch.Tensor]]] = field(default_factory=dict)


class LayoutCache:
    """The last layouts, and the slot views of their tensors, reused while the state's structure is unchanged.

    A training loop saves the same structure every time; planning the layout,
    encoding the header and making one view per tensor cost a millisecond per
    few hundred tensors, more than copying small ones. The key is everything
    the layout depends on: the packed structure (names, nesting, plain
    values), each tensor's dtype and shape, and the chunk metadata. Two are
    kept: a DCP save stages every local tensor ahead of DCP's plan, then lays
    out the planned ones (``Client._stage_ahead``), two structures a save.
    """

    KEPT = 2

    def __init__(self) -> None:
        self._cached: list[_Cached] = []
        """Most recently used first."""

    def layout(self, flat: Flat) -> ShardLayout:
        """Where each tensor of ``flat`` goes in the shard."""
        key = (flat.structure, tuple((name, t.dtype, t.shape, t.is_cpu) for name, t in flat.tensors),
               tuple(sorted(flat.chunks.items())), tuple(sorted(flat.global_shapes.items())))
        hit = next((c for c in self._cached if c.key == key), None)
        if hit is None:
            specs = [(name, SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for name, t in flat.tensors]
            layout = plan_layout(specs, flat.metadata())
            index = {name: i for i, (name, _) in enumerate(flat.tensors)}
            hit = _Cached(key, layout, [index[e.name] for e in layout.entries], all(t.is_cpu for _, t in flat.tensors))
        self._cached = [hit] + [c for c in self._cached if c is not hit][: self.KEPT - 1]
        return hit.layout

    def _of(self, layout: ShardLayout) -> _Cached | None:
        return next((c for c in self._cached if c.layout is layout), None)

    def copy(self, flat: Flat, layout: ShardLayout, slot: Slot) -> bool:
        """Stage ``flat`` into ``slot`` in one batched host copy (no Python per tensor) if ``layout`` is a cached
        one and every tensor is on the host; False where ``stage`` must do it."""
        cached = self._of(layout)
        if cached is None or not cached.on_host or slot.fresh:
            return False
        tensors, views = flat.tensors, self.views(layout, slot)
        if views:
            with torch.no_grad():
                torch._foreach_copy_(views, [tensors[i][1] for i in cached.order])
        return True

    def table(self, layout: ShardLayout) -> CheckedTable:
        """``layout``'s tensor table, checked (as the daemon checks it) once per layout; its digest names it."""
        cached = self._of(layout)
        if cached is None:
            return validate_entries(layout.entries, layout.nbytes - layout.data_start)
        if cached.table is None:
            cached.table = validate_entries(layout.entries, layout.nbytes - layout.data_start)
        return cached.table

    def views(self, layout: ShardLayout, slot: Slot) -> list[torch.Tensor]:
        """Typed views of ``slot`` for each entry of ``layout``, in entry order; the header written.

        Cached per slot while the layout is cached, and only while the slot
        holds that layout's header: views made for one layout are dropped
        from every other, whose header they overwrote.
        """
        cached = self._of(layout)
        views = cached.views.get(id(slot)) if cached is not None else None
        if views is None or views[0] is not slot:
            write_header(layout, slot)
            buf, start = slot.tensor, layout.data_start
            views = (slot, [buf[start + e.begin : start + e.end].view(TORCH_DTYPES[e.dtype]).view(e.shape)
                            for e in layout.entries])
            for other in self._cached:
                other.views.pop(id(slot), None)
            if cached is not None:
                cached.views[id(slot)] = views
        return views[1]


    def restage(self, flat: Flat, layout: ShardLayout, slot: Slot) -> bool:
        """Lay ``flat`` out in ``slot`` as ``layout`` where its tensors are in that slot already (copied ahead of
        the save, ``Client._stage_ahead``): each moves to its place, then the header is written. False, the slot
        untouched, where that cannot be done in place (a tensor elsewhere, or one that would have to move up).

        Ahead, every local tensor was staged; the save may keep fewer (DCP
        gives a tensor several ranks hold to one of them), so each one left
        moves down by the bytes dropped before it, and nothing when none was.
        Moved in file order, no move overwrites a tensor still to be moved.
        """
        base, by_name, moves = slot.tensor.data_ptr(), dict(flat.tensors), []
        for entry in layout.entries:
            if entry.nbytes == 0:
                continue
            src = by_name[entry.name]
            at = src.data_ptr() - base
            if not src.is_cpu or not src.is_contiguous() or at < 0 or at + entry.nbytes > slot.size:
                return False
            moves.append((layout.data_start + entry.begin, at, entry.nbytes))
        if any(to > at for to, at, _ in moves) or any(a[1] + a[2] > b[1] for a, b in zip(moves, moves[1:])):
            return False
        for to, at, n in moves:
            if to != at:
                ctypes.memmove(base + to, base + at, n)
        cached = self._of(layout)
        if cached is None or cached.views.get(id(slot), (None,))[0] is not slot:
            self.views(layout, slot)  # writes the header, after the moves: it may cover where a tensor was
        return True


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
