"""``ckptd export``: full tensors in the Hugging Face safetensors layout, without torch.

A checkpoint saved by four FSDP2 ranks (uneven rows, a 2-D mesh tensor whose
chunks are not contiguous in the full tensor) is exported and every file is
read back with ``safetensors.torch.load_file`` and compared with the
``full_tensor()`` of what was saved.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.tools.export import export_checkpoint, parse_size
from sharded_ranks import model, sharded_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    yield from sharded_checkpoint(tmp_path_factory.mktemp("export"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``ckptd export`` in a fresh interpreter that must never import torch."""
    code = ("import sys; from ckptd.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'export imported torch'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "export", *args], capture_output=True, text=True, timeout=120)


def test_export_writes_every_global_tensor_whole_in_one_file(saved, tmp_path: Path):
    path, reference = saved
    out = _cli(str(path), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert "left out 3 per-rank tensors" in out.stdout  # AdamW's step counters differ per rank
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = {f"model.{k}": v for k, v in reference["model"].items()}
    want["grid"] = reference["grid"]
    for fqn, state in reference["optim"]["state"].items():
        want.update({f"optim.state.{fqn}.{k}": v for k, v in state.items() if k != "step"})
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_prefix_and_a_small_max_shard_size_give_sharded_files_and_an_index(saved, tmp_path: Path):
    path, reference = saved
    result = export_checkpoint(path, tmp_path / "hf", prefix="model.", max_shard_size="100B")
    assert result.skipped_per_rank == 0  # the per-rank step counters lie outside the prefix
    assert result.tensor_files == 3
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    doc = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert doc["metadata"]["total_size"] == result.total_size == sum(
        t.numel() * t.element_size() for t in reference["model"].values())
    merged = {}
    for file in names[:3]:
        tensors = load_file(tmp_path / "hf" / file)
        assert all(doc["weight_map"][k] == file for k in tensors)
        merged.update(tensors)
    assert set(doc["weight_map"]) == set(merged) == set(reference["model"])
    fresh = model()
    fresh.load_state_dict(merged, strict=True)  # prefix stripped: the keys a model expects
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, reference["model"][k]), k


def test_a_one_rank_checkpoint_exports_its_plain_tensors(daemon, client, root: Path, tmp_path: Path):
    state = {"model": {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(2)}, "step": 4}
    path = client.save_async(state, root / "one").result(60).path
    result = export_checkpoint(path, tmp_path / "hf", prefix="model.")
    assert result.files == ("model.safetensors",) and result.skipped_per_rank == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == {"w", "b"} and torch.equal(got["w"], state["model"]["w"]) and torch.equal(got["b"], state["model"]["b"])


def test_errors_are_clear_and_leave_nothing_behind(saved, tmp_path: Path):
    path, _ = saved
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    out = _cli(str(path), str(taken))
    assert out.returncode == 2 and f"output directory {taken} already exists and is not empty" in out.stderr
    out = _cli(str(path), str(tmp_path / "a"), "--max-shard-size", "5XB")
    assert out.returncode == 2 and "max shard size '5XB' is not a positive size" in out.stderr
    with pytest.raises(ValueError, match="prefix 'nothing.' selects no tensor"):
        export_checkpoint(path, tmp_path / "b", prefix="nothing.")
    step = next(name for name in ckptd.load(path, rank=0)["optim"]["state"])  # AdamW's per-rank step counters
    with pytest.raises(ValueError, match=rf"prefix 'optim.state.{step}.step' selects no tensor .* \(only per-rank "
                                         rf"tensors \(1, such as optim.state.{step}.step\), which each rank saved "
                                         rf"its own of: no single value"):
        export_checkpoint(path, tmp_path / "b", prefix=f"optim.state.{step}.step")
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    chunk = ckptd.read_index(damaged).tensors["grid"].chunks[2]
    with open(damaged / chunk.file, "r+b") as f:
        f.seek(chunk.end - 1)
        f.write(b"\x7f" if f.read(1) != b"\x7f" else b"\x00")
    out = _cli(str(damaged), str(tmp_path / "c"))
    assert out.returncode == 3 and f"shard {damaged / chunk.file} fails its checksum" in out.stderr, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "taken"]  # no output, no .incomplete left
    assert [p.name for p in taken.iterdir()] == ["x"]


def test_sizes_read_as_hugging_face_reads_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6 and parse_size("1000") == 1000 and parse_size("1.5KB") == 1500
    for bad in ("", "0", "-1GB", "GB", "5 GBs"):
        with pytest.raises(ValueError, match="is not a positive size"):
            parse_size(bad)
