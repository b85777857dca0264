"""The peer protocol: what one node's daemon says to another's (``ckptd/peers``), over CurveZMQ.

The origin is the daemon whose ranks took a snapshot; its buddy holds a replica of it. Every message travels as
one msgpack frame, decoded and validated by ``messages.decode`` against ``PEER_TYPES`` only (a peer can send no
local request, nor a local client a peer's). A shard's bytes do not travel here: the daemon that serves a stream
answers with a ``Ticket`` (a token and a fresh key), and the bytes go as authenticated frames over the data port
beside the peer endpoint (``ckptd/peers/bulk.py``), each with its tag; encrypted (AES-256-GCM) where either daemon
runs with ``--peer-encrypt``, else in the clear under a GMAC tag (``Ticket.encrypted``)::

    origin                         buddy
    Offer                 ──▶      Ticket | Error    (one shard: its Snapshot message, checksum and chunk digests;
                                                     room is reserved; the ticket names the chunks the buddy
                                                     builds from the origin's previous replica of the directory)
    (the shard's other chunks on the data port, under the ticket's key)
    Seal                  ──▶      Ok | Error        (every byte came and matches the checksum: a replica now)

    a node restoring               a holder
    Replicas              ──▶      ReplicaList       (the replicas it holds)
    Fetch                 ──▶      Ticket | Error    (one replica's shard, then sent on the data port)

Nothing in a peer message is trusted because a peer is authenticated: an ``Offer``'s shard is checked as a
rank's own ``Snapshot`` would be, and a replica is held only once every byte came under its stream's key and
its checksum matches. A chunk the buddy builds from a replica it holds is taken only from the same origin's
replicas (the same key) of the same directory, whose digests that origin sent itself, and the shard built is held
only if its checksum over every byte, copied or sent, is the origin's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .checksums import ALGORITHMS
from .errors import BadMessage
from .messages import MAX_WORLD_SIZE, Error, Message, Ok, Snapshot, _check_path

TOKEN_BYTES = 16
"""A data stream's token: what its connection sends first, the only thing that admits it to the data port."""
KEY_BYTES = 32
"""A data stream's AES-256-GCM key (for encrypted frames and plain frames' GMAC tags alike)."""
FRAME_BYTES = 4 * 1024 * 1024
"""Plaintext bytes in one frame of a stream on the data port, at most (``ckptd/peers/bulk.py``): large enough that
the per-frame cost is nothing, small enough that the receiver checks one frame while the next is on the wire."""
CHUNK_BYTES = 256 * 1024
"""Bytes of a shard one chunk digest covers: what a replica is built from, or sent, at least (``Offer.digests``).
Finer than a frame, so a small tensor that changed among frozen ones (a LoRA adapter beside its base layer) sends
its own bytes and at most two chunks more, not two frames; 128 bytes of digest a MiB."""
MAX_DIGESTS_BYTES = 16 * 1024 * 1024
"""The most digests an offer carries: those of a 128 GiB shard. A larger shard is offered without them, and sent
whole."""
DIGEST = "sha256"
"""What ``Offer.digests`` are: SHA-256 (hashlib, OpenSSL), 1.7 GB/s on one core here with the CPU's SHA instructions
against 0.75 for BLAKE2b (``benchmarks/RESULTS.md``); a match must mean the same bytes, so no 32-bit CRC."""
DIGEST_BYTES = 32


