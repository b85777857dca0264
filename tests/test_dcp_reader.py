"""``ckptd.dcp.StorageReader``: DCP's own ``dcp.load`` reads a ckptd checkpoint saved by four FSDP2 ranks.

Two gloo ranks load it into an FSDP2 model of world size 2 (DCP plans and
reshards), the 2-D mesh tensor into a 1-D mesh, plain values through DCP's
bytes path; one plain process loads full tensors. A damaged shard is
refused by its checksum.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptd
from helpers import equal_states
from sharded_ranks import fsdp, full, run_rank, run_ranks, sharded_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    yield from sharded_checkpoint(tmp_path_factory.mktemp("dcp"))


def _load_on_two(rank: int, world: int, init: str, path: str, out: str) -> None:
    def body() -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        m, optim = fsdp(world)
        for p in m.parameters():
            torch.nn.init.zeros_(p)
        msd, osd = get_state_dict(m, optim)
        grid = distribute_tensor(torch.zeros(6, 5, dtype=torch.float64), init_device_mesh("cpu", (world,)), [Shard(1)])
        state = {"model": msd, "optim": osd, "grid": grid, "epoch": 0, "note": ""}
        dcp.load(state, storage_reader=ckptd.dcp.StorageReader(path))
        set_state_dict(m, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = full({"model": state["model"], "optim": state["optim"], "grid": state["grid"]})
        msd, osd = get_state_dict(m, optim)  # what the model and optimizer now hold
        applied = full({"model": msd, "optim": osd})
        if rank == 0:
            torch.save({"loaded": got, "applied": applied}, Path(out) / "dcp-loaded.pt")
        return {"epoch": state["epoch"], "note": state["note"]}

    run_rank(rank, world, init, out, "dcp", body)


@pytest.mark.timeout(600)
def test_dcp_load_on_two_ranks_reshards_a_four_rank_checkpoint(saved, tmp_path: Path):
    path, reference = saved
    logs = run_ranks(_load_on_two, 2, tmp_path, "dcp", str(path), str(tmp_path))
    assert logs == [{"epoch": 3, "note": "first run"}] * 2
    loaded = torch.load(tmp_path / "dcp-loaded.pt")
    assert equal_states(loaded["loaded"]["model"], reference["model"])
    assert equal_states(loaded["loaded"]["optim"]["state"], reference["optim"]["state"])
    assert equal_states(loaded["loaded"]["grid"], reference["grid"])
    assert equal_states(loaded["applied"]["model"], reference["model"])  # set_state_dict put it in the model
    assert equal_states(loaded["applied"]["optim"]["state"], reference["optim"]["state"])


def test_dcp_load_in_one_process_gives_full_tensors_and_plain_values(saved):
    path, reference = saved
    state = {"model": {k: torch.zeros_like(v) for k, v in reference["model"].items()},
             "grid": torch.zeros(6, 5, dtype=torch.float64), "epoch": 0,
             "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    dcp.load(state, storage_reader=ckptd.dcp.StorageReader(path))
    assert equal_states(state["model"], reference["model"]) and equal_states(state["grid"], reference["grid"])
    assert state["epoch"] == 3
    assert state["optim"]["param_groups"][0] == {"lr": 0.1, "betas": (0.9, 0.999)}  # plain values, by DCP's names
    assert ckptd.dcp.StorageReader.validate_checkpoint_id(path)
    assert not ckptd.dcp.StorageReader.validate_checkpoint_id(path.parent)


def _plain_state() -> dict:
    """Nested dicts, an optimizer's int keys and param groups, a list of tensors, a tuple, plain values."""
    torch.manual_seed(1)
    return {"model": {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3)},
            "optim": {"state": {0: {"exp_avg": torch.randn(3, 4), "step": torch.tensor(7.0)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]},
            "history": [torch.arange(4), torch.ones(2, dtype=torch.bfloat16)], "step": 5, "note": "run 1",
            "shape": (2, 3)}


