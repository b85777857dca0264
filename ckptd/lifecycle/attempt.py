"""One attempt at a checkpoint, on disk or in node memory: the part of its lifecycle both share.

A disk save (``commit.PendingCheckpoint``) and a memory snapshot
(``snapshots.HeldSnapshot``) gather their ranks the same way: the first rank
opens the attempt, later ranks join it if they are of the same run and agree
with it, every rank waits for one answer, and the attempt fails on every rank
at once when a rank is overdue, when a rank's process dies before it saved,
or when the ranks disagree. That much lives here, once; what happens to the
bytes (written and renamed, or held and checksummed) lives in the subclasses
and their pipelines (``saves.py``, ``holding.py``).

Both kinds live by one state model (``AttemptState``, ``NEXT_STATES``):
``move_to`` is the only way an attempt changes state, refuses any move the
table does not list (a defect, raised as ``InternalError``); ``Registry.end``
logs each end, with why (``event=attempt_ended``).

Bookkeeping only, on the loop thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, ClassVar, Hashable, Mapping

from ckptd.protocol.errors import CkptdError, Conflict, InternalError, RanksMissing
from ckptd.protocol.messages import DEFAULT_COMMIT_TIMEOUT, Error, Message, ReplicationState, StagedShard
from ckptd.protocol.objects import display

from ckptd.lifecycle.contributors import Contributors
from ckptd.storage.checkpoints import Checkpoints



class AttemptState(str, Enum):
    """Where an attempt is in its life: one model for disk attempts and memory snapshots (``NEXT_STATES``)."""

    PREPARING = "preparing"
    """Disk: its ``.incomplete`` directory is being made; its ranks wait for Accepted."""
    WRITING = "writing"
    """Disk: its shards are being written (on several nodes, kept until its run's Finalize or Abort)."""
    COMMITTING = "committing"
    """Disk: every shard durable, the index and the rename (the publish) under way."""
    HOLDING = "holding"
    """Memory: its ranks' shards arrive and are checksummed; nothing is told yet."""
    HELD = "held"
    """Memory: complete and its ranks told; in node memory only. A replica: every shard sealed; listed and read
    back by a node restoring it."""
    PERSISTING = "persisting"
    """Memory: held, and being written to disk by the save pipeline."""
    PERSISTED = "persisted"
    """Memory: held, and committed on disk too (dropped if retention deletes that copy)."""
    COMMITTED = "committed"
    """Ended, disk: published under its name."""
    FAILED = "failed"
    """Ended: every waiting rank was told why; nothing of it is kept."""
    DROPPED = "dropped"
    """Ended, memory: evicted by the budget, replaced by newer snapshots, or shadowed by a disk save."""
    LET_GO = "let go"
    """Ended, disk, several nodes: settled here, and published or discarded by another node's daemon, or left to
    it after its contributors died; nobody here is told."""
    RECEIVING = "receiving"
    """A replica, on the buddy: its origin's shards arrive on the data port and are checked as they come."""
    ADOPTED = "adopted"
    """Ended, replica: its origin gone, its bytes became a snapshot of this node's own (a drain persists it)."""


_S = AttemptState
NEXT_STATES: dict[AttemptState, frozenset[AttemptState]] = {
    _S.PREPARING: frozenset({_S.WRITING, _S.FAILED}),
    _S.WRITING: frozenset({_S.COMMITTING, _S.FAILED, _S.LET_GO}),
    _S.COMMITTING: frozenset({_S.COMMITTED, _S.FAILED}),
    _S.HOLDING: frozenset({_S.HELD, _S.FAILED}),
    _S.HELD: frozenset({_S.PERSISTING, _S.DROPPED}),
    _S.PERSISTING: frozenset({_S.PERSISTED, _S.HELD}),
    _S.PERSISTED: frozenset({_S.DROPPED}),
    _S.COMMITTED: frozenset(),
    _S.FAILED: frozenset(),
    _S.DROPPED: frozenset(),
    _S.LET_GO: frozenset(),
}
"""The only moves an attempt at a checkpoint or a snapshot makes (``Tracked.move_to``); it ends once."""
NEXT_REPLICA_STATES: dict[AttemptState, frozenset[AttemptState]] = {
    _S.RECEIVING: frozenset({_S.HELD, _S.DROPPED}),
    _S.HELD: frozenset({_S.DROPPED, _S.ADOPTED}),  # replaced, forgotten, stalled; or taken over by a drain
    _S.DROPPED: frozenset(),
    _S.ADOPTED: frozenset(),
}
"""The only moves of a replica held for a peer (``peers/replicas.Replica``): the same states, a table of its own."""
ENDED = frozenset(state for table in (NEXT_STATES, NEXT_REPLICA_STATES) for state, after in table.items()
                  if not after)


_R = ReplicationState
NEXT_REPLICATION: dict[ReplicationState, frozenset[ReplicationState]] = {
    # a held snapshot's second track, beside ``AttemptState``: it is streamed to its buddy while it is held,
    # persisted or being persisted alike (a drain persists what is being replicated); moved by
    # ``registry.Registry.replicate`` only
    _R.OFF: frozenset({_R.REPLICATING}),
    _R.REPLICATING: frozenset({_R.REPLICATED, _R.FAILED, _R.SUPERSEDED, _R.REPLICATING}),
    _R.REPLICATED: frozenset({_R.REPLICATING, _R.FAILED, _R.SUPERSEDED}),  # a late rank of its node joined, or the
    # buddy lost its copy: sent again; the buddy replaced its copy with another's: failed; with this node's newer
    # snapshot of its directory (a buddy keeps one per directory and ranks): superseded
    _R.FAILED: frozenset({_R.REPLICATING}),
    _R.SUPERSEDED: frozenset({_R.REPLICATING}),
    _R.RESTORED: frozenset({_R.REPLICATING, _R.FAILED, _R.SUPERSEDED}),  # the peer it was read from lost its copy,
    # or is not the buddy: sent to the buddy; or the peer holds a newer one of its directory in its place: failed,
    # or superseded if that is this node's own, replicated there
    _R.ADOPTED: frozenset(),
}
"""The only moves of a snapshot's replication; ``restored`` and ``adopted`` are where such snapshots start."""


@dataclass(frozen=True)
class PeerCopy:
    """A held snapshot's copy on a peer: the origin's one record of it, where it is along ``NEXT_REPLICATION``,
    which peer, and what that peer must still list for it. ``peers/replication.py`` streams and checks the copy;
    ``registry.Registry.replicate`` alone moves it, each move a new record (so a check that asked about one record
    can tell when its answer comes that the copy moved on meanwhile)."""

    state: ReplicationState = ReplicationState.OFF
    endpoint: str = ""
    """The peer it is streamed to, held on, or was read back from (empty: none yet)."""
    error: str = ""
    """Why it failed."""
    unanswered: bool = False
    """It failed because the peer did not answer (down, restarting, cut off): streamed again once the buddy
    answers, if no newer snapshot of its directory took its place (``Replication.check``). A refusal is final."""
    lag_s: float | None = None
    """Seconds from held here (its ranks told) to held on the buddy, once replicated."""
    checksums: tuple[tuple[int, int], ...] = ()
    """(rank, checksum) of every shard as the peer sealed it (or as it was read back from there): what the peer
    must still list while this says ``replicated`` or ``restored``."""


@dataclass(frozen=True)
class Waiter:
    """A rank owed one answer (``Done``/``HeldInMemory`` or ``Error``) for its request."""

    client: bytes
    request_id: int
    rank: int
    pid: int = 0
    nbytes: int = 0


@dataclass(kw_only=True)
class Tracked:
    """What the registry keeps of anything it owns (an attempt at a checkpoint or a snapshot, a replica held for a
    peer): where it is in its life, moved along its kind's table by ``registry.Registry`` only, and why
    housekeeping ends it (each kind says which of the three judgements apply to it)."""

    noun: ClassVar[str]
    """How messages name it: checkpoint (on disk), snapshot (in node memory), replica (a peer's, held here)."""
    entry: ClassVar[AttemptState]
    """The state every one of the kind starts at (``Registry.open`` refuses any other)."""
    moves: ClassVar[Mapping[AttemptState, frozenset[AttemptState]]] = NEXT_STATES
    """Its kind's table of moves."""
    judged_end: ClassVar[AttemptState] = AttemptState.FAILED
    """How housekeeping ends one it judges overdue, abandoned or orphaned."""
    overdue_reason: ClassVar[str] = "overdue"
    """What the log calls that end when it is ``overdue``."""
    path: Path
    state: AttemptState = field(init=False)
    """Where it is: its kind's ``entry`` at first, then moved by ``registry.Registry`` only."""

    def __post_init__(self) -> None:
        self.state = self.entry

    @property
    def key(self) -> Hashable:
        """Its place in its book: the path (a replica: its origin's key and the path)."""
        return self.path

    def move_to(self, state: AttemptState) -> None:
        """Change state along its kind's table; any other move is a defect in a pipeline, never done silently.
        Called by ``registry.Registry`` only (``move`` and ``end``), which keeps the books."""
        if state not in self.moves.get(self.state, ()):
            raise InternalError(f"{self.noun} {self.path} cannot go from {self.state.value} to {state.value}")
        self.state = state

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def overdue(self, now: float) -> CkptdError | None:
        """Why housekeeping ends it for taking too long (None: it does not)."""
        return None

    def orphaned(self) -> CkptdError | None:
        """Why housekeeping ends it because the processes it waits for are gone (None: it does not)."""
        return None

    def rank_died(self, job: str, world_size: int, rank: int, pid: int) -> CkptdError | None:
        """Why housekeeping ends it because rank ``rank`` of run ``job`` died before saving (None: it does not)."""
        return None


@dataclass(kw_only=True)
class Attempt(Tracked):
    """The ranks of one attempt at ``path``: who they are, what they agreed on, who waits for an answer."""

    nothing_kept: ClassVar[str]
    """What a failure leaves: nothing was committed / nothing was held."""
    backend: Checkpoints
    """The storage its path lies on, resolved once when the attempt was made: everything it writes, reads, sets
    aside or removes goes through it, never through a backend asked for again by path."""
    world_size: int
    step: int | None
    coordinated: bool = False
    """On several nodes: each daemon gathers only its own ranks, and the ranks agree among themselves."""
    timeout: float = DEFAULT_COMMIT_TIMEOUT
    started_at: float = field(default_factory=time.monotonic)
    contributors: Contributors = field(default_factory=lambda: Contributors(""))
    """The run and the processes whose shards this attempt holds (no other may join)."""
    waiting: list[Waiter] = field(default_factory=list)

    @property
    def arrived(self) -> set[int]:
        """The ranks that joined."""
        raise NotImplementedError

    @property
    def open(self) -> bool:
        """Whether ranks may still join (and so whether it can be overdue, abandoned or broken by a rank)."""
        raise NotImplementedError

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(self.world_size)) - self.arrived)

    def check_join(self, msg: StagedShard) -> None:
        """Raise ``Conflict`` unless ``msg``'s rank may join: same run, same world and step, a rank not yet in."""
        self.contributors.refuse_other_job(self.path, msg.job)
        if (self.world_size, self.step, self.coordinated) != (msg.world_size, msg.step, msg.coordinated):
            raise Conflict(f"{self.noun} {self.path} is in progress with world size {self.world_size} and step "
                           f"{self.step}; this rank says world size {msg.world_size}, step {msg.step}")
        if msg.rank in self.arrived:
            raise Conflict(f"rank {msg.rank} of {self.noun} {self.path} is already in it")

    def join(self, msg: StagedShard, pid: int, waiter: Waiter) -> None:
        """Add a rank that passed ``check_join``: it is waited for, and bounds the attempt's timeout."""
        self.contributors.join(msg, pid)
        self.timeout = min(self.timeout, msg.timeout)
        self.waiting.append(waiter)

    def broken_by(self, msg: StagedShard) -> Conflict | None:
        """A ``Conflict`` if ``msg``, a rank of this open attempt's own run, disagrees with the ranks before it:
        the run's save is broken, and the caller fails it on every rank, ``msg``'s included."""
        if not self.open:
            return None
        return self.contributors.same_run_conflict(self.path, msg, self.world_size, self.step, self.coordinated)

    def overdue(self, now: float) -> RanksMissing | None:
        """Why the attempt fails if ranks are still missing after its timeout (None: it does not)."""
        if not self.open or self.coordinated or not self.missing or now - self.started_at <= self.timeout:
            return None
        return RanksMissing(f"{self.noun} {display(self.path)}: ranks {self.missing} of {self.world_size} never "
                            f"committed within {self.timeout:g} s; {self.nothing_kept}")

    def orphaned(self) -> RanksMissing | None:
        """Why the attempt fails if it still misses ranks and some of its processes died (no rank of their run can
        complete it; a new run saving the path starts afresh)."""
        if not self.open or self.coordinated:
            return None
        why = self.contributors.why_abandoned(self.missing)
        if why is None:
            return None
        return RanksMissing(f"{self.noun} {display(self.path)} was abandoned: {why}; {self.nothing_kept}, and a new "
                            f"run of the job saving this path starts afresh")

    def rank_died(self, job: str, world_size: int, rank: int, pid: int) -> RanksMissing | None:
        """Why the attempt fails if it waits for rank ``rank`` of run ``job``, whose process died before saving."""
        if (not self.open or self.coordinated or self.contributors.job != job or self.world_size != world_size
                or rank not in self.missing):
            return None
        return RanksMissing(f"{self.noun} {display(self.path)} was abandoned: the process of its rank {rank} (pid "
                            f"{pid}) died before that rank saved; {self.nothing_kept}")

    def answered(self, client: bytes, request_id: int) -> None:
        """A rank's request had its one answer already (``Durable``): it no longer waits for this attempt's."""
        self.waiting = [w for w in self.waiting if (w.client, w.request_id) != (client, request_id)]

    def tell_failed(self, send: Callable[[bytes, Message], None], error: CkptdError) -> None:
        """Answer every waiting rank with one error (``replies.as_error``'s): each is answered once."""
        for waiter in self.waiting:
            send(waiter.client, Error.of(waiter.request_id, error))
        self.waiting = []
