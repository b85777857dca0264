"""Checksums: CRC32C for new checkpoints, CRC32 ones still verify, an unknown algorithm is refused,
and a process checks an unchanged file once."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from pathlib import Path

import crc32c
import pytest
import torch

import ckptd
from ckptd.client import verified
from ckptd.protocol import checksums
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import INDEX_NAME, CheckpointIndex, ShardRecord, read_index


def index_json(algorithm: str) -> bytes:
    index = CheckpointIndex(world_size=1, step=3, created=1.0,
                            files=(ShardRecord("rank-00000-of-00001.safetensors", 0, 4096, 7, 0),), tensors={})
    doc = json.loads(index.to_json())
    doc["checksum_algorithm"] = algorithm
    return json.dumps(doc).encode()


def test_an_index_with_crc32_reads_back() -> None:
    assert CheckpointIndex.from_json(index_json("crc32"), "ckptd.json").checksum_algorithm == "crc32"


@pytest.mark.parametrize("algorithm", ["sha256", "CRC32", ""])
def test_an_unknown_checksum_algorithm_makes_the_index_invalid(algorithm) -> None:
    with pytest.raises(InvalidCheckpoint, match=f"checksum_algorithm {algorithm!r} is not one ckptd can check"):
        CheckpointIndex.from_json(index_json(algorithm), "ckptd.json")


# --- checkpoints on disk: CRC32C for new ones, CRC32 ones still verify, one check per unchanged file ---

def shard_of(ckpt: Path) -> Path:
    return ckpt / read_index(ckpt).files[0].file


def test_a_new_checkpoint_names_crc32c_and_its_shard_checksum_is_crc32c(client, root, daemon) -> None:
    client.save_async({"w": torch.arange(4096.0)}, root / "new").result(30)
    index = read_index(root / "new")
    assert index.checksum_algorithm == "crc32c"
    assert index.files[0].checksum == crc32c.crc32c(shard_of(root / "new").read_bytes())
    assert daemon.cli("verify", str(root / "new")).returncode == 0


def as_crc32(ckpt: Path) -> None:
    """Rewrite the index as a checkpoint from before CRC32C: zlib CRC32 of each shard, named ``crc32``."""
    index = read_index(ckpt)
    files = tuple(dataclasses.replace(f, checksum=zlib.crc32((ckpt / f.file).read_bytes())) for f in index.files)
    (ckpt / INDEX_NAME).write_bytes(dataclasses.replace(index, files=files, checksum_algorithm="crc32").to_json())


def test_a_crc32_checkpoint_still_loads_and_verifies_and_its_damage_is_caught(client, root, daemon) -> None:
    client.save_async({"w": torch.arange(4096.0)}, root / "old").result(30)
    as_crc32(root / "old")
    assert torch.equal(ckptd.load(root / "old")["w"], torch.arange(4096.0))
    target = {"w": torch.zeros(4096)}
    ckptd.load_into(target, root / "old")
    assert torch.equal(target["w"], torch.arange(4096.0))
    assert daemon.cli("verify", str(root / "old")).returncode == 0
    shard = shard_of(root / "old")
    with open(shard, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    for load in (lambda: ckptd.load(root / "old"), lambda: ckptd.load_into({"w": torch.zeros(4096)}, root / "old")):
        with pytest.raises(ckptd.InvalidCheckpoint, match="fails its checksum \\(crc32 "):
            load()
    assert daemon.cli("verify", str(root / "old")).returncode == 3


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """Bytes the client checksums with CRC32C (the real function, counted)."""
    seen: list[int] = []

    def counting(data, value=0):
        seen.append(memoryview(data).nbytes)
        return crc32c.crc32c(data, value)
    monkeypatch.setitem(checksums.ALGORITHMS, "crc32c", counting)
    return seen


def test_two_load_intos_of_an_unchanged_checkpoint_verify_it_once(client, root, counted) -> None:
    state = {"a": torch.arange(100_000.0), "b": torch.ones(3, 5)}
    client.save_async(state, root / "ckpt").result(30)
    size = shard_of(root / "ckpt").stat().st_size
    time.sleep(verified.SETTLED_S + 0.2)  # a file changed just before it is read is checked every time
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ckptd.load_into(target, root / "ckpt")
    assert sum(counted) == size and torch.equal(target["a"], state["a"])  # every byte once, in the copy's pass
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ckptd.load_into(target, root / "ckpt")
    assert sum(counted) == size and torch.equal(target["b"], state["b"])  # not again
    assert ckptd.load(root / "ckpt")["a"].sum() == state["a"].sum() and sum(counted) == size


def test_a_shard_changed_after_it_was_verified_is_checked_again(client, root, counted) -> None:
    client.save_async({"a": torch.arange(100_000.0)}, root / "ckpt").result(30)
    shard = shard_of(root / "ckpt")
    time.sleep(verified.SETTLED_S + 0.2)
    ckptd.load_into({"a": torch.zeros(100_000)}, root / "ckpt")
    stat_before = shard.stat()
    with open(shard, "r+b") as f:  # same size, same inode, times set back: ctime still moves
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    os.utime(shard, ns=(stat_before.st_atime_ns, stat_before.st_mtime_ns))
    with pytest.raises(ckptd.InvalidCheckpoint, match="fails its checksum"):
        ckptd.load_into({"a": torch.zeros(100_000)}, root / "ckpt")
    replaced = shard.with_name("copy")
    replaced.write_bytes(shard.read_bytes())
    os.replace(replaced, shard)  # a new file under the old name
    with pytest.raises(ckptd.InvalidCheckpoint, match="fails its checksum"):
        ckptd.load(root / "ckpt")


def test_a_shard_changed_within_the_settling_time_is_never_remembered(client, root, counted) -> None:
    client.save_async({"a": torch.arange(1000.0)}, root / "ckpt").result(30)
    for _ in range(2):
        ckptd.load_into({"a": torch.zeros(1000)}, root / "ckpt")
    assert sum(counted) == 2 * shard_of(root / "ckpt").stat().st_size


def test_load_into_checks_every_byte_even_those_no_target_takes(client, root) -> None:
    state = {"a": torch.arange(1000.0), "skipped": torch.ones(5000), "t": torch.arange(12.0).reshape(3, 4)}
    client.save_async(state, root / "ckpt").result(30)
    target = {"a": torch.zeros(1000), "t": torch.zeros(4, 3).t()}  # a non-contiguous target goes through the mapping
    ckptd.load_into(target, root / "ckpt", strict=False)
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["t"], state["t"])
    entries = {e.name: e for e in ckptd.inspect(root / "ckpt").shards[0].tensors}
    shard = shard_of(root / "ckpt")
    data_start = shard.stat().st_size - sum(e.nbytes for e in entries.values())
    with open(shard, "r+b") as f:  # a byte of the tensor the target does not take
        f.seek(data_start + entries["skipped"].begin + 100)
        f.write(b"\x7f")
    with pytest.raises(ckptd.InvalidCheckpoint, match="fails its checksum.*partly copied"):
        ckptd.load_into({"a": torch.zeros(1000), "t": torch.zeros(4, 3).t()}, root / "ckpt", strict=False)
