"""The stateful test's node-loss rule: a node of a ring of peers is lost whole, a replacement starts, the job resumes.

Two mixins of ``tests/stateful.py``'s machine: ``NodeLoss``, the bookkeeping, in
every machine, and ``NodeLossRules``, the rules (``node_is_lost``,
``job_resumes``), only in ``NodeLossMachine``, the machine of a configuration
with ``Config.peers`` (``stateful_world.CONFIGS["node_lost"]``): each node's
daemon replicates the snapshots it holds to the next node's (docs/memory.md,
"Surviving the loss of a node"). ``node_is_lost`` kills a node's daemon and its ranks with SIGKILL
(the buddy too, for a double loss), may first change a byte of the replica the
lost node's replacement would read back, starts a replacement in a new run
directory with a new key pair (its line replacing its predecessor's in the keys
file), and resumes a new run of the job through ``ckptd.latest`` +
``ckptd.load_into`` on every rank. What the resume may return is worked out
before the loss, from the model (what was acknowledged) and from what each
surviving daemon says it holds: it must be one save of one incarnation,
bitwise, on every rank; never a snapshot one of whose shards survives only in
a replica whose bytes changed or on no node at all; and never older than the
newest checkpoint that certainly survives (the newest persisted one when both
holders of a shard are gone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from helpers import wait_until
from jobs import killed
from stateful_world import SNAPSHOTS, Saved

SETTLE_S = 120.0
"""How long the daemons may take to finish replicating what they hold: a guard, never a pace."""


@dataclass
class Holdings:
    """What one node's daemon said it held, just before a loss."""

    own: dict[str, set[int]] = field(default_factory=dict)
    """Snapshot path -> the ranks whose shards it holds of it."""
    own_keys: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Its complete snapshots' (step, time), as ``latest`` orders them."""
    replicas: dict[str, set[int]] = field(default_factory=dict)
    """Snapshot path -> the ranks whose shards it holds as complete replicas (none whose bytes the test changed)."""
    replica_keys: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Those replicas' (step, time), as ``latest`` orders them."""
    entries: list[dict] = field(default_factory=list)
    """Its ``replicas_held`` entries as ``status`` lists them (their shards' file names)."""
    shm_dir: Path = Path("/dev/shm")


@dataclass
class Resumable:
    """What a resume after a loss may return: any of ``possible`` at a step of at least ``floor`` (``None``: nothing
    certainly survives, so also nothing at all)."""

    possible: dict[tuple[int, int], tuple[str, Saved]]
    """(incarnation, save id) -> (path, save) of every save some rank set could still read whole."""
    floor: int | None
    certain: list[str]
    """The paths that certainly survive (for messages)."""


