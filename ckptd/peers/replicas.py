"""Replicas this daemon holds for its peers: shards of their snapshots, in this node's shared memory.

A buddy's side of replication (``replication.py`` is the origin's). A peer
offers one rank's shard of a snapshot it holds (``Offer``: that rank's
``Snapshot`` message and the checksum the origin took) and is answered with
a ``Ticket``; it streams the bytes on the data port under the ticket's key
(``data.py``, ``bulk.py``), and seals it (``Seal``): the bytes are decrypted
into the shard's file and checksummed as they come, a stream whose frame
fails its tag is dropped at that frame, and a shard whose checksum differs
from the origin's is never held. The seal is answered once the stream ended.
An offer carries its chunks' digests: the chunks of it that a replica held
here from the same origin in the same directory has are built from that
replica's file instead of sent (``chunks.py``), in the same pass, under the
same checksum; a build whose replica is dropped meanwhile is stopped, and the
origin sends the shard whole.
A replica is complete once every rank the origin holds of that snapshot is
sealed; only then is it listed (``Replicas``), read back by a node restoring
it (``Fetch``), and only then does it replace the replica of the same path
(whatever its step: a buddy holds, per origin path, only the copy its origin
holds now) and the older replica of the same ranks in its directory, from
any origin (a replacement node has a key of its own, and takes its
predecessor's place).

The memory budget (``--memory-budget``) counts replicas and this node's own
snapshots together, and neither evicts the other: an offer that does not fit
beside what is held (the replica it would replace included, which stays until
the new one is complete) is refused with ``NoSpace``, and its origin reports
the snapshot as not replicated; a snapshot of this node's own that does not
fit fails with ``NoSpace`` as before. An offer whose data connection does
not come within the peer timeout, or whose stream breaks, is dropped then;
one whose origin never seals it after ``STALLED_S``.

Bookkeeping on the loop thread; the files are created and removed on the
``replica`` pool, in order; the bytes are written and read on their data
connection's thread, which a removal stops first (``DataServer.cancel``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from ckptd.protocol.checksums import updater
from ckptd.protocol.errors import CkptdError, Conflict, InvalidCheckpoint, NoSpace, WriteFailed
from ckptd.protocol.messages import Message, Ok, Snapshot
from ckptd.protocol.objects import display
from ckptd.protocol.peer_messages import Fetch, Forget, Offer, ReplicaList, Seal, Ticket

from ckptd.core.events import Events, ReplicaEnded
from ckptd.core.render import human_bytes
from ckptd.core.replies import error_reply
from ckptd.core.stats import Stats
from ckptd.core.workers import Workers
from ckptd.lifecycle.attempt import NEXT_REPLICA_STATES, AttemptState, Tracked
from ckptd.lifecycle.budget import MemoryBudget
from ckptd.lifecycle.registry import Book, Registry
from ckptd.peers import bulk, chunks
from ckptd.peers.data import DataServer, StreamEnded, Transfer
from ckptd.peers.spares import Spare, Spares, adopt, remove

log = logging.getLogger("ckptd")
STALLED_S = 60.0
"""Seconds an offer whose bytes all came may wait for its seal before it is dropped (its origin died or gave up)."""
Reply = Callable[[Message, bytes | memoryview | None], None]


@dataclass
class ReplicaShard:
    """One rank's shard of a replica: the origin's ``Offer``, and the file in shared memory holding its bytes."""

    offer: Offer
    name: str
    fd: int = -1
    map: mmap.mmap | None = None
    queued: int = 0
    """Bytes of it that came, checked against their tags (all or none: set when its stream ended)."""
    crc: int = 0
    sealed: bool = False
    """Its seal came and its bytes passed their check: it counts towards its replica's completeness."""
    last_chunk: float = field(default_factory=time.monotonic)
    """When it was offered, its stream ended, or it was sealed."""
    transfer: Transfer | None = None
    """Its stream on the data port, until it ended."""
    sealing: tuple[Seal, "Reply"] | None = None
    """A seal that came before its stream ended: answered when it ends."""
    serving: set[Transfer] = field(default_factory=set)
    """Restores reading it back on the data port now."""
    building: set[Transfer] = field(default_factory=set)
    """Streams of other shards built in part from its chunks now (``chunks.py``): stopped if it goes."""
    bases: tuple["ReplicaShard", ...] = ()
    """The shards of replicas held here that its own stream builds chunks from (until its stream ended)."""
    reused: int = 0
    """Bytes of it built from those, not sent."""
    encrypted: bool = True
    """Whether its stream's frames are encrypted, or plain under their GMAC tags (``bulk.py``)."""

    @property
    def nbytes(self) -> int:
        return self.offer.snapshot.nbytes

    def close(self, shm_dir: Path, data: DataServer | None) -> None:
        """Stop its streams, then unmap, close and unlink (on the pool)."""
        if data is not None:
            for transfer in [*([self.transfer] if self.transfer is not None else []), *self.serving]:
                data.cancel(transfer, "the replica was dropped")
            for transfer in list(self.building):
                data.cancel(transfer, "the replica it was built from here was dropped meanwhile")
        remove_shm_file(shm_dir, self.name, self.fd, self.map)
        self.fd, self.map = -1, None


