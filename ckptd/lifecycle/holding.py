"""The memory tier's pipeline: from a rank's Snapshot to its HeldInMemory, and from a held snapshot to disk.

::

    Snapshot ──admit pool: examine (path, slot, header)
             ──loop: budget, bookkeeping, Accepted ──checksum pool: CRC as the client stages
             ──loop: every rank held? HeldInMemory to each rank, older snapshots dropped

    Persist  ──admit pool: free space ──loop: the held shards into the save pipeline as one attempt
             (``Saves.write_held``: .incomplete, write, fsync, index, rename)

    Pin      ──loop: the snapshot's listing, and a reader's lease on it (a drop waits for its Unpin)

Persisting reuses the disk save's pipeline from the held slot: there is no
second writer. It runs when a client asks (``Persist``), when the last
client of a snapshot's ranks dies or closes (``persist_on_exit``), and for
the newest snapshots when the daemon drains (SIGTERM).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from ckptd.protocol.errors import (
    CheckpointExists, CkptdError, InternalError, InvalidCheckpoint, RanksMissing, ShuttingDown, WriteFailed,
)
from ckptd.protocol.messages import (
    Abort, Accepted, Done, Error, HeldInMemory, ListSnapshots, Message, Ok, Persist, Pin, ReplicationState, Snapshot,
    SnapshotList, Unpin,
)
from ckptd.protocol.objects import display, is_permanent

from ckptd.core.config import DaemonConfig
from ckptd.core.events import Committed, Deleted, Events, SnapshotDropped, SnapshotFailed, SnapshotHeld
from ckptd.core.replies import as_error, error_reply, logged
from ckptd.core.workers import Workers
from ckptd.lifecycle.admission import Examined, examine
from ckptd.lifecycle.attempt import AttemptState, PeerCopy
from ckptd.lifecycle.contributors import Contributors
from ckptd.lifecycle.saves import Saves
from ckptd.lifecycle.slot_maps import MappedSlot, SlotMaps
from ckptd.lifecycle.snapshots import HeldShard, HeldSnapshot, shards_of
from ckptd.lifecycle.state import NodeState
from ckptd.lifecycle.writer import Progress, checksum_when_staged, round_up
from ckptd.storage.backends import Backends
from ckptd.storage.contract import Space

log = logging.getLogger("ckptd")
TRIM_MIN_BYTES = 1 << 20
"""A gone client's held slot is trimmed to its shard when that gives back at least this much."""
DRAIN_RETRY_S = 0.5
"""A drain persists a snapshot again this long after a failed write, doubling, while its deadline allows."""
Send = Callable[[bytes, Message], None]


