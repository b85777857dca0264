"""Loading: zero-copy, in place, verified, and clear about what is wrong (how many load at once: ``test_leases.py``)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptd


@pytest.fixture
def saved(client, root) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}
    client.save_async(state, root / "ckpt", step=3).result(30)
    return root / "ckpt"


def test_mmap_load_is_zero_copy_over_one_mapping(saved) -> None:
    state = ckptd.load(saved, mmap=True)
    tensors = list(state["model"].values())
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1, "all tensors must be views of the one shard mapping"


def test_map_location_copies_each_tensor_off_the_file(saved) -> None:
    state = ckptd.load(saved, map_location="cpu", mmap=True)
    storages = {t.untyped_storage().data_ptr() for t in state["model"].values()}
    assert len(storages) == len(state["model"])
    assert torch.equal(state["model"]["0.weight"], ckptd.load(saved)["model"]["0.weight"])


def test_load_into_a_module_and_optimizer_copies_in_place(saved) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    weight = model[0].weight
    report = ckptd.load_into(model, saved, key="model")
    assert report.copied == 4 and model[0].weight is weight
    assert torch.equal(model[0].weight, ckptd.load(saved)["model"]["0.weight"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    ckptd.load_into(opt, saved, key="optimizer")  # fresh optimizer: no state yet
    exp_avg = opt.state[model[0].weight]["exp_avg"]
    assert opt.param_groups[0]["lr"] == 1e-3
    opt.param_groups[0]["lr"] = 0.5
    report = ckptd.load_into(opt, saved, key="optimizer")  # now with state: in place
    assert opt.state[model[0].weight]["exp_avg"] is exp_avg and report.copied == 12
    assert opt.param_groups[0]["lr"] == 1e-3


def test_load_into_reports_every_problem_at_once_and_changes_nothing(saved) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5), nn.Linear(5, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckptd.InvalidCheckpoint) as info:
        ckptd.load_into(model, saved, key="model")
    message = str(info.value)
    assert "2.weight: target torch.float32[5, 32], checkpoint torch.float32[4, 32]" in message
    assert "missing from the checkpoint: 3.weight" in message and "(4 problems, nothing changed)" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # strict=False allows missing keys, never mismatched shapes
    small = nn.Sequential(nn.Linear(16, 32))
    report = ckptd.load_into(small, saved, key="model", strict=False)
    assert report.copied == 2 and sorted(report.unexpected) == ["2.bias", "2.weight"]


def test_load_into_a_nested_state_dict_sets_plain_values_too(saved) -> None:
    target = {"model": {k: torch.zeros_like(v) for k, v in ckptd.load(saved)["model"].items()},
              "optimizer": ckptd.load(saved, map_location="cpu")["optimizer"], "step": 0}
    ckptd.load_into(target, saved)
    assert target["step"] == 3
    assert torch.equal(target["model"]["2.bias"], ckptd.load(saved)["model"]["2.bias"])


def test_rank_all_returns_every_rank_and_a_missing_rank_is_named(daemon, client_factory, root) -> None:
    futures = [client_factory(rank=r, world_size=2).save_async({"r": r}, root / "two") for r in range(2)]
    for f in futures:
        f.result(30)
    assert ckptd.load(root / "two", rank="all") == [{"r": 0}, {"r": 1}]
    with pytest.raises(ckptd.InvalidCheckpoint, match="no rank 5"):
        ckptd.load(root / "two", rank=5)


def corrupt(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_checkpoints_fail_naming_what_is_wrong(saved, root) -> None:
    shard = saved / "rank-00000-of-00001.safetensors"
    (root / "half.incomplete").mkdir()
    (root / "noindex").mkdir()
    with pytest.raises(ckptd.InvalidCheckpoint, match=r"\.incomplete\) and is never loaded"):
        ckptd.load(root / "half.incomplete")
    with pytest.raises(ckptd.InvalidCheckpoint, match="has no ckptd.json"):
        ckptd.load(root / "noindex")
    with pytest.raises(ckptd.InvalidCheckpoint, match="no checkpoint at"):
        ckptd.load(root / "nothing")
    size = shard.stat().st_size
    corrupt(shard, size - 3, b"\xff\xfe\xfd")
    with pytest.raises(ckptd.InvalidCheckpoint, match="fails its checksum"):
        ckptd.load(saved)
    assert ckptd.load(saved, verify=False)["step"] == 3  # verify=False skips the check
    os.truncate(shard, size - 100)
    with pytest.raises(ckptd.InvalidCheckpoint, match="truncated"):
        ckptd.load(saved)


def test_a_header_that_lies_about_sizes_is_refused(client, root) -> None:
    client.save_async({"w": torch.ones(4)}, root / "lie").result(30)
    shard = root / "lie" / "rank-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    hlen = struct.unpack_from("<Q", raw)[0]
    header = raw[8 : 8 + hlen].replace(b'"data_offsets":[0,16]', b'"data_offsets":[0,32]')
    raw[8 : 8 + hlen] = header
    shard.write_bytes(bytes(raw))
    with pytest.raises(ckptd.InvalidCheckpoint, match="bad header"):
        ckptd.load(root / "lie", verify=False)


def test_verify_cli_passes_a_good_checkpoint_and_names_the_bad_file(daemon, saved) -> None:
    out = daemon.cli("verify", str(saved))
    assert out.returncode == 0 and "ok" in out.stdout
    shard = saved / "rank-00000-of-00001.safetensors"
    corrupt(shard, shard.stat().st_size - 1, b"\x01")
    out = daemon.cli("verify", str(saved))
    assert out.returncode == 3 and str(shard) in out.stderr and "checksum" in out.stderr
    report = json.loads(daemon.cli("verify", str(saved), "--json").stdout)
    assert report["ok"] is False and len(report["problems"]) == 1


def test_inspect_describes_without_reading_tensor_data(daemon, saved) -> None:
    info = ckptd.inspect(saved)
    assert info.index.step == 3 and info.tensor_count == 4 + 12 + 0
    names = {t.name: t for t in info.shards[0].tensors}
    assert names["model.0.weight"].shape == (32, 16) and names["model.0.weight"].dtype == "F32"
    out = json.loads(daemon.cli("inspect", str(saved), "--json").stdout)
    assert out["world_size"] == 1 and len(out["shards"][0]["tensors"]) == info.tensor_count
