"""The save pipeline: from a rank's Commit to its Done, one step per worker pool.

::

    Commit ──admit pool: examine (path, slot, header, free space)
           ──loop: room check, bookkeeping ──admit pool: remember the parent, prepare p.incomplete (first rank)
           ──loop: Accepted ──write pool: shard to disk, fsync ──loop: Durable / all ranks in?
           ──commit pool: index, rename, fsync parent ──loop: Done
           ──maintenance pool: retention

A failure at any step fails the whole checkpoint: every rank is told, and
once no shard of it is being written its ``.incomplete`` directory is
renamed aside on the admit pool (so a retry of the same path, admitted after
that on the same FIFO thread, can never lose its directory to the cleanup)
and removed on the maintenance pool. Until the rename, a retry of that path
waits (``NodeState.deferred``).

Every method runs on the loop thread; the work it hands to the pools is
the only I/O.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from ckptd.protocol.errors import CkptdError, InternalError, RanksMissing, ShuttingDown, WriteFailed
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.messages import Abort, Accepted, Commit, Done, Durable, Error, Finalize, Message, Ok
from ckptd.protocol.objects import display, is_permanent

from .admission import Examined, check_room, examine
from .commit import CheckpointState, PendingCheckpoint, resolve_path
from .config import DaemonConfig
from .mirror import Mirrors
from .retention import Retention, RetentionQueue, apply_retention
from .state import NodeState
from .storage import CheckpointStorage
from .sweep import KnownDirs
from .workers import Workers
from .writer import Progress, WriteJob, WriteState, write_shard

log = logging.getLogger("ckptd")
DISCARD_RETRY_S = 1.0
"""A failed attempt whose removal failed for a transient reason (a store down) is removed again after this
long, doubling up to ``MAX_DISCARD_RETRY_S``; its path takes no new save until then."""
MAX_DISCARD_RETRY_S = 30.0
Send = Callable[[bytes, Message], None]


def error_reply(state: NodeState, rid: int, exc: BaseException) -> Error:
    """The one place an exception becomes an ``Error`` reply (and a recent error in status)."""
    if not isinstance(exc, CkptdError):
        log.error("event=internal_error error=%r", exc, exc_info=exc)
        exc = InternalError(f"internal error in ckptd: {exc!r}")
    state.stats.error(exc.message)
    return Error(rid, exc.code, exc.message)


class Saves:
    """Moves saves through the pipeline above; replies through ``send``."""

    def __init__(self, state: NodeState, workers: Workers, storage: CheckpointStorage, config: DaemonConfig,
                 send: Send, known_dirs: KnownDirs, mirrors: Mirrors | None = None) -> None:
        self.state, self.workers, self.storage, self.config = state, workers, storage, config
        self.mirrors = mirrors
        self.send = send
        self.known_dirs = known_dirs
        self.retentions = RetentionQueue()
        self._discards: dict[Path, int] = {}
        """Failed removals of attempts, by path: how many so far."""
        self.on_end: Callable[[Path, CkptdError | None], None] = lambda path, error: None
        """Told when a checkpoint commits (None) or fails (why): the memory tier marks a persisted snapshot."""

    # -- admission ------------------------------------------------------------

    def commit(self, ident: bytes, msg: Commit) -> None:
        """Start admitting one rank's shard; Accepted (or Error) follows."""
        client = self.state.client(ident)
        progress = self.state.begin_save(ident, client, msg, deadline=time.monotonic() + msg.timeout)
        pid, slots, roots = client.pid, self.state.slots, self.config.roots
        self.workers.submit("admit", lambda: examine(self.storage, slots, msg, pid=pid, roots=roots),
                            lambda fut: self._examined(ident, msg, pid, progress, fut))

    def staged(self, ident: bytes, upto: int, error: str | None, request_id: int) -> None:
        progress = self.state.saves.get((ident, request_id))
        if progress is None:
            return  # that save already ended (refused or failed): the notice is moot
        if error:
            progress.fail(f"the client reported: {error}")
        else:
            progress.advance(upto)

    def _examined(self, ident: bytes, msg: Commit, pid: int, progress: Progress, fut: Future) -> None:
        if fut.exception() is not None:
            self._refuse(ident, msg, fut.exception())
            return
        self.admit_examined(ident, msg, progress, fut.result(), pid=pid)

    def _refuse(self, ident: bytes, msg: Commit, exc: BaseException) -> None:
        self.state.end_save(ident, msg.id)
        self.send(ident, error_reply(self.state, msg.id, exc))

    def admit_examined(self, ident: bytes, msg: Commit, progress: Progress, examined: Examined, *, pid: int,
                       internal: bool = False, expected_checksum: int | None = None) -> None:
        """Queue an examined shard's write, sent by process ``pid``.

        ``internal``: the daemon persists a held snapshot, even while draining;
        a refusal fails the checkpoint (``on_end``) so the snapshot is not left
        persisting. ``expected_checksum``: the write must produce it.
        """
        state, final = self.state, examined.final
        current = state.commits.pending.get(final)
        if current is not None and not internal:
            self._abandon_if_orphaned(current)
            live = current.state in (CheckpointState.PREPARING, CheckpointState.WRITING)
            conflict = current.contributors.same_run_conflict(final, msg, current.world_size, current.step,
                                                              current.coordinated) if live else None
            if conflict is not None:  # the run's save is broken: every rank is told, this one included
                self.fail(current, conflict)
                state.slots.release(examined.slot)
                self._refuse(ident, msg, conflict)
                return
        if final in state.closing:  # a failed attempt's directory is still in the way: wait for it
            state.deferred.setdefault(final, []).append((ident, msg, pid, progress, examined))
            return
        try:
            if state.draining and final not in state.commits.pending and not internal:
                raise ShuttingDown("the daemon is draining and accepts no new saves (only missing ranks of "
                                   "checkpoints already in progress)")
            cfg = self.config
            check_room(final, examined.space, msg.nbytes, state.reserved_on(examined.space.device),
                       margin_fraction=cfg.space_margin_fraction, margin_min=cfg.space_margin_bytes,
                       shm_min_free=cfg.shm_min_free, shm_free=examined.shm_free)
            pending, dest = state.commits.admit(msg, ident, final, pid)
        except BaseException as exc:
            state.slots.release(examined.slot)
            self._refuse(ident, msg, exc)
            if internal:
                pending = state.commits.pending.get(final)
                if pending is not None and pending.state is not CheckpointState.FAILED:
                    self.fail(pending, exc)
                else:
                    self.on_end(final, exc if isinstance(exc, CkptdError) else InternalError(repr(exc)))
            return
        job = WriteJob(ident, msg, examined.slot, dest, pending.path, progress, device=examined.space.device,
                       expected_checksum=expected_checksum)
        state.jobs.append(job)
        log.info("event=admitted path=%s rank=%d bytes=%d", pending.path, msg.rank, msg.nbytes)
        # The daemon holds the save now (its slot mapped, its job listed): the client may go on, before the
        # checkpoint's directory exists (a failure to make it fails the save through its future).
        self.send(ident, Accepted(msg.id))
        if pending.state is not CheckpointState.PREPARING:
            self._start(job, pending)
            return
        if final not in state.held:
            state.held[final] = []
            self.workers.submit("admit", lambda: self._prepare(pending), lambda fut: self._prepared(pending, fut))
        state.held[final].append(job)

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
        jobs = self.state.held.pop(pending.path, [])
        pending.owns_directory = fut.exception() is None
        if pending.state is CheckpointState.PREPARING:
            if fut.exception() is None:
                pending.state = CheckpointState.WRITING
                for job in jobs:
                    self._start(job, pending)
                return
            self.fail(pending, fut.exception())
        for job in jobs:  # the checkpoint failed before its directory was ready: these never start
            self._write_finished(job, pending, None)

    def _start(self, job: WriteJob, pending: PendingCheckpoint) -> None:
        cfg, storage, checksums = self.config, self.storage, self.workers.checksums
        run = lambda: write_shard(job, storage, checksums, direct=cfg.direct_io, chunk=cfg.chunk_bytes)  # noqa: E731
        self.workers.submit("write", run, lambda fut: self._write_finished(job, pending, fut))

    # -- writes and commits ---------------------------------------------------

    def _write_finished(self, job: WriteJob, pending: PendingCheckpoint, fut: Future | None) -> None:
        self.state.finish_job(job)
        exc = fut.exception() if fut is not None else None
        record: ShardRecord | None = fut.result() if fut is not None and exc is None else None
        if record is not None and job.expected_checksum is not None and record.checksum != job.expected_checksum:
            exc, record = WriteFailed(
                f"rank {job.commit.rank} of snapshot {pending.path} changed in node memory since the daemon held it "
                f"(checksum {record.checksum:#010x} now, {job.expected_checksum:#010x} when held): not persisted"), None
        if record is None:
            job.state = WriteState.FAILED
            if exc is not None and pending.state is not CheckpointState.FAILED:
                self.fail(pending, exc)
        ready = self.state.commits.shard_done(pending, record)
        if pending.state is CheckpointState.FAILED:
            if pending.writing == 0:
                self._discard(pending)
            return
        if pending.coordinated and record is not None:
            self.send(job.client, Durable(job.commit.id, record.file, record.rank, record.size,
                                          record.checksum, record.tensors))
        if ready:
            self._finalize(pending)

    def finalize(self, ident: bytes, msg: Finalize) -> None:
        """Global rank 0 asks this daemon to commit a multi-node checkpoint; Done or Error follows."""
        self.resolve_then(ident, msg.id, msg.path,
                          lambda final: self._finalize(self.state.commits.from_finalize(msg, ident, final)))

    def resolve_then(self, ident: bytes, rid: int, raw: str, then: Callable[[Path], None]) -> None:
        """Resolve a client's checkpoint path on the admit pool, then ``then(final)`` (or an Error reply)."""
        self.state.client(ident)
        roots = self.config.roots

        def resolved(fut: Future) -> None:
            if fut.exception() is not None:
                self.send(ident, error_reply(self.state, rid, fut.exception()))
            else:
                then(fut.result())

        self.workers.submit("admit", lambda: resolve_path(self.storage, raw, roots), resolved)

    def _finalize(self, pending: PendingCheckpoint) -> None:
        self.workers.submit("commit", lambda: self.state.commits.finalize(pending),
                            lambda fut: self._finalized(pending, fut))

    def _finalized(self, pending: PendingCheckpoint, fut: Future) -> None:
        if fut.exception() is not None:
            self.fail(pending, fut.exception())
            return
        state = self.state
        state.commits.forget(pending)
        pending.state = CheckpointState.COMMITTED
        seconds = time.monotonic() - pending.started_at
        state.stats.committed(pending, seconds)
        self.on_end(pending.path, None)
        log.info("event=committed path=%s bytes=%d seconds=%.3f", pending.path, pending.index().total_bytes, seconds)
        for ident, rid, rank in pending.waiting:
            self.send(ident, Done(rid, str(pending.path), pending.shards[rank].size, seconds))
        if self.mirrors is not None:
            self.mirrors.submit(pending.path, pending.keep_last)
        keep = pending.keep_last or self.config.retention_for(pending.path)
        if keep is not None:
            self.retain(pending.path, keep)

    def retain(self, newest: Path, keep: int) -> None:
        """Retention beside ``newest`` on the maintenance thread; never deletes what the mirror lacks.

        A run still waiting for the thread there does this request instead (``RetentionQueue``).
        """
        key = self.retentions.offer(Retention(newest, keep, frozenset(self.state.commits.pending)))
        if key is None:
            return
        mirrors, publishing = self.mirrors, self.state.commits.publishing

        def run() -> list[Path]:
            request = self.retentions.take(key)
            not_uploaded = (lambda victim: bool(mirrors.unmirrored([victim]))) if mirrors is not None else None
            return apply_retention(self.storage, request.newest, request.keep_last, set(request.in_flight),
                                   not_uploaded, publishing)

        self.workers.submit("maintenance", run, lambda f: self._retention_done(newest, f))

    def _retention_done(self, newest: Path, fut: Future) -> None:
        if fut.exception() is not None:
            log.error("event=retention_failed path=%s error=%r", newest, fut.exception())
            self.state.stats.error(f"retention after {newest} failed: {fut.exception()!r}")

    # -- failures -------------------------------------------------------------

    def abort(self, ident: bytes, msg: Abort) -> None:
        """A rank gave up on a checkpoint (multi-node); Ok follows once it is failed here."""

        def abort(final: Path) -> None:
            pending = self.state.commits.pending.get(final) or PendingCheckpoint(
                final, 1, None, False, coordinated=True, state=CheckpointState.WRITING, owns_directory=True)
            if pending.state is not CheckpointState.FAILED:
                self.fail(pending, RanksMissing(f"checkpoint {display(final)} was aborted: {msg.reason}"))
            self.send(ident, Ok(msg.id))

        self.resolve_then(ident, msg.id, msg.path, abort)

    def fail(self, pending: PendingCheckpoint, exc: BaseException) -> None:
        """Fail a checkpoint: tell every rank, remember why, clean up once no shard is being written."""
        if not isinstance(exc, CkptdError):
            log.error("event=internal_error path=%s error=%r", pending.path, exc)
            exc = InternalError(f"internal error while saving {pending.path}: {exc!r}")
        state = self.state
        state.commits.fail(pending, exc)
        self.on_end(pending.path, exc)
        state.stats.error(exc.message)
        log.warning("event=failed path=%s error=%s", pending.path, exc.message)
        for ident, rid, _ in pending.waiting:
            self.send(ident, Error(rid, exc.code, exc.message))
        state.closing.add(pending.path)
        if pending.writing == 0:  # else the last shard to finish discards (_write_finished)
            self._discard(pending)

    def _discard(self, pending: PendingCheckpoint) -> None:
        self.workers.submit("admit", lambda: self.state.commits.set_aside(pending),
                            lambda fut: self._set_aside(pending, fut))

    def _set_aside(self, pending: PendingCheckpoint, fut: Future) -> None:
        state = self.state
        error = fut.exception()
        if error is not None and not is_permanent(error):  # what it wrote stays until removed: try again
            tries = self._discards[pending.path] = self._discards.get(pending.path, 0) + 1
            delay = min(MAX_DISCARD_RETRY_S, DISCARD_RETRY_S * 2 ** (tries - 1))
            log.warning("event=discard_failed path=%s attempt=%d retry_in_s=%g error=%s", pending.incomplete, tries,
                        delay, getattr(error, "strerror", None) or error)
            self.workers.submit("maintenance", lambda: time.sleep(delay), lambda _: self._discard(pending))
            return
        self._discards.pop(pending.path, None)
        state.closing.discard(pending.path)
        if error is not None:
            log.warning("event=discard_failed path=%s error=%r", pending.incomplete, error)
        elif fut.result() is not None:
            aside: Path = fut.result()
            self.workers.submit("maintenance", lambda: self.storage.remove_tree(aside))
        for ident, msg, pid, progress, examined in state.deferred.pop(pending.path, []):
            self.admit_examined(ident, msg, progress, examined, pid=pid)

    def _abandon_if_orphaned(self, pending: PendingCheckpoint) -> None:
        """Fail an attempt still missing ranks whose contributors died: no rank of their job can complete it."""
        if pending.state not in (CheckpointState.PREPARING, CheckpointState.WRITING) or pending.coordinated:
            return
        why = pending.contributors.why_abandoned(pending.missing)
        if why is not None:
            self.fail(pending, RanksMissing(
                f"checkpoint {display(pending.path)} was abandoned: {why}; nothing was committed, and a new run of "
                f"the job saving this path starts afresh"))

    def rank_died(self, job: str, world_size: int, rank: int, pid: int) -> None:
        """Rank ``rank`` of run ``job`` died without saving: fail its run's saves that still wait for it."""
        for pending in list(self.state.commits.pending.values()):
            if (pending.state in (CheckpointState.PREPARING, CheckpointState.WRITING) and not pending.coordinated
                    and pending.contributors.job == job and pending.world_size == world_size
                    and rank in pending.missing):
                self.fail(pending, RanksMissing(
                    f"checkpoint {display(pending.path)} was abandoned: the process of its rank {rank} (pid {pid}) "
                    f"died before that rank saved; nothing was committed"))

    def abandon_orphaned(self) -> None:
        """Housekeeping: abandon every attempt whose contributors died before it was complete."""
        for pending in list(self.state.commits.pending.values()):
            self._abandon_if_orphaned(pending)

    def fail_overdue(self) -> None:
        for pending, error in self.state.commits.overdue(time.monotonic()):
            self.fail(pending, error)

    def fail_waiting_for_ranks(self) -> None:
        """At the end of a drain: checkpoints still missing ranks fail with ``ShuttingDown``."""
        waiting = [p for p in self.state.commits.pending.values()
                   if p.state is not CheckpointState.COMMITTING and not p.coordinated and p.missing]
        for pending in waiting:
            self.fail(pending, ShuttingDown(
                f"the daemon was stopped while checkpoint {pending.path} waited for ranks {pending.missing} "
                f"of {pending.world_size}; it waited {self.config.drain_timeout:g} s for them and "
                f"committed nothing"))
