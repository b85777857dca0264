"""Every message ckptd sends, and the one codec that turns them into bytes.

A message is a frozen dataclass. On the wire it is one msgpack map holding
``v`` (protocol version), ``type``, ``id`` (the request id, echoed by every
reply) and the dataclass fields by name. ``decode`` is the only way bytes
become a message, and it validates everything it can without knowing who
sent it: field types, integer bounds, string lengths, and for a commit the
whole tensor table against the slot (dtype allow-list, shape x itemsize =
nbytes, offsets inside the slot, no overlap, no hole). Checks that need the
daemon's state (who sent it, which roots are allowed) happen at admission.

Conversation::

    client                      daemon
    Hello            ──▶        Welcome
    WriteShard       ──▶        Accepted ... later Done | Error   (its tensor table, or the digest of one sent before)
    Snapshot         ──▶        Accepted ... later HeldInMemory | Error   (kept in node memory, not written)
    Persist          ──▶        Done | Error      (write a held snapshot to disk)
    Delete           ──▶        Ok | Error        (a committed checkpoint, as retention deletes it)
    ListSnapshots    ──▶        SnapshotList      (what the daemon holds in memory)
    ListPeerSnapshots ──▶       SnapshotList      (that, and its peers' replicas of snapshots it does not hold)
    Restore          ──▶        Ok | Error        (bring a snapshot back from a peer's replica into this node's memory)
    PeerIdentity     ──▶        PeerIdentityReply (the daemon's peer key and endpoint; empty without --peer-listen)
    Ring             ──▶        Ok | Error        (a node's first rank: the job's nodes, in ring order, and their keys)
    Pin              ──▶        SnapshotList      (that snapshot, kept as it is until Unpin: a reader's lease)
    Unpin            ──▶        Ok
    Staged           ──▶        (nothing: a notice; one for a save that ended is ignored)
                                (coordinated: Accepted ... Durable | Error)
    Finalize         ──▶        Done | Error      (global rank 0, several nodes)
    Abort            ──▶        Ok                (several nodes, a rank failed)
    Status           ──▶        StatusReply
    Ping             ──▶        Pong        (heartbeat while work is pending)
    Lease            ──▶        Granted (when a load slot frees up)
    Release          ──▶        Ok
    Bye | Stop       ──▶        Ok
    anything bad     ──▶        Error
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import msgpack

from .errors import BadMessage, CkptdError, PathNotAllowed, UnsupportedVersion
from .shm import SLOT_PREFIX
from .index import INCOMPLETE_SUFFIX, ShardRecord
from .layout import DATA_ALIGNMENT, LAYOUT_DIGEST_LEN, TensorEntry, validate_entries

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The daemon's socket drops frames larger than this before decoding."""
MAX_STRING = 64 * 1024
MAX_INT = 2**63 - 1
MAX_WORLD_SIZE = 1 << 20
"""More ranks than any job runs; bounds what the daemon keeps per checkpoint."""
DEFAULT_COMMIT_TIMEOUT = 600.0
"""Seconds every rank of a checkpoint has to commit its shard, unless the client says otherwise."""
MAX_TIMEOUT = 7 * 24 * 3600
"""Longest commit timeout a message may carry, in seconds (one week)."""
MAX_NAME_BYTES = 255
MAX_JOB = 256
"""Longest job incarnation a commit may carry, in characters."""
MAX_REPLICATED_KEYS = 4096
REPLICATED_DIGEST_LEN = 32
"""NAME_MAX of Linux filesystems: the longest name of one directory entry, in bytes."""


@dataclass(frozen=True)
class Message:
    """Base: the request id every message carries; ``type`` names it on the wire."""

    id: int
    type: ClassVar[str] = ""
    sparse: ClassVar[frozenset[str]] = frozenset()
    """Fields added later that are left off the wire while they hold their default, so a peer of an earlier
    release, which refuses a field it does not know, still takes the message when nothing new is said."""

    def to_wire(self) -> bytes:
        return encode(self)

    @classmethod
    def from_wire(cls, data: bytes) -> "Message":
        msg = decode(data)
        if not isinstance(msg, cls):
            raise BadMessage(f"expected a {cls.type or 'message'}, got {msg.type!r}")
        return msg


