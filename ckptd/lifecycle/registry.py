"""Every attempt in progress on this daemon, disk or memory: their books, the one code that moves them, and the one
housekeeping over them.

Each pipeline keeps its attempts by path in books the registry gives it (``book``: ``Commits.pending``,
``SnapshotBook.held`` and ``SnapshotBook.replacing``), and changes an attempt's state only through ``Registry.move``,
along ``attempt.NEXT_STATES``; an attempt that ends leaves every book in the same call, so no book ever holds an
ended attempt, nor forgets one that goes on (a test scans the daemon for any other caller of ``move_to``).

Both pipelines (``saves.Saves``: attempts at a disk checkpoint; ``holding.Holding``: memory snapshots) gather
their ranks the same way (``attempt.Attempt``). So what ends an attempt whose ranks will never all come is judged
once, here, for either kind, each housekeeping round (``Registry.housekeep``, called by the loop): ranks still
missing after the attempt's timeout, a rank of a named run whose process died before it saved, contributors
that died while ranks were missing. The pipeline that owns the attempt fails it (``fail``: every waiting rank is
told once, and ``Failed`` is published) or lets go of it (a disk attempt settled on several nodes whose
contributors all died: ``abandon``).

Bookkeeping only, on the loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from ckptd.protocol.errors import CkptdError, InternalError
from ckptd.protocol.messages import ReplicationState

from ckptd.lifecycle.attempt import NEXT_REPLICATION, Attempt, AttemptState


@dataclass(frozen=True)
class DeadRank:
    """A rank of a named run whose process died (its client's connection is torn down)."""

    job: str
    world_size: int
    rank: int
    pid: int


class Pipeline(Protocol):
    """What the registry needs of a pipeline: its attempts, and how it ends one."""

    def attempts(self) -> list[Attempt]:
        """Its attempts in progress (a copy: ending one changes the books)."""
        ...

    def fail(self, attempt: Attempt, exc: CkptdError) -> None:
        """Fail ``attempt`` on every rank waiting for it."""
        ...

    def abandon(self, attempt: Attempt) -> None:
        """``attempt``'s contributors died (``Attempt.orphaned``, or, for a settled disk attempt, all of them):
        fail it, or let go of it where another node's daemon may still publish it."""
        ...

    def tidy(self, now: float) -> None:
        """What the pipeline itself keeps up each round (forgetting old failures, looking at settled attempts)."""
        ...


class Registry:
    """The attempts of every pipeline: their books, their moves, and the one place that ends those whose ranks will
    never all come."""

    def __init__(self) -> None:
        self._books: list[dict[Path, Any]] = []
        self.pipelines: tuple[Pipeline, ...] = ()

    def book(self) -> dict[Path, Any]:
        """A new book of attempts by path, for a pipeline to keep its attempts in (an ended one leaves it)."""
        book: dict[Path, Any] = {}
        self._books.append(book)
        return book

    def keep(self, pipelines: Sequence[Pipeline]) -> None:
        """The pipelines whose attempts ``housekeep`` looks at (built after their books)."""
        self.pipelines = tuple(pipelines)

    def move(self, attempt: Attempt, state: AttemptState) -> None:
        """Move ``attempt`` to ``state`` (``Attempt.move_to`` refuses a move the table lacks); one that ends
        leaves every book it is in."""
        attempt.move_to(state)
        if attempt.ended:
            for book in self._books:
                if book.get(attempt.path) is attempt:
                    del book[attempt.path]

    @staticmethod
    def replicate(snap: Any, state: ReplicationState, error: str = "") -> None:
        """Move held snapshot ``snap``'s replication to ``state`` along ``NEXT_REPLICATION`` (any other move is a
        defect, raised as ``InternalError``); ``error`` says why it failed."""
        if state not in NEXT_REPLICATION[snap.replication]:
            raise InternalError(f"snapshot {snap.path}'s replication cannot go from {snap.replication.value} to "
                                f"{state.value}")
        snap.replication, snap.replication_error = state, error

    def housekeep(self, now: float, died: Sequence[DeadRank] = ()) -> None:
        """One round: fail what is overdue or waits for a rank that died, abandon what its contributors left."""
        for pipeline in self.pipelines:
            for attempt in pipeline.attempts():
                why = attempt.overdue(now) or next(
                    (w for d in died if (w := attempt.rank_died(d.job, d.world_size, d.rank, d.pid)) is not None), None)
                if why is not None:
                    pipeline.fail(attempt, why)
                else:
                    pipeline.abandon(attempt)
            pipeline.tidy(now)
