"""``ckptd verify`` accepts exactly what ``load`` accepts; ``list`` and ``latest()`` see damage.

Each damaged checkpoint here keeps a valid index whose checksums match the
bytes (recomputed after the damage), so only a check of what load relies on
can tell: the header's structure metadata, the tensor count, the files.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterator

import msgpack
import pytest
import torch

import ckptd
from ckptd.protocol.checksums import checksum
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import INDEX_NAME, read_index
from ckptd.protocol.layout import encode_header, parse_header
from ckptd.protocol.structure import EXT_DTYPE, EXT_GLOBAL, EXT_TENSOR, STRUCTURE_KEY, TORCH_DTYPE_NAMES

from helpers import ckptd_cli, short_tempdir, start_daemon, wait_until

STATE = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.int64)},
         "dtype": torch.bfloat16, "pair": (1, "two"), "step": 7}


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory) -> Iterator[Path]:
    """Three checkpoints (steps 1, 2, 3) saved once through a real daemon, copied by each test."""
    run_dir = short_tempdir("ckver-")
    root = tmp_path_factory.mktemp("saved")
    daemon = start_daemon(run_dir, root)
    try:
        with ckptd.Client(run_dir=run_dir, spawn=False, timeout=30) as client:
            for step in (1, 2, 3):
                client.save_async(STATE, root / f"step-{step}", step=step).result(60)
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    yield root


@pytest.fixture
def run1(saved_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run1"
    shutil.copytree(saved_dir, target)
    return target


def rewrite_header(ckpt: Path, change: Callable[[dict[str, str]], None]) -> None:
    """Change the shard's ``__metadata__`` in place and recompute the index's checksum."""
    index = read_index(ckpt)
    record = index.files[0]
    shard = ckpt / record.file
    data = bytearray(shard.read_bytes())
    entries, metadata, start = parse_header(data, len(data))
    change(metadata)
    header = encode_header(entries, metadata)
    assert len(header) == start, "the test's change must keep the header's padded length"
    data[:start] = header
    shard.write_bytes(data)
    fixed = dataclasses.replace(record, checksum=checksum(data, index.checksum_algorithm))
    (ckpt / INDEX_NAME).write_bytes(dataclasses.replace(index, files=(fixed,)).to_json())


def structure(obj: object) -> str:
    return base64.b64encode(msgpack.packb(obj, use_bin_type=True)).decode()


def tensor(name: str) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_TENSOR, name.encode())


BOTH = [tensor("model.w"), tensor("model.b")]
DAMAGE = {
    "structure is not base64": (lambda m: m.update({STRUCTURE_KEY: "!!not base64!!"}), "not base64"),
    "structure is not msgpack": (lambda m: m.update({STRUCTURE_KEY: base64.b64encode(b"\xc1\xc1").decode()}),
                                 "not a valid structure"),
    "structure is missing": (lambda m: m.pop(STRUCTURE_KEY), "holds no ckptd.structure"),
    "structure names a tensor the header lacks": (
        lambda m: m.update({STRUCTURE_KEY: structure(BOTH + [tensor("ghost")])}), "'ghost'"),
    "structure leaves a tensor out": (lambda m: m.update({STRUCTURE_KEY: structure([tensor("model.w")])}),
                                      "references none of the tensors ['model.b']"),
    "structure holds an unknown extension": (
        lambda m: m.update({STRUCTURE_KEY: structure(BOTH + [msgpack.ExtType(42, b"x")])}), "extension type 42"),
    "structure names a global tensor the index lacks": (
        lambda m: m.update({STRUCTURE_KEY: structure(BOTH + [msgpack.ExtType(EXT_GLOBAL, b"ghost")])}),
        "global tensor 'ghost', which the index does not list"),
    "structure names an unknown dtype": (
        lambda m: m.update({STRUCTURE_KEY: structure(BOTH + [msgpack.ExtType(EXT_DTYPE, b"float99")])}),
        "'float99'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_verify_refuses_what_load_refuses_even_with_a_recomputed_checksum(run1: Path, damage: str) -> None:
    change, expected = DAMAGE[damage]
    ckpt = run1 / "step-3"
    rewrite_header(ckpt, change)
    with pytest.raises(InvalidCheckpoint, match="bad header"):
        ckptd.load(ckpt)
    report = ckptd.verify_checkpoint(ckpt)
    assert not report.ok and expected in report.problems[0], report.problems
    out = ckptd_cli("verify", str(ckpt))
    assert out.returncode == 3 and expected in out.stderr and "Traceback" not in out.stderr, out


def test_verify_refuses_a_tensor_count_that_disagrees_with_the_index(run1: Path) -> None:
    ckpt = run1 / "step-3"
    index = read_index(ckpt)
    wrong = dataclasses.replace(index, files=(dataclasses.replace(index.files[0], tensors=5),))
    (ckpt / INDEX_NAME).write_bytes(wrong.to_json())
    out = ckptd_cli("verify", str(ckpt))
    assert out.returncode == 3 and "holds 2 tensors; the index says 5" in out.stderr, out
    with pytest.raises(InvalidCheckpoint, match="the index says 5"):
        ckptd.load(ckpt)


def test_an_intact_checkpoint_still_verifies_and_loads(run1: Path) -> None:
    ckpt = run1 / "step-3"
    out = ckptd_cli("verify", str(ckpt))
    assert out.returncode == 0 and ": ok (" in out.stdout, out
    loaded = ckptd.load(ckpt)
    assert loaded["dtype"] is torch.bfloat16 and loaded["pair"] == (1, "two")
    assert torch.equal(loaded["model"]["w"], STATE["model"]["w"])


def test_a_checkpoint_with_global_tensors_verifies_as_it_loads(client, root) -> None:
    state = {"model": {"w": torch.arange(6.0)}, "opt": {"m": torch.ones(2)}, "size": torch.Size([2, 3])}
    client.save_async(state, root / "replicated", replicated=("model",)).result(30)
    assert read_index(root / "replicated").tensors, "the model must be saved as a global tensor"
    out = ckptd_cli("verify", str(root / "replicated"))
    assert out.returncode == 0, out
    loaded = ckptd.load(root / "replicated")
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0)) and loaded["size"] == torch.Size([2, 3])


def test_every_torch_dtype_name_is_one_verify_accepts() -> None:
    names = {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert names <= TORCH_DTYPE_NAMES, sorted(names - TORCH_DTYPE_NAMES)


def truncate(shard: Path) -> None:
    os.truncate(shard, shard.stat().st_size - 1)


def replace_with_fifo(shard: Path) -> None:
    shard.unlink()
    os.mkfifo(shard)


SHARD_DAMAGE = {"truncated": truncate, "missing": Path.unlink, "a fifo": replace_with_fifo}


@pytest.mark.parametrize("damage", sorted(SHARD_DAMAGE))
def test_list_shows_a_checkpoint_with_a_bad_shard_file_as_damaged(run1: Path, damage: str) -> None:
    SHARD_DAMAGE[damage](next((run1 / "step-2").glob("*.safetensors")))
    rows = {r["name"]: r for r in json.loads(ckptd_cli("list", str(run1), "--json").stdout)}
    assert {n: r["state"] for n, r in rows.items()} == {"step-1": "committed", "step-2": "damaged",
                                                        "step-3": "committed"}
    assert "rank-00000-of-00001.safetensors" in rows["step-2"]["problem"]
    text = ckptd_cli("list", str(run1)).stdout.splitlines()
    row = next(i for i, line in enumerate(text) if line.startswith("step-2 "))
    assert "damaged" in text[row] and "safetensors" in text[row + 1], text


@pytest.mark.parametrize("damage", sorted(SHARD_DAMAGE))
def test_latest_skips_the_newest_checkpoint_when_its_shard_is_damaged(run1: Path, damage: str) -> None:
    assert ckptd.latest(run1) == run1 / "step-3"
    SHARD_DAMAGE[damage](next((run1 / "step-3").glob("*.safetensors")))
    assert ckptd.latest(run1) == run1 / "step-2"
    assert ckptd.load(ckptd.latest(run1))["step"] == 7


def plant_fifo_index(ckpt: Path) -> None:
    (ckpt / INDEX_NAME).unlink()
    os.mkfifo(ckpt / INDEX_NAME)


def test_an_index_that_is_a_fifo_is_no_checkpoint_and_blocks_no_reader(run1: Path) -> None:
    plant_fifo_index(run1 / "step-3")
    rows = {r["name"]: r["state"] for r in json.loads(ckptd_cli("list", str(run1), "--json").stdout)}
    assert rows == {"step-1": "committed", "step-2": "committed", "step-3": "foreign"}
    assert ckptd.latest(run1) == run1 / "step-2"
    out = ckptd_cli("verify", str(run1 / "step-3"))
    assert out.returncode == 3 and "is not a regular file" in out.stderr, out


def test_retention_passes_over_a_fifo_index_and_the_daemon_keeps_committing(daemon, client, root) -> None:
    planted = root / "planted"
    planted.mkdir()
    os.mkfifo(planted / INDEX_NAME)
    for step in (1, 2, 3):
        client.save_async({"s": step}, root / f"step-{step}", step=step, keep_last=1).result(60)
    names = lambda: {p.name for p in root.iterdir()}  # noqa: E731
    # retention runs on the maintenance pool after each commit, so it may still be at work when step 3 is done
    wait_until(lambda: names() == {"planted", "step-3"}, 30, lambda: f"retention ran past the FIFO: {names()}")
    assert stat.S_ISFIFO(os.lstat(planted / INDEX_NAME).st_mode)  # and left it alone
    assert daemon.proc.poll() is None
