"""Replication: every snapshot held here also goes to the buddy's memory, and a node that lost its own reads
its snapshots back from there.

The origin's side (``replicas.py`` is the buddy's). Once a snapshot is held
(``SnapshotHeld``: its ranks were told), its shards held on this node stream
to the buddy (``replicas=1``: the first ``--peer``, else the ring's next node, ``placement.py``), from the slots the
daemon already holds: no re-staging, no torch, and the ranks' blocking time
does not change. The snapshot is pinned meanwhile, as a reader pins it, so
its slots are not handed back to their trainer mid-stream. Its
``replication`` says how far it got (``off``, ``replicating``,
``replicated``, ``failed`` with why, ``superseded`` when a newer snapshot of
its directory was held before its turn came, ``restored`` for one read back
from a peer); ``ckptd status`` and ``SaveFuture.wait_replicated`` read it.
What it says is what the buddy holds now: every ``CHECK_S`` the origin asks
the buddy what it holds, sends a copy lost with no successor again (the
buddy restarted; for a restored one, also the peer it was read from),
reports one the buddy replaced with another run's
snapshot of its path or directory ``failed``, saying so, and sends again the
newest snapshot of a directory whose stream failed because the buddy did not
answer, once it answers.

A node restoring asks its peers what they hold (``ListPeerSnapshots``
lists their replicas of snapshots it does not hold) and reads one back
(``Restore``): every shard is checked against the checksum its origin took
as it arrives, and held here as the origin held it only if every shard
passed, so a replica that fails its check is never loaded. One peer at a
time is asked, in ``--peer`` order, then the ring's buddy.

Streams run on the ``peer`` pool, questions and restores on ``peer_ask``:
each has links of its own (a ZeroMQ socket is one thread's), so a listing
never waits behind a gigabyte being streamed.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from ckptd.protocol.errors import CkptdError, InvalidCheckpoint, PathNotAllowed
from ckptd.protocol.index import INDEX_NAME, read_index
from ckptd.protocol.messages import Message, Ok, ListPeerSnapshots, Restore, Snapshot, SnapshotList
from ckptd.protocol.objects import display

from ckptd.protocol.messages import ReplicationState as R
from ckptd.core.config import DaemonConfig
from ckptd.core.events import SnapshotDropped, SnapshotHeld
from ckptd.core.keys import KeyPair, Trust
from ckptd.core.replies import as_error, error_reply
from ckptd.core.stats import Stats
from ckptd.core.workers import Workers
from ckptd.lifecycle.attempt import PeerCopy
from ckptd.lifecycle.holding import Holding
from ckptd.lifecycle.snapshots import HeldSnapshot
from ckptd.peers import bulk
from ckptd.peers.link import PeerLink, PeerUnavailable
from ckptd.peers.placement import Placement
from ckptd.peers.replicas import Replica, ReplicaBook, new_shm_file, origin_named, remove_shm_file
from ckptd.storage.backends import Backends

log = logging.getLogger("ckptd")
FORGOTTEN = frozenset({"older_than_disk", "deleted", "saved_to_disk", "retention_deleted_disk_copy"})
"""Why a snapshot leaves memory for good (``SnapshotDropped.reason``): its replica is dropped on the buddy too. A
snapshot replaced or evicted by a newer one is not: its replica serves until the newer one's replaces it."""
ASK_TIMEOUT_S = 2.0
"""Seconds a peer has to answer a question (what it holds): a listing must not hang on a node that is gone."""
CHECK_S = 5.0
"""Seconds between two checks that the buddy still holds the copies this daemon says are replicated."""
COPIED = frozenset({R.REPLICATED, R.RESTORED})
"""Where a held snapshot has a copy on a peer: one it streamed, or the replica it was read back from. Either is
checked (``check``), and sent to the buddy again once gone: a restored snapshot left without its copy would be
lost with its node the next time."""
Send = Callable[[bytes, Message], None]


@dataclass
class _Turn:
    """A snapshot waiting for its stream; ``superseded`` once a newer one of its directory is held."""

    snap: HeldSnapshot
    reader: bytes
    endpoint: str
    """The buddy it streams to (the ring may name another by the time it ends)."""
    superseded: bool = False
    held_at: float = field(default_factory=time.monotonic)
    """Where its lag runs from, to the buddy's last seal: when it was queued (held here, or its copy found gone);
    for a stream resumed after the buddy did not answer, when the snapshot was held (its first copy, still)."""
    resumed: bool = False
    """Sent again because the buddy did not answer its first stream (``check``): if it fails too, that is final."""


