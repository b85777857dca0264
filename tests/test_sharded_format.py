"""The format of sharded checkpoints: the index's tensor table and the chunk metadata in shard headers.

Unit tests, no processes: what the committing daemon builds from shard
headers, what readers accept, and that version-1 indexes still read.
"""

from __future__ import annotations

import json

import pytest

from ckptd.protocol.chunks import GLOBAL_KEY, SHARDING_INFO_KEY, chunk_metadata, overlap, tensor_table
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ChunkRecord, ShardRecord, TensorRecord, shard_name
from ckptd.protocol.layout import plan_layout

FILES = tuple(ShardRecord(shard_name(r, 2), r, 8192, 1 + r, 1) for r in range(2))


def index_with(tensors: dict) -> CheckpointIndex:
    return CheckpointIndex(world_size=2, step=1, created=1.0, files=FILES, tensors=tensors)


def rows(file: int, first: int, count: int, begin: int = 4096) -> ChunkRecord:
    return ChunkRecord(FILES[file].file, (first, 0), (count, 4), begin, begin + count * 16)


def test_an_index_with_global_tensors_round_trips_through_json():
    index = index_with({"model.w": TensorRecord("F32", (7, 4), (rows(0, 0, 4), rows(1, 4, 3)))})
    doc = json.loads(index.to_json())
    assert doc["version"] == 2
    assert doc["tensors"]["model.w"] == {
        "dtype": "F32", "shape": [7, 4],
        "chunks": [{"file": FILES[0].file, "offsets": [0, 0], "sizes": [4, 4], "begin": 4096, "end": 4160},
                   {"file": FILES[1].file, "offsets": [4, 0], "sizes": [3, 4], "begin": 4096, "end": 4144}]}
    assert CheckpointIndex.from_json(index.to_json(), "x") == index


def test_a_version_1_index_still_reads_with_no_global_tensors():
    doc = json.loads(index_with({}).to_json())
    doc["version"] = 1
    del doc["tensors"]
    index = CheckpointIndex.from_json(json.dumps(doc).encode(), "x")
    assert index.version == 1 and index.tensors == {} and index.files == FILES


@pytest.mark.parametrize(
    "chunks, problem",
    [
        pytest.param((rows(0, 0, 4),), "hold 16 elements; its shape [7, 4] has 28", id="region-missing"),
        pytest.param((rows(0, 0, 4), rows(1, 0, 3)), "two chunks at the same offsets", id="stored-twice"),
        pytest.param((rows(0, 0, 4), rows(1, 4, 4)), "lies outside 'model.w'", id="outside-tensor"),
        pytest.param((rows(0, 0, 4), rows(1, 4, 3, begin=8190)), "outside rank-00001", id="outside-file"),
        pytest.param((rows(0, 0, 4), ChunkRecord("other.safetensors", (4, 0), (3, 4), 0, 48)),
                     "which the index does not list", id="unknown-file"),
        pytest.param((rows(0, 0, 4), ChunkRecord(FILES[1].file, (4, 0), (3, 4), 4096, 4100)),
                     "spans 4 bytes for 12 F32 elements", id="bytes-vs-sizes"),
    ],
)
def test_an_index_whose_chunks_do_not_tile_their_tensor_is_refused(chunks, problem):
    data = index_with({"model.w": TensorRecord("F32", (7, 4), chunks)}).to_json()
    with pytest.raises(InvalidCheckpoint) as info:
        CheckpointIndex.from_json(data, "ckptd.json")
    assert problem in info.value.message


def shard_header(chunks: dict, plain: tuple = ()) -> tuple:
    """(entries, metadata, data_start) of a shard holding ``chunks`` (name -> (offsets, sizes, shape)) and plain tensors."""
    specs = [(name, "F32", sizes) for name, (_, sizes, _) in chunks.items()] + [(name, "F32", shape) for name, shape in plain]
    ndims = [(name, len(shape)) for name, _, shape in specs]
    metadata = chunk_metadata(ndims, {n: (o, s) for n, (o, s, _) in chunks.items()},
                              {n: g for n, (_, _, g) in chunks.items()})
    layout = plan_layout(specs, metadata)
    return layout.entries, metadata, layout.data_start, layout.nbytes


def test_the_tensor_table_is_built_from_every_shards_chunk_metadata():
    e0, m0, d0, n0 = shard_header({"w": ((0, 0), (4, 4), (7, 4))}, plain=(("step", ()),))
    e1, m1, d1, n1 = shard_header({"w": ((4, 0), (3, 4), (7, 4))}, plain=(("step", ()),))
    assert json.loads(m0[SHARDING_INFO_KEY]) == {"w": {"saved_offsets": [0, 0]}, "step": {"saved_offsets": []}}
    assert json.loads(m0[GLOBAL_KEY]) == {"w": [7, 4]}
    table = tensor_table([("a", n0, e0, m0, d0), ("b", n1, e1, m1, d1)])
    assert list(table) == ["w"]  # per-rank tensors stay out of the index
    w = table["w"]
    assert (w.dtype, w.shape) == ("F32", (7, 4))
    assert [(c.file, c.offsets, c.sizes, c.end - c.begin) for c in w.chunks] == [
        ("a", (0, 0), (4, 4), 64), ("b", (4, 0), (3, 4), 48)]
    assert w.chunks[1].begin == d1 + next(e for e in e1 if e.name == "w").begin


def test_a_shard_without_chunks_keeps_the_version_1_header():
    assert chunk_metadata([("w", 2)], {}, {}) == {}


def test_the_tensor_table_refuses_ranks_that_disagree_on_a_global_shape():
    e0, m0, d0, n0 = shard_header({"w": ((0, 0), (4, 4), (7, 4))})
    e1, m1, d1, n1 = shard_header({"w": ((4, 0), (3, 4), (8, 4))})
    with pytest.raises(ValueError, match=r"'w' is F32\[8, 4\] here but F32\[7, 4\] in another shard"):
        tensor_table([("a", n0, e0, m0, d0), ("b", n1, e1, m1, d1)])


def test_the_tensor_table_refuses_unreadable_chunk_metadata_naming_the_file():
    e0, m0, d0, n0 = shard_header({"w": ((0, 0), (7, 4), (7, 4))})
    with pytest.raises(ValueError, match="a: chunk metadata is not readable"):
        tensor_table([("a", n0, e0, {**m0, SHARDING_INFO_KEY: "{"}, d0)])
    with pytest.raises(ValueError, match="a: chunk 'w' lacks a tensor, a global shape or saved_offsets"):
        tensor_table([("a", n0, e0, {**m0, GLOBAL_KEY: '{"w": [7, "4"]}'}, d0)])


@pytest.mark.parametrize(
    "a, b, shared",
    [
        pytest.param(((0, 0), (4, 4)), ((2, 1), (4, 4)), ((2, 1), (2, 3)), id="corner"),
        pytest.param(((0,), (4,)), ((4,), (3,)), None, id="touching"),
        pytest.param(((0,), (4,)), ((2,), (0,)), None, id="empty"),
        pytest.param(((), ()), ((), ()), ((), ()), id="scalar"),
    ],
)
def test_overlap_is_the_region_two_boxes_share(a, b, shared):
    assert overlap(a, b) == shared