def kinds(state: object) -> object:
    """``state``'s containers and leaf types (a tensor's dtype and shape): equal only if nested alike."""
    if isinstance(state, dict):
        return {k: kinds(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return (type(state).__name__, [kinds(v) for v in state])
    if isinstance(state, torch.Tensor):
        return (state.dtype, tuple(state.shape))
    return type(state).__name__


def rebuilt(reader: object, keys: set[str] | None = None) -> dict:
    """The state ``dcp_to_torch_save`` builds from ``reader``'s metadata alone (``keys``: only those)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys), no_dist=True)
    return state


def test_a_state_rebuilt_from_the_metadata_nests_as_dcps_own_checkpoint_does(daemon, client_factory, root: Path,
                                                                             tmp_path: Path):
    """``dcp_to_torch_save`` of DCP's own checkpoint and what it does (``_load_state_dict`` with an
    ``_EmptyStateDictLoadPlanner``: ``dcp.load`` into ``{}`` copies nothing back) with ckptd's reader over
    ckptd's give the same nested state, also for some keys only."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = _plain_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    dcp.save(state, storage_writer=ckptd.dcp.StorageWriter(root / "ckptd", client=client_factory()))
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    reference = torch.load(tmp_path / "dcp.pt", weights_only=False)
    assert set(reference) == set(state) and reference["step"] == 5  # DCP's own: nested as saved
    for keys in (None, {"model", "step"}, {"optim.state"}):
        dcps = rebuilt(dcp.FileSystemReader(tmp_path / "dcp"), keys)
        ours = rebuilt(ckptd.dcp.StorageReader(root / "ckptd"), keys)
        assert kinds(ours) == kinds(dcps) and equal_states(ours, dcps), keys
        if keys is None:
            assert kinds(ours) == kinds(reference) and equal_states(ours, reference)
    torch.save(ours, tmp_path / "ckptd.pt")  # as dcp_to_torch_save ends
    assert set(torch.load(tmp_path / "ckptd.pt", weights_only=False)["optim"]) == {"state"}


def test_a_sharded_checkpoint_rebuilt_from_its_metadata_is_the_saved_state_whole(saved):
    """Four FSDP2 ranks' DTensor state, rebuilt in one process from nothing but the checkpoint."""
    path, reference = saved
    state = rebuilt(ckptd.dcp.StorageReader(path))
    assert kinds(state) == kinds(reference) and equal_states(state, reference)


def test_a_damaged_shard_is_refused_by_its_checksum(saved, tmp_path: Path):
    path, reference = saved
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    chunk = ckptd.read_index(damaged).tensors["grid"].chunks[1]
    with open(damaged / chunk.file, "r+b") as f:
        f.seek(chunk.begin)
        byte = f.read(1)
        f.seek(chunk.begin)
        f.write(bytes([byte[0] ^ 0xFF]))
    state = {"grid": torch.zeros(6, 5, dtype=torch.float64)}
    with pytest.raises(CheckpointException) as info:  # DCP wraps each rank's error in it
        dcp.load(state, storage_reader=ckptd.dcp.StorageReader(damaged))
    assert f"shard {damaged / chunk.file} fails its checksum" in str(info.value), str(info.value)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="path"):
        ckptd.dcp.StorageReader(5)
    with pytest.raises(TypeError, match="verify"):
        ckptd.dcp.StorageReader("/tmp/x", verify="yes")
    with pytest.raises(CheckpointException, match="no checkpoint at /nonexistent/ckpt"):
        dcp.load({"a": torch.zeros(1)}, storage_reader=ckptd.dcp.StorageReader("/nonexistent/ckpt"))


def test_ckptd_dcp_is_a_module_that_imports_by_its_public_name():
    code = ("import ckptd.dcp\n"
            "from ckptd.dcp import StorageReader\n"
            "import ckptd\n"
            "assert ckptd.dcp.StorageReader is StorageReader, StorageReader\n"
            "assert 'dcp' in dir(ckptd)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _load_per_rank_keys(rank: int, world: int, init: str, path: str, out: str) -> None:
    def body() -> dict:
        state = {"model": {"w": torch.zeros(4)}, "dataloader": {f"dp_rank_{rank}": {"pos": 0, "tokens": torch.zeros(3)}},
                 "rng": torch.zeros(2), "step": 0}
        dcp.load(state, storage_reader=ckptd.dcp.StorageReader(path))
        loader = state["dataloader"][f"dp_rank_{rank}"]
        return {"w": state["model"]["w"].tolist(), "pos": loader["pos"], "tokens": loader["tokens"].tolist(),
                "rng": state["rng"].tolist(), "step": state["step"]}

    run_rank(rank, world, init, out, "perrank", body)


@pytest.mark.timeout(300)
def test_dcp_load_on_two_ranks_reads_each_ranks_own_keys(daemon, client_factory, root: Path, tmp_path: Path):
    """torchtitan keeps each data-parallel rank's loader under its own key (``dataloader.dp_rank_N``)."""
    path = root / "per-rank"
    futures = []
    for rank in range(2):
        state = {"model": {"w": torch.arange(4.0)}, "step": 9, "rng": torch.full((2,), float(rank)),
                 "dataloader": {f"dp_rank_{rank}": {"pos": 100 + rank, "tokens": torch.full((3,), 10.0 * rank)}}}
        futures.append(client_factory(rank=rank, world_size=2).save_async(state, path, step=9, replicated=("model",)))
    for fut in futures:
        fut.result(60)
    logs = run_ranks(_load_per_rank_keys, 2, tmp_path, "perrank", str(path), str(tmp_path))
    assert logs == [{"w": [0.0, 1.0, 2.0, 3.0], "pos": 100 + r, "tokens": [10.0 * r] * 3, "rng": [float(r)] * 2,
                     "step": 9} for r in range(2)]
