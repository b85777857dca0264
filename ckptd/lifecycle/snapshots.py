"""Memory snapshots: shards the daemon keeps in node memory, in the slots it took over.

A ``Snapshot`` stages exactly like a disk save; instead of writing the slot,
the daemon checksums it and keeps the mapping. The slot is the daemon's from
then on: its client stages the next save into another slot of its pool, and
never reuses or unlinks this one until a ``HeldInMemory`` reply names it as
released. A snapshot is complete once every rank of its world is held here
(on several nodes: once this node's ranks are; the ranks agree among
themselves). Only then are its ranks told ``HeldInMemory``, and only then are older
snapshots of the same job dropped: per directory and client, the newest
``keep_snapshots`` (by step, then time, as ``latest`` ranks them) stay, so a
snapshot is dropped only after a newer one is completely held, and never for
another job's. A snapshot of a path whose snapshot is held is refused as an
existing checkpoint (``CheckpointExists``), as a disk save would be; with
``overwrite=True`` it is assembled beside the held one (``replacing``) and
takes the path only once it is complete, so a replacement that fails leaves
the held one as it was.

The memory budget counts the snapshots' bytes (their shards' sizes), not
the slots they are held in: a client's slot only grows, so one snapshot
larger than the budget (refused) would otherwise leave a slot that no later
snapshot of that client fits in however small it is. A snapshot that would
exceed it first evicts the oldest snapshots that are already persisted to
disk; if that is not enough it is refused with a message naming the budget
and what is held. A held slot is renamed to a name of the daemon's own pid,
so no sweep of dead clients' slots takes it. A dropped slot whose client is
alive goes back to that client under its old name (named in its next
``HeldInMemory``); a dead or gone client's slot is unlinked.

A reader pins a snapshot while it copies out of its slots (``Pin``, a
reader's lease). One dropped meanwhile is parked: no longer listed, still
counted in the budget, never evicted, and its slots are released only when
its last reader unpins, says goodbye or dies.

Bookkeeping only, on the loop thread: ``holding.py`` does the I/O around it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable

from ckptd.protocol.errors import CheckpointExists, CkptdError, NoSpace, PathNotAllowed
from ckptd.protocol.index import CHECKSUM_ALGORITHM
from ckptd.protocol.messages import Snapshot
from ckptd.protocol.objects import display

from ckptd.core.render import human_bytes
from ckptd.lifecycle.attempt import Attempt, AttemptState, PeerCopy, Waiter
from ckptd.lifecycle.budget import MemoryBudget
from ckptd.lifecycle.contributors import Contributors
from ckptd.lifecycle.registry import Book, Registry
from ckptd.lifecycle.slot_maps import MappedSlot
from ckptd.storage.checkpoints import Checkpoints


@dataclass
class HeldShard:
    """One rank's shard of a snapshot, in the slot the daemon took over."""

    msg: Snapshot
    slot: MappedSlot
    pid: int
    """The client whose slot it is (alive or not)."""
    client: bytes = b""
    """That client's connection: its snapshots are one job's, which evict only each other."""
    checksum: int | None = None
    """None until the shard is checksummed (the client may still be staging)."""