@dataclass(frozen=True)
class Hello(Message):
    """A client registers: the pid owns its slots, so the daemon can check them.

    A training client also says which rank of which run it is: if its process
    dies before it saves, the daemon fails the saves of its run that wait for
    it at once, instead of after their commit timeout.
    """

    pid: int
    uid: int
    client_version: str
    rank: int = 0
    world_size: int = 1
    job: str = ""
    """The run (``StagedShard.job``); empty for a client that saves nothing or whose run has no name."""
    type: ClassVar[str] = "hello"

    def __post_init__(self) -> None:
        if not 1 <= self.world_size <= MAX_WORLD_SIZE or self.rank >= self.world_size:
            raise BadMessage(f"rank {self.rank} is not inside world size {self.world_size} (at most {MAX_WORLD_SIZE})")
        _check_job(self.job)


@dataclass(frozen=True)
class Welcome(Message):
    daemon_pid: int
    daemon_version: str
    roots: tuple[str, ...]
    type: ClassVar[str] = "welcome"


@dataclass(frozen=True)
class StagedShard(Message):
    """A shard staged in ``slot`` as ``rank`` of checkpoint ``path``, handed to the daemon: to write
    (``WriteShard``) or to hold in node memory (``Snapshot``). Both stage alike: same fields, same checks.
    Not a message of its own (no wire type)."""

    slot: str
    nbytes: int
    """Bytes of the shard file in the slot (header included)."""
    header_len: int
    """Length prefix plus padded JSON header; the data starts here."""
    tensors: tuple[TensorEntry, ...]
    path: str
    rank: int
    world_size: int
    step: int | None
    overwrite: bool
    coordinated: bool
    """Several nodes: reply ``Durable`` for this shard and leave the commit to
    global rank 0's ``Finalize``; otherwise this daemon commits when every
    rank of the world is durable."""
    keep_last: int | None
    """After the commit, keep only this many newest checkpoints beside it."""
    timeout: float
    """Seconds the daemon waits for the other ranks before failing them all."""
    waited: float
    """Seconds the client blocked for a free in-flight slot (backpressure)."""
    staged: int
    """Bytes of the shard already final in the slot. Below ``nbytes`` the
    client is still copying and reports progress with ``Staged`` notices; the
    daemon writes each part as soon as it is final (staging and writing
    overlap)."""
    layout: str = ""
    """The table's ``CheckedTable.digest`` (empty: none). With ``tensors``
    it must match them, and the daemon keeps the checked table for this
    connection; with no ``tensors`` it names a table this connection sent
    before, which the daemon then uses (refusing a name it does not hold)."""
    job: str = ""
    """The incarnation of the job that saves: its ranks from one launch share it, a restarted job has a new
    one (``client/incarnation.py``). An attempt only ever holds shards of one incarnation; empty: unknown,
    and the attempt is told apart by its ranks' processes alone."""
    replicated: dict[str, str] = dataclasses.field(default_factory=dict)
    """Digest of the tensors (names, shapes, dtypes) under each ``replicated=`` top-level key: rank 0 writes
    them for every rank, so every rank of the checkpoint must send the same map."""
    save: int = 0
    """This rank's count of its run's saves to ``path`` (1, 2, ...; 0: unknown). Every rank of an SPMD job counts
    alike, so one save has one count on every rank: ranks resuming from a snapshot spread over several nodes
    compare it (with ``job`` and ``step``) and never take shards of two saves of one path as one checkpoint."""

    def __post_init__(self) -> None:
        if not self.slot.startswith(SLOT_PREFIX) or "/" in self.slot:
            raise BadMessage(f"slot name {self.slot!r} must start with {SLOT_PREFIX!r} and hold no '/'")
        _check_path(self.path)
        if not 1 <= self.world_size <= MAX_WORLD_SIZE or self.rank >= self.world_size:
            raise BadMessage(f"rank {self.rank} is not inside world size {self.world_size} (at most {MAX_WORLD_SIZE})")
        if self.header_len < 8 or self.header_len % DATA_ALIGNMENT or self.header_len > self.nbytes:
            raise BadMessage(
                f"header length {self.header_len} must be a multiple of {DATA_ALIGNMENT} "
                f"no larger than the shard ({self.nbytes} bytes)"
            )
        if self.tensors or not self.layout:  # else a reference, resolved by the daemon (NodeState.resolve_layout)
            table = validate_entries(self.tensors, self.nbytes - self.header_len)
            if self.layout and table.digest != self.layout:
                raise BadMessage(f"layout {self.layout!r} is not the digest of the commit's tensor table")
            object.__setattr__(self, "tensors", table)  # checked once: the daemon keeps and reuses it
        if self.layout and len(self.layout) != LAYOUT_DIGEST_LEN:
            raise BadMessage(f"layout {self.layout[:40]!r} must be a digest of {LAYOUT_DIGEST_LEN} characters or empty")
        _check_common(self.keep_last, self.timeout)
        if not self.header_len <= self.staged <= self.nbytes:
            raise BadMessage(f"staged {self.staged} must lie between the header ({self.header_len}) and nbytes ({self.nbytes})")
        _check_job(self.job)
        if len(self.replicated) > MAX_REPLICATED_KEYS or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_STRING and len(v) == REPLICATED_DIGEST_LEN
                for k, v in self.replicated.items()):
            raise BadMessage(f"replicated must map at most {MAX_REPLICATED_KEYS} key names to digests of "
                             f"{REPLICATED_DIGEST_LEN} characters")