class NodeLoss:
    """The rules' bookkeeping, in every configuration's machine; ``self`` is the machine (``self.w``,
    ``self.model``, ``self.job``). The rules themselves are in ``NodeLossRules``."""

    last_snapshot: Saved | None
    """The snapshot acknowledged last on the daemons running now: held last, so never superseded on its way to the
    buddy, so replicated (docs/memory.md). ``None`` after a daemon was replaced or restarted."""
    changed_shards: set[str]
    """Shared-memory names of replica shards whose bytes the test changed (never loaded, for as long as held)."""

    def __init__(self) -> None:
        super().__init__()
        self.last_snapshot = None
        self.changed_shards = set()

    # -- before the loss ------------------------------------------------------------------------------------

    def _ranks_of(self, node: int) -> set[int]:
        return {r for r in range(self.world) if self.job.node_of[r] == node}

    def _wait_replication_settled(self) -> None:
        """Until no daemon is streaming a snapshot to its buddy or receiving a replica, and every snapshot said
        ``restored`` still has the copy it was read back from on its buddy (once that copy is gone, it is streamed
        to the buddy again: a restored snapshot is never left as its node's only copy)."""
        def settled() -> bool:
            infos = self._statuses()
            for node, info in enumerate(infos):
                if any(s.get("replication") == "replicating" for s in info["memory"]["snapshots"]):
                    return False
                if info["peers"]["replicas_held"]["receiving"]:
                    return False
                copies = infos[self.w.buddy(node)]["peers"]["replicas_held"]["held"]
                if any(s.get("replication") == "restored" and not any(
                        r["path"] == s["path"] and r["complete"] and set(s["ranks_held"]) <= set(r["ranks_held"])
                        for r in copies) for s in info["memory"]["snapshots"]):
                    return False
            return True
        wait_until(settled, SETTLE_S, lambda: f"replication settled; status: {self._statuses()}")

    def _assert_newest_snapshot_replicated(self) -> None:
        saved = self.last_snapshot
        if saved is None:
            return
        path = next((p for p, s in self.model.must.items() if s is saved), None)
        if path is None:
            return
        for node, info in enumerate(self._statuses()[:self.cfg.job_nodes]):  # the nodes its ranks saved through
            (snap,) = [s for s in info["memory"]["snapshots"] if s["path"] == path]
            assert snap["replication"] == "replicated", (
                f"node {node}'s shards of {path}, the snapshot held last, are {snap['replication']} "
                f"({snap.get('replication_error')!r}), not replicated on its buddy")

    def _holdings(self, node: int) -> Holdings:
        info = self._statuses()[node]
        held = Holdings(shm_dir=Path(info["shm"]["dir"]))
        for snap in info["memory"]["snapshots"]:
            held.own[snap["path"]] = set(snap["ranks_held"])
            if snap["complete"]:
                held.own_keys[snap["path"]] = (snap["step"] if snap["step"] is not None else -1, snap["created"])
        for replica in info["peers"]["replicas_held"]["held"]:
            held.entries.append(replica)
            if replica["complete"] and not {s[1] for s in replica["shards"]} & self.changed_shards:
                held.replicas[replica["path"]] = set(replica["ranks_held"])
                held.replica_keys[replica["path"]] = (replica["step"] if replica["step"] is not None else -1,
                                                      replica["created"])
        return held

    def _change_a_replica(self, node: int, holdings: list[Holdings]) -> str | None:
        """Flip a byte of the newest replica of ``node``'s shards on its buddy (the one its replacement reads back
        first); returns that replica's path, or None when the buddy holds none."""
        buddy = holdings[self.w.buddy(node)]
        ours = [r for r in buddy.entries if self._ranks_of(node) <= set(r["ranks_held"])]
        if not ours:
            return None
        replica = max(ours, key=lambda r: (r["step"] if r["step"] is not None else -1, r["created"]))
        _, name, nbytes, *_ = replica["shards"][0]
        shard = buddy.shm_dir / name
        assert os.path.getsize(shard) >= nbytes > 7, f"replica shard {shard}: {os.path.getsize(shard)} bytes"
        with open(shard, "r+b") as f:
            f.seek(nbytes - 7)
            byte = f.read(1)
            f.seek(nbytes - 7)
            f.write(bytes([byte[0] ^ 0xFF]))
        self.changed_shards.add(name)
        buddy.replicas.pop(replica["path"], None)
        buddy.replica_keys.pop(replica["path"], None)
        return replica["path"]

    def _resumable(self, lost: list[int], holdings: list[Holdings]) -> Resumable:
        """What a resume after losing ``lost`` may return. A disk checkpoint the model must have is certain, one it
        may have possible. A snapshot is possible if each node's shards of it are held by that node (not lost) or
        by its buddy as a replica whose bytes were not changed (not lost); certain if it is also one the model must
        have. Nothing else is: both holders of a shard gone, or a changed replica, and the snapshot is out."""
        directory = str(self.w.root / "run")
        possible: dict[tuple[int, int], tuple[str, Saved]] = {}
        certain: list[tuple[int, str]] = []
        entries = [(p, s, True) for p, s in self.model.must.items()]
        entries += [(p, s, False) for p, olds in self.model.may.items() for s in olds]
        entries += [(p, s, False) for p, t in self.model.tiers.items() for s in [t.disk, *t.beneath]
                    if s is not None]  # a persisted copy a newer snapshot of its path replaced in memory only
        entries = [(p, s, must) for p, s, must in entries if os.path.dirname(p) == directory]
        survive = {p for p, s, _ in entries if not s.durable and self._survives(p, lost, holdings)}
        for path, saved, must in entries:
            if not saved.durable and path not in survive and (must or not self._persisted(path)):
                continue  # (a snapshot the model let go may have been persisted unseen: a restored one at a drain)
            possible[(saved.inc, saved.sid)] = (path, saved)
            if must:
                certain.append((saved.step, path))
        return Resumable(possible, max((step for step, _ in certain), default=None), [p for _, p in sorted(certain)])

    def _survives(self, path: str, lost: list[int], holdings: list[Holdings]) -> bool:
        for node in range(self.cfg.nodes):
            ranks, buddy = self._ranks_of(node), self.w.buddy(node)
            if node not in lost and ranks <= holdings[node].own.get(path, set()):
                continue
            if buddy not in lost and ranks <= holdings[buddy].replicas.get(path, set()):
                continue
            return False
        return True

    # -- the loss -------------------------------------------------------------------------------------------

    def _lose(self, lost: list[int]) -> None:
        """Each lost node's daemon and ranks die of SIGKILL (proven by their exit status), then the job's other
        ranks (its launcher kills them); every snapshot not on disk may be gone."""
        for node in lost:
            daemon = self.w.daemons[node]
            daemon.kill()
            assert killed(daemon.proc.returncode), f"node {node}'s daemon exited {daemon.proc.returncode}"
            codes = [self.job.ranks[r].kill() for r in sorted(self._ranks_of(node))]
            assert all(killed(c) for c in codes), f"node {node}'s ranks did not die of SIGKILL: {codes}"
        codes = self.job.kill()
        assert all(killed(c) for c in codes), f"the job's ranks did not die of SIGKILL: {codes}"
        self._job_gone(self.job)
        self.dead_pids += [self.w.daemons[node].proc.pid for node in lost]
        self.last_snapshot = None
        for path, saved in list(self.model.must.items()):
            if not saved.durable:
                self.model.allow_gone(path)

    # -- the resume -----------------------------------------------------------------------------------------

    def _resume(self, can: Resumable, lost: list[int], changed: str | None) -> tuple[str, Saved] | None:
        """Every rank of the new run calls ``latest`` and ``load_into``; all must resume from one save, bitwise,
        and one that ``can`` allows; returns it (path, save), None for nothing."""
        root = str(self.w.root / "run")
        cids = {}
        for rank in self.job.ranks:
            cid = cids[rank.rank] = self.job.next_id()
            rank.send(op="resume", id=cid, root=root)
            rank.wait_for("returned", cid)
        told = {r: self.job.ranks[r].wait_for("done", cid, 240) for r, cid in cids.items()}
        what = ("resume" + (f" after losing node(s) {lost}" if lost else "")
                + (f" with a byte of the replica of {changed} changed" if changed else ""))
        assert all(o["ok"] for o in told.values()), f"{what}: a rank failed: {told}"
        paths = {o["path"] for o in told.values()}
        assert len(paths) == 1, f"{what}: the ranks resumed from different checkpoints: {told}"
        (path,) = paths
        if path is None:
            assert can.floor is None, f"{what}: nothing resumed, where {can.certain} survive"
            return None
        tags = {r: o["tag"] for r, o in told.items()}
        assert len({(t[0], t[1]) for t in tags.values()}) == 1, f"{what}: {path} mixes saves: {tags}"
        assert all(t[2] == r for r, t in tags.items()), f"{what}: {path} gave a rank another's shard: {tags}"
        assert all(o["bitwise"] for o in told.values()), f"{what}: {path} is not bitwise its save: {told}"
        inc, sid = tags[0][0], tags[0][1]
        assert (inc, sid) in can.possible, (
            f"{what}: resumed from save {sid} of incarnation {inc} at {path}, which cannot be read whole; "
            f"possible: {sorted((p, k) for k, (p, _) in can.possible.items())}")
        want_path, saved = can.possible[(inc, sid)]
        assert path == want_path, f"{what}: save {sid} of incarnation {inc} is at {want_path}, not {path}"
        assert can.floor is None or saved.step >= can.floor, (
            f"{what}: resumed from {path} (step {saved.step}), older than {can.certain[-1]} (step {can.floor}), "
            f"which survives")
        if changed is not None and (can.floor is None or self._step_of(changed) > can.floor):
            log = (self.w.run_dirs[lost[0]] / "ckptd.log").read_text()
            assert "event=restore_failed" in log, f"{what}: the replacement never refused the changed replica"
        return path, saved

    def _step_of(self, path: str) -> int:
        saved = self.model.must.get(path) or (self.model.may.get(path) or [None])[-1]
        return saved.step if saved is not None else -1

    def _snapshot_held(self, tier: str, saved: Saved) -> None:
        """Called for every acknowledged save: the last snapshot is the one that must reach the buddy."""
        if tier in SNAPSHOTS:
            self.last_snapshot = saved


