"""Admission checks a slot's header against its commit; a reused slot's unchanged header is not parsed again,
and a changed one (or a commit that no longer matches it) is checked in full."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ckptd.admission import examine
from ckptd.protocol.errors import BadSlot
from ckptd.protocol.messages import WriteShard
from ckptd.slot_maps import SlotMaps
from ckptd.routed import Routed
from ckptd.storage import LocalStorage
from ckptd.client.flatten import flatten
from ckptd.client.slots import Slot
from ckptd.client.staging import layout_for, write_header


def commit_for(slot: Slot, layout, root, **change) -> WriteShard:
    c = WriteShard(1, slot.name, layout.nbytes, layout.data_start, layout.entries, str(root / "ckpt"), 0, 1, None, False,
               False, None, 60.0, 0.0, layout.nbytes)
    return dataclasses.replace(c, **change)


def test_a_reused_slot_header_is_checked_against_every_commit(tmp_path) -> None:
    slot, maps, storage = Slot(1 << 20), SlotMaps(), Routed(LocalStorage())
    try:
        first = layout_for(flatten({f"t{i}": torch.ones(8) for i in range(50)}))
        write_header(first, slot)

        def check(msg: WriteShard) -> tuple | None:
            mapped = examine(storage, maps, msg, pid=os.getpid(), roots=(tmp_path,)).slot
            maps.release(mapped)
            return mapped.header
        parsed = check(commit_for(slot, first, tmp_path))
        assert check(commit_for(slot, first, tmp_path))[2] is parsed[2]  # the same header again: not parsed again
        renamed = tuple(dataclasses.replace(e, name=e.name + "x") if i == 0 else e for i, e in enumerate(first.entries))
        with pytest.raises(BadSlot, match="does not match the commit's tensor table"):
            check(commit_for(slot, first, tmp_path, tensors=renamed))
        second = layout_for(flatten({f"u{i}": torch.ones(8) for i in range(50)}))  # same sizes, other names
        assert (second.nbytes, second.data_start) == (first.nbytes, first.data_start)
        write_header(second, slot)
        with pytest.raises(BadSlot, match="does not match"):  # the old table against the new header
            check(commit_for(slot, first, tmp_path))
        check(commit_for(slot, second, tmp_path))
    finally:
        slot.close()


def test_a_held_slot_given_back_stays_mapped_for_its_clients_next_save() -> None:
    """A snapshot's slot is renamed to the daemon's name while held and back when dropped; the client's next save
    into it must find the daemon's mapping (a fresh MAP_POPULATE of a big slot cost each snapshot tens of ms)."""
    slot, maps = Slot(1 << 20), SlotMaps()
    try:
        mapped = maps.acquire(slot.name, pid=os.getpid(), nbytes=4096)
        maps.adopt(mapped, f"{slot.name}-held")
        assert not slot.path.exists()
        maps.give_back(mapped, slot.name)
        assert slot.path.exists() and not mapped.map.closed
        assert maps.acquire(slot.name, pid=os.getpid(), nbytes=4096) is mapped
    finally:
        slot.close()