def _newer_of_its_directory(newer: HeldSnapshot, snap: HeldSnapshot) -> bool:
    """Whether ``newer`` takes ``snap``'s place on the buddy, which keeps one replica per directory and ranks."""
    return (newer is not snap and newer.path.parent == snap.path.parent and set(newer.shards) == set(snap.shards)
            and newer.order > snap.order)


def _held_by(snap: HeldSnapshot, replicas: list[dict[str, Any]]) -> bool:
    """Whether a peer's listing holds ``snap``'s copy as its record says: the path, with every shard's checksum."""
    return any(r["path"] == str(snap.path) and r.get("complete")
               and set(snap.copy.checksums) <= {(rank, checksum) for rank, _, _, checksum, _ in r["shards"]}
               for r in replicas)


def _replaced_by(snap: HeldSnapshot, replicas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The replica a peer holds in place of ``snap``'s copy, if any (``ReplicaBook._completed``'s rules: another of
    the same path, or a newer one of the same ranks in its directory); None: it was lost with no successor (the
    buddy restarted)."""
    path, ranks = snap.path, sorted(rank for rank, _ in snap.copy.checksums)
    return next((r for r in replicas if r["path"] == str(path) or (
        Path(r["path"]).parent == path.parent and r["ranks_held"] == ranks and _step(r["step"]) > _step(
            snap.step))), None)


@dataclass
class PeerRecord:
    """What ``ckptd status`` says of one peer (``--peer``), from this daemon's last exchanges with it.

    CURVE gives no answer to a peer that refuses this daemon's key (the handshake never completes), so a peer
    that does not answer may be down, partitioned or distrustful; one that answers is connected and has
    authenticated (both ends proved their keys)."""

    endpoint: str
    connected: bool | None = None
    """Whether the last exchange got its answers in time (None: none yet)."""
    authenticated: bool = False
    """Whether it ever answered (a CURVE handshake with the key the keys file names for it completed)."""
    last_answer: float | None = None
    """Unix time of its last answer."""
    bytes_replicated: int = 0
    bytes_sent: int = 0
    """Of those, the bytes that crossed the data port (the others the buddy built from replicas it held)."""
    bytes_built: int = 0
    snapshots_replicated: int = 0
    failures: int = 0
    """Streams to it that failed (a snapshot reported not replicated)."""
    bytes_per_second: float | None = None
    """The last stream's rate: its bytes over the time from its first offer to its last seal."""
    lag_s: float | None = None
    """For the newest snapshot replicated to it: seconds from held here to held there."""
    last_error: str = ""

    def answered(self) -> None:
        self.connected, self.authenticated, self.last_answer = True, True, time.time()

    def unanswered(self, error: BaseException) -> None:
        self.connected, self.last_error = False, str(error)

    def describe(self, *, buddy: bool) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "buddy": buddy, "connected": self.connected,
                "authenticated": self.authenticated, "last_answer": self.last_answer,
                "bytes_replicated": self.bytes_replicated, "bytes_sent": self.bytes_sent,
                "bytes_built": self.bytes_built, "snapshots_replicated": self.snapshots_replicated,
                "failures": self.failures, "bytes_per_second": self.bytes_per_second, "lag_s": self.lag_s,
                "last_error": self.last_error}


@dataclass
class _Pulled:
    """A shard read back from a peer into a file of this node's shared memory."""

    msg: Snapshot
    name: str
    fd: int
    map: mmap.mmap
    checksum: int


