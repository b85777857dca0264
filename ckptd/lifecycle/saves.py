"""The save pipeline: from a rank's WriteShard to its Done, one step per worker pool.

::

    WriteShard ──admit pool: examine (path, slot, header, free space)
           ──loop: room check, bookkeeping ──admit pool: remember the parent, prepare p.incomplete (first rank)
           ──loop: Accepted ──write pool: shard to disk, fsync ──loop: Durable / all ranks in?
           ──commit pool: index, rename, fsync parent ──loop: Done, then ``Committed`` (``events.py``)

A failure at any step fails the whole checkpoint: every rank is told, and
once no shard of it is being written its ``.incomplete`` directory is
renamed aside on the admit pool (so a retry of the same path, admitted after
that on the same FIFO thread, can never lose its directory to the cleanup)
and removed on the maintenance pool. Until the rename, a retry of that path
waits (the failed attempt is releasing: ``Registry.after_release``).

Every method runs on the loop thread; the work it hands to the pools is
the only I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from ckptd.protocol.errors import CkptdError, InternalError, RanksMissing, ShuttingDown, WriteFailed
from ckptd.protocol.index import ShardRecord, shard_name
from ckptd.protocol.messages import Abort, Accepted, Done, Durable, Finalize, Message, Ok, StagedShard, WriteShard
from ckptd.protocol.objects import display, is_permanent

from ckptd.core.config import DaemonConfig
from ckptd.core.events import Committed, Events, Failed
from ckptd.core.replies import as_error, error_reply, logged
from ckptd.core.workers import Workers
from ckptd.lifecycle.admission import Examined, check_room, examine
from ckptd.lifecycle.attempt import AttemptState
from ckptd.lifecycle.commit import PendingCheckpoint
from ckptd.lifecycle.contributors import Contributors
from ckptd.lifecycle.snapshots import HeldSnapshot
from ckptd.lifecycle.state import NodeState
from ckptd.lifecycle.writer import Progress, ShardWrite, WriteState, write_shard
from ckptd.storage.backends import Backends
from ckptd.storage.contract import Space
from ckptd.upkeep.sweep import KnownDirs

log = logging.getLogger("ckptd")
DISCARD_RETRY_S = 1.0
"""A failed attempt whose removal failed for a transient reason (a store down) is removed again after this
long, doubling up to ``MAX_DISCARD_RETRY_S``; its path takes no new save until then."""
MAX_DISCARD_RETRY_S = 30.0
LOOK_INTERVAL_S = 5.0
"""How often housekeeping looks whether settled attempts ended on another node's daemon (one request each)."""
Send = Callable[[bytes, Message], None]
Examine = Callable[..., Examined]
"""``admission.examine`` or a stricter one with its signature (storage, slots, msg, *, pid, roots)."""
Admit = Callable[..., None]
"""What takes an examined shard on the loop: (ident, msg, progress, examined, *, pid)."""

UNCLAIMED = "its contributors all died"
"""Why a settled attempt is let go when no rank of its run is left to Finalize or Abort it (``ended`` gives up this
daemon's part of its directory then)."""


