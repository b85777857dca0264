"""Sharded state end to end: FSDP2, a 2-D mesh and HSDP saved on 4 ranks across two daemons, restored on 3 and on 1.

One group of 4 ranks (gloo, CPU) talks to two daemons (ranks 0-1 to A, 2-3
to B: two "nodes") and saves an FSDP2 model with its AdamW state, a 2-D mesh
state and an HSDP model; rank 0 also writes every tensor's ``full_tensor()``
with ``torch.save`` as the reference. A second group of 3 ranks on one daemon
restores everything with ``load_into`` (FSDP2 through ``set_state_dict``, the
2-D state into a 1-D mesh) and saves it again; this process then loads both
checkpoints with no process group at all. Every tensor is compared with the
reference.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckptd

from helpers import short_tempdir, start_daemon
from sharded_ranks import full, run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))  # 7 rows over 4 ranks: uneven


def _fsdp(world: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optim, get_state_dict


def _hsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return model


def _mesh_state(mesh, placements_2d: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    values = torch.arange(6 * 5, dtype=torch.float64).reshape(6, 5)
    ints = torch.arange(9, dtype=torch.int32)
    if placements_2d:
        return {"grid": distribute_tensor(values, mesh, [Shard(0), Shard(1)]),
                "mixed": distribute_tensor(ints, mesh, [Replicate(), Shard(0)])}
    return {"grid": distribute_tensor(torch.zeros_like(values), mesh, [Shard(1)]),
            "mixed": distribute_tensor(torch.zeros_like(ints), mesh, [Shard(0)])}


def _save_on_four(rank: int, world: int, init: str, run_dirs: list[str], root: str, out: str) -> None:
    """Four ranks, two daemons: FSDP2 + AdamW, a 2-D mesh, HSDP; every error a save can meet."""
    os.environ["LOCAL_RANK"] = str(rank % 2)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    dist.distributed_c10d._unpickler = _no_pickle  # the ranks' agreement must not unpickle what a peer sent
    log: dict = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Partial, distribute_tensor

        client = ckptd.Client(run_dir=run_dirs[rank // 2], spawn=False, commit_timeout=60, timeout=10)
        model, optim, get_state_dict = _fsdp(world)
        model(torch.randn(5, 4)).sum().backward()
        optim.step()
        msd, osd = get_state_dict(model, optim)
        fsdp_state = {"model": msd, "optim": osd, "epoch": 3}
        mesh_state = _mesh_state(init_device_mesh("cpu", (2, 2)), True)
        hsdp_state = {"model": _hsdp().state_dict()}
        reference = {"fsdp": full(fsdp_state), "mesh": full(mesh_state), "hsdp": full(hsdp_state)}
        if rank == 0:
            torch.save(reference, Path(out) / "reference.pt")
        for name, state in (("fsdp", fsdp_state), ("mesh", mesh_state), ("hsdp", hsdp_state)):
            log[name] = str(client.save_async(state, Path(root) / name, step=1).result(120).path)
        plain = {"model": {"w": torch.full((256,), 7.0)}, "mine": torch.full((4,), float(rank))}
        log["replicated"] = str(client.save_async(plain, Path(root) / "replicated", replicated=("model",)).result(120).path)
        partial = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (world,)), [Partial()])
        try:
            client.save_async({"opt": {"p": partial}}, Path(root) / "partial")
        except ValueError as exc:
            log["partial"] = str(exc)
        client.close()
    except BaseException:
        log["crash"] = traceback.format_exc()
    Path(out, f"save-{rank}.json").write_text(json.dumps(log))
    dist.destroy_process_group()


def _no_pickle(*args, **kwargs):
    raise AssertionError("an object collective unpickled what another rank sent")


def _load_on_three(rank: int, world: int, init: str, run_dirs: list[str], root: str, out: str) -> None:
    """Three ranks, one daemon: restore with resharding, report every error, save again."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    log: dict = {}
    try:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.device_mesh import init_device_mesh

        reference = torch.load(Path(out) / "reference.pt")
        model, optim, get_state_dict = _fsdp(world)
        msd, osd = get_state_dict(model, optim)  # initializes AdamW's state, as DCP does
        target = {"model": msd, "optim": osd, "epoch": 0}
        before = full(target)
        # errors first: one report naming every problem, and the target untouched
        bad = {"model": dict(msd), "optim": osd, "epoch": 0, "extra": torch.zeros(1)}
        bad["model"]["0.weight"] = torch.zeros(7, 5)
        try:
            ckptd.load_into(bad, Path(root) / "fsdp")
        except ckptd.InvalidCheckpoint as exc:
            log["bad"] = exc.message
        log["untouched"] = _same(full(target), before)
        report = ckptd.load_into(target, Path(root) / "fsdp")
        set_state_dict(model, optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
        restored = full(get_state_dict(model, optim))
        log["fsdp"] = _same({"model": restored[0], "optim": restored[1], "epoch": target["epoch"]}, reference["fsdp"])
        log["copied"] = report.copied
        mesh_target = _mesh_state(init_device_mesh("cpu", (world,)), False)  # 2-D -> 1-D, other placements
        ckptd.load_into(mesh_target, Path(root) / "mesh")
        log["mesh"] = _same(full(mesh_target), reference["mesh"])
        replicated = ckptd.load(Path(root) / "replicated")
        log["replicated"] = [replicated["model"]["w"][0].item(), replicated["mine"][0].item()]
        from torch.distributed.tensor import Shard, distribute_tensor

        mine = {"mine": distribute_tensor(torch.zeros(4), init_device_mesh("cpu", (world,)), [Shard(0)])}
        ckptd.load_into(mine, Path(root) / "replicated", strict=False)  # a plain saved tensor into a DTensor
        log["plain_into_dtensor"] = mine["mine"].to_local().tolist()
        client = ckptd.Client(run_dir=run_dirs[0], spawn=False, commit_timeout=60, timeout=10)
        client.save_async(target, Path(root) / "resaved", step=2).result(120)
        client.close()
    except BaseException:
        log["crash"] = traceback.format_exc()
    Path(out, f"load-{rank}.json").write_text(json.dumps(log))
    dist.destroy_process_group()


def _same(a, b) -> bool | str:
    """True, or where the two states differ."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            if (r := _same(a[k], b[k])) is not True:
                return f"{k}: {r}"
        return True
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b):
            return f"{type(a).__name__} vs {type(b).__name__}"
        for x, y in zip(a, b, strict=True):
            if (r := _same(x, y)) is not True:
                return r
        return True
    if isinstance(a, torch.Tensor):
        return True if a.dtype == b.dtype and torch.equal(a, b) else f"{a} != {b}"
    return True if a == b else f"{a!r} != {b!r}"


def _run(fn, world: int, tmp: Path, run_dirs: list[Path], root: Path, out: Path, name: str) -> list[dict]:
    return run_ranks(fn, world, tmp, name, [str(d) for d in run_dirs], str(root), str(out))


def _unique_bytes(reference) -> int:
    if isinstance(reference, dict):
        return sum(_unique_bytes(v) for v in reference.values())
    if isinstance(reference, list):
        return sum(_unique_bytes(v) for v in reference)
    return reference.numel() * reference.element_size() if isinstance(reference, torch.Tensor) else 0


@pytest.mark.timeout(600)
def test_sharded_state_saves_on_four_ranks_and_two_daemons_and_restores_on_three_and_on_one(root: Path, tmp_path: Path):
    run_a, run_b = short_tempdir("cksa-"), short_tempdir("cksb-")
    out = tmp_path / "out"
    out.mkdir()
    daemons = [start_daemon(run_a, root), start_daemon(run_b, root)]
    try:
        saved = _run(_save_on_four, 4, tmp_path, [run_a, run_b], root, out, "save")
        reference = torch.load(out / "reference.pt")
        for r, log in enumerate(saved):
            assert log["fsdp"] == str(root / "fsdp") and log["hsdp"] == str(root / "hsdp"), log
            assert "state_dict['opt']['p']" in log["partial"] and "Partial" in log["partial"], log
        assert daemons[0].status()["completed"]["count"] == 4  # daemon A committed everything
        assert daemons[1].status()["completed"]["count"] == 0
        _check_disk(root, reference)
        _check_dcp_reads_the_shards(root, reference)
        _check_overlapping_chunks_are_refused(root, tmp_path / "tampered")
        # one plain process, no process group: full tensors
        for name in ("fsdp", "mesh", "hsdp"):
            assert _same(ckptd.load(root / name), reference[name]) is True, name
        loaded = _run(_load_on_three, 3, tmp_path, [run_a], root, out, "load")
    finally:
        for d in daemons:
            d.kill()
    for r, log in enumerate(loaded):
        assert log["untouched"] is True and log["fsdp"] is True and log["mesh"] is True, (r, log)
        assert log["copied"] == len(reference["fsdp"]["model"]) + 3 * len(reference["fsdp"]["optim"]["state"]), log
        assert log["replicated"] == [7.0, float(r)], log
        assert log["plain_into_dtensor"] == [float(r)] * [2, 2, 0][r], log  # torch.chunk sizes
        for problem in ("missing from the checkpoint: extra",
                        "shape/dtype mismatch: model.0.weight: target torch.float32[7, 5], checkpoint torch.float32[7, 4]"):
            assert problem in log["bad"], log["bad"]
    assert _same(ckptd.load(root / "resaved"), {**reference["fsdp"], "epoch": 3}) is True
    assert ckptd.read_index(root / "resaved").world_size == 3


def _check_disk(root: Path, reference: dict) -> None:
    """Every global tensor's chunks tile it once: the bytes stored are the unique bytes (HSDP replicas once)."""
    for name in ("fsdp", "mesh", "hsdp"):
        index = ckptd.read_index(root / name)
        stored = sum(c.end - c.begin for t in index.tensors.values() for c in t.chunks)
        plain = reference[name]
        if name == "fsdp":  # AdamW's step counters are per-rank plain tensors
            plain = {"model": plain["model"], "optim": {k: {"exp_avg": v["exp_avg"], "exp_avg_sq": v["exp_avg_sq"]}
                                                      for k, v in plain["optim"]["state"].items()}}
        assert stored == _unique_bytes(plain), name
        tensor_bytes = sum(os.path.getsize(root / name / f.file) - _header_len(root / name / f.file)
                           for f in index.files)
        per_rank = 0 if name != "fsdp" else 4 * 4 * len(reference["fsdp"]["optim"]["state"])  # float32 step
        assert tensor_bytes == stored + per_rank, name
    w = ckptd.read_index(root / "fsdp").tensors["model.0.weight"]
    assert w.shape == (7, 4) and sorted(c.sizes[0] for c in w.chunks) == [1, 2, 2, 2]
    replicated = ckptd.read_index(root / "replicated")
    assert [c.file for c in replicated.tensors["model.w"].chunks] == [replicated.files[0].file]


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _check_dcp_reads_the_shards(root: Path, reference: dict) -> None:
    """torch.distributed.checkpoint's own safetensors reader places every chunk by DCP_SHARDING_INFO."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    want = {"model.0.weight": reference["fsdp"]["model"]["0.weight"],
            "optim.state.0.weight.exp_avg": reference["fsdp"]["optim"]["state"]["0.weight"]["exp_avg"]}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=HuggingFaceStorageReader(str(root / "fsdp")))
    assert _same(got, want) is True


def _check_overlapping_chunks_are_refused(root: Path, tampered: Path) -> None:
    """An index whose chunks overlap (and so leave a hole) is refused by both loaders, naming the tensor."""
    import shutil

    shutil.copytree(root / "fsdp", tampered)
    doc = json.loads((tampered / "ckptd.json").read_text())
    chunks = doc["tensors"]["model.0.weight"]["chunks"]
    moved = next(c for c in chunks if c["offsets"] == [4, 0])
    moved["offsets"] = [3, 0]  # now overlaps rows 2-3; rows 5 is nobody's
    (tampered / "ckptd.json").write_text(json.dumps(doc))
    with pytest.raises(ckptd.InvalidCheckpoint, match="saved chunks of 'model.0.weight' overlap at"):
        ckptd.load(tampered)
    target = {"0.weight": torch.zeros(7, 4), "0.bias": torch.zeros(7), "2.weight": torch.zeros(3, 7)}
    with pytest.raises(ckptd.InvalidCheckpoint, match="not covered by any saved chunk: 0.weight: saved chunks"):
        ckptd.load_into(target, tampered, key="model")
    assert not any(t.any() for t in target.values())  # nothing was copied