@dataclass
class Replication:
    """Snapshots to the buddy, and back from any peer."""

    ctx: zmq.Context
    config: DaemonConfig
    keys: Trust
    holding: Holding
    workers: Workers
    stats: Stats
    send: Send
    _turns: dict[Path, _Turn] = field(default_factory=dict)
    _restoring: dict[Path, list[tuple[bytes, int]]] = field(default_factory=dict)
    _pins: Any = field(default_factory=lambda: itertools.count(1))
    _next_check: float = 0.0
    _checking: bool = False
    _forgets: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    """Snapshots let go for good whose buddy is still to be told (``dropped``): appended on the loop, sent and
    removed by one job on the peer thread."""

    def __post_init__(self) -> None:
        self.placement = Placement(self.ctx, self.config, self.keys, self.workers, self.config.peer_timeout,
                                   ASK_TIMEOUT_S)
        self.records: dict[str, PeerRecord] = {}
        """What status says of each peer this daemon streamed to or asked (by endpoint), kept across ring changes."""
        self.pace = bulk.Pacer(self.config.peer_rate) if self.config.peer_rate is not None else None
        """``--peer-rate``: the share of the link the streams to the buddy keep to (restores are not paced: the
        node restoring is not training yet, and waits for them)."""

    @property
    def buddy(self) -> PeerLink | None:
        """The link to the buddy: the first ``--peer``, else the next node of the ring the ranks sent
        (``placement.py``); None with ``--replicas 0`` or neither."""
        return self.placement.buddy()

    @property
    def asks(self) -> list[PeerLink]:
        """The peers a node restoring asks (``--peer``'s, then the ring's buddy)."""
        return self.placement.asks()

    def _record(self, endpoint: str) -> PeerRecord:
        if endpoint not in self.records:
            self.records[endpoint] = PeerRecord(endpoint)
        return self.records[endpoint]

    # -- to the buddy ---------------------------------------------------------

    def held(self, event: SnapshotHeld) -> None:
        """A snapshot was held here (its ranks told): queue its stream to the buddy."""
        snap = self.holding.snapshots.current.get(event.path)
        if snap is not None and snap.copy.state not in (R.RESTORED, R.ADOPTED):  # read back from a replica, or
            # a replica a drain is persisting
            self._stream(snap)

    def dropped(self, event: SnapshotDropped) -> None:
        """A snapshot left this node's memory: where it went for good (``FORGOTTEN``), the buddy is told to drop
        its replica, after any stream of it still queued (one peer thread, in order). Kept there, a drain of the
        buddy that found this node gone would persist it: a state this node gave up, which a second run that
        restarted the directory at lower steps would see outrank its own newest, and lose it to ``keep_last``.
        Forgets queued together go in one job, which stops at the first the buddy does not answer: a drain
        waits for one peer timeout at most, not one per snapshot. A copy on a buddy the ring has since replaced
        is not told (that node is gone, or holds a copy its next drain may persist: logged as open)."""
        if event.reason not in FORGOTTEN:
            return
        buddy = self.buddy
        if buddy is None:
            return
        queued = self._forgets
        queued.append((str(event.path), event.ranks))
        if len(queued) > 1:  # a job that sends what is queued is on its way
            return

        def forget() -> None:  # on the peer thread, as the buddy's streams are (a link is one socket, one thread)
            while queued:
                path, ranks = queued[0]
                try:
                    buddy.forget(path, ranks)
                except Exception as exc:  # the buddy's drain may still find them: said so in the log
                    left = [p for p, _ in queued]
                    queued.clear()
                    log.warning("event=replica_forget_failed paths=%s peer=%s error=%s", ",".join(left),
                                buddy.endpoint, exc)
                    return
                queued.pop(0)
        self.workers.background("peer", forget)

    def _stream(self, snap: HeldSnapshot, *, resumed: bool = False) -> None:
        """Queue ``snap``'s stream to the buddy (none without one); ``resumed``: its first failed because the
        buddy did not answer, which does now."""
        buddy = self.buddy
        if buddy is None:
            return
        reader = b"ckptd-replication-%d" % next(self._pins)
        self.holding.snapshots.pin(reader, snap.path)
        turn = _Turn(snap, reader, buddy.endpoint, held_at=snap.held_at if resumed else time.monotonic(),
                     resumed=resumed)
        before = self._turns.get(snap.path.parent)
        if before is not None:
            before.superseded = True
        self._turns[snap.path.parent] = turn
        self.holding.state.attempts.replicate(snap, R.REPLICATING, endpoint=buddy.endpoint)
        ranks = tuple(sorted(snap.shards))
        shards = [(sh.msg.to_wire(), sh.checksum, sh.slot, sh.msg.nbytes) for _, sh in sorted(snap.shards.items())]

        def stream() -> tuple[float, float, int, int] | None:
            """(start, end) of the stream, monotonic, and its bytes sent and built on the buddy from what it held
            (``chunks.py``); None if superseded before its turn."""
            if turn.superseded:
                return None
            start = time.monotonic()
            views = [memoryview(slot.map)[:nbytes] for _, _, slot, nbytes in shards]
            try:
                sent, built = buddy.replicate([(w, c, v) for (w, c, _, _), v in zip(shards, views)], ranks,
                                              snap.created, self.pace, changed_only=self.config.peer_send_changed)
            finally:
                for view in views:
                    view.release()
            return start, time.monotonic(), sent, built
        self.workers.submit("peer", stream, lambda fut: self._streamed(turn, fut),
                            failed=lambda exc: self._unstreamed(turn, exc))

    def _streamed(self, turn: _Turn, fut: Future) -> None:
        snap, newer = turn.snap, self._turns.get(turn.snap.path.parent)
        if newer is turn:
            del self._turns[snap.path.parent]
        self.holding.unpin_for(turn.reader, snap.path)
        record = self._record(turn.endpoint)
        exc = fut.exception()
        again = newer is not None and newer is not turn and newer.snap is snap  # sent again: a late rank joined

        def move(state: R, **how: Any) -> None:
            if not again:  # else the newer turn says how it went
                self.holding.state.attempts.replicate(snap, state, endpoint=turn.endpoint, **how)
        if exc is None and fut.result() is not None:
            start, end, sent, built = fut.result()
            lag = round(end - turn.held_at, 6)
            move(R.REPLICATED, lag_s=lag, checksums=tuple(sorted((r, sh.checksum) for r, sh in snap.shards.items())))
            if not again:
                self._supersede_older(snap, turn.endpoint)
            record.answered()
            record.bytes_replicated += snap.nbytes
            record.bytes_sent, record.bytes_built = record.bytes_sent + sent, record.bytes_built + built
            record.snapshots_replicated += 1
            record.bytes_per_second = round(snap.nbytes / max(end - start, 1e-6), 1)
            record.lag_s = lag
            log.info("event=snapshot_replicated path=%s step=%s peer=%s lag_s=%.3f bytes=%d sent=%d built=%d",
                     snap.path, snap.step, turn.endpoint, lag, snap.nbytes, sent, built)
        elif exc is None:
            move(R.SUPERSEDED)
        else:
            # resumed once per failure: a buddy that answers but whose stream fails again (its data port
            # unreachable) is not sent to every check for ever
            move(R.FAILED, error=str(exc), unanswered=isinstance(exc, PeerUnavailable) and not turn.resumed)
            record.failures += 1
            if isinstance(exc, PeerUnavailable):
                record.unanswered(exc)
            else:  # it answered, with an error (a refusal, a checksum that differs)
                record.answered()
                record.last_error = str(exc)
            log.warning("event=replication_failed path=%s step=%s error=%s", snap.path, snap.step, exc)
            self.stats.error(f"replicating snapshot {display(snap.path)} failed: {exc}")

    def _supersede_older(self, snap: HeldSnapshot, endpoint: str) -> None:
        """``snap``'s replica is sealed on ``endpoint``, whose book dropped for it every replica of this node's
        older snapshots of the same directory and ranks (``ReplicaBook._completed``: a buddy keeps one per
        directory and ranks): those say ``superseded`` now, not ``replicated`` until the next check finds their
        copies gone."""
        for older in [s for s in self.holding.snapshots.current.values() if _newer_of_its_directory(snap, s)
                      and s.copy.state in COPIED and s.copy.endpoint == endpoint]:
            log.info("event=replica_gone path=%s step=%s peer=%s action=superseded newer=%s", older.path, older.step,
                     endpoint, snap.path)
            self.holding.state.attempts.replicate(older, R.SUPERSEDED)

    def check(self, now: float) -> None:
        """Housekeeping: every ``CHECK_S``, ask each peer holding a copy (``COPIED``: said ``replicated``, or the
        replica a ``restored`` one was read back from) whether it holds it still. A copy lost with no successor
        (the buddy restarted), or on a peer that is not the buddy now (the ring replaced it; a restore read it
        from another), is streamed again (to the buddy now); one the peer replaced (by
        another run's snapshot of the path, or a newer one of its directory) is reported ``failed``, saying so. A
        buddy that does not answer is not judged: it may be paused, and still hold the copy. A snapshot whose
        stream failed because the buddy did not answer (``PeerCopy.unanswered``) is streamed again once the buddy
        answers the check, if it is still the newest of its directory and ranks here: else, with the buddy
        restarted and no new snapshot since, the node's last one would have no copy, and be lost with the node."""
        if self._checking or now < self._next_check:
            return
        self._next_check = now + CHECK_S
        copied = [s for s in self.holding.snapshots.current.values() if s.copy.state in COPIED and s.copy.checksums]
        buddy = self.buddy
        for snap in [s for s in copied if buddy is not None and s.copy.endpoint != buddy.endpoint]:
            self._copy_gone(snap, snap.copy, None)  # the ring named a new buddy (a replacement node at another
            # endpoint): the copy on the old one is no copy of this node's any more, and the new one is sent what is
            # held
        asks = {link.endpoint: link for link in self.asks}
        asked = [(s, s.copy) for s in copied if s.copy.state in COPIED and s.copy.endpoint in asks]
        waiting = [(s, s.copy) for s in self._unanswered()] if buddy is not None and buddy.endpoint in asks else []
        if not asked and not waiting:
            return
        self._checking = True
        links = [asks[endpoint] for endpoint in sorted({copy.endpoint for _, copy in asked}
                                                      | ({buddy.endpoint} if waiting and buddy else set()))]

        def ask() -> dict[str, list[dict[str, Any]] | BaseException]:
            listed: dict[str, list[dict[str, Any]] | BaseException] = {}
            for link in links:
                try:
                    listed[link.endpoint] = link.replicas()
                except CkptdError as exc:
                    listed[link.endpoint] = exc
            return listed

        def answer(fut: Future) -> None:
            self._checking = False
            listed = fut.result()
            self._heard({ep: r if isinstance(r, BaseException) else None for ep, r in listed.items()})
            for snap, copy in asked:  # a copy that moved on meanwhile (a new record) is judged at the next check
                replicas = listed.get(copy.endpoint)
                if isinstance(replicas, list) and self.holding.snapshots.current.get(snap.path) is snap \
                        and snap.copy is copy and not _held_by(snap, replicas):
                    self._copy_gone(snap, copy, _replaced_by(snap, replicas))
            now_buddy = self.buddy
            if now_buddy is None or not isinstance(listed.get(now_buddy.endpoint), list):
                return  # the buddy still does not answer: asked again at the next check
            for snap, copy in waiting:  # one that moved on meanwhile (sent again, superseded) is left as it is
                if snap.copy is copy and any(s is snap for s in self._unanswered()):
                    log.info("event=replication_resumed path=%s step=%s peer=%s", snap.path, snap.step,
                             now_buddy.endpoint)
                    self._stream(snap, resumed=True)

        def unasked(exc: BaseException) -> None:
            self._checking = False
            log.warning("event=replica_check_failed error=%s", exc)
        self.workers.submit("peer_ask", ask, answer, failed=unasked)

    def _unanswered(self) -> list[HeldSnapshot]:
        """The held snapshots whose stream failed because the buddy did not answer, each the newest of its
        directory and ranks here, none of whose directory a stream is queued for: what a buddy that answers again
        is sent (an older one's place on the buddy is its newer one's)."""
        held = list(self.holding.snapshots.current.values())
        return [s for s in held if s.copy.state is R.FAILED and s.copy.unanswered
                and s.path.parent not in self._turns and not any(_newer_of_its_directory(o, s) for o in held)]

    def _copy_gone(self, snap: HeldSnapshot, copy: PeerCopy, successor: dict[str, Any] | None) -> None:
        """The peer no longer holds ``snap``'s ``copy``: send it to the buddy again, or say why not (on the loop)."""
        if successor is None and snap.path.parent in self._turns:  # a stream of its directory is queued: the
            return  # next check decides
        if successor is None and any(_newer_of_its_directory(s, snap) for s in self._unanswered()):
            return  # the newer one, which the buddy did not get, is sent in its place (``check``), and replaces it
        newer = None if successor is None else self.holding.snapshots.current.get(Path(successor["path"]))
        if newer is not None and newer is not snap and newer.copy.state is R.REPLICATED \
                and newer.copy.endpoint == copy.endpoint and _held_by(newer, [successor]):
            # this node's newer snapshot of its directory: the buddy keeps one replica per directory and ranks
            log.info("event=replica_gone path=%s step=%s peer=%s action=superseded newer=%s", snap.path, snap.step,
                     copy.endpoint, newer.path)
            self.holding.state.attempts.replicate(snap, R.SUPERSEDED)
            return
        log.warning("event=replica_gone path=%s step=%s peer=%s action=%s", snap.path, snap.step, copy.endpoint,
                    "failed" if successor is not None else "sent_again")
        if successor is None:
            self._stream(snap)
            return
        self.holding.state.attempts.replicate(snap, R.FAILED, error=(
            f"peer {copy.endpoint} no longer holds its copy: it holds a replica of {successor['path']} at step "
            f"{successor['step']} in its place (another run's snapshot of the same path, or a newer one of its "
            f"directory)"))

    def _unstreamed(self, turn: _Turn, exc: BaseException) -> None:
        """``_streamed`` raised (a defect): the snapshot is unpinned and shows its replication failed, instead of
        ``replicating`` for ever (``wait_replicated`` waits on it)."""
        snap = turn.snap
        if self._turns.get(snap.path.parent) is turn:
            del self._turns[snap.path.parent]
        self.holding.unpin_for(turn.reader, snap.path)
        if snap.copy.state is R.REPLICATING:
            self.holding.state.attempts.replicate(snap, R.FAILED, error=as_error(self.stats, exc).message)

    # -- from the peers -------------------------------------------------------

    def listing(self, ident: bytes, msg: ListPeerSnapshots) -> Message | None:
        """What is held here, and the replicas peers hold of snapshots not held here (answered once every peer
        answered or timed out)."""
        if not self.asks:
            return self.holding.listing(ident, msg)
        asks = self.asks

        def ask() -> tuple[list[dict[str, Any]], dict[str, BaseException | None]]:
            found, outcomes = [], {}
            for link in asks:
                try:
                    found += [{**r, "on_peer": link.endpoint} for r in link.replicas() if r.get("complete")]
                    outcomes[link.endpoint] = None
                except CkptdError as exc:
                    outcomes[link.endpoint] = exc
                    log.info("event=peer_unanswered peer=%s error=%s", link.endpoint, exc)
            return found, outcomes

        def answer(fut: Future) -> None:
            found, outcomes = fut.result()
            self._heard(outcomes)
            here = {s["path"] for s in self.holding.listing(ident, msg).snapshots if s.get("complete")}
            extra, seen = [], set()
            for replica in found:  # one per path and ranks: peers may hold replicas of one path for several nodes
                key = (replica["path"], tuple(replica["ranks_held"]))
                if replica["path"] not in here and key not in seen:
                    seen.add(key)
                    extra.append({k: v for k, v in replica.items() if k != "messages"})
            unanswered = tuple(str(error) for error in outcomes.values() if error is not None)
            self.send(ident, SnapshotList(msg.id, (*self.holding.listing(ident, msg).snapshots, *extra), unanswered))
        self.workers.submit("peer_ask", ask, answer, failed=lambda exc: self.send(ident, error_reply(
            self.stats, msg.id, exc)))
        return None

    def restore(self, ident: bytes, msg: Restore) -> Message | None:
        """Read snapshot ``msg.path`` back from a peer's replica into this node's memory; Ok once held."""
        path = Path(msg.path)
        held = self.holding.snapshots.current.get(path)
        if held is not None and held.acknowledged:
            return Ok(msg.id)
        if path in self._restoring:  # every rank of the node asks: one read serves them all (a node's ranks are
            # replicated together, so the replica that holds one holds every one)
            self._restoring[path].append((ident, msg.id))
            return None
        self._restoring[path] = [(ident, msg.id)]
        asks, shm_dir, new_name = self.asks, self.holding.state.slots.shm_dir, self.holding.state.slots.own_name
        storage, roots = self.holding.storage, self.config.roots

        def pull() -> tuple[dict[str, Any], list[_Pulled]]:
            storage.resolve(msg.path, roots)  # a snapshot held here may be persisted here: within the roots only
            why = []
            for link in asks:
                try:
                    entry = next((r for r in link.replicas() if r["path"] == msg.path and r.get("complete")
                                  and (msg.rank is None or msg.rank in r["ranks_held"])), None)
                except CkptdError as exc:
                    why.append(str(exc))
                    continue
                if entry is None:
                    continue
                pulled: list[_Pulled] = []
                try:
                    for (rank, _, size, checksum, _), wire in zip(entry["shards"], entry["messages"]):
                        name = new_name()
                        fd, mapping = new_shm_file(shm_dir / name, size)
                        pulled.append(_Pulled(Snapshot.from_wire(wire), name, fd, mapping, checksum))
                        link.fetch(msg.path, rank, size, checksum, entry["checksum_algorithm"], fd)
                    return {**entry, "on_peer": link.endpoint}, pulled
                except (CkptdError, OSError, KeyError, ValueError) as exc:
                    why.append(str(exc))
                    _discard(pulled, shm_dir)
                    log.warning("event=restore_failed path=%s peer=%s error=%s", msg.path, link.endpoint, exc)
            raise InvalidCheckpoint(f"no peer holds a replica of snapshot {display(path)} that passes its check"
                                    + (f": {'; '.join(why)}" if why else " (none holds one)"))

        def done(fut: Future) -> None:  # its waiters stay listed until answered: ``unanswered`` answers them if
            # this raises
            error: BaseException | None = fut.exception()
            if error is None:
                entry, pulled = fut.result()
                try:
                    self.holding.hold_restored(path, entry["created"], [
                        (p.msg, p.name, p.fd, p.map, p.checksum) for p in pulled], peer=entry["on_peer"])
                    log.info("event=snapshot_restored path=%s step=%s peer=%s", path, entry["step"], entry["on_peer"])
                except Exception as exc:  # noqa: BLE001 - not held (a defect included): its files go, its waiters
                    # are told
                    self.workers.background("maintenance", lambda: _discard(pulled, shm_dir))
                    error = exc
            for who, rid in self._restoring.pop(path, []):
                self.send(who, Ok(rid) if error is None else error_reply(self.stats, rid, error))
        def unanswered(exc: BaseException) -> None:
            for who, rid in self._restoring.pop(path, []):
                self.send(who, error_reply(self.stats, rid, exc))
        self.workers.submit("peer_ask", pull, done, failed=unanswered)
        return None

    def _heard(self, outcomes: dict[str, BaseException | None]) -> None:
        """Record which peers answered a question (``None``) and which did not (why), on the loop."""
        for endpoint, error in outcomes.items():
            record = self._record(endpoint)
            if error is None or not isinstance(error, PeerUnavailable):
                record.answered()
            else:
                record.unanswered(error)

    # -- the drain ------------------------------------------------------------------

    def drain(self, replicas: ReplicaBook) -> None:
        """The daemon drains: every replica held here whose origin is gone is persisted as a snapshot of this
        node's own would be, so draining a cluster loses nothing.

        Judged once, when the drain begins, on the ``peer_ask`` pool (the
        drain waits for it): an origin is gone when no line of the peer keys
        file names its key with an endpoint (a replacement node took its
        line), or when its endpoint does not answer a listing within
        ``ASK_TIMEOUT_S``. An origin that answers holds its own snapshot and
        persists it at its own drain or exit, so the replica is not persisted
        twice; nor is one whose checkpoint is committed already (an origin that
        drained first persisted it, then exited). A replica of a snapshot that
        spans several nodes is not persisted: one node's share is no
        checkpoint, and persisting such a snapshot is refused for a node's own
        as well (logged, ``reason=spans_nodes``). A persisted replica is held
        here as ``adopted`` and written through the save pipeline as a drain
        writes a snapshot of this node's own, within the same deadline.
        """
        todo = list(replicas.held.values())
        if not todo:
            return
        try:
            self.keys.reload()
        except (OSError, ValueError) as exc:
            log.warning("event=peer_keys_unreadable error=%s", exc)  # the keys read before stand
        by_key = {key.decode(): endpoint for endpoint, key in self.keys.endpoints.items()}
        ctx, keys, pair, storage = self.ctx, self.keys, KeyPair.of(self.config.run_dir), self.holding.storage
        roots, refused = self.config.roots, []
        log.info("event=drain_replicas replicas=%d", len(todo))

        def judge() -> list[tuple[Replica, str | None]]:
            """Each replica, and why it is persisted (its origin is gone), or None with the reason logged (and in
            ``refused`` if it cannot be persisted within this daemon's roots)."""
            gone: dict[str, str | None] = {}
            for origin in sorted({r.origin for r in todo}):
                endpoint = by_key.get(origin)
                if endpoint is None:
                    gone[origin] = "no line of the peer keys file names its key with an endpoint"
                    continue
                link = PeerLink(ctx, endpoint, keys, pair, ASK_TIMEOUT_S)
                try:
                    link.replicas()
                    gone[origin] = None
                except CkptdError as exc:
                    gone[origin] = f"it did not answer at {endpoint}: {exc}"
                finally:
                    link.close()
            verdicts: list[tuple[Replica, str | None]] = []
            for replica in todo:
                why = gone[replica.origin]
                if why is None:
                    _not_persisted(replica, by_key.get(replica.origin), "origin_alive")
                elif replica.describe()["coordinated"]:
                    _not_persisted(replica, by_key.get(replica.origin), "spans_nodes")
                    why = None
                elif (outside := _outside_roots(storage, replica.path, roots)) is not None:
                    _not_persisted(replica, by_key.get(replica.origin), "outside_roots")
                    refused.append(f"{display(replica.path)} (a replica of a node that is gone): {outside}")
                    why = None
                elif _written_since(storage, replica) is not None:
                    _not_persisted(replica, by_key.get(replica.origin), "committed_already")
                    why = None
                verdicts.append((replica, why))
            return verdicts

        def adopt(fut: Future) -> None:
            self.holding.drain_failures.extend(refused)
            for replica, why in fut.result():
                if why is None or replicas.held.get((replica.origin, replica.path)) is not replica:
                    continue
                log.info("event=drain_persist_replica path=%s step=%s origin=%s reason=%s", replica.path,
                         replica.order[0], origin_named(replica.origin, by_key.get(replica.origin)), why)
                files = replicas.hand_over(replica)
                try:
                    snap = self.holding.hold_restored(replica.path, replica.created, files, replication=R.ADOPTED)
                except CkptdError as exc:  # its files are nobody's now: removed, not left until the exit
                    self.holding.drain_failures.append(f"{display(replica.path)} (a replica of a node that is gone): "
                                                       f"{exc}")
                    shm_dir = self.holding.state.slots.shm_dir
                    self.workers.background("maintenance", lambda files=files: [
                        remove_shm_file(shm_dir, name, fd, mapping) for _, name, fd, mapping, _ in files])
                    continue
                self.holding.start_persist(snap)

        def unjudged(exc: BaseException) -> None:
            self.holding.drain_failures.append(f"the replicas held for peers could not be judged: {exc}")
        self.workers.submit("peer_ask", judge, adopt, failed=unjudged)

    def status(self) -> dict[str, Any]:
        """The ``peers`` part of ``ckptd status``: a link for every peer placed now (the buddy, those a restore asks)
        and every one exchanged with since the start."""
        for endpoint in (self.placement.buddy_endpoint(), *self.placement.ask_endpoints()):
            if endpoint is not None:
                self._record(endpoint)
        return {"buddy": None if self.buddy is None else self.buddy.endpoint, "peers": list(self.config.peers),
                "listen": self.config.peer_listen, "replicas": self.config.replicas,
                "streams_queued": len(self._turns),
                "links": [r.describe(buddy=self.buddy is not None and r.endpoint == self.buddy.endpoint)
                          for r in self.records.values()],
                "replicated_bytes_total": sum(r.bytes_replicated for r in self.records.values()),
                "replicated_sent_bytes_total": sum(r.bytes_sent for r in self.records.values()),
                "replicated_total": sum(r.snapshots_replicated for r in self.records.values()),
                "replication_failures_total": sum(r.failures for r in self.records.values())}

    def close(self) -> None:
        self.placement.close()


