"""``StorageWriter(stage_in_slot=True)`` stages before DCP plans: ``async_save`` returns while the plan is still
being made, and the checkpoint holds what was staged, whatever the plan keeps.

Two gloo ranks save an FSDP2 model with its AdamW state (whose ``step``
tensors are plain tensors on both ranks, so DCP's plan gives each to one rank
and the other's staged copy is dropped from its shard), a tensor identical on
both ranks and a sharded DTensor, through one client with one in-flight save.
A planner that waits for the caller proves the order: it plans only after
``async_save`` has returned, and the state is overwritten before it may. A
planner that makes copies of what it resolves, and one that fails on one rank
(the next save must get the slot and in-flight place back) complete the ways a
plan can meet a staged state. Last, three saves made in a row without waiting
must each hold the state as it was when it was made.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import ckptd
from ckptd.dcp import StorageWriter
from ckptd.protocol.names import INDEX_NAME
from helpers import equal_states, short_tempdir, start_daemon
from sharded_ranks import fsdp, full, run_rank, run_ranks

WAIT_S = 20.0
"""How long the waiting planner waits for the caller: only a writer that does not stage ahead waits this long."""


def _state(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    m, optim = fsdp(world)
    msd, osd = get_state_dict(m, optim)
    grid = torch.arange(6 * 5, dtype=torch.float64).reshape(6, 5)
    return {"model": msd, "optim": osd, "epoch": 3, "shared": torch.arange(7, dtype=torch.int32),
            "grid": distribute_tensor(grid, init_device_mesh("cpu", (world,)), [Shard(1)])}


def _scribble(state: object, value: float = -1) -> None:
    if isinstance(state, dict):
        for v in state.values():
            _scribble(v, value)
    elif isinstance(state, torch.Tensor):
        with torch.no_grad():
            getattr(state, "_local_tensor", state).fill_(value)


def _holds_only(state: object, value: float) -> bool:
    if isinstance(state, dict):
        return all(_holds_only(v, value) for v in state.values())
    if isinstance(state, torch.Tensor):
        return bool((state == value).all())
    return True


class _WaitingPlanner(DefaultSavePlanner):
    """Plans only once the caller says ``async_save`` returned (or after ``WAIT_S``): ``after_return`` says which."""

    def __init__(self, returned: threading.Event) -> None:
        super().__init__()
        self.returned = returned
        self.after_return: bool | None = None

    def create_local_plan(self):  # noqa: ANN201
        self.after_return = self.returned.wait(WAIT_S)
        return super().create_local_plan()


class _CopyingPlanner(DefaultSavePlanner):
    """Resolves every tensor to a copy: nothing it hands the writer is in the slot."""

    def transform_object(self, write_item, object):  # noqa: ANN001, ANN201, A002
        out = super().transform_object(write_item, object)
        return out.clone() if isinstance(out, torch.Tensor) else out


class _FailingPlanner(DefaultSavePlanner):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def create_local_plan(self):  # noqa: ANN201
        if self.rank == 1:
            raise RuntimeError("planner refused on rank 1")
        return super().create_local_plan()


def _body(rank: int, world: int, init: str, run_dir: str, root: str, out: str) -> None:
    def body() -> dict:
        state = _state(rank, world)
        reference = full(state)
        if rank == 0:
            torch.save(reference, Path(out) / "reference.pt")
        # One save in flight and a short commit timeout: a slot or place that a failed save kept is a Busy.
        with ckptd.Client(run_dir=run_dir, max_inflight=1, commit_timeout=20) as client:
            log: dict = {}
            for name in ("first", "waiting"):  # the first save makes the slot; the second reuses it
                returned = threading.Event()
                planner = _WaitingPlanner(returned)
                upload = dcp.async_save(state, storage_writer=StorageWriter(Path(root, name), client=client,
                                                                            stage_in_slot=True), planner=planner)
                returned.set()
                if name == "waiting":
                    _scribble(state)  # after the return, before the plan: none of it may reach the checkpoint
                upload.result(120)
                log[name] = planner.after_return
            writer = StorageWriter(Path(root, "failed"), client=client, stage_in_slot=True)
            failing = dcp.async_save(reference, storage_writer=writer, planner=_FailingPlanner(rank))
            with pytest.raises(CheckpointException, match="planner refused on rank 1"):
                failing.result(120)
            # The same writer saves again, and its close waits for that save (it was in flight).
            dcp.async_save(reference, storage_writer=writer, checkpoint_id=Path(root, "retried"))
            writer.close()
            log["retried_closed"] = (Path(root, "retried") / INDEX_NAME).is_file()
            state = _state(rank, world)
            copying = dcp.async_save(state, storage_writer=StorageWriter(Path(root, "copied"), client=client,
                                                                         stage_in_slot=True),
                                     planner=_CopyingPlanner())
            _scribble(state)
            copying.result(120)
        # Saves in a row, none waited for: two in flight, the third waits for a place. Each plans with
        # collectives on the same group, on a thread of its own; they must take turns, in the order they were
        # made, on every rank.
        with ckptd.Client(run_dir=run_dir, max_inflight=2, commit_timeout=60) as client:
            uploads = []
            for i in range(3):
                _scribble(state, i)
                uploads.append(dcp.async_save(state, storage_writer=StorageWriter(Path(root, f"row-{i}"),
                                                                                  client=client, stage_in_slot=True)))
            _scribble(state, 7)
            for upload in uploads:
                upload.result(60)
        return log

    run_rank(rank, world, init, out, "ahead", body)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    root, run_dir = tmp_path_factory.mktemp("dcpa") / "ckpts", short_tempdir("ckdcpa-")
    root.mkdir()
    daemon = start_daemon(run_dir, root)
    out = tmp_path_factory.mktemp("dcpa-out")
    try:
        logs = run_ranks(_body, 2, out, "ahead", str(run_dir), str(root), str(out))
    finally:
        daemon.kill()
    return root, torch.load(out / "reference.pt"), logs


def test_async_save_returns_before_dcp_plans_and_later_changes_are_not_saved(saved):
    root, reference, logs = saved
    assert [log["waiting"] for log in logs] == [True, True], logs  # planned after async_save returned
    assert [log["first"] for log in logs] == [True, True], logs  # the slot's first save too
    assert equal_states(ckptd.load(root / "waiting"), reference)


def test_what_the_plan_gives_another_rank_leaves_the_shard_and_the_rest_moves_into_place(saved):
    root, reference, _ = saved
    loaded = ckptd.load(root / "waiting")
    assert torch.equal(loaded["shared"], reference["shared"])
    assert loaded["optim"]["state"] and equal_states(loaded["optim"], reference["optim"])
    shards = sorted((root / "waiting").glob("*.safetensors"))
    assert len(shards) == 2
    from safetensors import safe_open
    names = [set(safe_open(str(p), "pt").keys()) for p in shards]
    assert "shared" in names[0] ^ names[1]  # written by one rank only


def test_a_planner_that_copies_what_it_resolves_still_saves_what_was_staged(saved):
    root, reference, _ = saved
    assert equal_states(ckptd.load(root / "copied"), reference)


def test_a_plan_that_fails_gives_the_slot_and_place_back_and_leaves_nothing(saved):
    root, reference, logs = saved
    assert not any(p.name.startswith("failed") for p in root.iterdir())
    assert (root / "copied").is_dir()  # the save after it got the one in-flight place
    assert equal_states(ckptd.load(root / "retried"), reference)  # the failed save's writer saved again


def test_closing_a_writer_waits_for_its_save_in_flight(saved):
    _, _, logs = saved
    assert [log["retried_closed"] for log in logs] == [True, True], logs


def test_saves_made_in_a_row_without_waiting_each_hold_their_own_state(saved):
    root, _, _ = saved
    for i in range(3):
        loaded = ckptd.load(root / f"row-{i}")
        assert _holds_only(loaded, i) and loaded["grid"].numel() == 30, i
