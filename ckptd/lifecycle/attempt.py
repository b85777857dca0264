"""One attempt at a checkpoint, on disk or in node memory: the part of its lifecycle both share.

A disk save (``commit.PendingCheckpoint``) and a memory snapshot
(``snapshots.HeldSnapshot``) gather their ranks the same way: the first rank
opens the attempt, later ranks join it if they are of the same run and agree
with it, every rank waits for one answer, and the attempt fails on every rank
at once when a rank is overdue, when a rank's process dies before it saved,
or when the ranks disagree. That much lives here, once; what happens to the
bytes (written and renamed, or held and checksummed) lives in the subclasses
and their pipelines (``saves.py``, ``holding.py``).

Bookkeeping only, on the loop thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

from ckptd.protocol.errors import Conflict, ErrorCode, RanksMissing
from ckptd.protocol.messages import DEFAULT_COMMIT_TIMEOUT, Error, Message, StagedShard
from ckptd.protocol.objects import display

from ckptd.lifecycle.contributors import Contributors


@dataclass(frozen=True)
class Waiter:
    """A rank owed one answer (``Done``/``Held`` or ``Error``) for its request."""

    client: bytes
    request_id: int
    rank: int
    pid: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class Words:
    """How messages name an attempt of one kind, so both kinds fail with one wording."""

    noun: str
    """checkpoint / snapshot"""
    gerund: str
    """saving / snapshotting"""
    sent: str
    """what a rank does to join: committed / snapshotted"""
    past: str
    """what a rank that arrived did: saved / snapshotted"""
    in_progress: str
    """is being written / is being held"""
    already: str
    """of a rank that joined: is already being written / is already held"""
    nothing: str
    """nothing was committed / nothing was held"""


@dataclass(kw_only=True)
class Attempt:
    """The ranks of one attempt at ``path``: who they are, what they agreed on, who waits for an answer."""

    words: ClassVar[Words]
    path: Path
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
        words = self.words
        self.contributors.refuse_other_job(self.path, msg.job)
        if (self.world_size, self.step, self.coordinated) != (msg.world_size, msg.step, msg.coordinated):
            raise Conflict(f"{words.noun} {self.path} {words.in_progress} with world size {self.world_size} and step "
                           f"{self.step}; this rank says world size {msg.world_size}, step {msg.step}")
        if msg.rank in self.arrived:
            raise Conflict(f"rank {msg.rank} of {words.noun} {self.path} {words.already}")

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
        w = self.words
        return RanksMissing(f"{w.noun} {display(self.path)}: ranks {self.missing} of {self.world_size} never "
                            f"{w.sent} within {self.timeout:g} s; {w.nothing}")

    def orphaned(self) -> RanksMissing | None:
        """Why the attempt fails if it still misses ranks and some of its processes died (no rank of their run can
        complete it; a new run saving the path starts afresh)."""
        if not self.open or self.coordinated:
            return None
        why = self.contributors.why_abandoned(self.missing)
        if why is None:
            return None
        w = self.words
        return RanksMissing(f"{w.noun} {display(self.path)} was abandoned: {why}; {w.nothing}, and a new run of the "
                            f"job {w.gerund} this path starts afresh")

    def rank_died(self, job: str, world_size: int, rank: int, pid: int) -> RanksMissing | None:
        """Why the attempt fails if it waits for rank ``rank`` of run ``job``, whose process died before saving."""
        if (not self.open or self.coordinated or self.contributors.job != job or self.world_size != world_size
                or rank not in self.missing):
            return None
        w = self.words
        return RanksMissing(f"{w.noun} {display(self.path)} was abandoned: the process of its rank {rank} (pid "
                            f"{pid}) died before that rank {w.past}; {w.nothing}")

    def answered(self, client: bytes, request_id: int) -> None:
        """A rank's request had its one answer already (``Durable``): it no longer waits for this attempt's."""
        self.waiting = [w for w in self.waiting if (w.client, w.request_id) != (client, request_id)]

    def tell_failed(self, send: Callable[[bytes, Message], None], code: ErrorCode, message: str) -> None:
        """Answer every waiting rank with one error: each is answered once."""
        for waiter in self.waiting:
            send(waiter.client, Error(waiter.request_id, code, message))
        self.waiting = []
