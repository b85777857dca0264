"""The peer protocol: what one node's daemon says to another's (``ckptd/peers``), over CurveZMQ.

The origin is the daemon whose ranks took a snapshot; its buddy holds a replica of it. Every message travels as
one msgpack frame, decoded and validated by ``messages.decode`` against ``PEER_TYPES`` only (a peer can send no
local request, nor a local client a peer's), and the bytes of a shard travel in a second frame beside it::

    origin                         buddy
    Offer                 ──▶      Ok | Error        (one shard: its Snapshot message and checksum; room is reserved)
    Chunk  + bytes        ──▶      Ok | Error        (the next piece of that shard, in order)
    Seal                  ──▶      Ok | Error        (every byte came and matches the checksum: a replica now)

    a node restoring               a holder
    Replicas              ──▶      ReplicaList       (the replicas it holds)
    Fetch                 ──▶      Piece + bytes | Error   (a piece of one replica's shard)

Nothing in a peer message is trusted because a peer is authenticated: an ``Offer``'s shard is checked as a
rank's own ``Snapshot`` would be, a chunk must fall inside the shard it names, and a replica is held only once
its checksum matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .checksums import ALGORITHMS
from .errors import BadMessage
from .messages import MAX_MESSAGE_BYTES, MAX_WORLD_SIZE, Error, Message, Ok, Snapshot, _check_path

MAX_PIECE = 16 * 1024 * 1024
"""Bytes of shard in one ``Chunk`` or ``Piece``: large enough that a stream runs at memcpy speed, small enough
that a window of them in flight stays well inside the socket's message limit and the holder's memory."""


@dataclass(frozen=True)
class Offer(Message):
    """A replica of one rank's shard of a held snapshot, about to be streamed: ``shard`` is that rank's
    ``Snapshot`` message as its origin admitted it (checked again here), ``checksum`` what the origin computed
    over its ``nbytes`` when it held it, ``ranks`` every rank of the snapshot on the origin's node (the replica
    is complete once each of them is sealed)."""

    shard: bytes
    checksum: int
    algorithm: str
    created: float
    ranks: tuple[int, ...]
    type: ClassVar[str] = "offer"

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

    @property
    def snapshot(self) -> Snapshot:
        """``shard``, decoded and checked on creation."""
        return self._snapshot  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Chunk(Message):
    """The next ``len(bytes)`` bytes of offer ``offer``'s shard, from ``offset``; the bytes are the second frame."""

    offer: int
    offset: int
    type: ClassVar[str] = "chunk"


@dataclass(frozen=True)
class Seal(Message):
    """Offer ``offer``'s bytes have all been sent: check them and hold them as a replica."""

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
    """``length`` bytes from ``offset`` of rank ``rank``'s shard of the replica of ``path``."""

    path: str
    rank: int
    offset: int
    length: int
    type: ClassVar[str] = "fetch"

    def __post_init__(self) -> None:
        _check_path(self.path)
        if not 0 < self.length <= MAX_PIECE:
            raise BadMessage(f"fetch.length must be 1..{MAX_PIECE}, got {self.length}")


@dataclass(frozen=True)
class Piece(Message):
    """The bytes a ``Fetch`` asked for, from ``offset``, in the second frame."""

    offset: int
    type: ClassVar[str] = "piece"


PEER_TYPES: dict[str, type[Message]] = {
    cls.type: cls for cls in (Offer, Chunk, Seal, Forget, Replicas, ReplicaList, Fetch, Piece, Ok, Error)
}
assert MAX_PIECE * 2 < MAX_MESSAGE_BYTES