class NodeLossRules:
    """The rules, only in the machine of a configuration with peers (``stateful.run_stateful``): every other
    configuration's machine has the rules it had before them, so its derandomized sequences in ``make test`` stay
    what they were."""

    @precondition(lambda self: self.cfg.peers)
    @rule(node=st.integers(0, 5), buddy_too=st.booleans(), corrupt=st.booleans())
    def node_is_lost(self, node: int, buddy_too: bool, corrupt: bool) -> None:
        """A node (its daemon and its ranks) is SIGKILLed whole, with its buddy (``buddy_too``: both holders of its
        shards gone) or after a byte of the replica its replacement would read back changed in the buddy's memory
        (``corrupt``); the rest of the job dies with it, replacements start, and a new run resumes on every rank."""
        self._begin()
        node %= self.cfg.nodes
        lost = [node, self.w.buddy(node)] if buddy_too else [node]
        self._wait_replication_settled()
        self._assert_newest_snapshot_replicated()
        holdings = [self._holdings(n) for n in range(self.cfg.nodes)]
        changed = self._change_a_replica(node, holdings) if corrupt and not buddy_too else None
        resumable = self._resumable(lost, holdings)
        self._lose(lost)
        for n in lost:
            self.w.replace_node(n)
        self.job = self._new_job()
        self._resume(resumable, lost, changed)

    @precondition(lambda self: self.cfg.peers)
    @rule()
    def job_resumes(self) -> None:
        """The job exits and a new run resumes on every rank, no node lost (a daemon restarted since, with its key,
        reads its ranks' shards back from its buddy as a replacement does)."""
        self._begin()
        self._wait_replication_settled()
        self.job.exit()
        self._job_gone(self.job)
        resumable = self._resumable([], [self._holdings(n) for n in range(self.cfg.nodes)])
        self.job = self._new_job()
        self._resume(resumable, [], None)