@dataclass(frozen=True)
class WriteShard(StagedShard):
    """Write the shard staged in ``slot`` as ``rank`` of checkpoint ``path`` (``Accepted``, then ``Done`` once the
    checkpoint is committed, or ``Durable`` on several nodes). On the wire it is still ``commit``, as it always was."""

    type: ClassVar[str] = "commit"


@dataclass(frozen=True)
class Snapshot(StagedShard):
    """Keep the shard staged in ``slot`` in node memory as rank ``rank`` of checkpoint ``path`` instead of writing it.

    The daemon takes over the slot (the client stages its next save into
    another one) until the snapshot is dropped; ``HeldInMemory`` says so.
    """

    type: ClassVar[str] = "snapshot"


@dataclass(frozen=True)
class HeldInMemory(Message):
    """Snapshot ``path`` is held (every rank of it, or this rank's on several nodes).

    ``released`` names slots of this client the daemon no longer holds
    (older snapshots it dropped): the client may reuse them.
    """

    path: str
    bytes_held: int
    seconds: float
    released: tuple[str, ...]
    type: ClassVar[str] = "held"


@dataclass(frozen=True)
class Persist(Message):
    """Write held snapshot ``path`` to disk as a committed checkpoint (``Done`` when it is)."""

    path: str
    type: ClassVar[str] = "persist"

    def __post_init__(self) -> None:
        _check_path(self.path)


@dataclass(frozen=True)
class Delete(Message):
    """Delete committed checkpoint ``path`` (``Ok`` once it is gone, or was): the daemon's two-phase delete, under
    its publish lock, as retention deletes. A save in flight to it, or what is not a ckptd checkpoint, is refused."""

    path: str
    type: ClassVar[str] = "delete"

    def __post_init__(self) -> None:
        _check_path(self.path)


@dataclass(frozen=True)
class ListSnapshots(Message):
    """Ask which snapshots the daemon holds in memory."""

    type: ClassVar[str] = "snapshots"


@dataclass(frozen=True)
class ListPeerSnapshots(Message):
    """Ask which snapshots the daemon holds, and which replicas its peers hold of snapshots it does not (listed
    with ``on_peer``, the peer's endpoint): what a node that lost its memory may restore (``Restore``). A
    daemon with no peers answers as ``ListSnapshots``."""

    type: ClassVar[str] = "peer_snapshots"


@dataclass(frozen=True)
class Restore(Message):
    """Bring snapshot ``path`` (resolved, as ``SnapshotList`` names it) back into this node's memory from the
    replica a peer holds (``ckptd/peers``): every byte is checked against the checksum its origin took. ``Ok``
    once it is held here, complete, as its origin held it; ``Error`` (``InvalidCheckpoint``) if no peer holds it
    or a replica fails its check, which is never held."""

    path: str
    rank: int | None = None
    """The rank whose shard the asking node needs: only a replica holding it is read back (peers may hold
    replicas of one path for several nodes); None (a client that predates it): the first replica of the path."""
    type: ClassVar[str] = "restore"

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank >= MAX_WORLD_SIZE:
            raise BadMessage(f"restore.rank {self.rank} is not a rank below {MAX_WORLD_SIZE}")


