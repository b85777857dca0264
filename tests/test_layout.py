"""The shard byte layout (protocol/layout.py) and the checkpoint index (protocol/index.py)."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from ckptd.protocol.errors import BadMessage, InvalidCheckpoint
from ckptd.protocol.index import (
    INDEX_NAME,
    CheckpointIndex,
    ShardRecord,
    incomplete_path,
    latest,
    read_index,
    shard_name,
)
from ckptd.protocol.layout import (
    DATA_ALIGNMENT,
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    TensorEntry,
    encode_header,
    parse_header,
    plan_layout,
)

MIXED = [
    ("flag", "BOOL", (3,)),
    ("moments", "F64", (5,)),
    ("half", "F16", (7,)),
    ("counts", "I32", (2, 2)),
    ("byte", "U8", (1,)),
    ("bf", "BF16", (3,)),
    ("scale", "F32", (1,)),
    ("empty", "F32", (0, 4)),
    ("steps", "I64", ()),
]


def header_with(body: bytes, file_size: int | None = None) -> tuple[bytes, int]:
    """A raw header: length prefix plus ``body``; file size defaults to exactly the header."""
    prefix = struct.pack("<Q", len(body)) + body
    return prefix, len(prefix) if file_size is None else file_size


def json_header(doc: object, data_len: int = 0) -> tuple[bytes, int]:
    body = json.dumps(doc).encode()
    return header_with(body, 8 + len(body) + data_len)


# --------------------------------------------------------------------------- plan_layout


def test_plan_layout_orders_tensors_by_element_size_largest_first_then_by_name():
    layout = plan_layout(MIXED, {})
    assert [e.name for e in layout.entries] == [
        "moments", "steps",            # 8 bytes
        "counts", "empty", "scale",    # 4 bytes
        "bf", "half",                  # 2 bytes
        "byte", "flag",                # 1 byte
    ]  # fmt: skip
    sizes = [DTYPE_SIZES[e.dtype] for e in layout.entries]
    assert sizes == sorted(sizes, reverse=True)


def test_plan_layout_starts_every_tensor_at_a_multiple_of_its_element_size_with_no_holes():
    layout = plan_layout(MIXED, {})
    offset = 0
    for e in layout.entries:
        assert e.begin == offset
        assert e.begin % DTYPE_SIZES[e.dtype] == 0
        assert e.nbytes == int(np.prod(e.shape, dtype=np.int64)) * DTYPE_SIZES[e.dtype]
        offset = e.end
    assert layout.nbytes == layout.data_start + offset


def test_plan_layout_keeps_zero_sized_and_scalar_tensors():
    by_name = {e.name: e for e in plan_layout(MIXED, {}).entries}
    assert by_name["empty"].begin == by_name["empty"].end
    assert by_name["steps"].shape == () and by_name["steps"].nbytes == 8


@pytest.mark.parametrize(
    "tensors, metadata",
    [
        pytest.param(MIXED, {}, id="mixed-no-metadata"),
        pytest.param(MIXED, {"ckptd.structure": "abc", "step": "100"}, id="mixed-with-metadata"),
        pytest.param([], {}, id="no-tensors"),
        pytest.param([(f"layer.{i}.weight", "BF16", (64, 64)) for i in range(200)], {}, id="header-over-4096"),
    ],
)
def test_plan_layout_pads_the_header_with_spaces_so_data_starts_on_a_4096_boundary(tensors, metadata):
    layout = plan_layout(tensors, metadata)
    header = layout.header
    assert layout.data_start == len(header)
    assert len(header) % DATA_ALIGNMENT == 0 and len(header) >= DATA_ALIGNMENT
    (hlen,) = struct.unpack_from("<Q", header)
    assert hlen == len(header) - 8
    assert header[8:9] == b"{"
    body = header[8:].rstrip(b" ")
    assert body.endswith(b"}")
    assert set(header[8 + len(body):]) <= {ord(" ")}
    assert isinstance(json.loads(header[8:]), dict)  # the padding is JSON whitespace
    if len(tensors) == 200:
        assert len(header) > DATA_ALIGNMENT


def test_a_header_that_exactly_fills_4096_bytes_gets_no_padding():
    base = len(encode_header([], {"k": ""}))
    assert base == DATA_ALIGNMENT
    unpadded = len(json.dumps({"__metadata__": {"k": ""}}, separators=(",", ":")))
    fill = "x" * (DATA_ALIGNMENT - 8 - unpadded)
    header = encode_header([], {"k": fill})
    assert len(header) == DATA_ALIGNMENT
    assert header.endswith(b"}")


def test_a_header_one_byte_over_4096_pads_to_8192():
    unpadded = len(json.dumps({"__metadata__": {"k": ""}}, separators=(",", ":")))
    header = encode_header([], {"k": "x" * (DATA_ALIGNMENT - 8 - unpadded + 1)})
    assert len(header) == 2 * DATA_ALIGNMENT


def test_the_header_holds_metadata_only_when_there_is_some():
    assert "__metadata__" not in json.loads(plan_layout(MIXED, {}).header[8:])
    doc = json.loads(plan_layout(MIXED, {"step": "7"}).header[8:])
    assert doc["__metadata__"] == {"step": "7"}
    assert doc["counts"] == {"dtype": "I32", "shape": [2, 2], "data_offsets": [48, 64]}


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "tensors, metadata",
    [
        pytest.param(MIXED, {}, id="mixed"),
        pytest.param(MIXED, {"ckptd.structure": "eyJhIjoxfQ==", "note": "naïve ✓"}, id="unicode-metadata"),
        pytest.param([("poids_é", "F32", (3,)), ("权重", "F16", (2,))], {}, id="unicode-names"),
        pytest.param([], {"only": "metadata"}, id="no-tensors"),
    ],
)
def test_parse_header_reads_back_what_plan_layout_wrote(tensors, metadata):
    layout = plan_layout(tensors, metadata)
    entries, parsed_metadata, data_start = parse_header(layout.header, layout.nbytes)
    assert entries == list(layout.entries)
    assert parsed_metadata == metadata
    assert data_start == layout.data_start


def test_encode_header_and_parse_header_round_trip_an_explicit_table():
    entries = [TensorEntry("a", "F64", (2,), 0, 16), TensorEntry("b", "U8", (3,), 16, 19)]
    header = encode_header(entries, {"k": "v"})
    assert parse_header(header, len(header) + 19) == (entries, {"k": "v"}, len(header))


def test_parse_header_needs_only_the_header_not_the_data():
    layout = plan_layout(MIXED, {})
    assert parse_header(memoryview(layout.header), layout.nbytes)[2] == layout.data_start


def test_a_shard_from_plan_layout_loads_with_the_safetensors_library(tmp_path):
    layout = plan_layout([("w", "F32", (2, 3)), ("b", "F16", (4,)), ("n", "I64", (1,))], {"k": "v"})
    arrays = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([1, 2, 3, 4], dtype=np.float16),
        "n": np.array([-7], dtype=np.int64),
    }
    data = bytearray(layout.nbytes)
    data[: layout.data_start] = layout.header
    for e in layout.entries:
        data[layout.data_start + e.begin : layout.data_start + e.end] = arrays[e.name].tobytes()
    path = tmp_path / "shard.safetensors"
    path.write_bytes(bytes(data))
    loaded = safetensors.numpy.load_file(str(path))
    assert loaded.keys() == arrays.keys()
    for name, array in arrays.items():
        np.testing.assert_array_equal(loaded[name], array)


def test_parse_header_accepts_a_file_written_by_the_safetensors_library(tmp_path):
    path = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file(
        {"x": np.zeros((3, 5), np.float32), "y": np.ones(7, np.uint8)}, str(path), metadata={"a": "b"}
    )
    data = path.read_bytes()
    entries, metadata, data_start = parse_header(data, len(data))
    assert {e.name: (e.dtype, e.shape) for e in entries} == {"x": ("F32", (3, 5)), "y": ("U8", (7,))}
    assert metadata == {"a": "b"}
    assert data_start + sum(e.nbytes for e in entries) == len(data)


# --------------------------------------------------------------------------- parse_header refusals


def test_parse_header_refuses_a_file_too_short_for_the_length_prefix():
    with pytest.raises(BadMessage, match="shard of 7 bytes is too short"):
        parse_header(b"\x00" * 7, 7)
    with pytest.raises(BadMessage, match="too short"):
        parse_header(b"\x00" * 4, 4096)


def test_parse_header_refuses_a_header_length_larger_than_the_file():
    prefix, _ = header_with(b"{}" + b" " * 98)
    with pytest.raises(BadMessage, match="header length 100 does not fit a shard of 50 bytes"):
        parse_header(prefix, 50)


def test_parse_header_refuses_a_header_length_beyond_the_safetensors_limit():
    prefix = struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}"
    with pytest.raises(BadMessage, match=f"header length {MAX_HEADER_BYTES + 1} does not fit"):
        parse_header(prefix, 2**40)


def test_parse_header_refuses_a_prefix_shorter_than_the_header_it_announces():
    prefix, size = header_with(b"{}" + b" " * 4086)
    with pytest.raises(BadMessage, match="need 4096 header bytes, got 100"):
        parse_header(prefix[:100], size)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"{not json", id="broken-json"),
        pytest.param(b"\xff\xfe{}", id="invalid-utf8"),
        pytest.param(b"", id="empty"),
        pytest.param(b'{"a": 1} {"b": 2}', id="two-documents"),
    ],
)
def test_parse_header_refuses_a_header_that_is_not_json(body):
    with pytest.raises(BadMessage, match="header is not valid JSON"):
        parse_header(*header_with(body))


def test_parse_header_refuses_deeply_nested_json_as_bad_json():
    body = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(BadMessage, match="header is not valid JSON"):
        parse_header(*header_with(body))


@pytest.mark.parametrize(
    "doc",
    [pytest.param([1, 2], id="array"), pytest.param("text", id="string"), pytest.param(3, id="number"),
     pytest.param(None, id="null")],
)
def test_parse_header_refuses_json_that_is_not_an_object(doc):
    with pytest.raises(BadMessage, match="header is not a JSON object"):
        parse_header(*json_header(doc))


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({"step": 100}, id="integer-value"),
        pytest.param({"a": ["b"]}, id="list-value"),
        pytest.param({"a": None}, id="null-value"),
        pytest.param("step=100", id="string"),
        pytest.param([["a", "b"]], id="list-of-pairs"),
        pytest.param(True, id="true"),
    ],
)
def test_parse_header_refuses_metadata_that_does_not_map_strings_to_strings(metadata):
    with pytest.raises(BadMessage, match="__metadata__ must map strings to strings"):
        parse_header(*json_header({"__metadata__": metadata}))


@pytest.mark.parametrize(
    "metadata",
    [pytest.param([], id="empty-list"), pytest.param(0, id="zero"), pytest.param("", id="empty-string"),
     pytest.param(False, id="false")],
)
def test_parse_header_refuses_empty_non_map_metadata_too(metadata):
    # safetensors itself refuses these; only an absent or null __metadata__ means "none".
    with pytest.raises(BadMessage, match="__metadata__ must map strings to strings"):
        parse_header(*json_header({"__metadata__": metadata}))


def test_parse_header_accepts_null_or_empty_metadata_as_none():
    assert parse_header(*json_header({"__metadata__": None}))[1] == {}
    assert parse_header(*json_header({"__metadata__": {}}))[1] == {}


@pytest.mark.parametrize(
    "info",
    [
        pytest.param({"dtype": "F32", "shape": [2]}, id="missing-data_offsets"),
        pytest.param({"shape": [2], "data_offsets": [0, 8]}, id="missing-dtype"),
        pytest.param({"dtype": "F32", "data_offsets": [0, 8]}, id="missing-shape"),
        pytest.param({"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}, id="three-offsets"),
        pytest.param({"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}, id="float-offset"),
        pytest.param({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, id="bool-dim"),
        pytest.param({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, id="string-shape"),
        pytest.param({"dtype": 4, "shape": [2], "data_offsets": [0, 8]}, id="integer-dtype"),
        pytest.param([0, 8], id="not-an-object"),
    ],
)
def test_parse_header_refuses_a_malformed_tensor_entry_naming_the_tensor(info):
    with pytest.raises(BadMessage, match="tensor 'w': header entry must hold dtype, shape and two integer"):
        parse_header(*json_header({"w": info}, data_len=8))


@pytest.mark.parametrize(
    "doc, data_len, problem",
    [
        pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16,
                     "tensors cover 8 bytes of data but the shard holds 16", id="data-longer-than-tensors"),
        pytest.param({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4,
                     "tensors cover 8 bytes of data but the shard holds 4", id="tensor-past-end-of-file"),
        pytest.param({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, 8,
                     "tensor 'w': dtype 'C64' is not one of", id="unknown-dtype"),
        pytest.param({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8,
                     "tensor 'w': negative dimension", id="negative-dim"),
        pytest.param({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8,
                     "tensor 'w': shape [3] x 4 bytes = 12, but its offsets span 8", id="shape-disagrees"),
        pytest.param({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                      "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6,
                     "tensor 'b' at offset 2 overlaps", id="overlap"),
        pytest.param({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                      "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}}, 10,
                     "tensor 'b' at offset 6 leaves a hole", id="hole"),
    ],
)
def test_parse_header_checks_the_tensor_table_against_the_file_size(doc, data_len, problem):
    with pytest.raises(BadMessage, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_header(*json_header(doc, data_len=data_len))


# --------------------------------------------------------------------------- index


def make_index(world_size: int = 2, step: int | None = 100, created: float = 1_700_000_000.25,
               ranks: list[int] | None = None) -> CheckpointIndex:
    ranks = list(range(world_size)) if ranks is None else ranks
    files = tuple(ShardRecord(shard_name(r, world_size), r, 4096 + 32 * r, 0xDEADBEEF + r, 2) for r in ranks)
    return CheckpointIndex(world_size=world_size, step=step, created=created, files=files)


def write_checkpoint(directory: Path, index: CheckpointIndex | bytes) -> Path:
    """An index, and for a parsed one, shard files of the sizes it records (zeros)."""
    directory.mkdir(parents=True)
    data = index if isinstance(index, bytes) else index.to_json()
    (directory / INDEX_NAME).write_bytes(data)
    for record in () if isinstance(index, bytes) else index.files:
        with open(directory / record.file, "wb") as f:
            f.truncate(record.size)
    return directory


def index_doc(**changes: object) -> bytes:
    doc = json.loads(make_index().to_json())
    doc.update(changes)
    return json.dumps(doc).encode()


def test_shard_names_are_zero_padded_rank_of_world():
    assert shard_name(3, 16) == "rank-00003-of-00016.safetensors"


@pytest.mark.parametrize(
    "index",
    [
        pytest.param(make_index(), id="two-ranks"),
        pytest.param(make_index(world_size=1, step=None), id="no-step"),
        pytest.param(make_index(world_size=4, step=0, created=0.0), id="step-zero"),
        pytest.param(dataclasses.replace(make_index(), keep_last=2), id="keep-last"),
    ],
)
def test_checkpoint_index_round_trips_through_json(index):
    data = index.to_json()
    assert data.endswith(b"\n")
    assert CheckpointIndex.from_json(data, "x") == index


def test_checkpoint_index_json_names_its_format_version_and_checksum():
    doc = json.loads(make_index().to_json())
    assert (doc["format"], doc["version"], doc["checksum_algorithm"]) == ("ckptd", 2, "crc32c")
    assert "keep_last" not in doc  # written only when the save asked for one: other indexes are as before
    assert doc["files"][1] == {"file": "rank-00001-of-00002.safetensors", "rank": 1, "size": 4128,
                               "checksum": 0xDEADBEEF + 1, "tensors": 2}


def test_checkpoint_index_finds_shards_by_rank_and_totals_their_bytes():
    index = make_index()
    assert index.shard(1).file == "rank-00001-of-00002.safetensors"
    assert index.total_bytes == 4096 + 4128
    with pytest.raises(InvalidCheckpoint, match="checkpoint has no rank 2; it holds ranks 0..1"):
        index.shard(2)


@pytest.mark.parametrize(
    "data, problem",
    [
        pytest.param(b"{not json", "index is not a valid ckptd index", id="not-json"),
        pytest.param(b"[1, 2]", "index is not a valid ckptd index", id="not-an-object"),
        pytest.param(index_doc(format="safetensors"), "format is 'safetensors', not 'ckptd'", id="format-name"),
        pytest.param(index_doc(version=3), "format version 3 is not one of [1, 2]", id="format-version"),
        pytest.param(index_doc(world_size="two"), "index is not a valid ckptd index", id="string-world-size"),
        pytest.param(index_doc(files=[{"file": "x"}]), "index is not a valid ckptd index", id="short-file-record"),
        pytest.param(index_doc(files="rank-0"), "index is not a valid ckptd index", id="files-not-a-list"),
        pytest.param(index_doc(world_size=3), "index lists ranks [0, 1] for world size 3", id="missing-rank"),
        pytest.param(index_doc(world_size=1), "index lists ranks [0, 1] for world size 1", id="extra-rank"),
        pytest.param(index_doc(keep_last=0), "keep_last 0 is not a positive integer", id="keep-last-zero"),
        pytest.param(index_doc(keep_last="2"), "keep_last '2' is not a positive integer", id="keep-last-string"),
        pytest.param(json.dumps({**json.loads(make_index(ranks=[0, 0]).to_json())}).encode(),
                     "index lists ranks [0, 0] for world size 2", id="duplicate-rank"),
        # Below: malformed values that must also end as InvalidCheckpoint.
        pytest.param(index_doc(world_size=float("inf")), "index is not a valid ckptd index", id="infinite-world-size"),
        pytest.param(index_doc(step=float("inf")), "index is not a valid ckptd index", id="infinite-step"),
        pytest.param(index_doc(files=[{"file": "a", "rank": 0, "size": 1, "checksum": 1, "tensors": 1},
                                      {"file": "b", "rank": "1", "size": 1, "checksum": 1, "tensors": 1}]),
                     "", id="string-rank"),
        pytest.param(index_doc(files=[{"file": "a", "rank": None, "size": 1, "checksum": 1, "tensors": 1},
                                      {"file": "b", "rank": 1, "size": 1, "checksum": 1, "tensors": 1}]),
                     "", id="null-rank"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, "", id="deeply-nested"),
    ],
)
def test_checkpoint_index_from_json_refuses_a_bad_index_with_invalid_checkpoint(data, problem):
    with pytest.raises(InvalidCheckpoint) as info:
        CheckpointIndex.from_json(data, "/ckpt/step-1/ckptd.json")
    assert info.value.message.startswith("/ckpt/step-1/ckptd.json: ")
    assert problem in info.value.message


def test_read_index_reads_a_committed_checkpoint(tmp_path):
    index = make_index()
    assert read_index(write_checkpoint(tmp_path / "step-100", index)) == index
    assert read_index(str(tmp_path / "step-100")) == index


def test_read_index_refuses_an_incomplete_checkpoint_even_with_a_valid_index(tmp_path):
    path = write_checkpoint(incomplete_path(tmp_path / "step-100"), make_index())
    assert path.name == "step-100.incomplete"
    with pytest.raises(InvalidCheckpoint, match=r"unfinished checkpoint \(\.incomplete\)"):
        read_index(path)


def test_read_index_refuses_a_directory_without_an_index(tmp_path):
    (tmp_path / "step-100").mkdir()
    with pytest.raises(InvalidCheckpoint, match="has no ckptd.json: it is not a committed ckptd checkpoint"):
        read_index(tmp_path / "step-100")


def test_read_index_refuses_a_path_that_does_not_exist(tmp_path):
    with pytest.raises(InvalidCheckpoint, match="no checkpoint at"):
        read_index(tmp_path / "nowhere")


def test_read_index_refuses_a_plain_file(tmp_path):
    (tmp_path / "step-100").write_bytes(make_index().to_json())
    with pytest.raises(InvalidCheckpoint, match="cannot read"):
        read_index(tmp_path / "step-100")


@pytest.mark.parametrize(
    "data, problem",
    [
        pytest.param(index_doc(format="other"), "format is 'other'", id="format-name"),
        pytest.param(index_doc(version=7), "format version 7 is not one of [1, 2]", id="format-version"),
        pytest.param(index_doc(world_size=4), "index lists ranks [0, 1] for world size 4", id="ranks-vs-world"),
    ],
)
def test_read_index_refuses_a_bad_index_file_naming_the_file(tmp_path, data, problem):
    path = write_checkpoint(tmp_path / "step-100", data)
    with pytest.raises(InvalidCheckpoint) as info:
        read_index(path)
    assert str(path / INDEX_NAME) in info.value.message
    assert problem in info.value.message


# --------------------------------------------------------------------------- latest


def test_latest_picks_the_checkpoint_with_the_highest_step(tmp_path):
    write_checkpoint(tmp_path / "b", make_index(step=9, created=300.0))
    best = write_checkpoint(tmp_path / "a", make_index(step=10, created=100.0))
    write_checkpoint(tmp_path / "c", make_index(step=2, created=900.0))
    assert latest(tmp_path) == best
    assert latest(str(tmp_path)) == best


def test_latest_breaks_step_ties_by_commit_time(tmp_path):
    write_checkpoint(tmp_path / "old", make_index(step=5, created=100.0))
    newer = write_checkpoint(tmp_path / "new", make_index(step=5, created=200.0))
    assert latest(tmp_path) == newer


def test_latest_ranks_checkpoints_without_a_step_below_step_zero(tmp_path):
    write_checkpoint(tmp_path / "unstepped", make_index(step=None, created=999.0))
    zero = write_checkpoint(tmp_path / "zero", make_index(step=0, created=1.0))
    assert latest(tmp_path) == zero


def test_latest_uses_commit_time_when_no_checkpoint_has_a_step(tmp_path):
    write_checkpoint(tmp_path / "first", make_index(step=None, created=1.0))
    second = write_checkpoint(tmp_path / "second", make_index(step=None, created=2.0))
    assert latest(tmp_path) == second


def test_latest_ignores_incomplete_checkpoints_even_with_a_higher_step(tmp_path):
    done = write_checkpoint(tmp_path / "step-10", make_index(step=10))
    write_checkpoint(incomplete_path(tmp_path / "step-20"), make_index(step=20))
    assert latest(tmp_path) == done


def test_latest_ignores_directories_with_no_or_an_invalid_index_and_plain_files(tmp_path):
    done = write_checkpoint(tmp_path / "step-10", make_index(step=10))
    (tmp_path / "step-30").mkdir()
    write_checkpoint(tmp_path / "step-40", b"{broken")
    write_checkpoint(tmp_path / "step-50", index_doc(step=50, world_size=3))
    (tmp_path / "step-60").write_bytes(make_index(step=60).to_json())
    assert latest(tmp_path) == done


def test_latest_ignores_directories_whose_index_has_malformed_values(tmp_path):
    done = write_checkpoint(tmp_path / "step-10", make_index(step=10))
    write_checkpoint(tmp_path / "step-70", index_doc(step=float("inf")))
    write_checkpoint(tmp_path / "step-80", index_doc(step=80, files=[
        {"file": "a", "rank": 0, "size": 1, "checksum": 1, "tensors": 1},
        {"file": "b", "rank": "1", "size": 1, "checksum": 1, "tensors": 1},
    ]))
    assert latest(tmp_path) == done


def test_latest_returns_none_for_an_empty_root(tmp_path):
    assert latest(tmp_path) is None


def test_latest_returns_none_for_a_root_with_only_unfinished_or_invalid_checkpoints(tmp_path):
    write_checkpoint(incomplete_path(tmp_path / "step-20"), make_index(step=20))
    (tmp_path / "step-30").mkdir()
    assert latest(tmp_path) is None


def test_latest_returns_none_for_a_missing_root(tmp_path):
    assert latest(tmp_path / "does-not-exist") is None