@dataclass(kw_only=True)
class Replica(Tracked):
    """The shards one origin holds of one snapshot, replicated here: owned by the registry as the daemon's own
    attempts are, in a life of its own kind (``NEXT_REPLICA_STATES``): receiving, then held once every shard is
    sealed, and ended dropped (replaced, forgotten, its stream failed, stalled) or adopted (a drain took it over)."""

    noun: ClassVar[str] = "replica"
    entry: ClassVar[AttemptState] = AttemptState.RECEIVING
    moves: ClassVar[Mapping[AttemptState, frozenset[AttemptState]]] = NEXT_REPLICA_STATES
    judged_end: ClassVar[AttemptState] = AttemptState.DROPPED
    overdue_reason: ClassVar[str] = "stalled"
    origin: str
    ranks: tuple[int, ...]
    created: float
    shards: dict[int, ReplicaShard] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, Path]:
        return (self.origin, self.path)

    def overdue(self, now: float) -> CkptdError | None:
        """Why a replica still being received is dropped: no stream of it runs, and nothing came (an offer, a
        stream's end, a seal) for ``STALLED_S``: its origin died or gave up."""
        if self.state is not AttemptState.RECEIVING or any(s.transfer is not None for s in self.shards.values()):
            return None
        if now - max((s.last_chunk for s in self.shards.values()), default=now) <= STALLED_S:
            return None
        return Conflict(f"replica of {display(self.path)}: nothing of it came from its origin for {STALLED_S:g} s "
                        f"and not every shard was sealed")

    @property
    def complete(self) -> bool:
        return set(self.ranks) == {r for r, s in self.shards.items() if s.sealed}

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    @property
    def order(self) -> tuple[int, float]:
        step = next(iter(self.shards.values())).offer.snapshot.step if self.shards else None
        return (step if step is not None else -1, self.created)

    def describe(self) -> dict[str, Any]:
        """As ``SnapshotList`` lists a held snapshot (docs/status.md), with ``origin`` for the peer it is of."""
        first = next(iter(self.shards.values())).offer
        saves = {s.offer.snapshot.save for s in self.shards.values()}
        return {"path": str(self.path), "step": first.snapshot.step, "world_size": first.snapshot.world_size,
                "created": self.created, "job": first.snapshot.job, "save": saves.pop() if len(saves) == 1 else -1,
                "bytes": self.nbytes, "ranks_held": sorted(self.shards),
                "complete": self.complete, "coordinated": first.snapshot.coordinated, "origin": self.origin,
                "checksum_algorithm": first.algorithm,
                "shards": [[r, s.name, s.nbytes, s.offer.checksum, len(s.offer.snapshot.tensors)]
                           for r, s in sorted(self.shards.items())],
                "messages": [s.offer.shard for _, s in sorted(self.shards.items())]}


def origin_named(origin: str, endpoint: str | None) -> str:
    """How the log names a replica's origin: the endpoint the peer keys file gives its key, else ``key:`` and the
    key's first 8 characters (a node a replacement took the line of), which ``ckptd status`` lists whole."""
    return endpoint if endpoint is not None else f"key:{origin[:8]}"