class Saves:
    """Moves saves through the pipeline above; replies through ``send``."""

    kind = PendingCheckpoint
    """The attempts it runs, which ``Registry.end`` hands to ``ended``."""

    def __init__(self, state: NodeState, workers: Workers, storage: Backends, config: DaemonConfig,
                 send: Send, known_dirs: KnownDirs, events: Events) -> None:
        self.state, self.workers, self.storage, self.config = state, workers, storage, config
        self.registry = state.attempts
        """The registry: the only way one of its attempts moves or ends."""
        self.send = send
        self.known_dirs = known_dirs
        self.events = events
        """Told when a checkpoint commits or fails: stats, the mirror, retention and the memory tier react."""
        self._discards: dict[Path, int] = {}
        """Failed removals of attempts, by path: how many so far."""
        self._looking = False
        """Whether housekeeping's look for settled attempts that ended elsewhere is in flight (``_let_go_ended``)."""
        self._next_look = 0.0

    # -- admission ------------------------------------------------------------

    def write_shard(self, ident: bytes, msg: WriteShard) -> None:
        """Start admitting one rank's shard; Accepted (or Error) follows.

        Whether the daemon was draining is judged now, on arrival: a shard
        that came before a stop is drained, however long its examination
        takes (20,000 tensors on a loaded node), never refused as new."""
        draining = self.state.draining
        self.enter(ident, msg, examine,
                   lambda *args, **kw: self.admit_examined(*args, arrived_draining=draining, **kw))

    def enter(self, ident: bytes, msg: StagedShard, examine: Examine, then: Admit) -> None:
        """The one way in for a rank's shard, to disk or to memory (``Snapshot``): count it, track its staging,
        examine it on the admit pool, then ``then`` on the loop, or an Error reply if the examination refused it."""
        client = self.state.client(ident)
        progress = self.state.begin_save(ident, client, msg, deadline=time.monotonic() + msg.timeout)
        pid, slots, roots = client.pid, self.state.slots, self.config.roots

        def examined(fut: Future) -> None:
            if fut.exception() is not None:
                self.refuse(ident, msg, fut.exception())
            else:
                then(ident, msg, progress, fut.result(), pid=pid)

        self.workers.submit("admit", lambda: examine(self.storage, slots, msg, pid=pid, roots=roots), examined,
                            failed=lambda exc: self.refuse(ident, msg, exc))

    def staged(self, ident: bytes, upto: int, error: str | None, request_id: int) -> None:
        progress = self.state.staging.get((ident, request_id))
        if progress is None:
            return  # that save already ended (refused or failed): the notice is moot
        if error:
            progress.fail(f"the client reported: {error}")
        else:
            progress.advance(upto)

    def refuse(self, ident: bytes, msg: StagedShard, exc: BaseException) -> None:
        """A rank's shard is not taken: its save ends, it is told why, and the log says so."""
        self.state.end_save(ident, msg.id)
        reply = error_reply(self.state.stats, msg.id, exc)
        log.warning("event=refused type=%s path=%s rank=%d error=%s", msg.type, msg.path, msg.rank, reply.message)
        self.send(ident, reply)

    def admit_examined(self, ident: bytes, msg: StagedShard, progress: Progress, examined: Examined, *, pid: int,
                       looked: bool = False, arrived_draining: bool | None = None) -> None:
        """Queue an examined shard's write, sent by process ``pid``.

        ``looked``: a settled attempt of another run at the path was found
        not to have ended elsewhere (``_look_then``), so the rank is refused.
        ``arrived_draining``: whether the daemon was draining when the shard
        arrived (None: judge by now).
        """
        state, final = self.state, examined.final
        current = state.commits.pending.get(final)
        if current is not None and current.held is None:
            if not self.registry.end_orphaned(current, msg.job):
                self._let_go_unclaimed(current)
            if current.settled and msg.job != current.contributors.job and not looked:
                self._look_then(current, lambda: self.admit_examined(ident, msg, progress, examined, pid=pid,
                                                                     looked=True, arrived_draining=arrived_draining),
                                failed=lambda exc: self.refuse(ident, msg, exc))
                return
            conflict = current.broken_by(msg)
            if conflict is not None:  # the run's save is broken: every rank is told, this one included
                self.registry.end(current, AttemptState.FAILED, conflict)
                state.slots.release(examined.slot)
                self.refuse(ident, msg, conflict)
                return
        again = lambda: self.admit_examined(ident, msg, progress, examined, pid=pid,  # noqa: E731
                                            arrived_draining=arrived_draining)
        if self.registry.after_release(PendingCheckpoint, final, again):
            return  # a failed attempt's directory is still in the way: admitted once it is not
        try:
            draining = state.draining if arrived_draining is None else arrived_draining
            if draining and final not in state.commits.pending:
                raise ShuttingDown("the daemon is draining and accepts no new saves (only missing ranks of "
                                   "checkpoints already in progress)")
            state.snapshots.refuse_nested(final)
            self._check_room(final, examined.space, msg.nbytes, examined.shm_free)
            pending, dest = state.commits.admit(msg, ident, final, pid, examined.backend)
        except BaseException as exc:
            state.slots.release(examined.slot)
            self.refuse(ident, msg, exc)
            return
        write = ShardWrite(ident, msg, examined.slot, dest, pending.path, progress, device=examined.space.device)
        log.info("event=admitted path=%s rank=%d bytes=%d", pending.path, msg.rank, msg.nbytes)
        # The daemon holds the save now (its slot mapped, its write listed): the client may go on, before the
        # checkpoint's directory exists (a failure to make it fails the save through its future).
        self.send(ident, Accepted(msg.id))
        self._queue(write, pending)

    def write_held(self, snap: HeldSnapshot, space: Space, ended: Callable[[CkptdError | None], None]) -> None:
        """Write held snapshot ``snap`` to disk (``space``: its parent's room): the disk side of its ``persisting``.

        Its shards are already in the daemon's slots, so nothing is admitted
        rank by rank: one attempt with every rank in (``Commits.open_held_write``),
        refused or failed as a whole, even while draining; each shard must
        write with the checksum it was held with (``HeldBytes``). ``ended``
        (the memory tier's) is told how it ended, once, directly; then the
        subscribers learn it as ``Committed`` or ``Failed``, like any save's.
        """
        state, final = self.state, snap.path
        if self.registry.after_release(PendingCheckpoint, final, lambda: self.write_held(snap, space, ended)):
            return
        try:
            self._check_room(final, space, snap.nbytes)
            pending = state.commits.open_held_write(snap, ended)
        except BaseException as exc:
            ended(as_error(state.stats, exc))
            return
        log.info("event=admitted path=%s ranks=%d bytes=%d persist=true", final, len(snap.shards), snap.nbytes)
        for rank, shard in sorted(snap.shards.items()):
            state.slots.share(shard.slot)  # the write releases it; the snapshot keeps its own hold
            msg = dataclasses.replace(shard.msg, id=0, coordinated=False)
            progress = Progress(msg.nbytes, msg.nbytes, deadline=math.inf)
            dest = pending.incomplete / shard_name(rank, snap.world_size)
            self._queue(ShardWrite(b"", msg, shard.slot, dest, final, progress, device=space.device), pending)

    def _check_room(self, final: Path, space: Space, nbytes: int, shm_free: int | None = None) -> None:
        """Refuse ``nbytes`` more for ``final`` unless its device keeps its margin after the writes in flight
        (and /dev/shm its own, where the staging slot is new: ``shm_free``)."""
        cfg = self.config
        check_room(final, space, nbytes, self.state.reserved_on(space.device),
                   margin_fraction=cfg.space_margin_fraction, margin_min=cfg.space_margin_bytes,
                   shm_min_free=cfg.shm_min_free, shm_free=shm_free)

    def _queue(self, write: ShardWrite, pending: PendingCheckpoint) -> None:
        """List an admitted write and start it, or queue it until ``pending``'s directory is made (first rank)."""
        self.state.writes.append(write)
        if pending.state is not AttemptState.PREPARING:
            self._start(write, pending)
            return
        if pending.queued is None:
            pending.queued = []
            self.workers.submit("admit", lambda: self._prepare(pending), lambda fut: self._prepared(pending, fut),
                                failed=self._fails(pending))
        pending.queued.append(write)

    def _prepare(self, pending: PendingCheckpoint) -> None:
        """Remember the parent for the start-up sweep, then create ``p.incomplete`` (admit pool).

        Remembered first, so a daemon killed at any point after this leaves no
        ``.incomplete`` directory that its restart does not look at.
        """
        try:
            self.known_dirs.remember(pending.path.parent)
        except OSError as exc:  # the save itself can go on; only a crash's leftovers would be missed
            log.warning("event=remember_failed dir=%s error=%r", pending.path.parent, exc)
        self.state.commits.prepare(pending)

    def _prepared(self, pending: PendingCheckpoint, fut: Future) -> None:
        writes_queued, pending.queued = pending.queued or [], []
        pending.owns_directory = fut.exception() is None
        if pending.state is AttemptState.PREPARING:
            if fut.exception() is None:
                self.registry.move(pending, AttemptState.WRITING)
                for write in writes_queued:
                    self._start(write, pending)
                return
            self.registry.end(pending, AttemptState.FAILED, fut.exception())
        for write in writes_queued:  # the checkpoint failed before its directory was ready: these never start
            self._write_finished(write, pending, None)

    def _start(self, write: ShardWrite, pending: PendingCheckpoint) -> None:
        cfg, backend, checksums = self.config, pending.backend, self.workers.checksums
        run = lambda: write_shard(write, backend, checksums, direct=cfg.direct_io, chunk=cfg.chunk_bytes)  # noqa: E731
        self.workers.submit("write", run, lambda fut: self._write_finished(write, pending, fut),
                            failed=lambda exc: self._write_defect(write, pending, exc))

    # -- writes and commits ---------------------------------------------------

    def _write_finished(self, write: ShardWrite, pending: PendingCheckpoint, fut: Future | None) -> None:
        self.state.finish_write(write)
        exc = fut.exception() if fut is not None else None
        record: ShardRecord | None = fut.result() if fut is not None and exc is None else None
        held = pending.held.checksums.get(write.msg.rank) if pending.held is not None else None
        if record is not None and held is not None and record.checksum != held:
            exc, record = WriteFailed(
                f"rank {write.msg.rank} of snapshot {pending.path} changed in node memory since the daemon held it "
                f"(checksum {record.checksum:#010x} now, {held:#010x} when held): not persisted"), None
        if record is None:
            write.state = WriteState.FAILED
            if exc is not None and pending.state is not AttemptState.FAILED:
                self.registry.end(pending, AttemptState.FAILED, exc)
        ready = self.state.commits.shard_done(pending, record)
        if pending.state is AttemptState.FAILED:
            if pending.writing == 0:
                self._discard(pending)
            return
        if pending.coordinated and record is not None:
            self.send(write.client, Durable(write.msg.id, record.file, record.rank, record.size,
                                          record.checksum, record.tensors))
            pending.answered(write.client, write.msg.id)
        if ready:
            self._finalize(pending)

    def _write_defect(self, write: ShardWrite, pending: PendingCheckpoint, exc: BaseException) -> None:
        """``_write_finished`` raised: the write is over, so it ends here if the completion had not ended it yet
        (its slot back, its shard no longer in flight), and the attempt fails on every rank (and is discarded once
        nothing of it is written any more)."""
        if write in self.state.writes:
            self.state.finish_write(write)
            write.state = WriteState.FAILED
            self.state.commits.shard_done(pending, None)
            if pending.state is AttemptState.FAILED and pending.writing == 0:  # failed by an earlier rank
                self._discard(pending)
        self._fails(pending)(exc)

    def finalize(self, ident: bytes, msg: Finalize) -> None:
        """Global rank 0 asks this daemon to commit a coordinated checkpoint; Done or Error follows."""

        def finalize(final: Path) -> None:
            try:
                pending = self.state.commits.from_finalize(msg, ident, final)
            except CkptdError as exc:  # another run's attempt holds the path: it is not this Finalize's to publish
                self.send(ident, error_reply(self.state.stats, msg.id, exc))
                return
            self._finalize(pending)

        self.resolve_then(ident, msg.id, msg.path, finalize)

    def resolve_then(self, ident: bytes, rid: int, raw: str, then: Callable[[Path], None]) -> None:
        """Resolve a client's checkpoint path on the admit pool, then ``then(final)`` (or an Error reply)."""
        self.state.client(ident)
        roots = self.config.roots

        def resolved(fut: Future) -> None:
            if fut.exception() is not None:
                self.send(ident, error_reply(self.state.stats, rid, fut.exception()))
            else:
                then(fut.result())

        self.workers.submit("admit", lambda: self.storage.resolve(raw, roots), resolved,
                            failed=lambda exc: self.send(ident, error_reply(self.state.stats, rid, exc)))

    def _finalize(self, pending: PendingCheckpoint) -> None:
        self.workers.submit("commit", lambda: self.state.commits.finalize(pending),
                            lambda fut: self._finalized(pending, fut), failed=self._fails(pending))

    def _finalized(self, pending: PendingCheckpoint, fut: Future) -> None:
        self.registry.end(pending, AttemptState.COMMITTED if fut.exception() is None else AttemptState.FAILED,
                          fut.exception())

    # -- how an attempt ends (``Registry.end`` hands it here) ------------------------------------------------

    def ended(self, pending: PendingCheckpoint, state: AttemptState, error: BaseException | None,
              reason: str) -> None:
        """``pending`` ended in ``state`` and left the books: its ranks are answered, its directory set aside if
        it failed, and ``Committed`` or ``Failed`` is published last. A let-go attempt is logged, and nobody here
        waits for it; its directory is another node's daemon's, except when its contributors all died
        (``UNCLAIMED``): this daemon's part of it is given up then (``_release``)."""
        if state is AttemptState.COMMITTED:
            self._committed(pending)
        elif state is AttemptState.FAILED:
            self._failed(pending, error)
        else:
            log.info("event=let_go path=%s job=%r why=%s", pending.path, pending.contributors.job, reason)
            if reason == UNCLAIMED:
                self._release(pending)

    def _committed(self, pending: PendingCheckpoint) -> None:
        seconds = time.monotonic() - pending.started_at
        nbytes = pending.index().total_bytes
        log.info("event=committed path=%s bytes=%d seconds=%.3f", pending.path, nbytes, seconds)
        for waiter in pending.waiting:
            self.send(waiter.client, Done(waiter.request_id, str(pending.path), pending.shards[waiter.rank].size,
                                          seconds))
        pending.waiting = []
        if pending.held is not None:
            pending.held.ended(None)
        self.events.publish(Committed(pending.path, pending.step, nbytes, seconds, pending.keep_last,
                                      snapshot=pending.held is not None))

    # -- failures -------------------------------------------------------------

    def abort_at(self, ident: bytes, msg: Abort, final: Path) -> None:
        """A rank of run ``msg.job`` gave up on coordinated checkpoint ``final`` (resolved; a memory snapshot's
        Abort is ``Holding.abort``'s); Ok follows once it is failed here.

        Only that run's attempt is failed: the Abort of a run whose ranks were
        refused because another run is saving the path is logged and answered,
        and the other run's attempt goes on.
        """
        pending = self.state.commits.pending.get(final)
        if pending is not None and pending.contributors.job != msg.job:
            log.warning("event=abort_of_other_run path=%s job=%r attempt_job=%r reason=%s", final, msg.job,
                        pending.contributors.job, msg.reason)
        else:
            pending = pending or PendingCheckpoint(  # none here: this node's ranks never came; another node's
                # daemon made its directory, removed here as its Abort says
                path=final, backend=self.storage.bind(final), world_size=1, step=None, overwrite=False,
                coordinated=True, owns_directory=True,
                contributors=Contributors(msg.job))
            if not pending.ended:
                if self.state.commits.pending.get(final) is not pending:  # opened like any attempt, then ended
                    self.registry.open(self.state.commits.pending, pending)
                self.registry.end(pending, AttemptState.FAILED,
                                  RanksMissing(f"checkpoint {display(final)} was aborted: {msg.reason}"),
                                  reason="aborted")
        self.send(ident, Ok(msg.id))

    def _failed(self, pending: PendingCheckpoint, error: BaseException | None) -> None:
        """A checkpoint failed: every rank is told, why is remembered, and its directory is set aside once no
        shard of it is being written."""
        exc = as_error(self.state.stats, error if error is not None else InternalError("failed for no reason"))
        self.state.commits.failed_with(pending, exc)
        log.warning("event=failed path=%s error=%s", pending.path, exc.message)
        pending.tell_failed(self.send, exc)
        if pending.held is not None:
            pending.held.ended(exc)
        if pending.writing == 0:  # else the last shard to finish discards (_write_finished)
            self._discard(pending)
        self.events.publish(Failed(pending.path, exc, snapshot=pending.held is not None))

    def _fails(self, pending: PendingCheckpoint) -> Callable[[BaseException], None]:
        """What a completion of ``pending``'s work that raised does: fail it on every waiting rank now (unless it
        already ended), so none waits for its timeout."""

        def failed(exc: BaseException) -> None:
            if not pending.ended:
                self.registry.end(pending, AttemptState.FAILED, exc)

        return failed

    def _discard(self, pending: PendingCheckpoint) -> None:
        self.workers.submit("admit", lambda: self.state.commits.set_aside(pending),
                            lambda fut: self._set_aside(pending, fut),
                            failed=lambda exc: self._unset_aside(pending, exc))

    def _unset_aside(self, pending: PendingCheckpoint, exc: BaseException) -> None:
        """A completion of ``pending``'s discard raised (a defect): what waits for its path to be cleared (a retry,
        a persist: ``Registry.after_release``) goes on now, and meets what is left there, instead of waiting
        for its timeout."""
        as_error(self.state.stats, exc)
        for again in self.registry.released(pending):
            again()

    def _set_aside(self, pending: PendingCheckpoint, fut: Future) -> None:
        state = self.state
        error = fut.exception()
        if error is not None and not is_permanent(error):  # what it wrote stays until removed: try again
            tries = self._discards[pending.path] = self._discards.get(pending.path, 0) + 1
            delay = min(MAX_DISCARD_RETRY_S, DISCARD_RETRY_S * 2 ** (tries - 1))
            log.warning("event=discard_failed path=%s attempt=%d retry_in_s=%g error=%s", pending.incomplete, tries,
                        delay, getattr(error, "strerror", None) or error)
            self.workers.submit("maintenance", lambda: time.sleep(delay), lambda _: self._discard(pending),
                                failed=lambda exc: self._unset_aside(pending, exc))
            return
        self._discards.pop(pending.path, None)
        if error is not None:
            log.warning("event=discard_failed path=%s error=%r", pending.incomplete, error)
        elif fut.result() is not None:
            aside: Path = fut.result()
            self.workers.background("maintenance", lambda: pending.backend.remove_tree(aside))
        for again in self.registry.released(pending):
            again()

    def _let_go_unclaimed(self, pending: PendingCheckpoint) -> None:
        """Let go of a settled attempt whose contributors all died (its directory may still be another node's to
        publish): no Finalize or Abort of theirs can come here."""
        if pending.unclaimed():
            self._let_go(pending, UNCLAIMED)

    def _let_go(self, pending: PendingCheckpoint, why: str) -> bool:
        """Forget a settled attempt that ended without a word here; nobody is told. False if it was not kept."""
        if self.state.commits.pending.get(pending.path) is not pending or not pending.settled:
            return False
        self.registry.end(pending, AttemptState.LET_GO, reason=why)
        return True

    def _release(self, pending: PendingCheckpoint) -> None:
        """Give up this daemon's part of an attempt no rank of its run can finish here (admit pool): the last
        node's daemon to give it up removes ``p.incomplete`` (``ownership.release``)."""

        def released(fut: Future) -> None:
            if fut.exception() is not None:  # left for the next start's sweep
                log.warning("event=release_failed path=%s error=%r", pending.incomplete, fut.exception())
            elif (aside := fut.result()) is not None:
                log.info("event=released path=%s", pending.incomplete)
                self.workers.background("maintenance", lambda: pending.backend.remove_tree(aside))

        self.workers.submit("admit", lambda: self.state.commits.release(pending), released,
                            failed=logged(self.state.stats))

    def _look_then(self, pending: PendingCheckpoint, then: Callable[[], None],
                   failed: Callable[[BaseException], None]) -> None:
        """Let go of a settled attempt if its directory is gone (admit pool), then ``then`` on the loop (``failed``
        if that raised)."""

        def looked(fut: Future) -> None:
            if fut.exception() is None and fut.result():
                self._let_go(pending, "its directory is gone: another node's daemon published or discarded it")
            then()

        self.workers.submit("admit", lambda: self.state.commits.ended_elsewhere(pending), looked, failed)

    def _let_go_ended(self) -> None:
        """Housekeeping: let go of settled attempts that another node's daemon published or discarded meanwhile
        (one look at a time)."""
        now = time.monotonic()
        if self._looking or now < self._next_look:
            return
        kept = self.attempts_kept()
        if not kept:
            return
        self._looking, self._next_look = True, now + LOOK_INTERVAL_S
        commits = self.state.commits

        def looked(fut: Future) -> None:
            self._looking = False
            for pending in fut.result() if fut.exception() is None else []:
                self._let_go(pending, "its directory is gone: another node's daemon published or discarded it")

        def unlooked(exc: BaseException) -> None:
            self._looking = False
            as_error(self.state.stats, exc)

        self.workers.submit("maintenance", lambda: [p for p in kept if commits.ended_elsewhere(p)], looked,
                            failed=unlooked)

    # -- the registry's housekeeping (``registry.Registry``) -------------------------------------------------

    def attempts(self) -> list[PendingCheckpoint]:
        return list(self.state.commits.pending.values())

    def tidy(self, now: float) -> None:
        for pending in self.attempts_kept():
            self._let_go_unclaimed(pending)
        self._let_go_ended()

    def exited(self, attempts: list[PendingCheckpoint]) -> None:
        """The daemon exits: its disk attempts (in progress, or failed with their directory still being set
        aside) hold nothing to release here (their slots go with ``SlotMaps``, a ``.incomplete`` directory left
        is the next start's sweep's), so they are only counted in the log."""
        if attempts:
            log.info("event=attempts_left_at_exit kind=checkpoint count=%d", len(attempts))

    def attempts_kept(self) -> list[PendingCheckpoint]:
        """Settled attempts: kept until their run's Finalize or Abort, here or on another node's daemon."""
        return [p for p in self.state.commits.pending.values() if p.settled]

    def fail_waiting_for_ranks(self) -> None:
        """At the end of a drain: checkpoints still missing ranks fail with ``ShuttingDown``."""
        waiting = [p for p in self.state.commits.pending.values()
                   if p.state is not AttemptState.COMMITTING and not p.coordinated and p.missing]
        for pending in waiting:
            self.registry.end(pending, AttemptState.FAILED, ShuttingDown(
                f"the daemon was stopped while checkpoint {pending.path} waited for ranks {pending.missing} "
                f"of {pending.world_size}; it waited {self.config.drain_timeout:g} s for them and "
                f"committed nothing"))

