"""Golden bytes for every message: the wire format is frozen here.

Clients and daemons of different ckptd releases talk to each other on the
same node, so any change to how a message is encoded is a protocol change.
If one of these tests fails, either the change was an accident (fix the
code) or it is deliberate (bump PROTOCOL_VERSION and regenerate the hex on
purpose, never silently).
"""

from __future__ import annotations

import dataclasses

import pytest

from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.layout import TensorEntry
from ckptd.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Accepted,
    Bye,
    Delete,
    WriteShard,
    Done,
    Durable,
    Error,
    Finalize,
    Granted,
    HeldInMemory,
    Hello,
    Lease,
    Message,
    Ok,
    PeerIdentity,
    PeerIdentityReply,
    ListPeerSnapshots,
    Persist,
    Pin,
    Ping,
    Pong,
    Release,
    Restore,
    Ring,
    Snapshot,
    SnapshotList,
    ListSnapshots,
    Staged,
    Status,
    StatusReply,
    Stop,
    Unpin,
    Welcome,
    decode,
)

PEER_KEYS = ("rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7", "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6")
"""Two CurveZMQ public keys in Z85, as ``ckptd peer-key`` prints them."""

GOLDEN: dict[str, tuple[Message, str]] = {
    "hello": (
        Hello(id=1, pid=4242, uid=1000, client_version="0.1.0", rank=1, world_size=2, job="torchelastic:abc:1"),
        "89a17601a474797065a568656c6c6fa2696401a3706964cd1092a3756964cd03e8"
        "ae636c69656e745f76657273696f6ea5302e312e30a472616e6b01aa776f726c64"
        "5f73697a6502a36a6f62b2746f726368656c61737469633a6162633a31",
    ),
    "welcome": (
        Welcome(id=1, daemon_pid=77, daemon_version="0.1.0", roots=("/ckpt", "/scratch/ckpt")),
        "86a17601a474797065a777656c636f6d65a2696401aa6461656d6f6e5f7069644d"
        "ae6461656d6f6e5f76657273696f6ea5302e312e30a5726f6f747392a52f636b70"
        "74ad2f736372617463682f636b7074",
    ),
    "commit": (
        WriteShard(
            id=2,
            slot="ckptd-1000-4242-0",
            nbytes=4096 + 32,
            header_len=4096,
            tensors=(),  # a save of a structure sent before names its table (the snapshot below carries one)
            path="/ckpt/step-100",
            rank=1,
            world_size=2,
            step=100,
            overwrite=False,
            coordinated=False,
            keep_last=3,
            timeout=600.0,
            waited=0.25,
            staged=4096,
            layout="0123456789abcdef0123456789abcdef",
            job="torchelastic:abc:1",
            replicated={"model": "00112233445566778899aabbccddeeff"},
            save=3,
        ),
        "de0015a17601a474797065a6636f6d6d6974a2696402a4736c6f74b1636b707464"
        "2d313030302d343234322d30a66e6279746573cd1020aa6865616465725f6c656e"
        "cd1000a774656e736f727390a470617468ae2f636b70742f737465702d313030a4"
        "72616e6b01aa776f726c645f73697a6502a47374657064a96f7665727772697465"
        "c2ab636f6f7264696e61746564c2a96b6565705f6c61737403a774696d656f7574"
        "cb4082c00000000000a6776169746564cb3fd0000000000000a6737461676564cd"
        "1000a66c61796f7574d92030313233343536373839616263646566303132333435"
        "36373839616263646566a36a6f62b2746f726368656c61737469633a6162633a31"
        "aa7265706c69636174656481a56d6f64656cd92030303131323233333434353536"
        "36373738383939616162626363646465656666a47361766503",
    ),
    "durable": (
        Durable(id=2, file="rank-00001-of-00002.safetensors", rank=1, size=4128, checksum=305419896, tensors=2),
        "88a17601a474797065a764757261626c65a2696402a466696c65bf72616e6b2d30"
        "303030312d6f662d30303030322e7361666574656e736f7273a472616e6b01a473"
        "697a65cd1020a8636865636b73756dce12345678a774656e736f727302",
    ),
    "finalize": (
        Finalize(
            id=9,
            path="/ckpt/step-100",
            world_size=2,
            step=100,
            overwrite=False,
            keep_last=None,
            files=(
                ShardRecord("rank-00000-of-00002.safetensors", 0, 4128, 1, 2),
                ShardRecord("rank-00001-of-00002.safetensors", 1, 4128, 2, 2),
            ),
            job="torchelastic:abc:1",
        ),
        "8aa17601a474797065a866696e616c697a65a2696409a470617468ae2f636b7074"
        "2f737465702d313030aa776f726c645f73697a6502a47374657064a96f76657277"
        "72697465c2a96b6565705f6c617374c0a566696c65739295bf72616e6b2d303030"
        "30302d6f662d30303030322e7361666574656e736f727300cd1020010295bf7261"
        "6e6b2d30303030312d6f662d30303030322e7361666574656e736f727301cd1020"
        "0202a36a6f62b2746f726368656c61737469633a6162633a31",
    ),
    "abort": (
        Abort(id=10, path="/ckpt/step-100", reason="rank 3: daemon gone", job="torchelastic:abc:1"),
        "86a17601a474797065a561626f7274a269640aa470617468ae2f636b70742f7374"
        "65702d313030a6726561736f6eb372616e6b20333a206461656d6f6e20676f6e65"
        "a36a6f62b2746f726368656c61737469633a6162633a31",
    ),
    "lease": (
        Lease(id=11, limit=2),
        "84a17601a474797065a56c65617365a269640ba56c696d697402",
    ),
    "granted": (
        Granted(id=11, waited=0.5),
        "84a17601a474797065a76772616e746564a269640ba6776169746564cb3fe00000"
        "00000000",
    ),
    "release": (
        Release(id=12),
        "83a17601a474797065a772656c65617365a269640c",
    ),
    "staged": (
        Staged(id=2, upto=1 << 26, error=""),
        "85a17601a474797065a6737461676564a2696402a47570746fce04000000a56572"
        "726f72a0",
    ),
    "accepted": (
        Accepted(id=2),
        "83a17601a474797065a86163636570746564a2696402",
    ),
    "done": (
        Done(id=2, path="/ckpt/step-100", bytes_written=4128, seconds=1.5),
        "86a17601a474797065a4646f6e65a2696402a470617468ae2f636b70742f737465"
        "702d313030ad62797465735f7772697474656ecd1020a77365636f6e6473cb3ff8"
        "000000000000",
    ),
    "error": (
        Error(id=3, code=6, message="checkpoint /ckpt/step-100 exists"),
        "85a17601a474797065a56572726f72a2696403a4636f646506a76d657373616765"
        "d920636865636b706f696e74202f636b70742f737465702d31303020657869737473",
    ),
    "status": (
        Status(id=4),
        "83a17601a474797065a6737461747573a2696404",
    ),
    "status_reply": (
        StatusReply(id=4, info={"pending": 2, "roots": ["/ckpt"]}),
        "84a17601a474797065ac7374617475735f7265706c79a2696404a4696e666f82a7"
        "70656e64696e6702a5726f6f747391a52f636b7074",
    ),
    "ping": (Ping(id=5), "83a17601a474797065a470696e67a2696405"),
    "pong": (Pong(id=5), "83a17601a474797065a4706f6e67a2696405"),
    "bye": (Bye(id=6), "83a17601a474797065a3627965a2696406"),
    "stop": (Stop(id=7), "83a17601a474797065a473746f70a2696407"),
    "ok": (Ok(id=7), "83a17601a474797065a26f6ba2696407"),
    "snapshot": (
        Snapshot(
            id=2,
            slot="ckptd-1000-4242-1",
            nbytes=4096 + 32,
            header_len=4096,
            tensors=(TensorEntry("w", "F32", (2, 3), 0, 24), TensorEntry("b", "BF16", (4,), 24, 32)),
            path="/ckpt/step-101",
            rank=1,
            world_size=2,
            step=101,
            overwrite=False,
            coordinated=False,
            keep_last=None,
            timeout=600.0,
            waited=0.0,
            staged=4128,
        ),
        "de0015a17601a474797065a8736e617073686f74a2696402a4736c6f74b1636b70"
        "74642d313030302d343234322d31a66e6279746573cd1020aa6865616465725f6c"
        "656ecd1000a774656e736f72739295a177a3463332920203001895a162a4424631"
        "3691041820a470617468ae2f636b70742f737465702d313031a472616e6b01aa77"
        "6f726c645f73697a6502a47374657065a96f7665727772697465c2ab636f6f7264"
        "696e61746564c2a96b6565705f6c617374c0a774696d656f7574cb4082c0000000"
        "0000a6776169746564cb0000000000000000a6737461676564cd1020a66c61796f"
        "7574a0a36a6f62a0aa7265706c69636174656480a47361766500",
    ),
    "held": (
        HeldInMemory(id=2, path="/ckpt/step-101", bytes_held=4128, seconds=0.5, released=("ckptd-1000-4242-0",)),
        "87a17601a474797065a468656c64a2696402a470617468ae2f636b70742f737465"
        "702d313031aa62797465735f68656c64cd1020a77365636f6e6473cb3fe0000000"
        "000000a872656c656173656491b1636b7074642d313030302d343234322d30",
    ),
    "delete": (  # added after persist: a daemon that predates it answers "unknown message type" (BadMessage)
        Delete(id=8, path="/ckpt/step-101"),
        "84a17601a474797065a664656c657465a2696408a470617468ae2f636b70742f737465702d313031",
    ),
    "persist": (
        Persist(id=8, path="/ckpt/step-101"),
        "84a17601a474797065a770657273697374a2696408a470617468ae2f636b70742f"
        "737465702d313031",
    ),
    "snapshots": (
        ListSnapshots(id=8),
        "83a17601a474797065a9736e617073686f7473a2696408",
    ),
    "snapshot_list": (
        SnapshotList(id=8, snapshots=({"path": "/ckpt/step-101", "step": 101, "shards": [[0, "ckptd-1000-4242-1", 4128, 1, 2]]},)),
        "84a17601a474797065ad736e617073686f745f6c697374a2696408a9736e617073"
        "686f74739183a470617468ae2f636b70742f737465702d313031a47374657065a6"
        "736861726473919500b1636b7074642d313030302d343234322d31cd10200102",
    ),
    "pin": (
        Pin(id=9, path="/ckpt/step-101"),
        "84a17601a474797065a370696ea2696409a470617468ae2f636b70742f737465702d313031",
    ),
    "unpin": (
        Unpin(id=10, path="/ckpt/step-101"),
        "84a17601a474797065a5756e70696ea269640aa470617468ae2f636b70742f737465702d313031",
    ),
    "peer_snapshots": (
        ListPeerSnapshots(id=8),
        "83a17601a474797065ae706565725f736e617073686f7473a2696408",
    ),
    "restore": (
        Restore(id=9, path="/ckpt/step-101", rank=1),
        "85a17601a474797065a7726573746f7265a2696409a470617468ae2f636b70742f737465702d313031a472616e6b01",
    ),
    # added with placement by the ranks: a daemon that predates them answers "unknown message type" (BadMessage)
    "peer_identity": (
        PeerIdentity(id=13),
        "83a17601a474797065ad706565725f6964656e74697479a269640d",
    ),
    "peer_identity_reply": (
        PeerIdentityReply(id=13, key=PEER_KEYS[0], endpoint="tcp://node-a:47101"),
        "85a17601a474797065b3706565725f6964656e746974795f7265706c79a269640da3"
        "6b6579d92872713a724d3e7d553f404c6e7334374531256b522e6f406e2546636d6d"
        "734c2f407b48385d796637a8656e64706f696e74b27463703a2f2f6e6f64652d613a"
        "3437313031",
    ),
    "ring": (
        Ring(id=14, job="torchelastic:abc:1", node=1, endpoints=("tcp://node-a:47101", "tcp://node-b:47101"),
             keys=PEER_KEYS),
        "87a17601a474797065a472696e67a269640ea36a6f62b2746f726368656c61737469"
        "633a6162633a31a46e6f646501a9656e64706f696e747392b27463703a2f2f6e6f64"
        "652d613a3437313031b27463703a2f2f6e6f64652d623a3437313031a46b65797392"
        "d92872713a724d3e7d553f404c6e7334374531256b522e6f406e2546636d6d734c2f"
        "407b48385d796637d9284a544b565342252529774b30452e5829563e2b7d6f3f704e"
        "6d437b4f2634573462214e697b4c6836",
    ),
}


