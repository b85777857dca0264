"""``decode`` refuses every malformed message with an error that says what is wrong.

The daemon decodes bytes from any local process, so whatever arrives must
end as a message or as a ``CkptdError`` (which becomes an ``Error`` reply),
never as some other exception escaping into the server loop.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.protocol.errors import BadMessage, CkptdError, PathNotAllowed, UnsupportedVersion
from ckptd.protocol.layout import DTYPE_SIZES, TensorEntry, validate_entries
from ckptd.protocol.messages import (
    MAX_INT,
    MAX_NAME_BYTES,
    MAX_STRING,
    MESSAGE_TYPES,
    WriteShard,
    Message,
    decode,
    request_id,
)

HEADER = 4096

VALID_FIELDS: dict[str, dict[str, Any]] = {
    "hello": {"pid": 4242, "uid": 1000, "client_version": "0.1.0"},
    "welcome": {"daemon_pid": 77, "daemon_version": "0.1.0", "roots": ["/ckpt"]},
    "commit": {
        "slot": "ckptd-1000-4242-0",
        "nbytes": HEADER + 32,
        "header_len": HEADER,
        "tensors": [["w", "F32", [2, 3], 0, 24], ["b", "BF16", [4], 24, 32]],
        "path": "/ckpt/step-100",
        "rank": 1,
        "world_size": 2,
        "step": 100,
        "overwrite": False,
        "coordinated": False,
        "keep_last": None,
        "timeout": 600.0,
        "waited": 0.0,
        "staged": HEADER + 32,
    },
    "staged": {"upto": HEADER + 16, "error": ""},
    "durable": {"file": "rank-00001-of-00002.safetensors", "rank": 1, "size": 4128, "checksum": 7, "tensors": 2},
    "finalize": {
        "path": "/ckpt/step-100",
        "world_size": 2,
        "step": 100,
        "overwrite": False,
        "keep_last": 2,
        "files": [["rank-00000-of-00002.safetensors", 0, 4128, 1, 2], ["rank-00001-of-00002.safetensors", 1, 4128, 2, 2]],
    },
    "abort": {"path": "/ckpt/step-100", "reason": "rank 1 failed"},
    "lease": {"limit": 2},
    "granted": {"waited": 0.5},
    "release": {},
    "accepted": {},
    "done": {"path": "/ckpt/step-100", "bytes_written": 4128, "seconds": 1.5},
    "error": {"code": 6, "message": "exists"},
    "status": {},
    "status_reply": {"info": {"pending": 0}},
    "ping": {},
    "pong": {},
    "bye": {},
    "stop": {},
    "ok": {},
    "held": {"path": "/ckpt/step-101", "bytes_held": 4128, "seconds": 0.5, "released": ["ckptd-1000-4242-0"]},
    "persist": {"path": "/ckpt/step-101"},
    "delete": {"path": "/ckpt/step-101"},
    "pin": {"path": "/ckpt/step-101"},
    "unpin": {"path": "/ckpt/step-101"},
    "snapshots": {},
    "peer_snapshots": {},
    "restore": {"path": "/ckpt/step-101"},
    "peer_identity": {},
    "peer_identity_reply": {"key": "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7", "endpoint": "tcp://node-a:47101"},
    "ring": {"job": "run:1", "node": 0, "endpoints": ["tcp://node-a:47101", "tcp://node-b:47101"],
             "keys": ["rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7", "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"]},
    "snapshot_list": {"snapshots": [{"path": "/ckpt/step-101", "shards": [[0, "ckptd-1000-4242-1", 4128, 1, 2]]}]},
}
VALID_FIELDS["snapshot"] = VALID_FIELDS["commit"]  # a snapshot stages and checks exactly like a commit


def wire(kind: str = "hello", drop: tuple[str, ...] = (), **changes: Any) -> dict[str, Any]:
    """A valid wire map for ``kind`` with some fields changed or dropped."""
    doc: dict[str, Any] = {"v": 1, "type": kind, "id": 42, **VALID_FIELDS[kind]}
    doc.update(changes)
    for name in drop:
        doc.pop(name)
    return doc


def packed(doc: Any) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def commit(**changes: Any) -> bytes:
    return packed(wire("commit", **changes))


def refused(data: bytes, exc_type: type[CkptdError] = BadMessage) -> str:
    with pytest.raises(exc_type) as info:
        decode(data)
    assert type(info.value) is exc_type
    return info.value.message


# --------------------------------------------------------------------------- sanity


@pytest.mark.parametrize("kind", sorted(VALID_FIELDS))
def test_the_valid_map_of_every_type_decodes(kind):
    assert set(VALID_FIELDS) == set(MESSAGE_TYPES)
    msg = decode(packed(wire(kind)))
    assert type(msg) is MESSAGE_TYPES[kind]
    assert msg.id == 42


def test_a_commit_without_a_step_decodes_with_step_none():
    assert decode(commit(step=None)).step is None


def test_a_whole_number_for_a_float_field_decodes_as_a_float():
    done = decode(packed(wire("done", seconds=2)))
    assert done.seconds == 2.0 and type(done.seconds) is float


# --------------------------------------------------------------------------- framing


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"\x93\x01", id="truncated-array"),
        pytest.param(b"\xdf\xff\xff\xff\xff", id="map-claiming-4G-entries"),
        pytest.param(packed(wire()) + b"\x00", id="trailing-bytes"),
        pytest.param(b"hello, daemon", id="plain-text"),
        pytest.param(packed({1: "int key"}), id="integer-map-key"),
    ],
)
def test_bytes_that_are_not_one_msgpack_value_are_refused_as_not_msgpack(data):
    assert "not a msgpack message" in refused(data)


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param([1, "hello", 42], id="array"),
        pytest.param(1, id="integer"),
        pytest.param("hello", id="string"),
        pytest.param(None, id="nil"),
        pytest.param(b"\x81\xa1v\x01", id="binary"),
    ],
)
def test_msgpack_that_is_not_a_map_is_refused(doc):
    assert "must be a msgpack map" in refused(packed(doc))


def test_a_message_without_a_version_is_refused_as_unsupported():
    message = refused(packed(wire(drop=("v",))), UnsupportedVersion)
    assert "protocol version None is not supported" in message


@pytest.mark.parametrize(
    "version",
    [pytest.param(2, id="next"), pytest.param(0, id="zero"), pytest.param("1", id="string-one")],
)
def test_a_message_with_another_version_is_refused_naming_both_versions(version):
    message = refused(packed(wire(v=version)), UnsupportedVersion)
    assert f"protocol version {version!r} is not supported" in message
    assert "speaks 1" in message


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("frobnicate", id="unknown-name"),
        pytest.param("Hello", id="wrong-case"),
        pytest.param("", id="empty"),
        pytest.param(3, id="integer"),
        pytest.param(b"hello", id="bytes"),
    ],
)
def test_an_unknown_message_type_is_refused_naming_the_type(kind):
    doc = wire()
    doc["type"] = kind
    assert f"unknown message type {kind!r}" in refused(packed(doc))


def test_a_message_without_a_type_is_refused_as_unknown_type():
    assert "unknown message type None" in refused(packed(wire(drop=("type",))))


@pytest.mark.parametrize(
    "kind, field",
    [
        pytest.param("hello", "pid", id="hello.pid"),
        pytest.param("hello", "id", id="hello.id"),
        pytest.param("ping", "id", id="ping.id"),
        pytest.param("commit", "tensors", id="commit.tensors"),
        pytest.param("commit", "step", id="commit.step"),
        pytest.param("done", "seconds", id="done.seconds"),
        pytest.param("status_reply", "info", id="status_reply.info"),
    ],
)
def test_a_missing_field_is_refused_naming_the_field(kind, field):
    assert f"{kind}: missing field {field!r}" in refused(packed(wire(kind, drop=(field,))))


@pytest.mark.parametrize(
    "kind, extra",
    [
        pytest.param("hello", {"color": "blue"}, id="hello+color"),
        pytest.param("ping", {"payload": 1}, id="ping+payload"),
        pytest.param("commit", {"checksum": 0}, id="commit+checksum"),
        pytest.param("ok", {"type_": "ok"}, id="ok+type_"),
    ],
)
def test_an_extra_field_is_refused_naming_the_field(kind, extra):
    (name,) = extra
    assert f"{kind}: unexpected fields [{name!r}]" in refused(packed(wire(kind, **extra)))


# --------------------------------------------------------------------------- field types


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("4242", id="string"),
        pytest.param(True, id="bool"),
        pytest.param(-1, id="negative"),
        pytest.param(-(2**63), id="most-negative"),
        pytest.param(2**63, id="2^63"),
        pytest.param(2**64 - 1, id="2^64-1"),
        pytest.param(4242.0, id="float"),
        pytest.param(None, id="nil"),
        pytest.param([4242], id="list"),
    ],
)
def test_a_bad_integer_field_is_refused_naming_the_field(value):
    message = refused(packed(wire(pid=value)))
    assert "hello.pid must be an integer in [0, 2^63)" in message


def test_the_largest_integer_a_field_takes_is_2_to_the_63_minus_1():
    assert decode(packed(wire(pid=MAX_INT))).pid == 2**63 - 1


@pytest.mark.parametrize(
    "value",
    [pytest.param(-1, id="negative"), pytest.param(True, id="bool"), pytest.param("42", id="string")],
)
def test_a_bad_request_id_is_refused_naming_the_id_field(value):
    assert "hello.id must be an integer" in refused(packed(wire(id=value)))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("0.1\x00", id="nul"),
        pytest.param("x" * (MAX_STRING + 1), id="over-long"),
        pytest.param(b"0.1.0", id="bytes"),
        pytest.param(1, id="integer"),
        pytest.param(None, id="nil"),
    ],
)
def test_a_bad_string_field_is_refused_naming_the_field_and_the_limits(value):
    message = refused(packed(wire(client_version=value)))
    assert f"hello.client_version must be a string of at most {MAX_STRING} characters without NUL" in message


def test_a_string_of_exactly_the_maximum_length_is_accepted():
    assert len(decode(packed(wire(client_version="x" * MAX_STRING))).client_version) == MAX_STRING


@pytest.mark.parametrize(
    "value", [pytest.param(0, id="zero"), pytest.param("false", id="string"), pytest.param(None, id="nil")]
)
def test_a_non_boolean_for_a_boolean_field_is_refused(value):
    assert "commit.overwrite must be a boolean" in refused(commit(overwrite=value))


@pytest.mark.parametrize("value", [pytest.param("1.5", id="string"), pytest.param(None, id="nil")])
def test_a_non_number_for_a_float_field_is_refused(value):
    assert "done.seconds must be a number" in refused(packed(wire("done", seconds=value)))


def test_a_string_for_the_optional_step_is_refused_naming_step():
    assert "commit.step must be an integer" in refused(commit(step="100"))


def test_a_non_list_for_a_list_field_is_refused():
    assert "welcome.roots must be a list" in refused(packed(wire("welcome", roots="/ckpt")))


def test_a_bad_item_in_a_list_field_is_refused_naming_its_index():
    message = refused(packed(wire("welcome", roots=["/ckpt", 7])))
    assert "welcome.roots[1] must be a string" in message


def test_a_non_map_for_a_map_field_is_refused():
    assert "status_reply.info must be a map" in refused(packed(wire("status_reply", info=[1, 2])))


# --------------------------------------------------------------------------- commit


@pytest.mark.parametrize(
    "slot",
    [
        pytest.param("shm-1000-4242-0", id="no-prefix"),
        pytest.param("CKPTD-1000", id="upper-case-prefix"),
        pytest.param("ckptd-1000/../../etc", id="slash"),
        pytest.param("/ckptd-1000", id="leading-slash"),
        pytest.param("", id="empty"),
    ],
)
def test_a_commit_with_a_bad_slot_name_is_refused_naming_the_slot(slot):
    message = refused(commit(slot=slot))
    assert f"slot name {slot!r} must start with 'ckptd-' and hold no '/'" in message


def test_the_daemon_refuses_an_overlong_name_at_decode() -> None:
    message = refused(commit(path="/ckpts/" + "z" * (MAX_NAME_BYTES - len(".incomplete") + 1)), PathNotAllowed)
    assert "names may be at most" in message


def test_a_commit_with_an_empty_path_is_refused():
    assert "checkpoint path is empty" in refused(commit(path=""))


@pytest.mark.parametrize(
    "rank, world_size",
    [
        pytest.param(2, 2, id="rank-equals-world"),
        pytest.param(5, 2, id="rank-above-world"),
        pytest.param(0, 0, id="world-size-zero"),
    ],
)
def test_a_commit_whose_rank_is_outside_the_world_is_refused(rank, world_size):
    message = refused(commit(rank=rank, world_size=world_size))
    assert f"rank {rank} is not inside world size {world_size}" in message


@pytest.mark.parametrize(
    "header_len, nbytes",
    [
        pytest.param(4000, 4000 + 32, id="not-a-multiple-of-4096"),
        pytest.param(4104, 4104 + 32, id="4096-plus-8"),
        pytest.param(0, 32, id="zero"),
        pytest.param(8192, HEADER + 32, id="larger-than-the-shard"),
    ],
)
def test_a_commit_with_a_bad_header_length_is_refused_naming_the_length(header_len, nbytes):
    message = refused(commit(header_len=header_len, nbytes=nbytes))
    assert f"header length {header_len} must be a multiple of 4096" in message
    assert f"({nbytes} bytes)" in message


def test_a_commit_whose_tensors_are_not_a_list_is_refused():
    assert "commit.tensors must be a list of tensors" in refused(commit(tensors={"w": 1}))


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(["w", "F32", [2, 3], 0], id="four-items"),
        pytest.param(["w", "F32", [2, 3], 0, 24, 0], id="six-items"),
        pytest.param({"name": "w"}, id="map"),
        pytest.param("w", id="string"),
    ],
)
def test_a_commit_whose_tensor_entry_is_not_a_5_list_is_refused_naming_the_entry(entry):
    tensors = [["b", "BF16", [4], 24, 32], entry]
    assert "commit.tensors[1] must be [name, dtype, shape, begin, end]" in refused(commit(tensors=tensors))


@pytest.mark.parametrize(
    "entry, where",
    [
        pytest.param(["w", "F32", [2, -3], 0, 24], "commit.tensors[0].shape[1] must be an integer", id="negative-dim"),
        pytest.param(["w", "F32", "2x3", 0, 24], "commit.tensors[0].shape must be a list", id="string-shape"),
        pytest.param(["w", 4, [2, 3], 0, 24], "commit.tensors[0].dtype must be a string", id="integer-dtype"),
        pytest.param([7, "F32", [2, 3], 0, 24], "commit.tensors[0].name must be a string", id="integer-name"),
        pytest.param(["w", "F32", [2, 3], -1, 24], "commit.tensors[0].begin must be an integer", id="negative-begin"),
        pytest.param(["w", "F32", [2, 3], 0, 24.0], "commit.tensors[0].end must be an integer", id="float-end"),
    ],
)
def test_a_commit_whose_tensor_entry_has_a_bad_item_is_refused_naming_the_item(entry, where):
    tensors = [entry, ["b", "BF16", [4], 24, 32]]
    assert where in refused(commit(tensors=tensors))


def test_a_commit_with_an_unknown_dtype_is_refused_naming_the_tensor_and_dtype():
    tensors = [["w", "F128", [2, 3], 0, 24], ["b", "BF16", [4], 24, 32]]
    message = refused(commit(tensors=tensors))
    assert "tensor 'w': dtype 'F128' is not one of" in message
    assert "'BF16'" in message


def test_a_tensor_with_a_negative_dimension_is_refused_naming_the_tensor():
    # The wire rejects negative integers before the table is checked, so a
    # negative dimension only reaches validate_entries from Python callers.
    entries = [TensorEntry("w", "F32", (-2, -3), 0, 24)]
    with pytest.raises(BadMessage, match=re.escape("tensor 'w': negative dimension in shape [-2, -3]")):
        validate_entries(entries, 24)
    with pytest.raises(BadMessage, match="negative dimension"):
        WriteShard(1, "ckptd-x", HEADER + 24, HEADER, tuple(entries), "/c", 0, 1, None, False, False, None, 60.0, 0.0, HEADER + 24)


def test_a_commit_whose_shape_disagrees_with_its_offsets_is_refused_naming_the_tensor():
    tensors = [["w", "F32", [2, 3], 0, 20], ["b", "BF16", [4], 20, 28]]
    message = refused(commit(tensors=tensors, nbytes=HEADER + 28))
    assert "tensor 'w': shape [2, 3] x 4 bytes = 24, but its offsets span 20" in message


def test_a_commit_whose_end_is_before_its_begin_is_refused_naming_the_tensor():
    tensors = [["w", "F32", [2, 3], 24, 0], ["b", "BF16", [4], 24, 32]]
    assert "tensor 'w': shape [2, 3] x 4 bytes = 24, but its offsets span -24" in refused(commit(tensors=tensors))


def test_a_commit_with_overlapping_tensors_is_refused_naming_the_tensor():
    tensors = [["w", "F32", [2, 3], 0, 24], ["b", "BF16", [4], 16, 24]]
    message = refused(commit(tensors=tensors))
    assert "tensor 'b' at offset 16 overlaps the tensor before it (expected 24)" in message


def test_a_commit_with_a_hole_between_tensors_is_refused_naming_the_tensor_after_it():
    tensors = [["w", "F32", [2, 3], 0, 24], ["b", "BF16", [4], 28, 36]]
    message = refused(commit(tensors=tensors, nbytes=HEADER + 36))
    assert "tensor 'b' at offset 28 leaves a hole before it (expected 24)" in message


def test_a_commit_whose_first_tensor_does_not_start_at_zero_is_refused_as_a_hole():
    tensors = [["w", "F32", [2, 3], 8, 32]]
    message = refused(commit(tensors=tensors))
    assert "tensor 'w' at offset 8 leaves a hole before it (expected 0)" in message


@pytest.mark.parametrize(
    "nbytes, data_len",
    [
        pytest.param(HEADER + 64, 64, id="shard-larger-than-tensors"),
        pytest.param(HEADER + 16, 16, id="tensors-past-the-shard"),
        pytest.param(HEADER, 0, id="no-data-at-all"),
    ],
)
def test_a_commit_whose_tensors_do_not_cover_the_data_is_refused_naming_both_sizes(nbytes, data_len):
    message = refused(commit(nbytes=nbytes))
    assert f"tensors cover 32 bytes of data but the shard holds {data_len}" in message


def test_a_commit_with_no_tensors_and_no_data_is_accepted():
    msg = decode(commit(tensors=[], nbytes=HEADER, staged=HEADER))
    assert msg.tensors == ()


def test_a_commit_with_a_duplicate_tensor_name_is_refused_naming_the_tensor():
    tensors = [["w", "F32", [2, 3], 0, 24], ["w", "BF16", [4], 24, 32]]
    assert "tensor 'w' appears twice" in refused(commit(tensors=tensors))


# --------------------------------------------------------------------------- request_id


@pytest.mark.parametrize(
    "data, rid",
    [
        pytest.param(packed(wire(pid="not an int")), 42, id="bad-field"),
        pytest.param(packed(wire(v=99)), 42, id="wrong-version"),
        pytest.param(packed(wire(type="frobnicate")), 42, id="unknown-type"),
        pytest.param(commit(slot="evil/slot"), 42, id="bad-commit"),
        pytest.param(packed({1: 2, "id": 9}), 9, id="integer-key-elsewhere"),
        pytest.param(b"\xc1garbage", 0, id="garbage"),
        pytest.param(b"", 0, id="empty"),
        pytest.param(packed([1, 2, 3]), 0, id="array"),
        pytest.param(packed(wire(drop=("id",))), 0, id="no-id"),
        pytest.param(packed(wire(id="42")), 0, id="string-id"),
        pytest.param(packed(wire(id=True)), 0, id="bool-id"),
        pytest.param(packed(wire(id=-5)), 0, id="negative-id"),
        pytest.param(packed(wire(id=2**63)), 0, id="id-too-large"),
    ],
)
def test_request_id_recovers_the_id_of_a_mapped_message_and_is_0_otherwise(data, rid):
    assert request_id(data) == rid


# --------------------------------------------------------------------------- properties

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
keys = st.text(max_size=12) | st.binary(max_size=4)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=12,
)
plausible_ints = st.sampled_from([0, 1, 2, 7, 24, 32, HEADER, HEADER + 32, 2**63 - 1, 2**63, -1])
tensor_entries = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["w", "b", "x", ""]),
            st.sampled_from(sorted(DTYPE_SIZES) + ["F128"]),
            st.lists(plausible_ints, max_size=3),
            plausible_ints,
            plausible_ints,
        ).map(list),
        values,
    ),
    max_size=4,
)


def assert_decodes_or_refuses(data: bytes) -> None:
    try:
        msg = decode(data)
    except CkptdError:
        return
    assert isinstance(msg, Message)
    assert type(decode(msg.to_wire())) is type(msg)


@PROPERTY
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_to_a_message_or_raise_a_ckptd_error(data):
    assert_decodes_or_refuses(data)


@PROPERTY
@given(
    extra=st.dictionaries(keys, values, max_size=4),
    version=st.sampled_from([1, 1, 1, 0, 2, None, "1"]),
    kind=st.sampled_from(sorted(MESSAGE_TYPES) + ["nope"]) | values,
    rid=st.integers(min_value=-1, max_value=2**63) | values,
)
def test_arbitrary_msgpack_maps_decode_to_a_message_or_raise_a_ckptd_error(extra, version, kind, rid):
    doc = {**extra, "v": version, "type": kind, "id": rid}
    assert_decodes_or_refuses(packed(doc))


@PROPERTY
@given(data=st.data(), kind=st.sampled_from(sorted(MESSAGE_TYPES)))
def test_maps_with_every_field_of_a_type_decode_to_a_message_or_raise_a_ckptd_error(data, kind):
    """Every field present, each valid, plausible or arbitrary, so checks deep inside a commit run."""
    doc = wire(kind)
    for name, valid in list(doc.items()):
        if name in ("v", "type"):
            continue
        if name == "tensors":
            doc[name] = data.draw(st.just(valid) | tensor_entries | values, label=name)
        elif name in ("nbytes", "header_len", "rank", "world_size", "step"):
            doc[name] = data.draw(st.just(valid) | plausible_ints | values, label=name)
        else:
            doc[name] = data.draw(st.just(valid) | values, label=name)
    assert_decodes_or_refuses(packed(doc))


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"keep_last": 0}, "keep_last must be at least 1"),
        ({"timeout": 0.0}, "timeout must be between"),
        ({"timeout": 1e9}, "timeout must be between"),
        ({"waited": "long"}, "commit.waited must be a number"),
        ({"staged": HEADER - 1}, "staged 4095 must lie between the header"),
        ({"staged": HEADER + 33}, "must lie between the header"),
        ({"save": -1}, r"commit.save must be an integer in \[0, 2\^63\), got -1"),
        ({"save": 1 << 63}, r"commit.save must be an integer in \[0, 2\^63\)"),
        ({"save": "2"}, "commit.save must be"),
    ],
    ids=["keep-last-zero", "timeout-zero", "timeout-huge", "waited-not-a-number", "staged-inside-header",
         "staged-past-the-shard", "save-negative", "save-huge", "save-not-an-int"],
)
def test_a_commit_with_bad_retention_or_timeout_is_refused(changes, needle) -> None:
    with pytest.raises(BadMessage, match=needle):
        decode(msgpack.packb(wire("commit", **changes)))


@pytest.mark.parametrize("rank", [-1, 1 << 20, "1", 1.5])
def test_a_restore_naming_no_rank_it_could_hold_is_refused(rank) -> None:
    with pytest.raises(BadMessage, match="restore.rank"):
        decode(msgpack.packb(wire("restore", rank=rank)))


@pytest.mark.parametrize(
    "files, needle",
    [
        ([["a", 0, 1, 1, 1]], "lists 1 files for world size 2"),
        ([["a", 0, 1, 1, 1], ["../../etc/x", 1, 1, 1, 1]], "not a plain file name"),
        ([["a", 0, 1, 1], ["b", 1, 1, 1, 1]], "must be \\[file, rank, size, checksum, tensors\\]"),
    ],
    ids=["missing-rank", "path-in-file-name", "short-row"],
)
def test_a_finalize_with_bad_files_is_refused(files, needle) -> None:
    with pytest.raises(BadMessage, match=needle):
        decode(msgpack.packb(wire("finalize", files=files)))
