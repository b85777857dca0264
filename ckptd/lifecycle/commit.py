"""Turning durable shards into a committed checkpoint, exactly once.

A checkpoint in progress lives at ``p.incomplete/``. Each rank's shard is
written and fsync'd there; when the last rank of the world is durable, the
index ``ckptd.json`` is written and fsync'd (the marker is written last),
``p.incomplete`` is renamed to ``p`` and the parent directory is fsync'd.
Only then are the ranks told ``Done``. If anything fails, or a rank does not
commit within the checkpoint's timeout, ``p.incomplete`` is removed, no
``p`` appears, and every rank is told why.

On several nodes (``coordinated``) each daemon only writes its own ranks'
shards and answers ``Durable``; the ranks agree among themselves, and global
rank 0's daemon receives ``Finalize`` and does the commit above. A
coordinated attempt whose shards are durable here is kept (``settled``) until
it ends: published here by its own run's ``Finalize``, failed here by its own
run's ``Abort``, its directory gone (published or discarded by another
node's daemon), or its contributors all dead. While it is kept, a rank of
another live run saving the same path is refused (``Conflict``), as it is
while any attempt is in progress.

All bookkeeping here runs on the loop thread; ``prepare``, ``set_aside`` and
``finalize`` do I/O (only through the
``Storage``) and run on the worker pools. A checkpoint goes through::

    preparing -> writing -> committing -> committed      (or -> failed)

and, on several nodes, a settled attempt another node's daemon publishes or
discards goes from writing to let go (``attempt.NEXT_STATES``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping

from ckptd.protocol.chunks import tensor_table
from ckptd.protocol.errors import (
    CkptdError,
    Conflict,
    InvalidCheckpoint,
    WriteFailed,
)
from ckptd.protocol.index import (
    CheckpointIndex,
    ShardRecord,
    TensorRecord,
    incomplete_path,
    shard_name,
)
from ckptd.protocol.messages import Finalize, StagedShard
from ckptd.protocol.objects import display

from ckptd.lifecycle.attempt import Attempt, AttemptState, Waiter
from ckptd.lifecycle.contributors import Contributors
from ckptd.lifecycle.registry import Book, Registry
from ckptd.lifecycle.snapshots import HeldSnapshot
from ckptd.storage.backends import Backends
from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import PublishedNotDurable

if TYPE_CHECKING:
    from ckptd.lifecycle.writer import ShardWrite


@dataclass(kw_only=True)
class PendingCheckpoint(Attempt):
    """A checkpoint some ranks have committed and that is not final yet: its ranks, shards, writes and state."""

    noun: ClassVar[str] = "checkpoint"
    nothing_kept: ClassVar[str] = "nothing was committed"
    overwrite: bool
    keep_last: int | None = None
    shards: dict[int, ShardRecord] = field(default_factory=dict)
    ranks_seen: set[int] = field(default_factory=set)
    writing: int = 0
    """Shards of this checkpoint admitted here and not yet durable or failed."""
    queued: list[ShardWrite] | None = None
    """Admitted writes waiting for ``p.incomplete`` to be made (None: nobody has started making it yet)."""
    entry: ClassVar[AttemptState] = AttemptState.PREPARING
    owns_directory: bool = False
    """Whether ``prepare`` made ``p.incomplete`` for this attempt: only then may a failure remove it."""
    held: HeldBytes | None = None
    """Set when this attempt writes bytes the daemon already holds: the PERSISTING phase of a memory snapshot's
    own attempt (``Saves.write_held``), which no client's save joins, nor it one."""

    @property
    def arrived(self) -> set[int]:
        return self.ranks_seen

    @property
    def open(self) -> bool:
        return self.state in (AttemptState.PREPARING, AttemptState.WRITING)

    @property
    def settled(self) -> bool:
        """A coordinated attempt whose shards here are all durable: it waits for its run's Finalize or Abort (here
        or on another node's daemon), and nothing of it is in flight here."""
        return self.coordinated and self.state is AttemptState.WRITING and self.writing == 0

    def moved_on(self, msg: StagedShard) -> bool:
        """Whether ``msg``, a rank of this settled attempt's own run that already saved here, shows the attempt
        ended elsewhere: a run's rank saves a path again only after its ranks agreed on the last save of it."""
        return self.settled and msg.job == self.contributors.job and msg.rank in self.ranks_seen

    def unclaimed(self) -> bool:
        """Whether this settled attempt's contributors all died: no Finalize or Abort of theirs can come here."""
        pids = self.contributors.pids
        return self.settled and bool(pids) and len(self.contributors.dead()) == len(pids)

    @property
    def incomplete(self) -> Path:
        return incomplete_path(self.path)

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.world_size

    def index(self, tensors: Mapping[str, TensorRecord] | None = None) -> CheckpointIndex:
        files = tuple(self.shards[r] for r in sorted(self.shards))
        # a persisted snapshot was acknowledged when it was held: ordered by when a persist ran, it would outrank a
        # checkpoint committed after it (retention and ``latest`` order by step, then by this time)
        created = self.held.created if self.held is not None else time.time()
        return CheckpointIndex(world_size=self.world_size, step=self.step, created=created, files=files,
                               tensors=tensors or {}, keep_last=self.keep_last)