def test_the_golden_table_covers_every_message_type_and_nothing_else():
    assert set(GOLDEN) == set(MESSAGE_TYPES)
    for name, (msg, _) in GOLDEN.items():
        assert type(msg) is MESSAGE_TYPES[name]


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_message_encodes_to_the_frozen_bytes(kind):
    msg, golden = GOLDEN[kind]
    assert msg.to_wire().hex() == golden


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_frozen_bytes_decode_back_to_the_same_message(kind):
    msg, golden = GOLDEN[kind]
    decoded = decode(bytes.fromhex(golden))
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_from_wire_on_the_message_class_accepts_its_own_bytes(kind):
    msg, golden = GOLDEN[kind]
    assert type(msg).from_wire(bytes.fromhex(golden)) == msg


BEFORE_JOB = {
    "finalize": "89a17601a474797065a866696e616c697a65a2696409a470617468ae2f636b7074"
                "2f737465702d313030aa776f726c645f73697a6502a47374657064a96f76657277"
                "72697465c2a96b6565705f6c617374c0a566696c65739295bf72616e6b2d303030"
                "30302d6f662d30303030322e7361666574656e736f727300cd1020010295bf7261"
                "6e6b2d30303030312d6f662d30303030322e7361666574656e736f727301cd1020"
                "0202",
    "abort": "85a17601a474797065a561626f7274a269640aa470617468ae2f636b70742f7374"
             "65702d313030a6726561736f6eb372616e6b20333a206461656d6f6e20676f6e65",
}
"""The frozen bytes of Finalize and Abort before they named their run (``job``)."""