class Holding:
    """Moves snapshots in and out of node memory; replies through ``send``."""

    kind = HeldSnapshot
    """The attempts it runs, which ``Registry.end`` hands to ``ended``."""

    def __init__(self, state: NodeState, workers: Workers, storage: Backends, config: DaemonConfig,
                 send: Send, saves: Saves, events: Events) -> None:
        self.state, self.workers, self.storage, self.config = state, workers, storage, config
        self.send, self.saves, self.events = send, saves, events
        self.registry = state.attempts
        """The registry: the only way a snapshot moves or ends."""
        self.snapshots = state.snapshots
        self.drain_failures: list[str] = []
        """Snapshots the drain could not persist (path: why), for the log and ``ckptd stop``."""
        self._drain_deadline: float | None = None
        self._drain_attempts: dict[Path, int] = {}

    # -- holding ---------------------------------------------------------------

    def snapshot(self, ident: bytes, msg: Snapshot) -> None:
        """Start admitting one rank's snapshot shard; Accepted then HeldInMemory (or Error) follow."""
        self.state.client(ident)
        if self.state.draining:
            raise ShuttingDown("the daemon is draining and holds no new snapshots")
        self.saves.enter(ident, msg, _examine, self._examined)

    def _examined(self, ident: bytes, msg: Snapshot, progress: Progress, examined: Examined, *, pid: int) -> None:
        current = self.snapshots.opening(examined.final)
        if current is not None and self.registry.end_orphaned(current, msg.job):
            current = self.snapshots.opening(examined.final)
        conflict = None if current is None else current.broken_by(msg)
        try:
            # a late rank of a snapshot that failed is told why at once, as on disk
            self.registry.refuse_late_rank(HeldSnapshot, examined.final, msg)
            if conflict is not None:  # the snapshot fails on every rank, this one included
                self.registry.end(current, AttemptState.FAILED, conflict)
                raise conflict
            self.snapshots.refuse_nested(examined.final)
            snap = self.snapshots.admit(msg, examined.final, examined.backend, examined.slot, pid, ident)
        except CkptdError as exc:
            self.state.slots.release(examined.slot)
            self.saves.refuse(ident, msg, exc)
            return
        self.send(ident, Accepted(msg.id))
        slot, slots = examined.slot, self.state.slots
        name = slots.own_name()

        def checksum_and_adopt() -> int:
            crc = checksum_when_staged(memoryview(slot.map), msg.nbytes, progress)
            slots.adopt(slot, name)
            return crc
        shard = snap.shards[msg.rank]  # a drop meanwhile takes it out of the snapshot (``ended``), not out of here
        self.workers.submit("checksum", checksum_and_adopt, lambda f: self._checksummed(ident, msg, snap, shard, f),
                            failed=lambda exc: self._checksum_failed(ident, msg, snap, shard, exc))

    def _checksum_failed(self, ident: bytes, msg: Snapshot, snap: HeldSnapshot, shard: HeldShard,
                         exc: BaseException) -> None:
        """The completion of a shard's checksum raised (a defect): its snapshot fails on every rank now, held or
        replacing one (``holds``: a replacement with ``overwrite=True`` is in the other book, and its ranks waited
        for their timeout), and the shard's slot goes back as a failed checksum's would. A snapshot acknowledged
        already (a late rank of its node, or a defect after it was held) is not failed, which its table forbids:
        that rank alone is, if it still waits."""
        self.state.end_save(ident, msg.id)
        if not self.snapshots.holds(snap):  # failed or dropped meanwhile: its end handed back only the checksummed
            if shard.checksum is None:
                self._return_unheld([shard], lambda: self._tell_ended(snap, ident, msg.id))
            return
        if snap.acknowledged:
            if shard.checksum is None and snap.shards.get(msg.rank) is shard:
                del snap.shards[msg.rank]
                self._return_unheld([shard])
            if any((w.client, w.request_id) == (ident, msg.id) for w in snap.waiting):
                snap.answered(ident, msg.id)
                self.send(ident, error_reply(self.state.stats, msg.id, exc))
            return
        self.registry.end(snap, AttemptState.FAILED, exc)
        if shard.checksum is None:  # a failure hands back only the checksummed ones
            self._return_unheld([shard], lambda: self._tell_ended(snap, ident, msg.id))

    def _checksummed(self, ident: bytes, msg: Snapshot, snap: HeldSnapshot, shard: HeldShard, fut: Future) -> None:
        self.state.end_save(ident, msg.id)
        failed = not self.snapshots.holds(snap)
        if fut.exception() is not None:  # not adopted
            self.state.slots.release(shard.slot)
            if failed:  # its slot never left its name
                self._tell_ended(snap, ident, msg.id)
            elif snap.acknowledged:  # a late rank of a held snapshot (``takes_late_rank``): it alone
                del snap.shards[msg.rank]
                snap.answered(ident, msg.id)
                self.send(ident, error_reply(self.state.stats, msg.id, fut.exception()))
            else:
                self.registry.end(snap, AttemptState.FAILED, fut.exception())
                self._tell_ended(snap, ident, msg.id)
            return
        if failed:  # the snapshot ended meanwhile: the slot goes back under its name, then its rank is told why
            self._return_unheld([shard], lambda: self._tell_ended(snap, ident, msg.id))
            return
        shard.checksum = fut.result()
        log.info("event=snapshot_held path=%s rank=%d bytes=%d", snap.path, msg.rank, msg.nbytes)
        if snap.coordinated:  # on several nodes each rank is told at once; the ranks agree among themselves
            snap.waiting = [w for w in snap.waiting if (w.client, w.request_id) != (ident, msg.id)]
            self.send(ident, self._held(snap, msg.id, msg.nbytes, shard.pid))
            if snap.acknowledged:  # a late rank of this node joined: its shard goes to the buddy too
                self._published_held(snap)
            elif snap.gathered:
                self._acknowledge(snap)
            return
        if not snap.gathered:
            return
        self._acknowledge(snap)

    def _acknowledge(self, snap: HeldSnapshot) -> None:
        """Every rank held here: from now on it is a snapshot a restore may use. A replacement (``overwrite=True``
        over a held snapshot) takes its path now, or, while the one it replaces is being written to disk, once
        that write ended (``persisted``): that write's end must find the snapshot it was writing."""
        self.registry.move(snap, AttemptState.HELD)
        snap.held_at = time.monotonic()
        replaced = self.snapshots.replaced_by(snap)
        if replaced is not None and replaced.persisting:
            log.info("event=snapshot_replace_deferred path=%s step=%s reason=persisting", snap.path, snap.step)
            return
        self._take_path(snap)

    def _take_path(self, snap: HeldSnapshot) -> None:
        """``snap`` (complete, acknowledged) is the snapshot of its path: the one it replaces and older ones of its
        job beyond ``--keep-snapshots`` are dropped, then its ranks are told ``HeldInMemory``. A coordinated
        snapshot (several nodes) is complete once this node's ranks are held: its older ones are dropped then as
        well, or a multi-node job's snapshots would pile up until the memory budget refused the next."""
        replaced = self.snapshots.promote(snap)
        dropped: list[tuple[HeldSnapshot, str, CkptdError | None]] = [] if replaced is None else [(
            replaced, "replaced",
            InvalidCheckpoint(f"snapshot {display(snap.path)} was replaced in memory by a newer one (overwrite=True)"))]
        dropped += [(s, "newer", None) for s in self.snapshots.beyond_kept(snap)]
        if snap.coordinated:  # its ranks were told as each was held (the slots dropped now are named in their next
            # HeldInMemory); they agree among themselves
            self._drop_all(dropped)
            self._published_held(snap)
            return
        # Their slots back first, then HeldInMemory: it names every slot they give back, so the trainer reuses them
        self._drop_all(dropped, then=lambda: self._tell_held(snap))
        if snap.persist_waiting or self._left_behind(snap) or self._held_in_drain(snap):
            self.start_persist(snap)

    def _held_in_drain(self, snap: HeldSnapshot) -> bool:
        """Whether ``snap`` (its shards came before the drain began) was held after the drain chose what to
        persist, and is now its directory's newest: persisted too, or a stop lost it while exiting 0. Asked of
        the drain's choice (``drain``), not of the SIGTERM flag: one held between the signal and the drain's
        first pass is the drain's to choose (and its ``drain_persist`` count to include)."""
        return self._drain_deadline is not None and any(s is snap for s in self.snapshots.newest())

    def _left_behind(self, snap: HeldSnapshot) -> bool:
        """Whether ``snap`` took its path after every client of its ranks had gone (a replacement that waited for
        the write of the one it replaced): it is persisted as their exit would have (``client_gone``)."""
        pids = {sh.pid for sh in snap.shards.values()}
        return (self.config.persist_on_exit == "newest" and not any(self.state.pid_connected(p) for p in pids)
                and any(s is snap for p in pids for s in self.snapshots.newest(pid=p)))

    def _published_held(self, snap: HeldSnapshot) -> None:
        """``SnapshotHeld``, once its ranks were told (``events.py``: handlers run after the ranks are answered)."""
        self.events.publish(SnapshotHeld(snap.path, snap.step, snap.nbytes))

    def _tell_held(self, snap: HeldSnapshot) -> None:
        """HeldInMemory to every rank, once the slots it released are back under their names (so the reply can
        name them)."""
        for waiter in snap.waiting:
            self.send(waiter.client, self._held(snap, waiter.request_id, waiter.nbytes, waiter.pid))
        snap.waiting = []
        self._published_held(snap)

    def _held(self, snap: HeldSnapshot, rid: int, nbytes: int, pid: int) -> HeldInMemory:
        return HeldInMemory(rid, str(snap.path), nbytes, time.monotonic() - snap.started_at,
                    self.snapshots.take_released(pid))

    # -- how a snapshot ends (``Registry.end`` hands it here) ------------------------------------------------

    def ended(self, snap: HeldSnapshot, state: AttemptState, error: BaseException | None, reason: str) -> None:
        """``snap`` ended in ``state`` and left the books: every rank and ``persist`` still waiting is answered
        (``error``; a drop without one says why it was dropped), its slots go back (a dropped one a reader pins is
        parked until it unpins), and its end is published last (``SnapshotDropped`` with ``reason``, or
        ``SnapshotFailed``)."""
        if state is AttemptState.FAILED:
            failure = as_error(self.state.stats, error if error is not None else InternalError("failed"))
            log.warning("event=snapshot_failed path=%s error=%s", snap.path, failure.message)
            self.registry.remember_failure(snap, failure)
            self._answer_persists(snap, failure)
            self._tell_when_back(snap, failure)  # the slots still being checksummed: when checksummed
            self.events.publish(SnapshotFailed(snap.path, snap.step, failure))
            return
        log.info("event=snapshot_dropped path=%s step=%s reason=%s", snap.path, snap.step, reason)
        why = as_error(self.state.stats, error) if error is not None else InvalidCheckpoint(
            f"snapshot {display(snap.path)} was dropped from memory ({reason})")
        self._answer_persists(snap, why)
        snap.ended_with = why  # a late rank of its node still being checksummed (``takes_late_rank``) is told
        # when its checksum ends and its slot is back (``_checksummed``), never handed back twice
        unchecked = [r for r, sh in snap.shards.items() if sh.checksum is None]
        for waiter in [w for w in snap.waiting if w.rank not in unchecked]:
            snap.answered(waiter.client, waiter.request_id)
            self.send(waiter.client, Error.of(waiter.request_id, why))
        for rank in unchecked:
            del snap.shards[rank]
        if snap.readers:
            log.info("event=snapshot_drop_deferred path=%s step=%s readers=%d", snap.path, snap.step,
                     sum(snap.readers.values()))
            self.registry.releasing(snap)
        else:
            self._release(list(snap.shards.values()))
        self.events.publish(SnapshotDropped(snap.path, snap.step, reason, tuple(sorted(snap.shards))))

    def _drop_all(self, dropped: list[tuple[HeldSnapshot, str, CkptdError | None]],
                  then: Callable[[], None] | None = None) -> None:
        """End each of ``dropped`` (a snapshot, why, what its persists are told), then ``then`` on the loop once
        all their slots are back: the releases run in order on the one maintenance thread, so a no-op queued
        after them completes after theirs."""
        for snap, reason, error in dropped:
            self.registry.end(snap, AttemptState.DROPPED, error, reason=reason)
        if then is None:
            return
        if not dropped:
            then()
            return

        def undone(exc: BaseException) -> None:
            as_error(self.state.stats, exc)
            then()
        self.workers.submit("maintenance", lambda: None, lambda _: then(), undone)

    def _return_unheld(self, shards: list[HeldShard], then: Callable[[], None] = lambda: None) -> None:
        """Slots of a snapshot that failed before its ranks were told ``HeldInMemory``: their clients still count
        them as their own (no ``released`` entry), and a gone client's is unlinked (``_hand_back``); ``then`` runs
        on the loop once they are back (or their hand-back raised)."""
        if not shards:
            then()
            return
        stats = self.state.stats

        def failed(exc: BaseException) -> None:
            logged(stats)(exc)
            then()
        self._hand_back(shards, lambda back, fut: then(), failed)

    def _tell_when_back(self, snap: HeldSnapshot, error: CkptdError) -> None:
        """Tell ``snap``'s waiting ranks ``error``: one whose slot the daemon took over (checksummed, so renamed
        to the daemon's own name) once it is back under its name, as its client reuses it the moment it is told
        (its retry's admission would not find it: ``BadSlot``); one still being checksummed when that ends
        (``_checksummed``: ``snap.ended_with``); any other (its shard never joined) now."""
        snap.ended_with = error
        taken = {r for r, sh in snap.shards.items() if sh.checksum is not None}
        checking = {r for r, sh in snap.shards.items() if sh.checksum is None}
        later = [w for w in snap.waiting if w.rank in taken]
        now = [w for w in snap.waiting if w.rank not in taken and w.rank not in checking]
        snap.waiting = [w for w in snap.waiting if w.rank in checking]
        for waiter in now:
            self.send(waiter.client, Error.of(waiter.request_id, error))

        def tell() -> None:
            for waiter in later:
                self.send(waiter.client, Error.of(waiter.request_id, error))
        self._return_unheld([snap.shards[r] for r in sorted(taken)], tell)

    def _tell_ended(self, snap: HeldSnapshot, ident: bytes, rid: int) -> None:
        """A rank of ``snap``, which ended meanwhile, whose slot is back: told why, if it still waits."""
        if snap.ended_with is not None and any((w.client, w.request_id) == (ident, rid) for w in snap.waiting):
            snap.answered(ident, rid)
            self.send(ident, Error.of(rid, snap.ended_with))

    def _hand_back(self, shards: list[HeldShard], done: Callable[[list[HeldShard], Future], None],
                   failed: Callable[[BaseException], None]) -> None:
        """A connected client's slot goes back under its old name, a gone one's is unlinked (its name would be a
        dead process's segment that nothing reclaims any more); ``done(back, future)`` runs on the loop after,
        ``failed(exc)`` if it raised."""
        slots = self.state.slots
        back = [sh for sh in shards if self.state.pid_connected(sh.pid)]
        gone = [sh for sh in shards if sh not in back]
        for shard in gone:
            slots.release(shard.slot)
        names = [sh.slot.name for sh in gone]

        def work() -> None:
            _unlink(slots.shm_dir, names)
            for sh in back:
                slots.give_back(sh.slot, sh.msg.slot)
        self.workers.submit("maintenance", work, lambda fut: done(back, fut), failed)

    # -- the registry's housekeeping (``registry.Registry``) -------------------------------------------------

    def attempts(self) -> list[HeldSnapshot]:
        return self.snapshots.all()

    def tidy(self, now: float) -> None:
        """Nothing of its own: a snapshot's life after it is held is the budget's and its readers'."""

    def pin(self, ident: bytes, msg: Pin) -> SnapshotList:
        """A reader's lease on a held snapshot: its listing, its slots kept as they are until ``Unpin``."""
        self.state.client(ident)  # a reader that said hello: its death ends its pins (``reader_gone``)
        snap = self.snapshots.pin(ident, Path(msg.path))
        return SnapshotList(msg.id, () if snap is None else (snap.describe(),))

    def unpin(self, ident: bytes, msg: Unpin) -> Ok:
        self.unpin_for(ident, Path(msg.path))
        return Ok(msg.id)

    def unpin_for(self, reader: bytes, path: Path) -> None:
        """End one pin of ``path`` by ``reader`` (a reader's ``Unpin``, or a stream to the buddy that ended)."""
        self._release(shards_of(self.snapshots.unpin(reader, path)))

    def hold_restored(self, path: Path, created: float, shards: list[tuple[Snapshot, str, int, mmap.mmap, int]],
                      *, peer: str = "", replication: ReplicationState = ReplicationState.RESTORED) -> HeldSnapshot:
        """Hold a snapshot read back from ``peer``'s replica (``peers/replication.py``), every shard checked: its
        ranks' ``Snapshot`` messages as the origin admitted them, and the files of this daemon's own that hold
        them (name, fd, mapping, checksum). It is held as its origin held it, complete; ``CheckpointExists`` if a
        snapshot of the path is held here meanwhile, ``NoSpace`` if it does not fit the budget.
        ``replication`` ``ADOPTED`` (and no ``peer``): a replica held here for a peer that is gone, about to be
        persisted by a drain (``Replication.drain``). Its copy (``PeerCopy``) starts there: ``restored`` on
        ``peer`` with the shards' checksums (what that peer must still list), or ``adopted``."""
        if self.snapshots.opening(path) is not None or not shards:
            raise CheckpointExists(f"snapshot {display(path)} is held here already; the replica is not restored")
        first = shards[0][0]
        self.snapshots.make_room(path, sum(msg.nbytes for msg, *_ in shards))
        checksums = tuple(sorted((msg.rank, checksum) for msg, *_, checksum in shards))
        snap = HeldSnapshot(path=path, backend=self.storage.bind(path), world_size=first.world_size, step=first.step,
                            coordinated=first.coordinated, created=created, contributors=Contributors(first.job),
                            copy=PeerCopy(replication, peer, checksums=checksums if peer else ()),
                            restored_from=peer)
        for msg, name, fd, mapping, checksum in shards:
            slot = MappedSlot(name, os.fstat(fd).st_ino, max(1, msg.nbytes), mapping, fd, users=1)
            snap.shards[msg.rank] = HeldShard(msg, slot, os.getpid(), checksum=checksum)
        self.registry.open(self.snapshots.current, snap)
        self.registry.move(snap, AttemptState.HELD)
        snap.held_at = time.monotonic()
        self._published_held(snap)
        return snap

    def in_the_way_of_delete(self, final: Path) -> str | None:
        """Why a trainer's ``Delete`` of ``final`` must wait: a snapshot of it still being taken, replaced or
        written to disk (None: none is)."""
        snap = self.snapshots.opening(final)
        if snap is not None and (snap.open or snap.persisting or self.snapshots.replacing.get(final) is snap):
            return f"a memory snapshot of it is being {'written to disk' if snap.persisting else 'taken'}"
        return None

    def deleted_on_request(self, final: Path) -> None:
        """A trainer deleted ``final`` (``Client.delete``): the snapshot held of it goes too, or it would be
        listed, loaded, and persisted again on exit, as if the delete had not happened."""
        snap = self.snapshots.current.get(final)
        if snap is None or not snap.acknowledged or snap.persisting:
            return
        self.registry.end(snap, AttemptState.DROPPED,
                          InvalidCheckpoint(f"snapshot {display(final)} was deleted (client.delete)"), reason="deleted")

    def reader_gone(self, ident: bytes) -> None:
        """A connection closed or its process died: its pins end."""
        self._release(shards_of(self.snapshots.unpin(ident)))

    def _release(self, shards: list[HeldShard], then: Callable[[], None] = lambda: None) -> None:
        """Drop held shards: a live, connected client gets its slot back (under its old name, named in its next
        ``HeldInMemory``), others' are unlinked; ``then`` runs on the loop once that is done."""
        slots = self.state.slots

        def done(back: list[HeldShard], fut: Future) -> None:
            if fut.exception() is not None:
                log.warning("event=release_failed error=%r", fut.exception())
            left = [sh.msg.slot for sh in back if not self.state.pid_connected(sh.pid)]  # went meanwhile
            for sh in back:
                if sh.msg.slot not in left:
                    self.snapshots.released.setdefault(sh.pid, []).append(sh.msg.slot)
            if left:
                self.workers.background("maintenance", lambda: _unlink(slots.shm_dir, left))
            then()

        def undone(exc: BaseException) -> None:  # ``done`` raised (a defect): those waiting on ``then`` (ranks owed
            # their HeldInMemory, a closing client its Ok) are answered still
            as_error(self.state.stats, exc)
            then()
        if shards:
            self._hand_back(shards, done, undone)
        else:
            then()

    def abort(self, ident: bytes, msg: Abort) -> None:
        """A rank of run ``msg.job`` gave up on a save of ``msg.path``; Ok follows. A snapshot of that run still
        gathering its ranks there fails on every rank at once (``ckptd.dcp.StorageWriter`` aborts when a rank's
        shard never came, so the others do not wait for their timeout); anything else is a coordinated disk
        attempt's Abort (``Saves.abort_at``). A held snapshot being written to disk is not: that write is the
        daemon's own (its ranks were answered), so an Abort, which ends an attempt whose ranks are gathering, never
        fails it (it was taken for the persist's disk attempt, and the persist failed with ``RanksMissing``)."""

        def abort(final: Path) -> None:
            candidates = (self.snapshots.replacing.get(final), self.snapshots.current.get(final))
            snap = next((s for s in candidates if s is not None and s.open and s.contributors.job == msg.job), None)
            held = self.snapshots.current.get(final)
            if snap is None and held is not None and held.persisting:
                log.info("event=abort_ignored path=%s job=%r reason=%s why=persisting_held_snapshot", final, msg.job,
                         msg.reason)
                self.send(ident, Ok(msg.id))
                return
            if snap is None:
                self.saves.abort_at(ident, msg, final)
                return
            self.registry.end(snap, AttemptState.FAILED,
                              RanksMissing(f"snapshot {display(final)} was aborted: {msg.reason}"), reason="aborted")
            self.send(ident, Ok(msg.id))

        self.saves.resolve_then(ident, msg.id, msg.path, abort)

    # -- what is held -----------------------------------------------------------

    def listing(self, ident: bytes, msg: ListSnapshots) -> SnapshotList:
        return SnapshotList(msg.id, self.snapshots.listing())

    # -- persisting ----------------------------------------------------------------

    def persist(self, ident: bytes, msg: Persist) -> None:
        """Write held snapshot ``msg.path`` to disk; Done (or Error) follows once it is committed.

        Idempotent, so every rank may ask: a snapshot still missing ranks is
        persisted once complete, one being persisted answers when it is
        committed, one already persisted answers at once.
        """
        self.saves.resolve_then(ident, msg.id, msg.path, lambda final: self._persist_resolved(ident, msg.id, final))

    def _persist_resolved(self, ident: bytes, rid: int, final: Path) -> None:
        snap = self.snapshots.current.get(final)
        if snap is None:
            self.send(ident, error_reply(self.state.stats, rid, InvalidCheckpoint(
                f"the daemon holds no snapshot {final} in memory; held: "
                f"{', '.join(str(p) for p in self.snapshots.current) or 'none'}")))
            return
        if snap.coordinated:
            self.send(ident, error_reply(self.state.stats, rid, WriteFailed(
                f"snapshot {final} spans several nodes; persisting it is not supported: save with persist=True")))
            return
        if snap.persisted:
            self.send(ident, Done(rid, str(snap.path), snap.nbytes, 0.0))
            return
        snap.persist_waiting.append((ident, rid))
        if snap.acknowledged and not snap.persisting:
            self.start_persist(snap)
        # else: started when the snapshot is complete (``_checksummed``), answered when it is committed

    def start_persist(self, snap: HeldSnapshot) -> None:
        """Hand every held shard of ``snap`` to the save pipeline; ``persist_ended`` answers its waiters."""
        self.registry.move(snap, AttemptState.PERSISTING)
        snap.persist_started = time.monotonic()
        log.info("event=persist path=%s step=%s", snap.path, snap.step)
        backend, final, order = snap.backend, snap.path, snap.order
        world_size, fingerprint = snap.world_size, snap.fingerprint
        overwrite = snap.shards[min(snap.shards)].msg.overwrite

        def look() -> tuple[Space, Path | None, bool]:
            there = backend.holds_same(final, world_size, fingerprint)
            if not there:  # what came to its name since it was held (a directory a user made) refuses it now, as
                backend.admit(final, overwrite)  # a disk save's admission would, before a byte is written
            return backend.space(final.parent), backend.newer_beside(final, order), there
        self.workers.submit("admit", look, lambda fut: self._persist_looked(snap, fut),
                            failed=lambda exc: self.persist_ended(snap, as_error(self.state.stats, exc)))

    def _persist_looked(self, snap: HeldSnapshot, fut: Future) -> None:
        exc = fut.exception()
        if exc is not None:
            self.persist_ended(snap, exc if isinstance(exc, CkptdError) else WriteFailed(
                f"cannot persist {snap.path}: {exc}"))
        elif snap.persisting:
            space, newer, there = fut.result()
            if there:
                self._committed_by_another(snap)
            elif newer is None:
                self.saves.write_held(snap, space, lambda error: self.persist_ended(snap, error))
            else:
                self._outranked(snap, newer)

    def _committed_by_another(self, snap: HeldSnapshot) -> None:
        """Its path holds exactly its bytes, committed by another holder of them (its buddy's drain judged this
        node gone while it did not answer, or a node restored from that buddy): persisted, and no loss."""
        log.info("event=snapshot_not_persisted path=%s reason=committed_by_another", snap.path)
        self._end_persist(snap, None)

    def _outranked(self, snap: HeldSnapshot, newer: Path) -> None:
        """A checkpoint newer than ``snap`` (by step, then time) is committed beside it: ``snap`` is not persisted.

        Persisted, it would never be ``latest``, and retention would count it,
        written last, as newer than the checkpoint committed after it, and
        delete that one. An explicit ``persist`` is refused saying so; one the
        daemon began itself (its trainer gone, a drain) drops the snapshot, as
        its directory's newest state is on disk: nothing acknowledged is lost,
        and a spawned daemon is not kept from exiting by it.
        """
        self.registry.move(snap, AttemptState.HELD)
        log.info("event=snapshot_not_persisted path=%s step=%s reason=newer_on_disk newer=%s", snap.path, snap.step,
                 newer)
        self._answer_persists(snap, CheckpointExists(
            f"snapshot {display(snap.path)} (step {snap.step}) is not persisted: {display(newer)}, committed beside "
            f"it, is newer (by step, then time); persisted, it would never be latest(), and keep_last would count it "
            f"as newer than {display(newer)}. Save it with persist=True under a step above that checkpoint's"))
        replacing = self.snapshots.replacing.get(snap.path)
        if replacing is not None and replacing.acknowledged:  # it waited for this persist to end: it drops ``snap``
            self._take_path(replacing)
        elif self.state.draining or not any(self.state.pid_connected(sh.pid) for sh in snap.shards.values()):
            self.registry.end(snap, AttemptState.DROPPED, reason="older_than_disk")

    def committed(self, event: Committed) -> None:
        """A disk save committed ``event.path``: a snapshot held of that path is older than it, and is dropped so
        it never shadows it (a snapshot's own persist ends through ``persist_ended``, not this event)."""
        if event.snapshot:
            return
        path = event.path
        snap = self.snapshots.current.get(path)
        if snap is None or snap.persisting:
            return
        why = InvalidCheckpoint(f"snapshot {path} was dropped from memory: a disk save committed the same path")
        replacing = self.snapshots.replacing.get(path)
        if replacing is not None:  # older than that save, as the one it was to replace
            self.registry.end(replacing, AttemptState.FAILED, why)
        self.registry.end(snap, AttemptState.DROPPED if snap.acknowledged else AttemptState.FAILED, why,
                          reason="saved_to_disk")

    def deleted(self, event: Deleted) -> None:
        """Retention deleted the disk copy of a persisted snapshot still held: the snapshot goes from memory too,
        as with a trainer's delete. Retention judged it older than the checkpoints its directory keeps; held on,
        an exit or a drain persisted it again as its directory's newest snapshot, and that persist's own
        retention then deleted a newer checkpoint (found by a new-user pass: step-14 came back, step-15 went)."""
        snap = self.snapshots.current.get(event.path)
        if snap is None or not snap.persisted:
            return
        self.registry.end(snap, AttemptState.DROPPED, reason="retention_deleted_disk_copy")

    def persist_ended(self, snap: HeldSnapshot, error: CkptdError | None) -> None:
        """The write of ``snap`` to disk committed (``error`` None) or failed: the save pipeline calls this
        directly (its attempt's ``HeldBytes.ended``), as do the persist's own checks before it.

        A defect here is an internal error its persist's waiters are told,
        and the snapshot is held again (a drain, an exit or a ``persist()``
        tries again): never left ``persisting`` for ever.
        """
        try:
            self._judge_persist_end(snap, error)
        except BaseException as exc:
            internal = as_error(self.state.stats, exc)
            log.error("event=persist_end_failed path=%s error=%s", snap.path, internal.message)
            if snap.persisting:
                self.registry.move(snap, AttemptState.HELD)
            self._answer_persists(snap, internal)
            self._replacement_in(snap.path)

    def _judge_persist_end(self, snap: HeldSnapshot, error: CkptdError | None) -> None:
        if self.snapshots.current.get(snap.path) is not snap or not snap.persisting:
            return
        path = snap.path
        if isinstance(error, CheckpointExists):  # another holder of the same bytes may have committed them first
            backend, world_size, fingerprint = snap.backend, snap.world_size, snap.fingerprint

            def judged(same: bool) -> None:
                if self.snapshots.current.get(path) is snap and snap.persisting:
                    self._committed_by_another(snap) if same else self._end_persist(snap, error)
            self.workers.submit("admit", lambda: backend.holds_same(path, world_size, fingerprint),
                                lambda fut: judged(fut.result()), failed=lambda _: judged(False))
            return
        self._end_persist(snap, error)

    def _end_persist(self, snap: HeldSnapshot, error: CkptdError | None) -> None:
        """``snap``'s persist committed (``error`` None) or failed: persisted, or held again and retried by a
        drain while its deadline allows; its waiters answered; a replacement that waited for it takes the path."""
        path = snap.path
        self.registry.move(snap, AttemptState.PERSISTED if error is None else AttemptState.HELD)
        if error is not None:
            log.warning("event=persist_failed path=%s draining=%s error=%s", path, self.state.draining, error.message)
            self.state.stats.error(f"persisting snapshot {path} failed: {error.message}")
            if self.state.draining and _transient(error) and self._retry_in_drain(snap):
                return  # its waiters are answered by the last attempt
            if self.state.draining:
                self.drain_failures.append(f"{display(path)}: {error.message}")
        self._answer_persists(snap, error)
        self._replacement_in(path)

    def _replacement_in(self, path: Path) -> None:
        """A write of the snapshot at ``path`` ended, however: a complete replacement that waited for it
        (``_acknowledge``) takes the path now."""
        replacing = self.snapshots.replacing.get(path)
        if replacing is not None and replacing.acknowledged:
            self._take_path(replacing)

    def _retry_in_drain(self, snap: HeldSnapshot) -> bool:
        """Persist ``snap`` again after a backoff if the drain's deadline allows (a write may fail for a moment:
        an endpoint restarting); the wait runs on the maintenance pool, so the drain waits for it."""
        attempt = self._drain_attempts.get(snap.path, 0) + 1
        delay = DRAIN_RETRY_S * 2 ** (attempt - 1)
        if self._drain_deadline is None or time.monotonic() + delay >= self._drain_deadline:
            return False
        self._drain_attempts[snap.path] = attempt
        log.info("event=persist_retry path=%s attempt=%d in_s=%g", snap.path, attempt + 1, delay)

        def again(_: Future) -> None:
            if self.snapshots.current.get(snap.path) is snap and not snap.persisting and not snap.persisted:
                self.start_persist(snap)

        self.workers.submit("maintenance", lambda: time.sleep(delay), again,
                            failed=lambda exc: self.persist_ended(snap, as_error(self.state.stats, exc)))
        return True

    def _answer_persists(self, snap: HeldSnapshot, error: CkptdError | None) -> None:
        for ident, rid in snap.persist_waiting:
            if error is None:
                self.send(ident, Done(rid, str(snap.path), snap.nbytes, time.monotonic() - snap.persist_started))
            else:
                self.send(ident, Error.of(rid, error))
        snap.persist_waiting = []

    def client_gone(self, pid: int, then: Callable[[], None] = lambda: None) -> None:
        """A client closed or died: persist its newest snapshot, unlink the slots it was owed back; ``then`` on the
        loop once they are unlinked."""
        if self.config.persist_on_exit == "newest":
            for snap in self.snapshots.newest(pid=pid):
                if not any(self.state.pid_connected(sh.pid) for sh in snap.shards.values()):
                    self.start_persist(snap)
        if not self.state.pid_connected(pid):
            self._trim_slots(pid)
        owed = list(self.snapshots.released.pop(pid, []))
        if not owed:
            then()
            return
        self.workers.submit("maintenance", lambda: _unlink(self.state.slots.shm_dir, owed), lambda _: then(),
                            failed=lambda _: then())

    def _trim_slots(self, pid: int) -> None:
        """Gone client ``pid``'s held slots shrink to the whole pages of the shards they hold (``SlotMaps.trim``; a
        write with O_DIRECT reads the last page whole), where that gives back at least ``TRIM_MIN_BYTES``; a slot
        still being taken over (not checksummed) keeps its client's name and is left alone."""
        shards = [sh for snap in self.snapshots.all() for sh in snap.shards.values() if sh.pid == pid
                  and sh.checksum is not None and sh.slot.size - round_up(sh.msg.nbytes) >= TRIM_MIN_BYTES]
        if not shards:
            return
        slots = self.state.slots

        def trimmed(fut: Future) -> None:
            log.info("event=slots_trimmed pid=%d slots=%d bytes=%d", pid, len(shards), fut.result())
        self.workers.submit("maintenance", lambda: sum(slots.trim(sh.slot, round_up(sh.msg.nbytes)) for sh in shards),
                            trimmed, failed=logged(self.state.stats))

    def exited(self, snaps: list[HeldSnapshot]) -> None:
        """The daemon exits (its loop is over, its workers closed; ``Registry.close`` hands over ``snaps``: held
        and replacing, out of the books, and dropped ones a reader still pinned): no slot it took over outlives it.

        This unlinks on the calling thread: maintenance may have been
        abandoned at the drain deadline (a stalled store request ahead of
        it), and its thread dies with the process, so unlinks queued there
        would leave gigabytes in ``/dev/shm``. What goes: the slots still
        held (the newest snapshots were persisted while it drained), the
        slots owed back to clients that were not told yet, and every slot
        still under this daemon's own name (a release or give-back queued
        behind abandoned maintenance).
        """
        held = shards_of(snaps)  # the parked ones too (``Registry.close``)
        owed = [n for names in self.snapshots.released.values() for n in names]
        self.snapshots.released.clear()
        for shard in held:  # a shard never taken over keeps its client's name: the client's to unlink
            self.state.slots.release(shard.slot)
        _unlink(self.state.slots.shm_dir, owed)
        own = self.state.slots.reclaim(os.getpid())
        log.info("event=slots_unlinked held=%d owed=%d own=%d", len(held), len(owed), own)

    def drain(self) -> None:
        """SIGTERM: persist the newest snapshot of every directory before the daemon exits."""
        newest = self.snapshots.newest()
        self._drain_deadline = time.monotonic() + self.config.drain_timeout
        log.info("event=drain_persist snapshots=%d deadline_s=%g", len(newest), self.config.drain_timeout)
        for snap in newest:
            self.start_persist(snap)
        for snap in self.snapshots.newest_of_several_nodes():
            self._lost_in_drain(snap)

    def _lost_in_drain(self, snap: HeldSnapshot) -> None:
        """``snap``, its directory's newest, spans several nodes: no drain persists it (this node holds its ranks'
        share only), so unless a checkpoint newer than it is committed beside it, it is lost with the daemon's
        memory, and ``ckptd stop`` exits 3 naming it (as it does for a snapshot of one node a drain could not
        persist) instead of exiting 0 as if nothing held were lost."""
        backend, final, order = snap.backend, snap.path, snap.order
        why = (f"a snapshot of several nodes (this node held {len(snap.shards)} of its {snap.world_size} ranks): "
               f"a drain persists one node's snapshots only, so this node's share is lost with its memory (a state "
               f"a stop must keep is saved with persist=True)")

        def judged(fut: Future) -> None:
            newer = fut.result()
            if newer is not None:
                log.info("event=snapshot_not_persisted path=%s step=%s reason=newer_on_disk newer=%s", final,
                         snap.step, newer)
                return
            log.error("event=drain_not_persisted path=%s step=%s reason=spans_nodes", final, snap.step)
            self.drain_failures.append(f"{display(final)}: {why}")

        def unjudged(exc: BaseException) -> None:
            self.drain_failures.append(f"{display(final)}: {why} (and whether a newer checkpoint is on disk "
                                       f"could not be read: {as_error(self.state.stats, exc).message})")
        self.workers.submit("admit", lambda: backend.newer_beside(final, order), judged, failed=unjudged)


def _examine(storage: Backends, slots: SlotMaps, msg: Snapshot, *, pid: int,
             roots: tuple[Path, ...]) -> Examined:
    """A disk save's checks, and those a disk save makes only when it writes (``Checkpoints.persistable``): a
    snapshot that could never be persisted is refused now, not when its trainer dies or the daemon drains (I/O)."""
    examined = examine(storage, slots, msg, pid=pid, roots=roots)
    try:
        examined.backend.persistable(examined.final, msg.overwrite)
    except BaseException:
        slots.release(examined.slot)
        raise
    return examined


def _transient(error: CkptdError) -> bool:
    """Whether a failed write may succeed if tried again: the storage's error behind it is not permanent."""
    cause = error.__cause__ or error.__context__
    return (isinstance(error, WriteFailed) and isinstance(cause, OSError) and not isinstance(cause, CkptdError)
            and not is_permanent(cause))


def _unlink(directory: Path, names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            pass

