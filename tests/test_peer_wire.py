"""The peer protocol's wire format, frozen, and what its decode refuses.

Daemons of different releases replicate to one another across nodes, so how a
peer message is encoded is a protocol change as much as a local one
(``test_wire_format.py``). Decoding against ``PEER_TYPES`` also keeps the two
protocols apart: a peer cannot send a local request, nor a local client a
peer's, and an offer's shard is checked as a rank's own ``Snapshot`` is.
"""

from __future__ import annotations

import dataclasses

import pytest

from ckptd.protocol.errors import BadMessage
from ckptd.protocol.messages import MESSAGE_TYPES, Message, ListSnapshots, decode
from ckptd.protocol.peer_messages import PEER_TYPES, Fetch, Forget, Offer, ReplicaList, Replicas, Seal, Ticket
from test_wire_format import GOLDEN

SNAPSHOT = GOLDEN["snapshot"][0]
PEER_GOLDEN: dict[str, tuple[Message, str]] = {
    "offer": (
        Offer(id=3, shard=SNAPSHOT.to_wire(), checksum=0x1234, algorithm="crc32c", created=1700000000.5, ranks=(0, 1),
              digests=bytes(range(32))),
        "89a17601a474797065a56f66666572a2696403a57368617264c50101de0015a17601a474797065a8736e617073686f74a269"
        "6402a4736c6f74b1636b7074642d313030302d343234322d31a66e6279746573cd1020aa6865616465725f6c656ecd1000a7"
        "74656e736f72739295a177a3463332920203001895a162a44246313691041820a470617468ae2f636b70742f737465702d31"
        "3031a472616e6b01aa776f726c645f73697a6502a47374657065a96f7665727772697465c2ab636f6f7264696e61746564c2"
        "a96b6565705f6c617374c0a774696d656f7574cb4082c00000000000a6776169746564cb0000000000000000a67374616765"
        "64cd1020a66c61796f7574a0a36a6f62a0aa7265706c69636174656480a47361766500a8636865636b73756dcd1234a9616c"
        "676f726974686da6637263333263a763726561746564cb41d954fc40200000a572616e6b73920001a764696765737473c420"
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
    ),
    "ticket": (
        Ticket(id=4, token=bytes(range(16)), key=bytes(range(32)), reused=b"\x01"),
        "86a17601a474797065a67469636b6574a2696404a5746f6b656ec410000102030405060708090a0b0c0d0e0fa36b6579c420"
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa6726575736564c40101",
    ),
    "seal": (
        Seal(id=5, offer=3),
        "84a17601a474797065a47365616ca2696405a56f6666657203",
    ),
    "forget": (
        Forget(id=8, path="/ckpt/step-101", ranks=(0, 1)),
        "85a17601a474797065a6666f72676574a2696408a470617468ae2f636b70742f737465702d313031a572616e6b73920001",
    ),
    "replicas": (
        Replicas(id=6),
        "83a17601a474797065a87265706c69636173a2696406",
    ),
    "replica_list": (
        ReplicaList(id=6, replicas=({"path": "/ckpt/step-101", "step": 101},)),
        "84a17601a474797065ac7265706c6963615f6c697374a2696406a87265706c696361739182a470617468ae2f636b70742f73"
        "7465702d313031a47374657065",
    ),
    "fetch": (
        Fetch(id=7, path="/ckpt/step-101", rank=1),
        "85a17601a474797065a56665746368a2696407a470617468ae2f636b70742f737465702d313031a472616e6b01",
    ),
}


def test_the_golden_table_covers_every_peer_request_and_reply_of_its_own() -> None:
    assert set(PEER_GOLDEN) == set(PEER_TYPES) - {"ok", "error"}  # those two are the local protocol's, frozen there


@pytest.mark.parametrize("kind", sorted(PEER_GOLDEN))
def test_peer_message_encodes_to_the_frozen_bytes_and_back(kind: str) -> None:
    msg, golden = PEER_GOLDEN[kind]
    assert msg.to_wire().hex() == golden
    assert decode(bytes.fromhex(golden), PEER_TYPES) == msg


def test_an_offer_carries_its_shard_checked_as_a_snapshot() -> None:
    offer = PEER_GOLDEN["offer"][0]
    assert isinstance(offer, Offer) and offer.snapshot == SNAPSHOT


@pytest.mark.parametrize("bad, says", [
    (dict(shard=b"\x81\xa1v\x01"), "offer.shard: unknown message type"),
    (dict(shard=ListSnapshots(1).to_wire()), "offer.shard: expected a snapshot"),
    (dict(ranks=(0,)), "its own rank 1"),
    (dict(ranks=(1, 1)), "distinct"),
    (dict(ranks=(1, 2)), "world size 2"),
    (dict(algorithm="md5"), "algorithm"),
    (dict(digests=bytes(31)), "offer.digests must be 32 bytes for each of the 1 chunks"),
    (dict(digests=bytes(64)), "offer.digests"),
])
def test_a_bad_offer_is_refused_naming_what_is_wrong(bad: dict, says: str) -> None:
    good = dict(id=3, shard=SNAPSHOT.to_wire(), checksum=1, algorithm="crc32c", created=1.0, ranks=(0, 1))
    wire = Offer.__new__(Offer)
    for name, value in {**good, **bad}.items():
        object.__setattr__(wire, name, value)
    with pytest.raises(BadMessage, match=says):
        decode(wire.to_wire(), PEER_TYPES)