@pytest.mark.parametrize("kind", sorted(BEFORE_JOB))
def test_a_finalize_or_abort_from_before_job_decodes_as_an_unnamed_runs(kind):
    msg, _ = GOLDEN[kind]
    decoded = decode(bytes.fromhex(BEFORE_JOB[kind]))
    assert decoded == dataclasses.replace(msg, job="")


BEFORE_SAVE = {
    "commit": "de0014a17601a474797065a6636f6d6d6974a2696402a4736c6f74b1636b7074642d"
               "313030302d343234322d30a66e6279746573cd1020aa6865616465725f6c656ecd10"
               "00a774656e736f727390a470617468ae2f636b70742f737465702d313030a472616e"
               "6b01aa776f726c645f73697a6502a47374657064a96f7665727772697465c2ab636f"
               "6f7264696e61746564c2a96b6565705f6c61737403a774696d656f7574cb4082c000"
               "00000000a6776169746564cb3fd0000000000000a6737461676564cd1000a66c6179"
               "6f7574d9203031323334353637383961626364656630313233343536373839616263"
               "646566a36a6f62b2746f726368656c61737469633a6162633a31aa7265706c696361"
               "74656481a56d6f64656cd92030303131323233333434353536363737383839396161"
               "62626363646465656666",
    "snapshot": "de0014a17601a474797065a8736e617073686f74a2696402a4736c6f74b1636b7074"
                 "642d313030302d343234322d31a66e6279746573cd1020aa6865616465725f6c656e"
                 "cd1000a774656e736f72739295a177a3463332920203001895a162a4424631369104"
                 "1820a470617468ae2f636b70742f737465702d313031a472616e6b01aa776f726c64"
                 "5f73697a6502a47374657065a96f7665727772697465c2ab636f6f7264696e617465"
                 "64c2a96b6565705f6c617374c0a774696d656f7574cb4082c00000000000a6776169"
                 "746564cb0000000000000000a6737461676564cd1020a66c61796f7574a0a36a6f62"
                 "a0aa7265706c69636174656480",
}
"""The frozen bytes of a shard handed over before it said which save of its path it is (``save``)."""