def chunk_count(nbytes: int) -> int:
    """How many ``CHUNK_BYTES`` chunks a shard of ``nbytes`` has (the last may be shorter)."""
    return -(-nbytes // CHUNK_BYTES)


@dataclass(frozen=True)
class Offer(Message):
    """A replica of one rank's shard of a held snapshot, about to be streamed: ``shard`` is that rank's
    ``Snapshot`` message as its origin admitted it (checked again here), ``checksum`` what the origin computed
    over its ``nbytes`` when it held it, ``ranks`` every rank of the snapshot on the origin's node (the replica
    is complete once each of them is sealed). ``digests``: the ``DIGEST`` of each ``CHUNK_BYTES`` chunk of the
    shard, in order, concatenated (empty: none; every byte is sent, and no later offer is built from it).
    ``plain``: the origin takes the stream's frames in the clear under their GMAC tag (it does not run with
    ``--peer-encrypt``); left out (False), by an origin that requires encryption or predates plain frames."""

    shard: bytes
    checksum: int
    algorithm: str
    created: float
    ranks: tuple[int, ...]
    digests: bytes = b""
    plain: bool = False
    type: ClassVar[str] = "offer"
    sparse: ClassVar[frozenset[str]] = frozenset({"digests", "plain"})

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "_snapshot", Snapshot.from_wire(self.shard))
        except BadMessage as exc:
            raise BadMessage(f"offer.shard: {exc}") from None
        if self.algorithm not in ALGORITHMS:
            raise BadMessage(f"offer.algorithm {self.algorithm!r} is none of {sorted(ALGORITHMS)}")
        world = self.snapshot.world_size
        if not self.ranks or len(self.ranks) > MAX_WORLD_SIZE or not all(0 <= r < world for r in self.ranks) \
                or self.snapshot.rank not in self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise BadMessage(f"offer.ranks must be distinct ranks of world size {world}, its own rank "
                             f"{self.snapshot.rank} among them")
        if self.digests and (len(self.digests) != DIGEST_BYTES * chunk_count(self.snapshot.nbytes)
                             or len(self.digests) > MAX_DIGESTS_BYTES):
            raise BadMessage(f"offer.digests must be {DIGEST_BYTES} bytes for each of the "
                             f"{chunk_count(self.snapshot.nbytes)} chunks of {CHUNK_BYTES} bytes of its shard, at "
                             f"most {MAX_DIGESTS_BYTES} bytes, or none")

    @property
    def snapshot(self) -> Snapshot:
        """``shard``, decoded and checked on creation."""
        return self._snapshot  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Ticket(Message):
    """The answer to an ``Offer`` or a ``Fetch``: connect to the data port (this peer's port + 1), send ``token``
    first, and the shard's bytes follow (to the buddy for an offer, from the holder for a fetch) as AES-256-GCM
    frames under ``key``, which serves this one stream only. Sent over CURVE, so only the two daemons know it.
    ``reused`` (an offer's only): a bitmap of the shard's chunks, bit ``i % 8`` of byte ``i // 8`` set for chunk
    ``i`` that the buddy builds from a replica it holds of the same origin and directory, whose digest is the
    offer's; those are not sent, and the frames carry the others, in order (empty: every chunk is sent).
    ``encrypted``: the frames are encrypted (True, and what a peer that predates plain frames means), or plain under
    a GMAC tag: only where the request said ``plain`` and the daemon answering does not run with
    ``--peer-encrypt``."""

    token: bytes
    key: bytes
    reused: bytes = b""
    encrypted: bool = True
    type: ClassVar[str] = "ticket"
    sparse: ClassVar[frozenset[str]] = frozenset({"reused", "encrypted"})

    def __post_init__(self) -> None:
        if not isinstance(self.token, bytes) or len(self.token) != TOKEN_BYTES:
            raise BadMessage(f"ticket.token must be {TOKEN_BYTES} bytes")
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise BadMessage(f"ticket.key must be {KEY_BYTES} bytes (AES-256)")


@dataclass(frozen=True)
class Seal(Message):
    """Offer ``offer``'s bytes have all been sent on the data port: check them and hold them as a replica
    (answered once the buddy took or refused the stream)."""

    offer: int
    type: ClassVar[str] = "seal"


@dataclass(frozen=True)
class Forget(Message):
    """The origin let its snapshot of ``path`` go for good (older than a checkpoint on disk, deleted, saved over
    on disk): drop its replica of ``path`` from this origin, or of one of its ``ranks`` (a replacement node
    holds, under a key of its own, what it restored from its predecessor's replica), so no drain of this node
    persists a state the origin gave up (``Ok``; ``Ok`` too when none is held)."""

    path: str
    ranks: tuple[int, ...]
    type: ClassVar[str] = "forget"

    def __post_init__(self) -> None:
        _check_path(self.path)
        if len(self.ranks) > MAX_WORLD_SIZE or not all(isinstance(r, int) and 0 <= r < MAX_WORLD_SIZE
                                                        for r in self.ranks):
            raise BadMessage(f"forget.ranks must be at most {MAX_WORLD_SIZE} ranks below {MAX_WORLD_SIZE}")


@dataclass(frozen=True)
class Replicas(Message):
    """Ask which replicas a peer holds."""

    type: ClassVar[str] = "replicas"


@dataclass(frozen=True)
class ReplicaList(Message):
    """The complete replicas a peer holds: one map per snapshot, as ``SnapshotList`` lists a held one, with its
    shards as ``[rank, name, size, checksum, tensors]``."""

    replicas: tuple[dict, ...]
    type: ClassVar[str] = "replica_list"


@dataclass(frozen=True)
class Fetch(Message):
    """Rank ``rank``'s shard of the replica of ``path``, whole, on the data port (answered with a ``Ticket``).
    ``plain``: as ``Offer.plain``, for the frames that come back."""

    path: str
    rank: int
    plain: bool = False
    type: ClassVar[str] = "fetch"
    sparse: ClassVar[frozenset[str]] = frozenset({"plain"})

    def __post_init__(self) -> None:
        _check_path(self.path)
        if not isinstance(self.rank, int) or not 0 <= self.rank < MAX_WORLD_SIZE:
            raise BadMessage(f"fetch.rank must be a rank below {MAX_WORLD_SIZE}, got {self.rank!r}")


PEER_TYPES: dict[str, type[Message]] = {
    cls.type: cls for cls in (Offer, Ticket, Seal, Forget, Replicas, ReplicaList, Fetch, Ok, Error)
}
