"""``ckptd.dcp.StorageWriter`` replaces a checkpoint already at its path, as DCP's ``FileSystemWriter`` does.

Real gloo ranks (one and two) save twice to one path with ``dcp.save``,
``dcp.async_save`` THREAD and PROCESS: the second save replaces the first
(``overwrite=True`` by default), and ``overwrite=False`` refuses and keeps it.
The state holds a tensor sharded over the ranks (each rank writes its own
chunk), so a checkpoint mixing two saves would show in its values. A replace
that fails (a rank's write, the swap at publish, the daemon killed at the
swap) leaves the old checkpoint whole at the path, and nothing else behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptd
from ckptd.dcp import StorageWriter
from helpers import equal_states, short_tempdir, start_daemon, wait_until
from sharded_ranks import run_rank, run_ranks

MODES = ("save", "thread", "process")
ROWS = 8
"""Rows of the sharded tensor: split over the ranks, each rank's chunk its own."""


def _state(value: float, world: int) -> dict:
    """Every tensor filled with ``value``; ``grid`` sharded by rows over ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    grid = distribute_tensor(torch.full((ROWS, 3), value), init_device_mesh("cpu", (world,)), [Shard(0)])
    return {"model": {"w": torch.full((5,), value)}, "grid": grid, "step": int(value), "note": f"save {value:g}"}


def expected(value: float) -> dict:
    """What ``ckptd.load`` of a checkpoint of ``_state(value, ...)`` holds."""
    return {"model": {"w": torch.full((5,), value)}, "grid": torch.full((ROWS, 3), value), "step": int(value),
            "note": f"save {value:g}"}


def _save(mode: str, state: dict, writer: StorageWriter) -> None:
    """One save through DCP, the way ``mode`` names, waited for."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if mode == "save":
        dcp.save(state, storage_writer=writer)
    else:
        kind = AsyncCheckpointerType.THREAD if mode == "thread" else AsyncCheckpointerType.PROCESS
        dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind).result(300)


def _save_twice(rank: int, world: int, init: str, run_dir: str, root: str, out: str) -> None:
    """For each mode: save 1.0, then 2.0 to the same path (replaced), then 3.0 with ``overwrite=False``."""
    def body() -> dict:
        refusals = {}
        with ckptd.Client(run_dir=run_dir, spawn=False, commit_timeout=120) as client:
            for mode in MODES:
                path = Path(root, mode)
                _save(mode, _state(1.0, world), StorageWriter(path, client=client))
                _save(mode, _state(2.0, world), StorageWriter(path, client=client))
                try:
                    _save(mode, _state(3.0, world), StorageWriter(path, client=client, overwrite=False))
                    refusals[mode] = "saved"
                except CheckpointException as exc:
                    refusals[mode] = str(exc)
        return refusals

    run_rank(rank, world, init, out, "twice", body)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_a_second_save_to_the_same_path_replaces_it_unless_overwrite_is_false(tmp_path: Path, world: int):
    root, run_dir = tmp_path / "ckpts", short_tempdir("ckdcpr-")
    root.mkdir()
    daemon = start_daemon(run_dir, root)
    try:
        logs = run_ranks(_save_twice, world, tmp_path, "twice", str(run_dir), str(root), str(tmp_path))
    finally:
        daemon.kill()
    for mode in MODES:
        for log in logs:
            assert "already exists; pass overwrite=True to replace it" in log[mode], (mode, log)
        assert ckptd.read_index(root / mode).world_size == world
        assert equal_states(ckptd.load(root / mode), expected(2.0)), mode
        assert ckptd.verify_checkpoint(root / mode).ok
    assert sorted(p.name for p in root.iterdir()) == sorted(MODES)  # no attempt, no replaced copy left


def _replace_and_fail(rank: int, world: int, init: str, run_dir: str, root: str, out: str) -> None:
    """Save 1.0 to each path, then try to replace it with 2.0 in a way that fails there."""
    def body() -> dict:
        outcomes = {}
        client = ckptd.Client(run_dir=run_dir, spawn=False, commit_timeout=120)
        try:
            for name in ("write-fails", "exchange-fails", "killed-at-exchange"):
                path = Path(root, name)
                dcp.save(_state(1.0, world), storage_writer=StorageWriter(path, client=client))
                state = _state(2.0, world)
                if name == "write-fails" and rank == 1:
                    state["bad"] = object()  # msgpack cannot hold it: this rank's write_data fails
                elif name == "write-fails":
                    state["bad"] = 0
                try:
                    dcp.save(state, storage_writer=StorageWriter(path, client=client))
                    outcomes[name] = "saved"
                except CheckpointException as exc:
                    outcomes[name] = str(exc)
        finally:
            client.close()
        return outcomes

    run_rank(rank, world, init, out, "fail", body)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("after", [False, True], ids=["killed-before-the-swap", "killed-after-the-swap"])
def test_a_replace_that_fails_leaves_one_whole_checkpoint_at_its_path(tmp_path: Path, after: bool):
    """Two ranks; rank 1's write fails, then the swap at publish fails: the old checkpoint stays. Then the daemon
    dies just before the swap (the old one stays) or just after it (the new one is there, whole)."""
    root, run_dir = tmp_path / "ckpts", short_tempdir("ckdcpf-")
    root.mkdir()
    faults = [{"op": "exchange", "match": "/exchange-fails"},
              {"op": "exchange", "match": "/killed-at-exchange", "kill": True, "after": after}]
    daemon = start_daemon(run_dir, root, faults=faults)
    try:
        logs = run_ranks(_replace_and_fail, 2, tmp_path, "fail", str(run_dir), str(root), str(tmp_path))
        assert daemon.proc.wait(60) != 0  # killed at the last swap
        logged = (run_dir / "ckptd.log").read_text()
        daemon = start_daemon(run_dir, root)  # its start sweeps what the killed one left
        wait_until(lambda: sorted(p.name for p in root.iterdir()) ==
                   ["exchange-fails", "killed-at-exchange", "write-fails"],
                   timeout=60, what="nothing but the three checkpoints under the root")
    finally:
        daemon.kill()
    assert f"event=fault op=exchange after=False action=errno=5 path={root / 'exchange-fails'}" in logged
    assert f"event=fault op=exchange after={after} action=kill path={root / 'killed-at-exchange'}" in logged
    for log in logs:
        assert "Input/output error (injected)" in log["exchange-fails"], log
        assert "exited (it died or was stopped)" in log["killed-at-exchange"], log
    assert "state_dict['bad']" in logs[1]["write-fails"], logs[1]
    for name, value in (("write-fails", 1.0), ("exchange-fails", 1.0), ("killed-at-exchange", 2.0 if after else 1.0)):
        assert equal_states(ckptd.load(root / name), expected(value)), name
        assert ckptd.verify_checkpoint(root / name).ok


def test_what_is_not_a_ckptd_checkpoint_is_never_replaced_and_is_named(daemon, client_factory, root: Path):
    """A DCP checkpoint that ``FileSystemWriter`` wrote at the path is in the way, not replaced."""
    path = root / "dcp-own"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(path))
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(CheckpointException, match=r"refusing to replace .*dcp-own: it is not a committed ckptd checkpoint: it has no ckptd.json"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(path, client=client_factory()))
    assert sorted(p.name for p in path.iterdir()) == before and ".metadata" in before
    wait_until(lambda: not list(root.glob("dcp-own?*")), timeout=60, what="the refused attempt's directory to go")