class ReplicationState(str, Enum):
    """A held snapshot's copy on the buddy node: the ``replication`` of each map in a ``SnapshotList`` (and of
    ``ckptd status``), defined here once for the daemon, which moves it (``ckptd/lifecycle/attempt.py``'s
    ``NEXT_REPLICATION``), and the client, which waits on it (``SaveFuture.wait_replicated``)."""

    OFF = "off"
    """Not sent (yet): no buddy, or not held yet."""
    REPLICATING = "replicating"
    REPLICATED = "replicated"
    """Held on the buddy, every checksum checked there."""
    FAILED = "failed"
    """Not held on the buddy; ``replication_error`` says why."""
    SUPERSEDED = "superseded"
    """A newer snapshot of its directory was held before its turn came: that one is sent instead."""
    RESTORED = "restored"
    """Read back from a peer's replica: its copy is the peer's, never sent on."""
    ADOPTED = "adopted"
    """A replica held here for a node that is gone, persisted by this daemon's drain: never sent on."""


@dataclass(frozen=True)
class SnapshotList(Message):
    """Every held snapshot: a map per snapshot (path, step, world_size, created, persisted, complete,
    ``replication`` (a ``ReplicationState`` value), shards as ``[rank, slot, size, checksum, tensors]``),
    documented in docs/status.md."""

    snapshots: tuple[dict, ...]
    unanswered: tuple[str, ...] = ()
    """For ``ListPeerSnapshots``: why each peer asked that did not answer did not (naming it): the replicas it
    may hold are not listed, and a node restoring says so, rather than find nothing and start afresh."""
    type: ClassVar[str] = "snapshot_list"
    sparse: ClassVar[frozenset[str]] = frozenset({"unanswered"})


@dataclass(frozen=True)
class Pin(Message):
    """A reader's lease on held snapshot ``path`` (resolved, as ``SnapshotList`` names it): until ``Unpin``,
    ``Bye`` or the reader's death the daemon keeps its slots as they are (a drop waits), so the reader copies
    straight out of them. Answered by a ``SnapshotList`` of that snapshot, or of none if it is not held complete."""

    path: str
    type: ClassVar[str] = "pin"


@dataclass(frozen=True)
class Unpin(Message):
    """End one ``Pin`` of snapshot ``path`` by this client (``Ok``)."""

    path: str
    type: ClassVar[str] = "unpin"


PEER_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
"""A daemon's CurveZMQ public key in Z85: 40 characters of its alphabet (``ckptd peer-key`` prints it)."""
PEER_ENDPOINT = re.compile(r"tcp://[^:/\s]+:(\d{1,5})")
"""Where other nodes' daemons reach a daemon (``--peer-listen``): ``tcp://HOST:PORT``."""


@dataclass(frozen=True)
class PeerIdentity(Message):
    """Ask the daemon who it is to other nodes' daemons (``PeerIdentityReply``): what a rank tells the job's other
    ranks when they agree on the ring (``client/coordinate.py``)."""

    type: ClassVar[str] = "peer_identity"


@dataclass(frozen=True)
class PeerIdentityReply(Message):
    """The daemon's CurveZMQ public key (Z85) and the endpoint its peers reach it at (``--peer-listen``, a
    wildcard host replaced by this host's name); both empty when it opened no peer endpoint."""

    key: str
    endpoint: str
    type: ClassVar[str] = "peer_identity_reply"

    def __post_init__(self) -> None:
        if (self.key == "") != (self.endpoint == ""):
            raise BadMessage("peer_identity_reply: a key and an endpoint, or neither")
        if self.key:
            _check_peer(self.key, self.endpoint, "peer_identity_reply")


@dataclass(frozen=True)
class Ring(Message):
    """The placement of run ``job``'s snapshots, from the first rank of each of its nodes to that node's daemon.

    ``endpoints`` and ``keys`` name the job's nodes that have a peer endpoint, in ring order (each node's
    lowest global rank), and this daemon is node ``node``: its snapshots are replicated on node ``node + 1``
    (the last node's on node 0), and it trusts every key listed (the job's ranks vouch for them, as the job's
    own gloo group does). Only a rank of ``job`` connected to this daemon may send it; a daemon without
    ``--peer-listen`` answers ``Ok`` and ignores it. The newest ring replaces the one before.
    """

    job: str
    node: int
    endpoints: tuple[str, ...]
    keys: tuple[str, ...]
    type: ClassVar[str] = "ring"

    def __post_init__(self) -> None:
        _check_job(self.job)
        if not self.job:
            raise BadMessage("ring.job is empty: a ring names the run whose ranks agreed on it")
        if not 2 <= len(self.endpoints) <= MAX_WORLD_SIZE or len(self.keys) != len(self.endpoints):
            raise BadMessage(f"ring: {len(self.endpoints)} endpoints and {len(self.keys)} keys; a ring has one key "
                             f"per endpoint, for 2 to {MAX_WORLD_SIZE} nodes")
        if self.node >= len(self.endpoints):
            raise BadMessage(f"ring.node {self.node} is not one of its {len(self.endpoints)} nodes")
        for i, (key, endpoint) in enumerate(zip(self.keys, self.endpoints)):
            _check_peer(key, endpoint, f"ring node {i}")
        for what, values in (("endpoints", self.endpoints), ("keys", self.keys)):
            if len(set(values)) != len(values):
                twice = next(v for v in values if values.count(v) > 1)
                raise BadMessage(f"ring.{what} names {twice!r} twice: every node of a ring is another daemon")


