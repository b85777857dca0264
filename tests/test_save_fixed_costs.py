"""A save's fixed costs: the layout is planned once while the structure holds, slots can be reserved up front."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd.client.flatten import flatten
from ckptd.client.slots import Slot
from ckptd.client.staging import LayoutCache


def mixed(step: int) -> dict:
    """Mixed dtypes, a 0-dim and an empty tensor, a non-contiguous view: what the batched copy must get right."""
    base = torch.arange(24.0).reshape(4, 6)
    return {"w": base.t(), "i": torch.arange(5, dtype=torch.int64) * step, "h": torch.ones(3, dtype=torch.float16),
            "s": torch.tensor(float(step)), "e": torch.empty(0, 2), "step": step}


def test_one_client_saving_changing_structures_writes_each_as_it_was(client, root) -> None:
    states = [mixed(1), mixed(2),  # same structure, new values and a new plain value
              {**mixed(3), "w": torch.zeros(6, 5)},  # a shape changes
              {**mixed(4), "h": torch.ones(3, dtype=torch.bfloat16)},  # a dtype changes
              {**mixed(5), "extra": torch.ones(2)},  # a key is added
              mixed(6)]  # back to the first structure
    for i, state in enumerate(states):
        client.save_async(state, root / f"c{i}").result(30)
    for i, state in enumerate(states):
        loaded = ckptd.load(root / f"c{i}")
        assert loaded.keys() == state.keys() and loaded["step"] == state["step"]
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), (i, k)


def test_the_layout_and_slot_views_are_reused_while_the_structure_holds() -> None:
    cache, slot = LayoutCache(), Slot(1 << 20)
    try:
        first = cache.layout(flatten(mixed(1)))
        views = cache.views(first, slot)
        state = mixed(1)
        state["i"].add_(7)  # new values, same structure
        assert cache.layout(flatten(state)) is first and cache.views(first, slot) is views
        assert cache.layout(flatten(mixed(2))) is not first  # a plain value is part of the structure
        assert cache.layout(flatten({**mixed(1), "w": torch.zeros(6, 5)})) is not first
    finally:
        slot.close()


def test_a_reserved_slot_serves_the_first_save(daemon, client_factory, root) -> None:
    state = {"w": torch.arange(300_000.0)}
    client = client_factory(reserve_bytes=2 << 20)
    reserved = client.slot_names
    assert len(reserved) == 1  # made at construction, before any save
    client.save_async(state, root / "first").result(30)
    assert client.slot_names == reserved
    assert torch.equal(ckptd.load(root / "first")["w"], state["w"])
    client.save_async({"w": torch.zeros(1_000_000)}, root / "bigger").result(30)  # outgrows it: a new slot
    assert client.slot_names != reserved


@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError),
                                          (2**63 - 1, ValueError), (10**15, ckptd.NoSpace)])
def test_a_bad_reserve_bytes_is_refused_naming_it(daemon, run_dir, value, error) -> None:
    with pytest.raises(error, match="reserve_bytes"):
        ckptd.Client(run_dir=run_dir, spawn=False, reserve_bytes=value)