BEFORE_CHUNK_DIGESTS = {
    "offer": "88a17601a474797065a56f66666572a2696403a57368617264c50101de0015a17601a474797065a8736e617073686f74a269"
             "6402a4736c6f74b1636b7074642d313030302d343234322d31a66e6279746573cd1020aa6865616465725f6c656ecd1000a7"
             "74656e736f72739295a177a3463332920203001895a162a44246313691041820a470617468ae2f636b70742f737465702d31"
             "3031a472616e6b01aa776f726c645f73697a6502a47374657065a96f7665727772697465c2ab636f6f7264696e61746564c2"
             "a96b6565705f6c617374c0a774696d656f7574cb4082c00000000000a6776169746564cb0000000000000000a67374616765"
             "64cd1020a66c61796f7574a0a36a6f62a0aa7265706c69636174656480a47361766500a8636865636b73756dcd1234a9616c"
             "676f726974686da6637263333263a763726561746564cb41d954fc40200000a572616e6b73920001",
    "ticket": "85a17601a474797065a67469636b6574a2696404a5746f6b656ec410000102030405060708090a0b0c0d0e0fa36b6579c4200001"
              "02030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
}
"""The offer and the ticket as the release before chunk digests encoded them (and refuses any field more)."""


@pytest.mark.parametrize("kind, field", [("offer", "digests"), ("ticket", "reused")])
def test_an_offer_or_ticket_that_says_nothing_of_chunks_is_the_bytes_of_the_release_before_them(
        kind: str, field: str) -> None:
    """An origin started with --peer-send-all offers no digests, and a buddy that builds nothing names no chunk: their
    messages are what a daemon of the release before takes, and that release's are taken as sending every byte."""
    msg = dataclasses.replace(PEER_GOLDEN[kind][0], **{field: b""})
    assert msg.to_wire().hex() == BEFORE_CHUNK_DIGESTS[kind]
    assert decode(bytes.fromhex(BEFORE_CHUNK_DIGESTS[kind]), PEER_TYPES) == msg


PLAIN_FRAMES = {
    "offer": ("plain", True, "a5706c61696ec3"),
    "fetch": ("plain", True, "a5706c61696ec3"),
    "ticket": ("encrypted", False, "a9656e63727970746564c2"),
}
"""What plain frames add to a request (``plain``: its sender takes them) and to a ticket (``encrypted`` False): one
field, appended to the golden bytes (and the map one entry longer)."""


@pytest.mark.parametrize("kind", sorted(PLAIN_FRAMES))
def test_plain_frames_are_one_field_more_and_their_absence_is_the_encrypted_bytes_of_before(kind: str) -> None:
    """A request that takes plain frames and a ticket that sends them encode to frozen bytes; a daemon started with
    --peer-encrypt sends neither field, so its messages are those of the release before plain frames, and that
    release's requests and tickets are read as encrypted ones."""
    field, value, suffix = PLAIN_FRAMES[kind]
    golden, wire = PEER_GOLDEN[kind]
    msg = dataclasses.replace(golden, **{field: value})
    assert msg.to_wire().hex() == f"{int(wire[:2], 16) + 1:02x}{wire[2:]}{suffix}"
    assert decode(msg.to_wire(), PEER_TYPES) == msg
    assert getattr(decode(bytes.fromhex(wire), PEER_TYPES), field) is (not value)


def test_a_fetch_of_no_rank_is_refused() -> None:
    for rank in (-1, 1 << 30):
        wire = Fetch.__new__(Fetch)
        for name, value in dict(id=1, path="/ckpt/a", rank=rank).items():
            object.__setattr__(wire, name, value)
        with pytest.raises(BadMessage, match="fetch.rank"):
            decode(wire.to_wire(), PEER_TYPES)


@pytest.mark.parametrize("field, size", [("token", 15), ("key", 16)])
def test_a_ticket_of_a_short_token_or_key_is_refused(field: str, size: int) -> None:
    wire = Ticket.__new__(Ticket)
    for name, value in {**dict(id=1, token=bytes(16), key=bytes(32)), field: bytes(size)}.items():
        object.__setattr__(wire, name, value)
    with pytest.raises(BadMessage, match=f"ticket.{field}"):
        decode(wire.to_wire(), PEER_TYPES)


def test_the_two_protocols_do_not_accept_each_others_requests() -> None:
    with pytest.raises(BadMessage, match="unknown message type 'snapshots'"):
        decode(ListSnapshots(1).to_wire(), PEER_TYPES)
    with pytest.raises(BadMessage, match="unknown message type 'seal'"):
        decode(Seal(1, 1).to_wire(), MESSAGE_TYPES)