def _step(step: int | None) -> int:
    """A step to compare: none is older than any."""
    return -1 if step is None else step


def _outside_roots(storage: Backends, path: Path, roots: tuple[Path, ...]) -> PathNotAllowed | None:
    """Why ``path`` may not be written by this daemon (None: it lies within its roots), asked now: a directory
    on the way may have become a link since the replica came."""
    try:
        storage.resolve(str(path), roots)
    except PathNotAllowed as exc:
        return exc
    return None


def _written_since(storage: Backends, replica: Replica) -> Path | None:
    """The checkpoint committed at ``replica``'s path, if it was written at or after the replica's snapshot (the
    origin persisted it, or saved the path again since): then there is nothing to persist. One written before it
    (a rollback, saved over that checkpoint with ``overwrite=True``, is the replica) does not count, and neither
    does none. An index that cannot be read counts as written since: what cannot be judged is never replaced."""
    files, index = storage.files, replica.path / INDEX_NAME
    if files.stat(index) is None:
        return None
    try:
        written = read_index(replica.path, files).created
    except InvalidCheckpoint:
        return index
    return index if written >= replica.created else None


def _not_persisted(replica: Replica, endpoint: str | None, reason: str) -> None:
    log.info("event=replica_not_persisted path=%s origin=%s reason=%s", replica.path,
             origin_named(replica.origin, endpoint), reason)


def _discard(pulled: list[_Pulled], shm_dir: Path) -> None:
    for p in pulled:
        remove_shm_file(shm_dir, p.name, p.fd, p.map)
