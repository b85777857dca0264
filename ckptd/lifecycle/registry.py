"""Every attempt in progress on this daemon, disk or memory, and the one housekeeping over them.

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
from typing import Protocol, Sequence

from ckptd.protocol.errors import CkptdError

from ckptd.lifecycle.attempt import Attempt


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
    """The attempts of every pipeline, and the one place that ends those whose ranks will never all come."""

    def __init__(self, pipelines: Sequence[Pipeline]) -> None:
        self.pipelines = tuple(pipelines)

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
