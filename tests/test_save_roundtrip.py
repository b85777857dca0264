"""A save through a real daemon comes back bitwise, and is a real safetensors file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckptd
from ckptd.client.dtypes import SAFETENSORS_DTYPES


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in SAFETENSORS_DTYPES:
        base = torch.randn(7, 5, generator=g) * 10
        tensors[str(dtype).removeprefix("torch.")] = base.to(dtype)
    return {
        "model": {
            "weight": torch.randn(64, 32, generator=g),
            "bias": torch.zeros(32, dtype=torch.bfloat16),
            "transposed": torch.randn(8, 16, generator=g).t(),  # non-contiguous
            "strided": torch.arange(100, dtype=torch.int32)[::3],
            "scalar": torch.tensor(3.5, dtype=torch.float64),  # 0-dim
            "empty": torch.zeros(0, 4),
            "param": torch.nn.Parameter(torch.ones(3)),
        },
        "dtypes": tensors,
        "optimizer": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(4, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "step": 1234,
        "big_int": 2**63 + 5,
        "ratio": 0.25,
        "name": "run-α",
        "flag": True,
        "blob": b"\x00\xffbytes",
        "nothing": None,
        "dtype": torch.bfloat16,
        "nested": [1, (2, [3, {"x": (4,)}]), []],
        "int_keys": {1: "a", 2.5: "b", None: "c", False: "d"},
    }


def assert_same(a, b, where="state") -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        bits = lambda t: t.detach().contiguous().view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)  # noqa: E731
        assert torch.equal(bits(a), bits(b)), where  # bitwise: NaNs and -0.0 too
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_mixed_state_dict_round_trips_bitwise(client, root: Path) -> None:
    state = mixed_state()
    result = client.save_async(state, root / "ckpt", step=7).result(30)
    assert result.path == root / "ckpt"
    assert result.step == 7
    shard = root / "ckpt" / "rank-00000-of-00001.safetensors"
    assert result.bytes_written == shard.stat().st_size
    assert_same(state, ckptd.load(root / "ckpt"))


def test_shard_opens_with_the_safetensors_library_and_holds_the_same_tensors(client, root: Path) -> None:
    state = mixed_state()
    client.save_async(state, root / "ckpt").result(30)
    loaded = safetensors.torch.load_file(root / "ckpt" / "rank-00000-of-00001.safetensors")
    assert torch.equal(loaded["model.weight"], state["model"]["weight"])
    assert torch.equal(loaded["model.transposed"], state["model"]["transposed"])
    assert torch.equal(loaded["model.strided"], state["model"]["strided"])
    assert loaded["model.scalar"].shape == () and loaded["model.scalar"].item() == 3.5
    assert loaded["model.empty"].shape == (0, 4)
    assert torch.equal(loaded["dtypes.bfloat16"], state["dtypes"]["bfloat16"])


def test_tensor_data_is_page_aligned_and_each_tensor_aligned_to_its_element_size(client, root: Path) -> None:
    client.save_async(mixed_state(), root / "ckpt").result(30)
    raw = (root / "ckpt" / "rank-00000-of-00001.safetensors").read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    assert (8 + hlen) % 4096 == 0
    header = json.loads(raw[8 : 8 + hlen])
    header.pop("__metadata__")
    from ckptd.protocol.layout import DTYPE_SIZES

    for name, info in header.items():
        assert info["data_offsets"][0] % DTYPE_SIZES[info["dtype"]] == 0, name


def test_success_leaves_no_incomplete_directory_and_writes_an_index(client, root: Path) -> None:
    client.save_async({"w": torch.ones(10)}, root / "a", step=3).result(30)
    assert sorted(p.name for p in root.iterdir()) == ["a"]
    index = ckptd.read_index(root / "a")
    assert index.world_size == 1 and index.step == 3
    assert index.files[0].file == "rank-00000-of-00001.safetensors"
    assert index.files[0].size == (root / "a" / index.files[0].file).stat().st_size


def test_latest_picks_the_highest_step(client, root: Path) -> None:
    for step in (5, 20, 10):
        client.save_async({"step": step}, root / f"step-{step}", step=step).result(30)
    (root / "step-99.incomplete").mkdir()
    assert ckptd.latest(root) == root / "step-20"
    assert ckptd.load(ckptd.latest(root)) == {"step": 20}


def test_background_staging_returns_before_the_copy_and_resolves_staged_first(client_factory, daemon, root) -> None:
    c = client_factory(background_staging=True)
    state = {"w": torch.randn(1024, 1024)}
    fut = c.save_async(state, root / "bg")
    fut.wait_staged(30)
    state["w"].zero_()  # allowed once staged: the saved copy must not change
    fut.result(30)
    assert not torch.equal(ckptd.load(root / "bg")["w"], state["w"])


def test_relative_paths_are_resolved_against_the_callers_directory(client, root, monkeypatch) -> None:
    monkeypatch.chdir(root)
    result = client.save_async({"x": 1}, "rel").result(30)
    assert result.path == root / "rel"
    assert (root / "rel" / "ckptd.json").exists()


def test_a_save_call_with_an_unsupported_leaf_names_its_key_path(client, root) -> None:
    with pytest.raises(TypeError, match=r"state_dict\['opt'\]\['fn'\]"):
        client.save_async({"opt": {"fn": lambda: 1}}, root / "bad")
    with pytest.raises(TypeError, match=r"state_dict\['s'\].*sparse"):
        client.save_async({"s": torch.eye(3).to_sparse()}, root / "bad")
    with pytest.raises(TypeError, match=r"state_dict\['c'\].*complex64"):
        client.save_async({"c": torch.zeros(2, dtype=torch.complex64)}, root / "bad")
    assert not (root / "bad").exists() and not (root / "bad.incomplete").exists()
    # and the client still works
    client.save_async({"ok": torch.ones(1)}, root / "good").result(30)


def test_same_tensor_object_twice_is_stored_once_and_loads_shared(client, root) -> None:
    w = torch.randn(16)
    client.save_async({"a": w, "tied": w}, root / "tied").result(30)
    back = ckptd.load(root / "tied")
    assert back["a"] is back["tied"]
    assert len(safetensors.torch.load_file(root / "tied" / "rank-00000-of-00001.safetensors")) == 1


def test_loaded_tensors_are_copy_on_write_and_never_change_the_file(client, root) -> None:
    client.save_async({"w": torch.ones(8)}, root / "cow").result(30)
    back = ckptd.load(root / "cow")
    back["w"].mul_(5)
    assert torch.equal(ckptd.load(root / "cow")["w"], torch.ones(8))
    assert os.path.getsize(root / "cow" / "rank-00000-of-00001.safetensors") > 0