@pytest.mark.parametrize("kind", sorted(BEFORE_SAVE))
def test_a_shard_from_before_save_decodes_as_an_unknown_save(kind):
    msg, _ = GOLDEN[kind]
    decoded = decode(bytes.fromhex(BEFORE_SAVE[kind]))
    assert decoded == dataclasses.replace(msg, save=0) and decoded.save == 0


BEFORE_RANK = "84a17601a474797065a7726573746f7265a2696409a470617468ae2f636b70742f737465702d313031"
"""The frozen bytes of a ``Restore`` before it named the rank whose shard the node needs."""


def test_a_restore_from_before_rank_decodes_as_any_replica_of_the_path():
    msg, _ = GOLDEN["restore"]
    assert decode(bytes.fromhex(BEFORE_RANK)) == dataclasses.replace(msg, rank=None)


def test_message_type_names_are_frozen():
    assert {name: cls.__name__ for name, cls in MESSAGE_TYPES.items()} == {
        "hello": "Hello",
        "welcome": "Welcome",
        "commit": "WriteShard",
        "accepted": "Accepted",
        "durable": "Durable",
        "finalize": "Finalize",
        "abort": "Abort",
        "delete": "Delete",
        "lease": "Lease",
        "granted": "Granted",
        "release": "Release",
        "staged": "Staged",
        "done": "Done",
        "error": "Error",
        "status": "Status",
        "status_reply": "StatusReply",
        "ping": "Ping",
        "pong": "Pong",
        "bye": "Bye",
        "stop": "Stop",
        "ok": "Ok",
        "snapshot": "Snapshot",
        "held": "HeldInMemory",
        "persist": "Persist",
        "snapshots": "ListSnapshots",
        "snapshot_list": "SnapshotList",
        "pin": "Pin",
        "unpin": "Unpin",
        "peer_snapshots": "ListPeerSnapshots",
        "restore": "Restore",
        "peer_identity": "PeerIdentity",
        "peer_identity_reply": "PeerIdentityReply",
        "ring": "Ring",
    }