@dataclass(frozen=True)
class HeldBytes:
    """What a disk attempt that writes bytes the daemon already holds carries, instead of a back-pointer to
    what holds them: the attempt is the PERSISTING phase of a memory snapshot's own attempt, and the disk
    pipeline needs only these three things of it."""

    created: float
    """When the bytes were acknowledged as held: the checkpoint's time. Ordered by when the persist ran, it would
    outrank a checkpoint committed after it (retention and ``latest`` order by step, then by this time)."""
    checksums: Mapping[int, int]
    """Each rank's checksum when held: a write that reads other bytes fails (they changed in node memory)."""
    ended: Callable[[CkptdError | None], None]
    """Told once how the write ended (None: committed), directly from the attempt's end (``Saves.ended``), before
    any event: a subscriber can neither keep it from being told nor be the one who tells it."""


class Commits:
    """Checkpoints in progress on this daemon, by final path (bookkeeping on the loop; I/O where marked)."""

    def __init__(self, storage: Backends, registry: Registry) -> None:
        self.storage, self.registry = storage, registry
        self.pending: Book[PendingCheckpoint] = registry.book()
        self.publishing = threading.Lock()
        """Held while a checkpoint takes its name (rename or exchange, commit pool) and while retention checks
        that a victim is still the version it judged and sets it aside (maintenance pool): so retention never
        deletes a version that replaced the one it checked (an overwrite committed while it asked the mirror)."""

    def admit(self, commit: StagedShard, client: bytes, final: Path, pid: int,
              backend: Checkpoints) -> tuple[PendingCheckpoint, Path]:
        """Register one rank's commit (from process ``pid``) to ``final`` (on ``backend``, as admission found it);
        returns its checkpoint and shard file path.

        A new checkpoint starts ``preparing``: its directory is made by
        ``prepare`` on a worker before any of its shards is written. A rank
        of another job incarnation than the attempt's is refused
        (``Contributors``); one whose attempt was abandoned is not: the caller
        failed that attempt first. A rank of a settled attempt's own run that
        saved there already starts a fresh attempt (``moved_on``).
        """
        self.registry.refuse_late_rank(PendingCheckpoint, final, commit)
        pending = self.pending.get(final)
        if pending is not None and pending.moved_on(commit):
            # its directory is another node's daemon's to publish or remove: left alone
            self.registry.end(pending, AttemptState.LET_GO, reason="a rank of its run saved the path again")
            pending = None
        if pending is None:
            pending = self.registry.open(self.pending, PendingCheckpoint(
                path=final, backend=backend, world_size=commit.world_size, step=commit.step, overwrite=commit.overwrite,
                coordinated=commit.coordinated, keep_last=commit.keep_last, timeout=commit.timeout,
                contributors=Contributors(commit.job)))
        if pending.held is not None:
            raise Conflict(f"the daemon is writing its memory snapshot of {display(final)} to disk there now; save "
                           f"again once that is done (client.persist({display(final)!r}) returns then), or save "
                           f"under another path")
        pending.check_join(commit)
        pending.join(commit, pid, Waiter(client, commit.id, commit.rank))
        pending.ranks_seen.add(commit.rank)
        pending.writing += 1
        return pending, pending.incomplete / shard_name(commit.rank, commit.world_size)

    def open_held_write(self, snap: HeldSnapshot, ended: Callable[[CkptdError | None], None]) -> PendingCheckpoint:
        """The disk attempt that persists held snapshot ``snap``, every rank in: with the snapshot's own
        ``overwrite`` and ``keep_last`` (persisting is the disk save it stood in for), ``preparing``; ``ended`` is
        told how it ends (``HeldBytes``)."""
        final = snap.path
        if final in self.pending:
            raise Conflict(f"a save of {display(final)} is being written; the memory snapshot of that path is not "
                           f"persisted over it (once that save commits, the snapshot is dropped as older)")
        first = snap.shards[min(snap.shards)].msg
        return self.registry.open(self.pending, PendingCheckpoint(
            path=final, backend=snap.backend, world_size=snap.world_size, step=snap.step, overwrite=first.overwrite,
            keep_last=first.keep_last, contributors=Contributors(snap.contributors.job),
            held=HeldBytes(snap.created, {rank: shard.checksum for rank, shard in snap.shards.items()}, ended),
            ranks_seen=set(snap.shards), writing=len(snap.shards)))

    def prepare(self, pending: PendingCheckpoint) -> None:
        """Begin the attempt: refuse what is in the way, then create ``p.incomplete`` with this daemon's marker
        (I/O; ``Checkpoints.begin``). Coordinated checkpoints share the directory with other nodes' daemons, so
        there it is created if missing and never removed."""
        pending.backend.begin(pending.path, pending.incomplete, overwrite=pending.overwrite,
                              coordinated=pending.coordinated)

    def shard_done(self, pending: PendingCheckpoint, record: ShardRecord | None) -> bool:
        """Record a shard's end (None: it failed); True when the checkpoint can be finalized."""
        pending.writing -= 1
        if pending.state is AttemptState.FAILED:
            return False
        if record is not None:
            pending.shards[record.rank] = record
        if pending.coordinated:  # kept until its run's Finalize or Abort, or it ends elsewhere
            return False
        if pending.complete:
            self.registry.move(pending, AttemptState.COMMITTING)
        return pending.complete

    def failed_with(self, pending: PendingCheckpoint, error: CkptdError) -> None:
        """``pending`` failed (``Registry.end``): why is remembered for its late ranks, and it is releasing until
        its ``p.incomplete`` is out of the way (``Saves._set_aside``): a retry's admission or a persist at its path
        waits for that (``Registry.after_release``)."""
        self.registry.remember_failure(pending, error)
        self.registry.releasing(pending)

    def from_finalize(self, msg: Finalize, client: bytes, final: Path) -> PendingCheckpoint:
        """The checkpoint global rank 0 asks this daemon to commit (at ``final``, resolved), ``committing``.

        The attempt kept here for its run's ranks on this node is taken over;
        one of another run is refused (``Conflict``: never publish another
        run's shards). With none kept here (its ranks all on other nodes, or
        this daemon restarted), the attempt is made from the message.
        """
        kept = self.pending.get(final)
        if kept is not None:
            kept.contributors.refuse_other_job(final, msg.job)
            if not kept.settled or (kept.world_size, kept.step) != (msg.world_size, msg.step):
                raise Conflict(f"checkpoint {display(final)} cannot be finalized: its attempt here is "
                               f"{kept.state.value} with {kept.writing} shard(s) in flight, world size "
                               f"{kept.world_size} and step {kept.step}; Finalize says world size {msg.world_size}, "
                               f"step {msg.step}")
            self.registry.move(kept, AttemptState.COMMITTING)
            kept.overwrite, kept.keep_last = msg.overwrite, msg.keep_last
            kept.shards = {f.rank: f for f in msg.files}
            kept.ranks_seen = set(range(msg.world_size))
            kept.waiting.append(Waiter(client, msg.id, 0))
            return kept
        pending = self.registry.open(self.pending, PendingCheckpoint(  # taken: no other run's rank may start an
            # attempt at the path meanwhile
            path=final, backend=self.storage.bind(final), world_size=msg.world_size, step=msg.step,
            overwrite=msg.overwrite, coordinated=True,
            keep_last=msg.keep_last, shards={f.rank: f for f in msg.files}, ranks_seen=set(range(msg.world_size)),
            owns_directory=True, waiting=[Waiter(client, msg.id, 0)], contributors=Contributors(msg.job)))
        self.registry.move(pending, AttemptState.WRITING)  # its shards were written by the other nodes' daemons
        self.registry.move(pending, AttemptState.COMMITTING)
        return pending

    def ended_elsewhere(self, pending: PendingCheckpoint) -> bool:
        """Whether a settled attempt's directory is gone: another node's daemon published or discarded it (I/O)."""
        return not pending.backend.holds(pending.incomplete)

    def finalize(self, pending: PendingCheckpoint) -> None:
        """Index, then publish: the checkpoint becomes visible (I/O; ``Checkpoints.publish`` says how).

        Locally, replacing an existing checkpoint swaps the two directories in one
        atomic ``renameat2(RENAME_EXCHANGE)``, so a crash at any point leaves
        either the old or the new checkpoint under the name, never neither.
        Only a committed checkpoint holding nothing but ckptd's files is ever
        replaced (checked again there: the path may have changed since admission).
        The owner markers stay until after the rename, so the start-up sweep
        can still recognise a crashed commit as ours; failing to remove them
        afterwards does not undo the commit (readers ignore markers).

        If the parent's fsync fails after the rename, the checkpoint is
        visible and whole but its name may not survive a power loss: that is
        reported as ``WriteFailed`` whose message says it is committed and
        visible (the future fails: durability was promised and is unknown), and the
        checkpoint is left in place, never discarded.
        """
        final, backend = pending.path, pending.backend
        try:
            backend.check_shards(pending.incomplete, {f.file: f.size for f in pending.shards.values()},
                                 {f.file: f.rank for f in pending.shards.values()})
            index = pending.index(self._tensor_table(pending))
            backend.publish(pending.incomplete, final, index.to_json(), overwrite=pending.overwrite,
                            publishing=self.publishing)
        except CkptdError:
            raise
        except PublishedNotDurable as exc:
            backend.published(final)
            raise WriteFailed(
                f"checkpoint {final} is committed and visible (its index and shards are durable), but "
                f"fsync of {final.parent} failed ({exc.strerror or exc}), so the new name may not survive "
                f"a power loss; it was not reported saved. Load it, or save again under another "
                f"path") from None
        except OSError as exc:
            raise WriteFailed(f"committing {final} failed: {exc.strerror or exc}") from None
        backend.published(final)

    def _tensor_table(self, pending: PendingCheckpoint) -> dict[str, TensorRecord]:
        """The global tensors' chunks, from every shard's header (the ranks' chunk tables)."""
        headers = []
        for f in pending.shards.values():
            try:
                shard = pending.incomplete / f.file
                entries, metadata, data_start = pending.backend.shard_header(shard, f.size)
            except InvalidCheckpoint as exc:
                raise WriteFailed(exc.message) from None
            headers.append((f.file, f.size, entries, metadata, data_start))
        try:
            return tensor_table(headers)
        except ValueError as exc:
            raise Conflict(f"checkpoint {pending.path}: the ranks' chunks of sharded tensors disagree: {exc}") from None

    def set_aside(self, pending: PendingCheckpoint) -> Path | None:
        """Rename a failed attempt's ``p.incomplete`` to a name of its own (I/O); returns it.

        After this the path is free for a retry, and removing the returned
        directory (later, on another thread) can only ever remove what this
        attempt wrote (if the rename fails, it is removed in place here, still
        before any retry). A crash before the removal leaves a ``.incomplete``
        directory owned by a dead daemon, which the start-up sweep removes.
        """
        if not pending.owns_directory:
            return None
        return pending.backend.discard(pending.incomplete, pending.path)

    def release(self, pending: PendingCheckpoint) -> Path | None:
        """Let go of this daemon's part of a settled attempt whose contributors all died (I/O): its marker goes,
        and so does ``p.incomplete`` once no other daemon claims it; returns what is left to remove later."""
        return pending.backend.let_go(pending.incomplete, pending.path)

    @property
    def in_progress(self) -> bool:
        """Whether an attempt here has work of its own left (a settled one only waits for word from its run, which
        may come to another node's daemon: a drain or an idle exit does not wait for it)."""
        return any(not p.settled for p in self.pending.values())