@dataclass(kw_only=True)
class HeldSnapshot(Attempt):
    """A checkpoint held in node memory instead of (or besides) on disk."""

    noun: ClassVar[str] = "snapshot"
    nothing_kept: ClassVar[str] = "nothing was held"
    shards: dict[int, HeldShard] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    entry: ClassVar[AttemptState] = AttemptState.HOLDING
    persist_waiting: list[tuple[bytes, int]] = field(default_factory=list)
    """(client, request id) of every ``Persist`` owed a ``Done`` or an ``Error`` for this snapshot."""
    persist_started: float = 0.0
    held_at: float = 0.0
    """When it was held here (monotonic): its ranks told, or read back from a peer. A replication lag runs from it."""
    readers: dict[bytes, int] = field(default_factory=dict)
    """Pins by reader connection (``Pin``): while any is held its slots stay as they are, dropped or not."""
    ended_with: CkptdError | None = None
    """Once it failed or was dropped, what a rank still waiting is told: a rank whose slot the daemon took over
    is told once that slot is back under its name (``Holding._tell_when_back``), as its client reuses the slot the
    moment it is told, and its next save's admission must find it there."""
    copy: PeerCopy = field(default_factory=PeerCopy)
    """Its copy on the buddy node (``ckptd/peers/replication.py``), moved by ``Registry.replicate`` only."""
    restored_from: str = ""
    """The peer it was read back from (``Holding.hold_restored``); empty: taken here. Kept whatever its
    replication says since: a restored snapshot is streamed on to the buddy once the peer's copy is gone."""

    @property
    def arrived(self) -> set[int]:
        return set(self.shards)

    @property
    def open(self) -> bool:
        return self.state is AttemptState.HOLDING

    @property
    def acknowledged(self) -> bool:
        """Complete and its ranks told: from now on it is a snapshot a restore may use."""
        return self.state in (AttemptState.HELD, AttemptState.PERSISTING, AttemptState.PERSISTED)

    @property
    def persisting(self) -> bool:
        return self.state is AttemptState.PERSISTING

    @property
    def persisted(self) -> bool:
        return self.state is AttemptState.PERSISTED

    @property
    def fingerprint(self) -> dict[int, tuple[int, int]]:
        """Each rank's (size, checksum): what a checkpoint on disk holds if it holds this snapshot's bytes."""
        return {r: (s.msg.nbytes, s.checksum if s.checksum is not None else -1) for r, s in self.shards.items()}

    @property
    def checksummed(self) -> bool:
        return all(s.checksum is not None for s in self.shards.values())

    @property
    def gathered(self) -> bool:
        """Every rank held here and checksummed (several nodes: every rank that committed here); acknowledged
        (``HELD``) once its ranks are told. A listing's ``complete`` means acknowledged."""
        have_all = self.coordinated or len(self.shards) == self.world_size
        return have_all and bool(self.shards) and self.checksummed

    @property
    def nbytes(self) -> int:
        """The checkpoint's bytes (its shards' sizes): what the memory budget counts."""
        return sum(s.msg.nbytes for s in self.shards.values())

    @property
    def slot_bytes(self) -> int:
        """The slots holding it (a slot grown for a larger state earlier is larger than its shard)."""
        return sum(s.slot.size for s in self.shards.values())

    def takes_late_rank(self, msg: Snapshot) -> bool:
        """Whether ``msg`` is another rank of this node for the same save of a snapshot spread over several nodes,
        arriving after the ranks before it were held: it joins (a node's ranks save a little apart, and each
        node's daemon holds what reached it; the ranks agree among themselves, ``client/memory.py``)."""
        return (self.coordinated and msg.coordinated and msg.save != 0 and msg.save == self.save
                and msg.job == self.contributors.job and (msg.world_size, msg.step) == (self.world_size, self.step)
                and msg.rank not in self.shards)

    def left_by_a_gone_run(self, newer: "HeldSnapshot") -> bool:
        """Whether this is a snapshot of several nodes that a run now gone left, which ``newer``'s run (another,
        restarted in the same directory) takes over as its own for ``--keep-snapshots``: such a snapshot is never
        persisted whole (neither at its trainers' exit nor at a drain, which persist one node's snapshots only),
        so left alone each restart would leave one more in memory until the budget refused every snapshot."""
        pids = self.contributors.pids
        return (self.coordinated and not self.persisted and self.contributors.job != newer.contributors.job
                and bool(pids) and len(self.contributors.dead()) == len(pids))

    @property
    def save(self) -> int:
        """Which save of its path by its run the shards are (``StagedShard.save``): -1 if its shards' counts differ
        (no resume takes such a snapshot as one checkpoint)."""
        counts = {s.msg.save for s in self.shards.values()}
        return counts.pop() if len(counts) == 1 else -1

    @property
    def order(self) -> tuple[int, float]:
        return (self.step if self.step is not None else -1, self.created)

    def describe(self) -> dict[str, Any]:
        """The snapshot as ``ListSnapshots`` and ``ckptd status`` report it (keys documented in docs/status.md)."""
        return {
            "path": display(self.path), "step": self.step, "world_size": self.world_size, "created": self.created,
            "job": self.contributors.job, "save": self.save,
            "bytes": self.nbytes, "held_bytes": self.slot_bytes,
            "ranks_held": sorted(r for r, s in self.shards.items() if s.checksum is not None),
            "complete": self.acknowledged, "persisted": self.persisted, "persisting": self.persisting,
            "persists_waiting": len(self.persist_waiting),
            "replication": self.copy.state.value, "replication_error": self.copy.error,
            "replication_lag_s": self.copy.lag_s,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "shards": [[r, s.slot.name, s.msg.nbytes, s.checksum, len(s.msg.tensors)]
                       for r, s in sorted(self.shards.items()) if s.checksum is not None],
        }


