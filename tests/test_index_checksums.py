"""An index naming a checksum algorithm ckptd cannot check is invalid, never checked as CRC32."""

from __future__ import annotations

import json

import pytest

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ShardRecord


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
