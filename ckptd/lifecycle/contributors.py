"""Who may add a shard to a checkpoint attempt: one incarnation of one job, alive, agreeing on replicated keys.

A checkpoint must only ever be made of shards one job saved in one launch.
When a job dies mid-save and its launcher starts it again, the new job saves
the same paths; if its ranks joined the dead job's attempt, the committed
checkpoint would mix the two jobs' state and still verify. So every attempt,
on disk (``commit.PendingCheckpoint``) or in memory
(``snapshots.HeldSnapshot``), keeps its ``Contributors``: the job incarnation
its ranks named (``StagedShard.job``) and the process behind each rank. A rank
joins only an attempt of its own incarnation whose processes are all alive;
an attempt still missing ranks whose processes died can never complete with
its own job's shards, and is abandoned (at once when a newcomer asks, and by
the daemon's housekeeping otherwise), so the newcomer starts a fresh attempt.

The incarnation alone is not enough (a launcher may name none: the ranks'
processes then tell jobs apart), and the processes alone are not enough (a
pid may be reused, and a second live job must be refused, not merged): each
covers the other.

The same object checks what ``replicated=`` promises: rank 0 writes the
tensors under those keys for every rank, so every rank must hold the same
names, shapes and dtypes there (``StagedShard.replicated`` carries a digest per
key). Values are not compared: that would cost a read of every rank's bytes.

Bookkeeping only, on the loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ckptd.protocol.errors import Conflict
from ckptd.protocol.messages import StagedShard
from ckptd.protocol.objects import display

from ckptd.protocol.processes import pid_alive


@dataclass
class Contributors:
    """The job incarnation of an attempt and the process behind each of its ranks."""

    job: str
    pids: dict[int, int] = field(default_factory=dict)
    """rank -> pid of the process that sent it (the daemon's own for a persisted snapshot)."""
    replicated: dict[str, str] | None = None
    """The first rank's ``StagedShard.replicated``; every later rank must match it."""
    replicated_rank: int = 0

    def dead(self, alive: Callable[[int], bool] = pid_alive) -> dict[int, int]:
        """rank -> pid of every contributor whose process is gone."""
        return {rank: pid for rank, pid in self.pids.items() if not alive(pid)}

    def why_abandoned(self, missing: list[int]) -> str | None:
        """Why an attempt still missing ``missing`` ranks can never complete with its own run's shards (None: it
        can)."""
        dead = self.dead()
        if not missing or not dead:
            return None
        ranks = ", ".join(f"{r} (pid {p})" for r, p in sorted(dead.items()))
        return f"the process of rank(s) {ranks} died before ranks {missing} saved"

    def refuse_other_job(self, path: Path, job: str) -> None:
        """Raise ``Conflict`` if ``job`` (a rank's, or a Finalize's) is another incarnation than this live
        attempt's."""
        if job != self.job:
            ranks = sorted(self.pids)
            raise Conflict(
                f"checkpoint {display(path)} is being saved by another run of the job (incarnation "
                f"{self.job or 'unnamed'!r}, ranks {ranks}, whose processes are alive); this rank is from "
                f"incarnation {job or 'unnamed'!r}. A checkpoint is only ever made of one run's shards: wait for "
                f"that save to end, or save under another path")

    def same_run_conflict(self, path: Path, msg: StagedShard, world_size: int, step: int | None,
                          coordinated: bool) -> Conflict | None:
        """A ``Conflict`` if ``msg``, a rank of this attempt's own run, disagrees with the ranks before it (world
        size, step, replicated keys): the run's save is broken, so the caller fails it on every rank."""
        if msg.job != self.job:
            return None  # another run: ``refuse_other_job`` answers it alone
        if (world_size, step, coordinated) != (msg.world_size, msg.step, msg.coordinated):
            return Conflict(
                f"checkpoint {display(path)}: rank {msg.rank} says world size {msg.world_size}, step {msg.step}"
                f"{' (several nodes)' if msg.coordinated else ''}; ranks {sorted(self.pids)} said world size "
                f"{world_size}, step {step}{' (several nodes)' if coordinated else ''}. Every rank of a save must "
                f"agree; nothing was saved")
        return self._replicated_conflict(path, msg)

    def _replicated_conflict(self, path: Path, msg: StagedShard) -> Conflict | None:
        """A ``Conflict`` naming the key and ranks if ``msg``'s replicated keys differ from the first rank's."""
        if self.replicated is None or msg.replicated == self.replicated:
            return None
        first, this = self.replicated, msg.replicated
        keys = sorted(k for k in first.keys() | this.keys() if first.get(k) != this.get(k))
        described = []
        for key in keys:
            if key not in this or key not in first:
                lacking = msg.rank if key not in this else self.replicated_rank
                described.append(f"{key!r} (rank {lacking} does not save it as replicated)")
            else:
                described.append(f"{key!r} (tensor names, shapes or dtypes differ)")
        low, high = sorted((self.replicated_rank, msg.rank))
        return Conflict(
            f"checkpoint {display(path)}: ranks {low} and {high} disagree on replicated "
            f"key(s) {', '.join(described)}. Rank 0 writes replicated keys once for every rank, so every rank must "
            f"hold the same tensors there; nothing was saved. Save keys whose state differs between ranks "
            f"without replicated=")

    def join(self, msg: StagedShard, pid: int) -> None:
        self.pids[msg.rank] = pid
        if self.replicated is None:
            self.replicated, self.replicated_rank = dict(msg.replicated), msg.rank
