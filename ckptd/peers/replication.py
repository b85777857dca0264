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

A node restoring asks its peers what they hold (``PeerSnapshots``
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
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from ckptd.protocol.errors import CkptdError, InvalidCheckpoint
from ckptd.protocol.index import CHECKSUM_ALGORITHM
from ckptd.protocol.messages import Message, Ok, PeerSnapshots, Restore, Snapshot, SnapshotList
from ckptd.protocol.objects import display
from ckptd.protocol.peer_messages import Offer

from ckptd.lifecycle.holding import Holding
from ckptd.lifecycle.snapshots import HeldSnapshot
from ckptd.loop.config import DaemonConfig
from ckptd.loop.events import SnapshotHeld
from ckptd.loop.replies import error_reply
from ckptd.loop.stats import Stats
from ckptd.loop.workers import Workers
from ckptd.peers.keys import Trust
from ckptd.peers.link import PeerLink
from ckptd.peers.placement import Placement
from ckptd.peers.replicas import new_shm_file, remove_shm_file

log = logging.getLogger("ckptd")
ASK_TIMEOUT_S = 2.0
"""Seconds a peer has to answer a question (what it holds): a listing must not hang on a node that is gone."""
Send = Callable[[bytes, Message], None]


@dataclass
class _Turn:
    """A snapshot waiting for its stream; ``superseded`` once a newer one of its directory is held."""

    snap: HeldSnapshot
    reader: bytes
    superseded: bool = False


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

    def __post_init__(self) -> None:
        self.placement = Placement(self.ctx, self.config, self.keys, self.workers, self.config.peer_timeout,
                                   ASK_TIMEOUT_S)

    @property
    def buddy(self) -> PeerLink | None:
        """The link to the buddy: the first ``--peer``, else the next node of the ring the ranks sent
        (``placement.py``); None with ``--replicas 0`` or neither."""
        return self.placement.buddy()

    @property
    def asks(self) -> list[PeerLink]:
        """The peers a node restoring asks (``--peer``'s, then the ring's buddy)."""
        return self.placement.asks()

    # -- to the buddy ---------------------------------------------------------

    def held(self, event: SnapshotHeld) -> None:
        """A snapshot was held here (its ranks told): queue its stream to the buddy."""
        snap = self.holding.snapshots.held.get(event.path)
        if self.buddy is None or snap is None or snap.replication == "restored":
            return
        reader = b"ckptd-replication-%d" % next(self._pins)
        self.holding.snapshots.pin(reader, snap.path)
        turn = _Turn(snap, reader)
        before = self._turns.get(snap.path.parent)
        if before is not None:
            before.superseded = True
        self._turns[snap.path.parent] = turn
        snap.replication = "replicating"
        buddy, ranks = self.buddy, tuple(sorted(snap.shards))
        shards = [(sh.msg.to_wire(), sh.checksum, sh.slot, sh.msg.nbytes) for _, sh in sorted(snap.shards.items())]

        def stream() -> bool:
            if turn.superseded:
                return False
            for wire, checksum, slot, nbytes in shards:
                view = memoryview(slot.map)[:nbytes]
                try:
                    buddy.stream(Offer(0, wire, checksum, CHECKSUM_ALGORITHM, snap.created, ranks), view)
                finally:
                    view.release()
            return True
        self.workers.submit("peer", stream, lambda fut: self._streamed(turn, fut))

    def _streamed(self, turn: _Turn, fut: Future) -> None:
        snap = turn.snap
        if self._turns.get(snap.path.parent) is turn:
            del self._turns[snap.path.parent]
        self.holding.unpin_for(turn.reader, snap.path)
        exc = fut.exception()
        if exc is None and fut.result():
            snap.replication, snap.replication_error = "replicated", ""
            log.info("event=snapshot_replicated path=%s step=%s peer=%s", snap.path, snap.step, self.buddy.endpoint)
        elif exc is None:
            snap.replication = "superseded"
        else:
            snap.replication, snap.replication_error = "failed", str(exc)
            log.warning("event=replication_failed path=%s step=%s error=%s", snap.path, snap.step, exc)
            self.stats.error(f"replicating snapshot {display(snap.path)} failed: {exc}")

    # -- from the peers -------------------------------------------------------

    def listing(self, ident: bytes, msg: PeerSnapshots) -> Message | None:
        """What is held here, and the replicas peers hold of snapshots not held here (answered once every peer
        answered or timed out)."""
        if not self.asks:
            return self.holding.listing(ident, msg)
        asks = self.asks

        def ask() -> list[dict[str, Any]]:
            found = []
            for link in asks:
                try:
                    found += [{**r, "on_peer": link.endpoint} for r in link.replicas() if r.get("complete")]
                except CkptdError as exc:
                    log.info("event=peer_unanswered peer=%s error=%s", link.endpoint, exc)
            return found

        def answer(fut: Future) -> None:
            here = {s["path"] for s in self.holding.listing(ident, msg).snapshots if s.get("complete")}
            extra, seen = [], set()
            for replica in fut.result():
                if replica["path"] not in here and replica["path"] not in seen:
                    seen.add(replica["path"])
                    extra.append({k: v for k, v in replica.items() if k != "messages"})
            self.send(ident, SnapshotList(msg.id, (*self.holding.listing(ident, msg).snapshots, *extra)))
        self.workers.submit("peer_ask", ask, answer, failed=lambda exc: self.send(ident, error_reply(
            self.stats, msg.id, exc)))
        return None

    def restore(self, ident: bytes, msg: Restore) -> Message | None:
        """Read snapshot ``msg.path`` back from a peer's replica into this node's memory; Ok once held."""
        path = Path(msg.path)
        held = self.holding.snapshots.held.get(path)
        if held is not None and held.acknowledged:
            return Ok(msg.id)
        if path in self._restoring:  # every rank of the node asks: one read serves them all
            self._restoring[path].append((ident, msg.id))
            return None
        self._restoring[path] = [(ident, msg.id)]
        asks, shm_dir, new_name = self.asks, self.holding.state.slots.shm_dir, self.holding.state.slots.own_name

        def pull() -> tuple[dict[str, Any], list[_Pulled]]:
            why = []
            for link in asks:
                try:
                    entry = next((r for r in link.replicas() if r["path"] == msg.path and r.get("complete")), None)
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
                        link.fetch(msg.path, rank, size, checksum, entry["checksum_algorithm"], mapping)
                    return {**entry, "on_peer": link.endpoint}, pulled
                except (CkptdError, OSError, KeyError, ValueError) as exc:
                    why.append(str(exc))
                    _discard(pulled, shm_dir)
                    log.warning("event=restore_failed path=%s peer=%s error=%s", msg.path, link.endpoint, exc)
            raise InvalidCheckpoint(f"no peer holds a replica of snapshot {display(path)} that passes its check"
                                    + (f": {'; '.join(why)}" if why else " (none holds one)"))

        def done(fut: Future) -> None:
            waiters = self._restoring.pop(path, [])
            error: BaseException | None = fut.exception()
            if error is None:
                entry, pulled = fut.result()
                try:
                    self.holding.hold_restored(path, entry["created"], [(p.msg, p.name, p.fd, p.map, p.checksum)
                                                                        for p in pulled])
                    log.info("event=snapshot_restored path=%s step=%s peer=%s", path, entry["step"], entry["on_peer"])
                except CkptdError as exc:
                    self.workers.submit("maintenance", lambda: _discard(pulled, shm_dir))
                    error = exc
            for who, rid in waiters:
                self.send(who, Ok(rid) if error is None else error_reply(self.stats, rid, error))
        self.workers.submit("peer_ask", pull, done)
        return None

    def status(self) -> dict[str, Any]:
        """The ``peers`` part of ``ckptd status``."""
        return {"buddy": None if self.buddy is None else self.buddy.endpoint, "peers": list(self.config.peers),
                "listen": self.config.peer_listen, "replicas": self.config.replicas,
                "streams_queued": len(self._turns)}

    def close(self) -> None:
        self.placement.close()


def _discard(pulled: list[_Pulled], shm_dir: Path) -> None:
    for p in pulled:
        remove_shm_file(shm_dir, p.name, p.fd, p.map)