def _check_peer(key: str, endpoint: str, where: str) -> None:
    """A peer's key and endpoint as ``ckptd peer-key`` and ``--peer-listen`` give them, or BadMessage naming it."""
    if not PEER_KEY.fullmatch(key):
        raise BadMessage(f"{where}: key {key[:48]!r} is not a CurveZMQ public key (40 characters of Z85)")
    match = PEER_ENDPOINT.fullmatch(endpoint)
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        raise BadMessage(f"{where}: endpoint {endpoint[:80]!r} is not tcp://HOST:PORT with PORT in 1..65535")


def _check_path(path: str) -> None:
    """Refuse a checkpoint path whose name cannot exist on disk while it is written.

    The checkpoint is written as ``name.incomplete`` first, so the name must
    leave room for that suffix within ``MAX_NAME_BYTES``; otherwise the save
    would fail deep in the write with a bare ``File name too long``. Raises
    ``PathNotAllowed``, like every other path the daemon will not write.
    """
    if not path:
        raise BadMessage("checkpoint path is empty")
    name = path.rstrip("/").rpartition("/")[2]
    limit = MAX_NAME_BYTES - len(INCOMPLETE_SUFFIX)
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise PathNotAllowed(
            f"checkpoint name {name[:40]!r}... is {size} bytes long; names may be at most {limit} bytes "
            f"(the filesystem allows {MAX_NAME_BYTES}, and the checkpoint is first written as "
            f"'<name>{INCOMPLETE_SUFFIX}'): choose a shorter name"
        )


def _check_job(job: str) -> None:
    """A run's name (``StagedShard.job``) is bounded and printable: it is logged and shown in errors."""
    if len(job) > MAX_JOB or not job.isprintable():
        raise BadMessage(f"job {job[:40]!r} must be at most {MAX_JOB} printable characters")


def _check_common(keep_last: int | None, timeout: float) -> None:
    if keep_last is not None and keep_last < 1:
        raise BadMessage(f"keep_last must be at least 1, got {keep_last}")
    if not 0 < timeout <= MAX_TIMEOUT:
        raise BadMessage(f"timeout must be between 0 and one week, got {timeout}")


@dataclass(frozen=True)
class Staged(Message):
    """Notice for commit ``id``: bytes up to ``upto`` are final in the slot.

    A non-empty ``error`` says staging failed on the client; the daemon then
    fails the save. No reply.
    """

    upto: int
    error: str
    type: ClassVar[str] = "staged"


@dataclass(frozen=True)
class Accepted(Message):
    """The commit passed admission and is queued; ``Done`` or ``Error`` follows."""

    type: ClassVar[str] = "accepted"


@dataclass(frozen=True)
class Done(Message):
    """The checkpoint holding this shard is durable under its final name."""

    path: str
    bytes_written: int
    seconds: float
    type: ClassVar[str] = "done"


@dataclass(frozen=True)
class Durable(Message):
    """A coordinated commit's shard is written and fsync'd (not yet committed)."""

    file: str
    rank: int
    size: int
    checksum: int
    tensors: int
    type: ClassVar[str] = "durable"