class SnapshotBook:
    """The snapshots this daemon holds, by final path, within the memory budget."""

    def __init__(self, memory: MemoryBudget, keep: int, registry: Registry) -> None:
        self.memory, self.keep, self.registry = memory, keep, registry
        """``memory``: the node's budget, which the replicas held for peers share (``budget.py``)."""
        memory.count("snapshots", lambda: sum(s.nbytes for s in [*self.all(), *self.parked]))
        self.current: Book[HeldSnapshot] = registry.book()
        """The snapshot of each path, by path: still gathering its ranks (``holding``) or acknowledged (held,
        persisting, persisted)."""
        self.released: dict[int, list[str]] = {}
        """Slots dropped from snapshots whose client is alive, by its pid: named in its next ``HeldInMemory``."""
        self.replacing: Book[HeldSnapshot] = registry.book()
        """Snapshots saved with ``overwrite=True`` over the acknowledged one held at their path, by path: not
        listed, read or persisted until complete (``promote``), so the held one serves until then."""

    @property
    def parked(self) -> list[HeldSnapshot]:
        """Dropped while pinned by a reader, still releasing (``Registry.releasing``): no longer listed, their
        slots released when the last reader unpins."""
        return self.registry.still_releasing(HeldSnapshot)

    def all(self) -> list[HeldSnapshot]:
        """Every snapshot this daemon assembles or holds (held and replacing; not the parked)."""
        return [*self.current.values(), *self.replacing.values()]

    def opening(self, final: Path) -> HeldSnapshot | None:
        """The snapshot at ``final`` that ranks still join: its replacement if one is open, else the held one."""
        return self.replacing.get(final) or self.current.get(final)

    def holds(self, snap: HeldSnapshot) -> bool:
        """Whether ``snap`` is still this daemon's (held or replacing): not failed, dropped or replaced."""
        return self.current.get(snap.path) is snap or self.replacing.get(snap.path) is snap

    def replaced_by(self, snap: HeldSnapshot) -> HeldSnapshot | None:
        """The held snapshot ``snap`` (a complete replacement) is to take the path of; None if it is no
        replacement. ``promote`` makes the swap."""
        return self.current.get(snap.path) if self.replacing.get(snap.path) is snap else None

    def promote(self, snap: HeldSnapshot) -> HeldSnapshot | None:
        """A complete replacement takes its path; returns the snapshot it replaced, out of the books and still to
        be ended (dropped) by the caller."""
        if self.replacing.get(snap.path) is not snap:
            return None
        return self.registry.promote(snap, self.replacing, self.current)

    @property
    def held_bytes(self) -> int:
        """What the budget counts: the snapshots held and those parked for their readers, and what the node holds
        for its peers."""
        return self.memory.held()

    def refuse_nested(self, final: Path) -> None:
        """``PathNotAllowed`` if a checkpoint at ``final`` (to disk or to memory) would lie inside a held snapshot
        or hold one: a checkpoint holds no other, so the held one could never be persisted (its name taken by a
        directory ckptd did not make a checkpoint, or a checkpoint with an entry ckptd did not write)."""
        for snap in (*self.current.values(), *self.replacing.values()):
            if snap.path in final.parents or final in snap.path.parents:
                where = "lies inside" if snap.path in final.parents else "would hold"
                raise PathNotAllowed(f"checkpoint path {display(final)} {where} memory snapshot "
                                     f"{display(snap.path)}; a checkpoint holds no other: save beside it")

    def admit(self, msg: Snapshot, final: Path, backend: Checkpoints, slot: MappedSlot, pid: int,
              client: bytes) -> HeldSnapshot:
        """Register one rank's shard to ``final`` (on ``backend``, as admission found it); returns its snapshot
        (persisted ones may be evicted to make room).

        Raises ``NoSpace`` (the budget), ``CheckpointExists`` (a snapshot is held at the path, no ``overwrite``) or
        ``Conflict`` (the rank is held already, or the world differs, or another run's snapshot is open there).
        """
        held = self.current.get(final)
        into = self.current
        if held is not None and held.acknowledged and not held.takes_late_rank(msg):
            if not msg.overwrite:
                raise CheckpointExists(f"snapshot {display(final)} is already held in memory; pass overwrite=True "
                                       f"to replace it, or snapshot under a new path (one per step)")
            into = self.replacing
        snap = into.get(final)
        if snap is not None:
            snap.check_join(msg)
        self.make_room(final, msg.nbytes)
        if snap is None:
            snap = self.registry.open(into, HeldSnapshot(path=final, backend=backend, world_size=msg.world_size,
                                                         step=msg.step, coordinated=msg.coordinated,
                                                         timeout=msg.timeout, contributors=Contributors(msg.job)))
        snap.join(msg, pid, Waiter(client, msg.id, msg.rank, pid, msg.nbytes))
        snap.shards[msg.rank] = HeldShard(msg, slot, pid, client)
        return snap

    def make_room(self, final: Path, needed: int) -> None:
        """Evict the oldest persisted snapshots until ``needed`` more bytes fit; ``NoSpace`` if they cannot.

        Which to evict is decided first, and nothing is evicted unless ``needed`` then fits: a snapshot refused
        anyway must not cost one that is held. Each evicted one ends dropped (``Registry.end``: its slots are
        released by the memory tier)."""
        self.memory.make_room(needed)  # spare replica files first: they hold nothing anyone asked for
        budget = self.memory.total
        candidates = sorted((s for s in self.current.values() if s.persisted and not s.persisting and not s.readers),
                            key=lambda s: s.order)  # a pinned one's memory would stay until its readers are done
        evicted: list[HeldSnapshot] = []
        freed = 0
        while self.held_bytes - freed + needed > budget and candidates:
            evicted.append(candidates.pop(0))
            freed += evicted[-1].nbytes
        if self.held_bytes - freed + needed <= budget:
            for victim in evicted:  # never pinned: the budget evicts none a reader holds
                self.registry.end(victim, AttemptState.DROPPED, reason="budget")
            return
        unpersisted, replicas = sum(1 for s in self.current.values() if not s.persisted), self.memory.held("replicas")
        raise NoSpace(
            f"snapshot {final} needs {human_bytes(needed)} of node memory, but the daemon's memory budget is "
            f"{human_bytes(budget)}: {human_bytes(self.held_bytes - replicas)} hold snapshots "
            f"({len(self.current)} held, {unpersisted} of them not on disk yet, which are never evicted for "
            f"another; the rest being replaced or still read after a drop) and {human_bytes(replicas)} hold "
            f"replicas for peers. The budget must hold keep_snapshots + 1 snapshots per job (the newest is only "
            f"dropped once a newer one is held): start the daemon with a larger --memory-budget or a smaller "
            f"--keep-snapshots, persist (client.persist, for a snapshot of one node) or save to disk "
            f"(persist=True) instead")

    def beyond_kept(self, snap: HeldSnapshot) -> list[HeldSnapshot]:
        """Once ``snap`` is complete: the snapshots of its job to drop (the caller ends them).

        Its job's snapshots are the acknowledged ones in its directory held
        from the same client connections (or read back from a peer's replica for the same ranks: the job that
        restored it saves on); the newest ``keep`` of them (by
        ``order``, as ``latest`` ranks them) stay, and so does ``snap``
        itself: a snapshot is never dropped for an older one, nor for another
        job's (a job that is gone leaves its newest persisted on exit, and
        the budget evicts what is on disk).
        """
        clients = {sh.client for sh in snap.shards.values()}
        job = sorted((s for s in self.current.values() if s.acknowledged and s.path.parent == snap.path.parent
                      and not s.persisting and (clients & {sh.client for sh in s.shards.values()}
                                                or (bool(s.restored_from) or s.left_by_a_gone_run(snap))
                                                and set(s.shards) & set(snap.shards))),
                     key=lambda s: s.order, reverse=True)
        return [s for s in job[self.keep:] if s is not snap]

    def newest(self, *, pid: int | None = None) -> list[HeldSnapshot]:
        """Per directory, the newest acknowledged snapshot not yet on disk (of client ``pid``'s ranks, if given)."""
        best: dict[Path, HeldSnapshot] = {}
        for s in self.current.values():
            if not s.acknowledged or s.coordinated or (pid is not None and all(sh.pid != pid
                                                                                for sh in s.shards.values())):
                continue
            current = best.get(s.path.parent)
            if current is None or s.order > current.order:
                best[s.path.parent] = s
        return [s for s in best.values() if not (s.persisted or s.persisting)]

    def newest_of_several_nodes(self) -> list[HeldSnapshot]:
        """Per directory, the newest acknowledged snapshot if it spans several nodes and is not on disk: a drain
        persists no such snapshot (this node holds only its ranks' share), so it is lost with this memory."""
        best: dict[Path, HeldSnapshot] = {}
        for s in self.current.values():
            current = best.get(s.path.parent)
            if s.acknowledged and (current is None or s.order > current.order):
                best[s.path.parent] = s
        return [s for s in best.values() if s.coordinated and not s.persisted]

    def pin(self, reader: bytes, path: Path) -> HeldSnapshot | None:
        """One more pin of the complete snapshot at ``path`` by ``reader``; None if none is held there."""
        snap = self.current.get(path)
        if snap is None or not snap.acknowledged:
            return None
        snap.readers[reader] = snap.readers.get(reader, 0) + 1
        return snap

    def unpin(self, reader: bytes, path: Path | None = None) -> list[HeldSnapshot]:
        """End one pin of ``path`` by ``reader`` (None: all its pins, the reader is gone); returns the parked
        snapshots that no reader pins any more, dropped from the books: their slots are to be released."""
        for snap in [*self.parked, *self.current.values()]:
            if reader in snap.readers and path in (None, snap.path):
                snap.readers[reader] -= 1
                if path is None or snap.readers[reader] == 0:
                    del snap.readers[reader]
                if path is not None:
                    break
        free = [s for s in self.parked if not s.readers]
        for snap in free:
            self.registry.released(snap)  # nothing waits for a snapshot's release
        return free

    def take_released(self, pid: int) -> tuple[str, ...]:
        return tuple(self.released.pop(pid, []))

    def listing(self) -> tuple[dict[str, Any], ...]:
        return tuple(s.describe() for s in sorted(self.current.values(), key=lambda s: (str(s.path.parent), s.order)))

    def summary(self) -> dict[str, Any]:
        """The ``memory`` part of ``ckptd status``."""
        return {"budget_bytes": self.memory.total, "held_bytes": self.held_bytes, "keep_snapshots": self.keep,
                "snapshots": [{k: v for k, v in d.items() if k != "shards"} for d in self.listing()]}


def shards_of(snapshots: Iterable[HeldSnapshot]) -> list[HeldShard]:
    return [sh for s in snapshots for sh in s.shards.values()]