def new_shm_file(path: Path, size: int, *, allocate: bool = True) -> tuple[int, mmap.mmap]:
    """A new file of this daemon's own in the shared-memory directory, mapped: a replica's shard, or one read back
    from a peer. ``allocate``: its pages allocated now, in one call; else by the ``pwrite`` of each frame as it
    comes, overlapped with the stream (a replica's: 256 MiB took 60-100 ms to allocate here, on the stream's path
    when done at the offer)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if allocate:
            os.posix_fallocate(fd, 0, max(1, size))
        else:
            os.ftruncate(fd, max(1, size))
        return fd, mmap.mmap(fd, max(1, size), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def _plan(msg: Offer, bases: list[ReplicaShard]) -> dict[int, tuple[ReplicaShard, int]]:
    """The chunks of the shard ``msg`` offers that ``bases`` have, by digest: each chunk's shard to copy it from and
    where in it. ``bases`` are the shards of the replicas held here of the same origin (its key: a reference never
    reaches another peer's bytes) in the same directory (the previous snapshot of a run); their digests are the ones
    that origin sent with them, and their bytes passed the checksum when they were held."""
    where: dict[bytes, tuple[ReplicaShard, int, int]] = {}
    for base in bases:
        for i, digest in enumerate(chunks.split(base.offer.digests)):
            where.setdefault(digest, (base, *chunks.chunk_span(i, base.nbytes)))
    plan = {}
    for i, digest in enumerate(chunks.split(msg.digests)):
        found = where.get(digest)
        if found is not None and found[2] == chunks.chunk_span(i, msg.snapshot.nbytes)[1]:
            plan[i] = (found[0], found[1])
    return plan


def _mapped(base: ReplicaShard) -> memoryview:
    """The bytes of a held replica's shard that a build reads, once its file is checked whole (a mapping read past
    the end of a file another process of this user shortened is SIGBUS: the daemon would die of it)."""
    if base.map is None or os.fstat(base.fd).st_size < base.nbytes:
        raise bulk.FrameError("the replica held here that it is built from is damaged: its file was shortened")
    return memoryview(base.map)[:base.nbytes]


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """Write ``view`` into the file ``fd`` at ``offset``."""
    written = 0
    try:
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
    except OSError as exc:  # the shared-memory directory is full, say: not the connection's fault
        raise bulk.FrameError(f"cannot write it into this node's shared memory: {exc.strerror or exc}") from None


def remove_shm_file(shm_dir: Path, name: str, fd: int, mapping: mmap.mmap | None) -> None:
    """Unmap, close and unlink what ``new_shm_file`` made (a file already gone is fine)."""
    if mapping is not None:
        mapping.close()
    if fd >= 0:
        os.close(fd)
    try:
        os.unlink(shm_dir / name)
    except FileNotFoundError:
        pass


class ReplicaBook:
    """Every replica this daemon holds or is receiving, within the node's memory budget (shared with its own
    snapshots: ``lifecycle/budget.MemoryBudget``): the registry's pipeline of replicas (``kind``,
    ``attempts``, ``ended``, ``tidy``), whose books it reads and whose ``open``, ``promote``, ``move`` and ``end``
    change them."""

    kind = Replica
    """What ``Registry.end`` hands to ``ended``."""

    def __init__(self, registry: Registry, workers: Workers, stats: Stats, events: Events, shm_dir: Path,
                 new_name: Callable[[], str],
                 memory: MemoryBudget, resolve: Callable[[str], Path], *, encrypt: bool = False) -> None:
        self.registry = registry
        self.encrypt = encrypt
        """``--peer-encrypt``: every stream this daemon serves is encrypted; else only one whose peer asked for it
        (its request without ``plain``)."""
        self.data: DataServer | None = None
        """The data port the shards' bytes come and go on (set with the peer endpoint: without one, no peer
        reaches this book)."""
        self._failed: dict[tuple[bytes, int], tuple[str, float]] = {}
        """Why the stream of an offer failed (its replica dropped then), for its seal; by (connection, offer id)."""
        self.workers, self.stats, self.shm_dir, self.new_name, self.memory = workers, stats, shm_dir, new_name, memory
        self.events = events
        self.resolve = resolve
        """A path a peer names, checked against this daemon's roots as a local request's is (``PathNotAllowed``
        naming it and the roots; I/O, so on the pool): a drain may write a replica to disk here."""
        self.held: Book[Replica] = registry.book()
        """Complete replicas by (origin, path)."""
        self.incoming: Book[Replica] = registry.book()
        """Replicas still being received, by (origin, path)."""
        self._offers: dict[tuple[bytes, int], ReplicaShard] = {}
        """Shards being received, by (connection, offer id)."""
        self.endpoint_of: Callable[[str], str | None] = lambda origin: None
        """The endpoint the peer keys file names for an origin's key (None: none), for status."""
        self.spares = Spares(shm_dir, lambda work: workers.background("replica", work))
        """The files of replicas a newer one replaced, for the next replica of their directory's ranks."""
        memory.count("replicas", lambda: self.budgeted)
        memory.spare(self.spares.release)

    @property
    def holds_any(self) -> bool:
        """Whether a replica is held or being received: a peer may still need it (its node lost), so a daemon
        that exits when idle (a spawned one) must not take it along."""
        return bool(self.held or self.incoming)

    @property
    def nbytes(self) -> int:
        """The replicas' bytes: held and incoming."""
        return sum(r.nbytes for r in (*self.held.values(), *self.incoming.values()))

    @property
    def budgeted(self) -> int:
        """What the memory budget counts of what this book holds: the replicas and the spares."""
        return self.nbytes + self.spares.bytes

    # -- receiving ----------------------------------------------------------

    def offer(self, ident: bytes, origin: str, msg: Offer, reply: Reply) -> None:
        """Reserve room for one shard and create its file; Ok once it may be streamed."""
        snap = msg.snapshot
        path = Path(snap.path)
        spare_key = (origin, path.parent, snap.rank)
        spare = self.spares.take(spare_key)  # its bytes become this shard's
        self.memory.make_room(snap.nbytes)  # spare files first: they hold nothing anyone asked for
        if self.memory.free < snap.nbytes:
            if spare is not None:
                self.spares.keep(spare_key, spare)
            raise NoSpace(f"a replica of {display(path)} rank {snap.rank} needs {human_bytes(snap.nbytes)} of this "
                          f"node's memory budget and only {human_bytes(max(0, self.memory.free))} are free; start this "
                          f"daemon with a larger --memory-budget")
        replica = self.incoming.get((origin, path))
        if replica is None or replica.ranks != msg.ranks or snap.rank in replica.shards:  # a new attempt starts over
            if replica is not None:
                self.registry.end(replica, AttemptState.DROPPED, reason="offered_again")
            replica = self.registry.open(self.incoming, Replica(origin=origin, path=path, ranks=msg.ranks,
                                                                created=msg.created))
        shard = replica.shards[snap.rank] = ReplicaShard(msg, self.new_name())
        self._offers[(ident, msg.id)] = shard
        bases = [base for held in self.held.values() if held.origin == origin and held.path.parent == path.parent
                 for base in held.shards.values()] if msg.digests else []
        plan: dict[int, tuple[ReplicaShard, int]] = {}
        path_in_shm, resolve = self.shm_dir / shard.name, self.resolve
        encrypted = self._encrypted(msg)

        def create() -> None:
            try:
                resolve(snap.path)
            except BaseException:
                if spare is not None:
                    remove(path_in_shm.parent, spare)
                raise
            shard.fd, shard.map = (new_shm_file(path_in_shm, shard.nbytes, allocate=False) if spare is None
                                   else adopt(spare, path_in_shm.parent, path_in_shm.name, shard.nbytes))
            plan.update(_plan(msg, bases))  # on the pool: a large shard has many chunks to look up

        def created(fut: Any) -> None:
            if fut.exception() is not None:  # refused, or no file: nothing of the offer stays on the books
                if not replica.ended:
                    self.registry.end(replica, AttemptState.DROPPED, fut.exception(), reason="offer_refused")
                reply(self._answer(fut, msg.id), None)
            elif not self._receiving(replica, shard) or self.data is None:
                reply(error_reply(self.stats, msg.id, Conflict(
                    f"offer {msg.id}: a newer offer of {display(path)} rank {snap.rank} came before its file was "
                    f"made; this one is not taken")), None)
            else:
                sources = self._sources(plan)
                transfer = shard.transfer = self.data.announce(
                    self._receiver(shard, sources, encrypted),
                    lambda error, crc: self._received(ident, msg.id, replica, shard, error, crc),
                    f"replica of {path} rank {snap.rank}")
                shard.bases = tuple({id(base): base for base, _ in plan.values()}.values()) if sources else ()
                for base in shard.bases:
                    base.building.add(transfer)
                shard.reused = sum(chunks.chunk_span(i, shard.nbytes)[1] for i in sources)
                shard.encrypted = encrypted
                reply(Ticket(msg.id, transfer.token, transfer.key, chunks.bitmap(set(sources), shard.nbytes),
                             encrypted=encrypted), None)
        self.workers.submit("replica", create, created, failed=self._refused(reply, msg.id))

    def _sources(self, plan: dict[int, tuple[ReplicaShard, int]]) -> dict[int, tuple[ReplicaShard, int]]:
        """``plan``, checked on the loop once the shard's file is made: none if a replica it reads from was dropped
        since the offer (the origin then sends every chunk)."""
        alive = {id(s) for r in self.held.values() for s in r.shards.values() if s.map is not None and s.fd >= 0}
        return plan if all(id(base) in alive for base, _ in plan.values()) else {}

    @staticmethod
    def _receiver(shard: ReplicaShard, sources: dict[int, tuple[ReplicaShard, int]],
                  encrypted: bool) -> Callable[[Any], int]:
        """The work of a shard's stream on its data connection's thread, in the shard's order: each chunk in
        ``sources`` read from the mapping of the replica's shard held here that has it (its file's size checked
        first, as a restore's read is: a mapping read past a shortened file's end is SIGBUS; 460 MiB took 0.32 s
        so against 0.42-0.60 s through ``pread``, measured here), each other chunk's frame taken as it comes
        (decrypted where ``encrypted``) once its tag passed,
        and each checksummed and written into the shard's file with ``pwrite`` (a fresh mapping's page faults cost
        twice the copy: 256 MiB took 0.20 s decrypted through the mapping, 0.11 s by pwrite, measured here); its
        crc32c, over every byte, built or sent."""
        def receive(conn: Any) -> int:
            assert shard.transfer is not None
            update, crc, key, nbytes = updater(shard.offer.algorithm), 0, shard.transfer.key, shard.nbytes
            scratch = memoryview(bytearray(min(bulk.FRAME, max(nbytes, 1))))
            reused = set(sources)
            frames = bulk.receive(conn, key, nbytes, lambda _, n: scratch[:n],
                                  spans=chunks.spans(reused, nbytes) if reused else None, encrypted=encrypted)
            with contextlib.ExitStack() as views:
                mapped = {id(base): views.enter_context(_mapped(base)) for base, _ in sources.values()}
                for begin, length, built in chunks.runs(reused, nbytes) if reused else [(0, nbytes, False)]:
                    end = begin + length
                    while begin < end:
                        if built:  # the chunks that follow in the same replica's shard, a frame's worth at most
                            i = begin // chunks.CHUNK_BYTES
                            base, at = sources[i]
                            n = chunks.chunk_span(i, nbytes)[1]
                            while begin + n < end and n < bulk.FRAME and sources[i + 1][0] is base \
                                    and sources[i + 1][1] == at + n:
                                i += 1
                                n += chunks.chunk_span(i, nbytes)[1]
                            offset, piece = begin, mapped[id(base)][at:at + n]
                        else:
                            offset, piece = next(frames)
                        crc = update(piece, crc)
                        _write_at(shard.fd, piece, offset)
                        begin = offset + len(piece)
                        piece.release()
            return crc
        return receive

    def _received(self, ident: bytes, offer: int, replica: Replica, shard: ReplicaShard, error: StreamEnded | None,
                  crc: int | None) -> None:
        """A shard's stream ended (on the loop): its bytes came, or the replica is dropped saying why; a seal that
        waited for it is answered."""
        for base in shard.bases:
            base.building.discard(shard.transfer)
        shard.transfer, shard.last_chunk, shard.bases = None, time.monotonic(), ()
        sealing, shard.sealing = shard.sealing, None
        if not self._receiving(replica, shard):  # dropped meanwhile (a newer offer, a forget, the daemon's exit)
            if sealing is not None:
                sealing[1](error_reply(self.stats, sealing[0].id, Conflict(
                    f"seal of offer {offer}: its replica of {display(replica.path)} rank {shard.offer.snapshot.rank} "
                    f"was dropped before its stream ended (a newer offer of it came, or it was forgotten); this "
                    f"shard is not held")), None)
            return
        if error is None and crc is not None:
            shard.queued, shard.crc = shard.nbytes, crc
        else:
            log.warning("event=replica_stream_failed path=%s rank=%d reason=%s", replica.path,
                        shard.offer.snapshot.rank, error)
            self._failed[(ident, offer)] = (f"its stream on the data port failed: {error}", time.monotonic())
            self.registry.end(replica, AttemptState.DROPPED, reason="stream_failed")
        if sealing is not None:
            self._seal(ident, *sealing)

    def seal(self, ident: bytes, msg: Seal, reply: Reply) -> None:
        """Every byte of a shard was sent: held if they all came under its stream's key and their checksum is the
        origin's, else dropped; Ok or Error, once its stream ended."""
        shard = self._offers.get((ident, msg.offer))
        if shard is not None and shard.transfer is not None:  # its stream has not ended: answered when it does
            shard.sealing = (msg, reply)
            return
        self._seal(ident, msg, reply)

    def _seal(self, ident: bytes, msg: Seal, reply: Reply) -> None:
        shard = self._offers.pop((ident, msg.offer), None)
        if shard is None:
            failed = self._failed.pop((ident, msg.offer), None)
            reply(error_reply(self.stats, msg.id, WriteFailed(f"seal of offer {msg.offer}: not held: {failed[0]}")
                              if failed is not None else
                              Conflict(f"seal of offer {msg.offer}: no such offer is being received from this peer")),
                  None)
            return
        replica = next(r for r in self.incoming.values() if any(s is shard for s in r.shards.values()))
        if shard.queued != shard.nbytes or shard.crc != shard.offer.checksum:
            self.registry.end(replica, AttemptState.DROPPED, reason="checksum")
            why = (f"{shard.queued} of {shard.nbytes} bytes came" if shard.queued != shard.nbytes else
                   f"its bytes' checksum {shard.crc:#x} is not the origin's {shard.offer.checksum:#x}"
                   + (f" ({shard.reused} of them built from a replica held here, which may be damaged)"
                      if shard.reused else ""))
            log.warning("event=replica_refused path=%s rank=%d reason=%s", replica.path,
                        shard.offer.snapshot.rank, why)
            reply(error_reply(self.stats, msg.id, WriteFailed(
                f"replica of {display(replica.path)} rank {shard.offer.snapshot.rank} not held: {why}")), None)
            return
        shard.sealed, shard.last_chunk = True, time.monotonic()
        if shard.reused:
            log.info("event=replica_shard_built path=%s rank=%d bytes=%d reused=%d", replica.path,
                     shard.offer.snapshot.rank, shard.nbytes, shard.reused)
        if replica.complete:
            self._completed(replica)
        reply(Ok(msg.id), None)

    def _receiving(self, replica: Replica, shard: ReplicaShard) -> bool:
        """Whether ``shard`` of ``replica`` is still being received: a new offer of the same shard (a peer that
        did not wait for its seal's answer) drops the attempt it belongs to, files and all, before its seal is
        checked, and then neither may be held nor touch the new attempt's books."""
        return self.incoming.get((replica.origin, replica.path)) is replica and replica.shards.get(
            shard.offer.snapshot.rank) is shard

    def _completed(self, replica: Replica) -> None:
        """A replica is whole: it is listed, and replaces every replica of the same path from its origin or of a
        rank it holds, whatever their step (its origin holds only this save of the path now: a rollback, a second
        run or a replacement node replaced the older one there), and the older ones of the same ranks in its directory,
        from whichever origin (a replacement node has a key of its own, and takes its predecessor's place). Of
        the other paths' newer ones only the newest stays, as its origin keeps a newer snapshot it never drops
        for an older one (a restarted run saving older steps): otherwise each older save would add one more."""
        replaced = [r for r in self.held.values() if r.path == replica.path
                    and (r.origin == replica.origin or set(r.ranks) & set(replica.ranks))]
        same = [r for r in self.held.values() if r.path.parent == replica.path.parent and r.path != replica.path
                and r.ranks == replica.ranks]
        newest = max((r for r in same if r.order > replica.order), key=lambda r: r.order, default=None)
        for old in [*replaced, *(r for r in same if r is not newest)]:
            self.registry.end(old, AttemptState.DROPPED, reason="replaced")
        self.registry.promote(replica, self.incoming, self.held)
        self.registry.move(replica, AttemptState.HELD)
        log.info("event=replica_held path=%s ranks=%s bytes=%d encrypted=%s origin=%s", replica.path,
                 list(replica.ranks), replica.nbytes, str(all(s.encrypted for s in replica.shards.values())).lower(),
                 origin_named(replica.origin, self.endpoint_of(replica.origin)))

    def _encrypted(self, request: Offer | Fetch) -> bool:
        """Whether the stream ``request`` asks for is encrypted: with this daemon's ``--peer-encrypt``, or where the
        peer did not say it takes plain frames (it asks for encryption, or predates plain frames)."""
        return self.encrypt or not request.plain

    def _answer(self, fut: Any, rid: int) -> Message:
        exc = fut.exception()
        return Ok(rid) if exc is None else error_reply(self.stats, rid, exc)

    def _refused(self, reply: Reply, rid: int) -> Callable[[BaseException], None]:
        """A completion's failure path: the peer's request ``rid`` is answered with the error, not left to time out."""
        return lambda exc: reply(error_reply(self.stats, rid, exc), None)

    # -- the registry's pipeline (``lifecycle/registry.Pipeline``) -------------------------------------------

    def attempts(self) -> list[Replica]:
        """The replicas being received: housekeeping ends one that stalled (``Replica.overdue``)."""
        return list(self.incoming.values())

    def ended(self, replica: Replica, state: AttemptState, error: BaseException | None, reason: str) -> None:
        """``replica`` ended and left the books: its offers are forgotten, and its files unlinked (dropped, its
        streams stopped first) or left to the snapshot that adopted them (its restores stopped); its end is
        published last (``ReplicaEnded``)."""
        for key in [k for k, s in self._offers.items() if s in replica.shards.values()]:
            del self._offers[key]
        ended = ReplicaEnded(replica.path, replica.origin, state is AttemptState.ADOPTED, reason)
        if state is AttemptState.ADOPTED:
            for shard in replica.shards.values():  # a restore reading it back ends here: the snapshot may unmap it
                for transfer in [*shard.serving, *shard.building] if self.data is not None else ():
                    self.data.cancel(transfer, "the replica was persisted by a drain")
            self.events.publish(ended)
            return
        log.log(logging.WARNING if reason == "stalled" else logging.INFO,
                "event=replica_dropped path=%s origin=%s reason=%s", replica.path,
                origin_named(replica.origin, self.endpoint_of(replica.origin)), reason)
        shards, shm_dir, data = list(replica.shards.values()), self.shm_dir, self.data
        if reason in ("replaced", "forgotten"):  # its directory's next replica may take its files (``spares.py``)
            for rank, shard in replica.shards.items():
                if shard.map is not None and shard.fd >= 0 and shard.transfer is None and not shard.serving \
                        and not shard.building:
                    self.spares.keep((replica.origin, replica.path.parent, rank),
                                     Spare(shard.name, shard.fd, shard.map, shard.nbytes))
                    shard.fd, shard.map = -1, None
            shards = [s for s in shards if s.map is not None]
        self.workers.background("replica", lambda: [s.close(shm_dir, data) for s in shards])
        self.events.publish(ended)

    def tidy(self, now: float) -> None:
        """End the streams whose data connection did not come, and forget why old offers failed."""
        if self.data is not None:
            self.data.expire(now)
        self.spares.expire(now)
        for key in [k for k, (_, when) in self._failed.items() if now - when > STALLED_S]:
            del self._failed[key]

    def forget(self, origin: str, msg: Forget) -> Ok:
        """The origin let its snapshot of ``msg.path`` go for good: its replica of that path goes too, from that
        origin or of one of its ranks (``_completed``'s rule: a replacement node, under a key of its own, holds
        what it restored from its predecessor's replica here)."""
        path, ranks = Path(msg.path), set(msg.ranks)

        def theirs(replica: Replica) -> bool:
            return replica.path == path and (replica.origin == origin or bool(set(replica.ranks) & ranks))
        for replica in [r for r in (*self.incoming.values(), *self.held.values()) if theirs(r)]:
            self.registry.end(replica, AttemptState.DROPPED, reason="forgotten")
        return Ok(msg.id)

    # -- reading back -------------------------------------------------------

    def listing(self, rid: int) -> ReplicaList:
        """The complete replicas, answering request ``rid``."""
        return ReplicaList(rid, tuple(r.describe() for r in self.held.values()))

    def fetch(self, msg: Fetch, reply: Reply) -> None:
        """A complete replica's shard for a node restoring it: a ``Ticket``, then the shard on the data port."""
        replica = next((r for r in self.held.values() if str(r.path) == msg.path), None)
        shard = None if replica is None else replica.shards.get(msg.rank)
        if replica is None or shard is None or self.data is None:
            raise InvalidCheckpoint(f"this daemon holds no replica of {msg.path} rank {msg.rank}")
        data, damaged = self.data, (f"the replica of {msg.path} rank {msg.rank} is damaged: its file in "
                                    f"{self.shm_dir} was shortened; it is not read")
        transfer: Transfer | None = None
        encrypted = self._encrypted(msg)

        def check() -> None:  # a mapping read past its file's end is SIGBUS: the daemon would die of a file another
            # process of its user shortened
            if shard.map is None or os.fstat(shard.fd).st_size < shard.nbytes:
                raise InvalidCheckpoint(damaged)

        def send(conn: Any) -> None:
            check()
            assert shard.map is not None and transfer is not None
            with memoryview(shard.map) as view:
                bulk.send(conn, transfer.key, view[:shard.nbytes], encrypted=encrypted)

        def sent(error: StreamEnded | None, _: object) -> None:
            shard.serving.discard(transfer)
            if error is not None:
                log.warning("event=replica_send_failed path=%s rank=%d reason=%s", msg.path, msg.rank, error)

        def checked(fut: Any) -> None:
            nonlocal transfer
            if fut.exception() is not None:
                reply(self._answer(fut, msg.id), None)
            elif self.held.get((replica.origin, replica.path)) is not replica:
                reply(error_reply(self.stats, msg.id, InvalidCheckpoint(
                    f"the replica of {msg.path} was replaced or dropped while it was asked for")), None)
            else:
                transfer = data.announce(send, sent, f"restore of {msg.path} rank {msg.rank}")
                shard.serving.add(transfer)
                log.info("event=replica_read_back path=%s rank=%d encrypted=%s", msg.path, msg.rank,
                         str(encrypted).lower())
                reply(Ticket(msg.id, transfer.token, transfer.key, encrypted=encrypted), None)
        self.workers.submit("replica", check, checked, failed=self._refused(reply, msg.id))

    def hand_over(self, replica: Replica) -> list[tuple[Snapshot, str, int, mmap.mmap, int]]:
        """Take a complete replica off the books without unlinking its files, which become a snapshot held here
        (a drain persists a replica whose origin is gone: ``Replication.drain``): each shard's ``Snapshot`` as its
        origin admitted it, file name, fd, mapping and the origin's checksum. Its bytes leave the replicas' share of
        the memory budget as they join the snapshots'."""
        self.registry.end(replica, AttemptState.ADOPTED, reason="origin_gone")
        return [(s.offer.snapshot, s.name, s.fd, s.map, s.offer.checksum) for _, s in sorted(replica.shards.items())
                if s.map is not None]

    def summary(self) -> dict[str, Any]:
        """The ``replicas`` part of ``ckptd status``: what this node holds for others."""
        return {"bytes": self.nbytes, "spare_bytes": self.spares.bytes,
                "held": [{**{k: v for k, v in r.describe().items() if k != "messages"},
                          "origin_endpoint": self.endpoint_of(r.origin)} for r in self.held.values()],
                "receiving": len(self.incoming)}

    def exited(self, replicas: list[Replica]) -> None:
        """The daemon exits (``Registry.close`` hands over ``replicas``, held and incoming, out of the books):
        nothing held for others outlives it (on the calling thread)."""
        for replica in replicas:
            for shard in replica.shards.values():
                shard.close(self.shm_dir, self.data)
        self.spares.close()