@dataclass(frozen=True)
class Finalize(Message):
    """Publish checkpoint ``path`` from every rank's durable shard (global rank 0)."""

    path: str
    world_size: int
    step: int | None
    overwrite: bool
    keep_last: int | None
    files: tuple[ShardRecord, ...]
    job: str = ""
    """The run whose attempt this publishes (``StagedShard.job``): the daemon refuses to publish another run's.
    Added later: a peer that predates it leaves it out (an unnamed run's)."""
    type: ClassVar[str] = "finalize"

    def __post_init__(self) -> None:
        _check_path(self.path)
        if len(self.files) != self.world_size:
            raise BadMessage(f"finalize lists {len(self.files)} files for world size {self.world_size}")
        ranks = sorted(f.rank for f in self.files)
        if ranks != list(range(self.world_size)):
            raise BadMessage(f"finalize lists ranks {ranks} for world size {self.world_size}")
        for f in self.files:
            if "/" in f.file or f.file in ("", ".", ".."):
                raise BadMessage(f"finalize names file {f.file!r}, which is not a plain file name")
        _check_common(self.keep_last, 1.0)
        _check_job(self.job)


@dataclass(frozen=True)
class Abort(Message):
    """Give up checkpoint ``path`` (a rank failed): remove what was written, if it is run ``job``'s attempt; a
    memory snapshot of run ``job`` still gathering its ranks there fails on every rank (its held shards go back).

    A rank refused because another run is saving the path aborts too; that
    Abort must not end the other run's attempt, so it names its own run.
    """

    path: str
    reason: str
    job: str = ""
    """The run whose attempt to give up (``StagedShard.job``). Added later: a peer that predates it leaves it out
    (an unnamed run's)."""
    type: ClassVar[str] = "abort"

    def __post_init__(self) -> None:
        _check_job(self.job)


@dataclass(frozen=True)
class Lease(Message):
    """Ask to load: at most ``limit`` holders per node at once (None: the daemon's default)."""

    limit: int | None
    type: ClassVar[str] = "lease"

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise BadMessage(f"lease limit must be at least 1, got {self.limit}")


@dataclass(frozen=True)
class Granted(Message):
    """The lease is held until ``Release`` (or until the client's process dies)."""

    waited: float
    type: ClassVar[str] = "granted"


@dataclass(frozen=True)
class Release(Message):
    type: ClassVar[str] = "release"


@dataclass(frozen=True)
class Error(Message):
    code: int
    message: str
    type: ClassVar[str] = "error"

    @classmethod
    def of(cls, request_id: int, error: CkptdError) -> "Error":
        """The reply telling ``error`` (the daemon turns exceptions into ``CkptdError`` in one place:
        ``ckptd/core/replies.py``)."""
        return cls(request_id, error.code, error.message)


@dataclass(frozen=True)
class Status(Message):
    type: ClassVar[str] = "status"


@dataclass(frozen=True)
class StatusReply(Message):
    """A snapshot of the daemon; the schema is documented in docs/status.md."""

    info: dict
    type: ClassVar[str] = "status_reply"


@dataclass(frozen=True)
class Ping(Message):
    type: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Pong(Message):
    type: ClassVar[str] = "pong"


@dataclass(frozen=True)
class Bye(Message):
    """A client closes: its slots are gone and it expects no more replies."""

    type: ClassVar[str] = "bye"


@dataclass(frozen=True)
class Stop(Message):
    """Drain: refuse new work, finish what is in flight, then exit."""

    type: ClassVar[str] = "stop"


@dataclass(frozen=True)
class Ok(Message):
    type: ClassVar[str] = "ok"


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.type: cls
    for cls in (Hello, Welcome, WriteShard, Staged, Accepted, Durable, Finalize, Abort, Done, Lease, Granted, Release,
                Error, Status, StatusReply, Ping, Pong, Bye, Stop, Ok, Snapshot, HeldInMemory, Persist, ListSnapshots,
                SnapshotList, Pin, Unpin, Delete, ListPeerSnapshots, Restore, PeerIdentity, PeerIdentityReply, Ring)
}


def encode(msg: Message) -> bytes:
    """The wire bytes of a message."""
    wire: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.type}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if f.name in msg.sparse and value == f.default:
            continue
        if isinstance(value, tuple):
            value = [_flat(item) for item in value]
        wire[f.name] = value
    return msgpack.packb(wire, use_bin_type=True)


def _flat(item: Any) -> Any:
    """Table rows travel as plain lists: compact, and the same in every language."""
    if isinstance(item, TensorEntry):
        return [item.name, item.dtype, list(item.shape), item.begin, item.end]
    if isinstance(item, ShardRecord):
        return [item.file, item.rank, item.size, item.checksum, item.tensors]
    return item