def test_protocol_version_is_one():
    assert PROTOCOL_VERSION == 1
    assert type(PROTOCOL_VERSION) is int


def test_error_codes_are_frozen_by_name_and_number():
    assert {code.name: int(code) for code in ErrorCode} == {
        "BAD_MESSAGE": 1,
        "UNSUPPORTED_VERSION": 2,
        "UNKNOWN_CLIENT": 3,
        "BAD_SLOT": 4,
        "PATH_NOT_ALLOWED": 5,
        "CHECKPOINT_EXISTS": 6,
        "WRITE_FAILED": 7,
        "CONFLICT": 8,
        "SHUTTING_DOWN": 9,
        "INTERNAL": 10,
        "DAEMON_UNAVAILABLE": 11,
        "INVALID_CHECKPOINT": 12,
        "RANKS_MISSING": 13,
        "NO_SPACE": 14,
        "BUSY": 15,
    }


def test_an_error_built_with_an_error_code_enum_encodes_as_the_plain_integer():
    # The server builds replies as Error(rid, exc.code, ...) with an IntEnum.
    with_enum = Error(id=3, code=ErrorCode.CHECKPOINT_EXISTS, message="checkpoint /ckpt/step-100 exists")
    assert with_enum.to_wire().hex() == GOLDEN["error"][1]