def decode(data: bytes, types: dict[str, type[Message]] = MESSAGE_TYPES) -> Message:
    """Bytes to a validated message of one of ``types`` (the local protocol's, or the peers'
    ``peer_messages.PEER_TYPES``), or ``BadMessage`` saying what is wrong."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        wire = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadMessage(f"not a msgpack message: {exc}") from None
    if not isinstance(wire, dict):
        raise BadMessage("a message must be a msgpack map")
    version = wire.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {version!r} is not supported; this side speaks {PROTOCOL_VERSION}")
    kind = wire.pop("type", None)
    cls = types.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadMessage(f"unknown message type {kind!r}")
    hints = _wire_fields(cls)
    names = hints.keys()
    extra = set(wire) - names
    if extra:
        raise BadMessage(f"{kind}: unexpected fields {sorted(map(str, extra))}")
    values = {}
    for name in names:
        if name in wire:
            values[name] = _check(wire[name], hints[name], f"{kind}.{name}")
        elif name not in _optional_fields(cls):
            raise BadMessage(f"{kind}: missing field {name!r}")
    return cls(**values)


@functools.cache
def _wire_fields(cls: type[Message]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def _optional_fields(cls: type[Message]) -> frozenset[str]:
    """Fields added later, with a default: a peer that predates one may leave it out."""
    return frozenset(f.name for f in dataclasses.fields(cls)
                     if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)


def request_id(data: bytes) -> int:
    """Best-effort id of an undecodable message, so its error reply can echo it."""
    try:
        wire = msgpack.unpackb(data, raw=False, strict_map_key=False)
        rid = wire.get("id") if isinstance(wire, dict) else None
    except Exception:
        return 0
    return rid if type(rid) is int and 0 <= rid <= MAX_INT else 0


def _check(value: Any, hint: Any, where: str) -> Any:
    """Check one decoded field against its annotation; return the typed value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(value, inner, where)
    if hint is bool:
        if type(value) is not bool:
            raise BadMessage(f"{where} must be a boolean, got {type(value).__name__}")
        return value
    if hint is int:
        if type(value) is not int or not 0 <= value <= MAX_INT:
            raise BadMessage(f"{where} must be an integer in [0, 2^63), got {value!r:.40}")
        return value
    if hint is float:
        if type(value) not in (int, float):
            raise BadMessage(f"{where} must be a number, got {type(value).__name__}")
        return float(value)
    if hint is bytes:
        if not isinstance(value, bytes) or len(value) > MAX_MESSAGE_BYTES:
            raise BadMessage(f"{where} must be binary of at most {MAX_MESSAGE_BYTES} bytes")
        return value
    if hint is str:
        if not isinstance(value, str) or len(value) > MAX_STRING or "\x00" in value:
            raise BadMessage(f"{where} must be a string of at most {MAX_STRING} characters without NUL")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise BadMessage(f"{where} must be a map")
        return value
    if origin is tuple and args[0] is ShardRecord:
        if not isinstance(value, list):
            raise BadMessage(f"{where} must be a list of files")
        return tuple(_shard_record(item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin is tuple and args[0] is TensorEntry:
        if not isinstance(value, list):
            raise BadMessage(f"{where} must be a list of tensors")
        return tuple(_tensor_entry(item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin is tuple:
        if not isinstance(value, list):
            raise BadMessage(f"{where} must be a list")
        return tuple(_check(item, args[0], f"{where}[{i}]") for i, item in enumerate(value))
    raise AssertionError(f"no wire check for {hint!r} at {where}")


def _shard_record(item: Any, where: str) -> ShardRecord:
    if not isinstance(item, list) or len(item) != 5:
        raise BadMessage(f"{where} must be [file, rank, size, checksum, tensors]")
    file, *numbers = item
    return ShardRecord(_check(file, str, f"{where}.file"), *(_check(n, int, f"{where}[{i + 1}]") for i, n in enumerate(numbers)))


def _tensor_entry(item: Any, where: str) -> TensorEntry:
    if not isinstance(item, list) or len(item) != 5:
        raise BadMessage(f"{where} must be [name, dtype, shape, begin, end]")
    name, dtype, shape, begin, end = item
    shape = _check(shape, tuple[int, ...], f"{where}.shape")
    return TensorEntry(
        _check(name, str, f"{where}.name"),
        _check(dtype, str, f"{where}.dtype"),
        shape,
        _check(begin, int, f"{where}.begin"),
        _check(end, int, f"{where}.end"),
    )
