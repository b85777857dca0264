"""The stateful test's one model for every tier: per path, what disk, memory, the buddy and the store hold.

Two mixins of ``tests/stateful.py``'s machine for the ``buddy`` configuration
(``stateful_world.CONFIGS["one_model"]``): the job runs on node 0, whose
daemon replicates its snapshots to node 1's (static ``--peer``); snapshots and
disk checkpoints share one directory and its ``keep_last``, and the daemons
persist a job's newest snapshot when it closes or dies, and on a drain.
``Model.tiers`` holds, per path, the newest acknowledged save on disk, in node
0's memory, on the buddy (once node 0's status said ``replicated``) and on the
store; ``TierChecks`` checks each tier against the daemons after every rule
(what the store holds is read by the machine's own loads: no ``s3://`` path is
held in memory here),
and ``TierRules`` adds the rules where the tiers meet: a snapshot persisted
after a newer checkpoint committed (on close, kill and drain), a path rolled
back to a lower step, a second run on the same paths, node 0 lost whole and
replaced, a restart with another world size, the buddy restarted, the buddy
paused past ``--peer-timeout``. What each may do is what ``docs/memory.md``
says, and where issue 38 states the rule a fix makes true, that rule; the
rules that still find its open cases are listed in ``Config.awaiting_fixes``.
"""

from __future__ import annotations

import os
import signal

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

import ckptd
from ckptd.protocol.names import LOG_NAME
from helpers import status
from jobs import killed
from stateful_nodes import Holdings, Resumable
from stateful_world import NAMES, PEER_TIMEOUT_S, Saved

PAUSED_S = 60.0
"""How long node 0 may take to report a replication to a paused buddy failed: ``--peer-timeout`` per step of the
stream, on two busy cores (a guard, never a pace)."""


INTERLEAVED = st.lists(st.tuples(st.sampled_from(["disk", "memory"]), st.sampled_from(NAMES), st.booleans(),
                                 st.sampled_from([None, 1, 2])), min_size=2, max_size=4)
"""Saves of one directory: (tier, name, overwrite, keep_last) each."""


def _on(case: str):
    """A rule's precondition: the ``buddy`` configuration, and the fix of the issue 38 case it finds merged."""
    return lambda self: self.cfg.buddy and not self.cfg.awaits(case)


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class TierChecks:
    """Every tier against the model and the daemons' own word; ``self`` is the machine."""

    def _directory(self) -> str:
        return str(self.w.root / "run")

    def _origin_and_buddy(self) -> tuple[dict, dict]:
        """Node 0's and node 1's status once node 0 streams nothing."""
        self._origin_settled()
        origin, buddy = self._statuses()
        return origin, buddy

    def _origin_settled(self) -> None:
        """Until node 0 streams no snapshot to its buddy: each is replicated (the buddy acknowledged it whole) or
        failed. (Not until the buddy receives nothing: what a paused buddy received of a stream node 0 failed
        stays there as ``receiving`` until ``STALLED_S``, and is never listed or restored.)"""
        self._wait(lambda: not any(s.get("replication") == "replicating"
                                   for s in status(self.w.run_dir)["memory"]["snapshots"]),
                   PAUSED_S, "node 0 streaming no snapshot")

    def _replicas(self, buddy: dict) -> dict[str, list[dict]]:
        by_path: dict[str, list[dict]] = {}
        for replica in buddy["peers"]["replicas_held"]["held"]:
            by_path.setdefault(replica["path"], []).append(replica)
        return by_path

    def _unreal_copies(self, origin: dict, buddy: dict) -> list[str]:
        """What status says of a copy that does not exist: a snapshot node 0 shows ``replicated`` must be listed by
        the buddy as a replica of the same save (issue 38, case 7), and as the only replica of its path: a replica
        of a replaced save is dropped once its replacement is complete there (case 3). (One whose replacement never
        reached the buddy stays, and may be restored.)"""
        replicas, said = self._replicas(buddy), []
        for snap in origin["memory"]["snapshots"]:
            if not snap["complete"] or snap["replication"] != "replicated":
                continue
            key = (snap["job"], snap["save"], snap["step"])
            copies = [(r["job"], r["save"], r["step"]) for r in replicas.get(snap["path"], [])]
            if key not in copies and not self.cfg.awaits("replicated_but_gone"):
                said.append(f"node 0 shows {snap['path']} (job {key[0]!r}, save {key[1]}, step {key[2]}) replicated, "
                            f"but the buddy holds {copies or 'no replica of it'}")
            elif copies != [key] and not self.cfg.awaits("replica_of_a_replaced_save"):
                said.append(f"the buddy holds {copies} of {snap['path']}, where node 0 holds save {key[1]} of job "
                            f"{key[0]!r} at step {key[2]}, replicated: a replica of a replaced save")
        return said

    def _replicated_now(self, origin: dict) -> None:
        """A snapshot node 0 shows ``replicated`` is the model's buddy copy of its path from now on."""
        for snap in origin["memory"]["snapshots"]:
            tiers = self.model.tiers.get(snap["path"])
            if (tiers is not None and tiers.memory is not None and snap["replication"] == "replicated"
                    and snap["step"] == tiers.memory.step):
                tiers.buddy = tiers.memory

    def _memory_holds(self, origin: dict) -> None:
        """Every snapshot the model says node 0 holds is listed complete there, at its step, ``persisted`` once it
        was persisted."""
        held = {s["path"]: s for s in origin["memory"]["snapshots"]}
        for path, tiers in self.model.tiers.items():
            saved = tiers.memory
            if saved is None:
                continue
            snap = held.get(path)
            assert snap is not None and snap["complete"], f"node 0 no longer holds snapshot {path}: {snap}"
            assert snap["step"] == saved.step, f"node 0 holds {path} at step {snap['step']}, not {saved.step}"
            if tiers.disk is saved:
                assert snap["persisted"], f"node 0 shows {path} not persisted, which it persisted"

    def _disk_holds(self) -> None:
        """A persisted snapshot's copy on disk loads, read from disk (no daemon asked), as the save persisted
        (``load`` reads the daemon's memory first, so the invariant above never reads it)."""
        nowhere = self.w.fifos / "no-daemon"
        nowhere.mkdir(exist_ok=True)
        for path, tiers in self.model.tiers.items():
            saved = tiers.disk
            if saved is None or tiers.memory is None or path in self.model.trimmed:
                continue
            try:
                shards = {r: ckptd.load(path, rank=r, run_dir=nowhere) for r in range(self.world)}
            except ckptd.InvalidCheckpoint as exc:
                raise AssertionError(f"{path}, persisted, is not on disk: {exc}") from None
            self._assert_one_save(f"{path} on disk", shards, [saved])

    def _buddy_floor(self) -> tuple[int, str] | None:
        """The newest snapshot of the directory the model knows the buddy holds (its newest replica there is never
        dropped for an older one, docs/memory.md): (step, path)."""
        on_buddy = [(t.buddy.step, t.buddy.seq, p) for p, t in self.model.tiers.items()
                    if t.buddy is not None and os.path.dirname(p) == self._directory()]
        if not on_buddy:
            return None
        step, _, path = max(on_buddy)
        return step, path


class TierRules(TierChecks):
    """The rules where the tiers meet, in the machine of the ``buddy`` configuration only."""

    @invariant()
    def every_tier_holds_what_the_model_says(self) -> None:
        if not self.cfg.buddy or self.job is None:
            return
        origin, buddy = self._origin_and_buddy()
        if self._unreal_copies(origin, buddy):  # the origin checks its buddy every CHECK_S (docs/memory.md): until
            # then it may show a copy the buddy lost as replicated; after it, never
            said: list[str] = []

            def real() -> bool:
                self._origin_settled()
                both = self._statuses()
                said[:] = self._unreal_copies(both[0], both[1])
                return not said
            self._wait(real, 60, lambda: f"status shows copies that do not exist: {said}")
            origin, buddy = self._origin_and_buddy()
        self._replicated_now(origin)
        self._memory_holds(origin)
        self._disk_holds()

    def _opening(self, data: st.DataObject) -> None:
        """After the opening loss, one of the rules where the tiers meet (drawn among those on), so a short run
        of few sequences exercises several of them."""
        rules = {"paused buddy": lambda: self.the_buddy_is_paused_past_the_peer_timeout("step-1"),
                 "another world size": self.the_job_restarts_with_another_world_size}
        if not self.cfg.awaits("persist_outranks_newer"):
            rules["persist under a newer checkpoint"] = lambda: (
                self.a_snapshot_then_a_newer_checkpoint_then_the_snapshot_persisted(
                    data.draw(st.sampled_from(["close", "kill", "drain"]), label="how")))
        if not self.cfg.awaits("replica_of_a_replaced_save"):
            rules["rollback"] = lambda: self.a_snapshot_is_rolled_back_to_a_lower_step(
                data, data.draw(st.booleans(), label="second_run"))
        if not self.cfg.awaits("replicated_but_gone"):
            rules["buddy restarted"] = lambda: self.the_buddy_is_restarted("step-2")
        if not self.cfg.awaits("paused_origin_calls_its_snapshot_lost"):
            rules["origin paused"] = lambda: self.the_origin_is_paused_while_its_buddy_drains("step-2")
        if self.world < 2:
            rules.pop("another world size")
        if not self._rollbacks():
            rules.pop("rollback", None)
        rules[data.draw(st.sampled_from(sorted(rules)), label="then")]()

    @precondition(lambda self: self.cfg.buddy)
    @rule(saves=INTERLEAVED)
    def snapshots_and_checkpoints_of_one_directory_interleaved(
            self, saves: list[tuple[str, str, bool, int | None]]) -> None:
        """Snapshots and disk saves of one directory in a drawn order, each with ``overwrite`` and ``keep_last``
        drawn (a snapshot's applies when it is persisted, so only once a persist never outranks a newer checkpoint;
        the daemon's ``--keep`` likewise).

        Allowed: what ``save`` allows each; retention after a disk save keeps it and the newest ``keep_last - 1``
        others by step, then commit time (docs/api.md)."""
        self._begin()
        for tier, name, overwrite, keep_last in saves:
            if tier == "memory" and self.cfg.awaits("persist_outranks_newer"):
                keep_last = None
            self._save_all(tier, name, overwrite, keep_last, False)

    @precondition(_on("persist_outranks_newer"))
    @rule(how=st.sampled_from(["close", "kill", "drain"]))
    def a_snapshot_then_a_newer_checkpoint_then_the_snapshot_persisted(self, how: str) -> None:
        """A snapshot at step 15 (``keep_last=1``), then a disk save at step 20 (``keep_last=1``) committed in the
        same directory; then the daemon persists its snapshots as the job closes, is killed, or the daemon drains.

        Allowed (issue 38, case 2): the snapshot is persisted or dropped (it is older than step 20, committed beside
        it), but a persist never outranks the checkpoint committed after it: step 20 stays, and retention orders by
        step, never by when a persist ran."""
        self._begin()
        self._save_all("memory", "step-15", True, 1, False)
        self._save_all("disk", "step-20", True, 1, False)
        snapshot = self.model.must.get(self.w.path("memory", "step-15"))
        if how == "close":
            self.job.exit()
            self._job_gone(self.job)
            self.job = self._new_job()
        elif how == "kill":
            self._crash_job()
        else:
            daemon = self.w.daemon
            code = daemon.stop(timeout=120)
            assert code == 0, f"ckptd stop of node 0 exited {code}"
            if snapshot is not None and not snapshot.durable and not self._persisted(self._path_of(snapshot)):
                self.model.allow_gone(self._path_of(snapshot))
            elif snapshot is not None and not snapshot.durable:
                self._now_durable(snapshot)
            self._daemon_lost(0)
            return
        self._wait(self._idle, 60, "the daemons idle after the job's exit")
        if snapshot is not None and not snapshot.durable:  # persisted or passed over, never counted as newer
            path = self.w.path("memory", "step-15")  # (``_job_gone`` may have let it go already: passed over)
            self._wait(lambda: not any(s["persisting"] for s in status(self.w.run_dir)["memory"]["snapshots"]
                                       if s["path"] == path), 60, f"the persist of {path} ended")
            if self._persisted(path) and self.model.must.get(path) is snapshot:
                self._now_durable(snapshot)
            elif path not in [s["path"] for s in status(self.w.run_dir)["memory"]["snapshots"]]:
                # older than the checkpoint committed beside it: a persist the daemon began drops it (docs/memory.md,
                # "A persist never writes an older state over a newer one")
                self.model.tier(path).memory = None
                self.model.allow_gone(path)

    @precondition(lambda self: _on("replica_of_a_replaced_save")(self) and self._rollbacks())
    @rule(data=st.data(), second_run=st.booleans())
    def a_snapshot_is_rolled_back_to_a_lower_step(self, data: st.DataObject, second_run: bool) -> None:
        """A snapshot's path (held, persisted, or restored from the buddy after a loss) is snapshotted again at a
        lower step with ``overwrite=True``, by the same run or by a second run of the job (the first one closed).

        Allowed: ``ok`` (a snapshot is replaced with ``overwrite``, docs/memory.md); then the path loads as the new
        save, and once replication settled the buddy holds, of that path, only the new save (issue 38, case 3); a
        later loss of node 0 resumes from it or from what is on disk, never from the replaced save's replica."""
        self._begin()
        path, step = data.draw(st.sampled_from(self._rollbacks()), label="snapshot")
        if second_run:
            self.job.exit()
            self._job_gone(self.job)
            self.job = self._new_job()
        self._save_all("memory", f"step-{path.rsplit('-', 1)[1]}", True, None, False, step=step - 1)

    def _rollbacks(self) -> list[tuple[str, int]]:
        """(path, step) of each snapshot path whose newest acknowledged save is at a step above 0."""
        newest = {p: max(saves, key=lambda s: s.seq) for p, saves in self.model.history.items()
                  if os.path.basename(p).startswith("snap-")}
        return sorted((p, s.step) for p, s in newest.items() if s.step >= 1)

    @precondition(lambda self: self.cfg.buddy)
    @rule()
    def the_origin_node_is_lost(self) -> None:
        """Node 0 (its daemon and the job's ranks) is SIGKILLed whole; a replacement starts (new run directory, new
        key pair, its line replacing its predecessor's in the keys file) and a new run resumes on every rank.

        Allowed: one save, bitwise, on every rank: a checkpoint on disk, or a snapshot the buddy holds whole; never
        older than the newest checkpoint on disk or the newest snapshot node 0 showed replicated."""
        self._begin()
        self._origin_settled()
        self._assert_newest_snapshot_replicated()
        holdings = [self._holdings(n) for n in range(self.cfg.nodes)]
        can = self._resumable([0], holdings)
        can.possible.update(self._replicated_saves(holdings[1]))
        floor = self._buddy_floor()
        if floor is not None and (can.floor is None or floor[0] > can.floor):
            can = Resumable(can.possible, floor[0], [*can.certain, floor[1]])
        self._lose_origin()
        self.w.replace_node(0)
        self.job = self._new_job()
        resumed = self._resume(can, [0], None)
        if resumed is not None and not resumed[1].durable:  # read back from the buddy: node 0 holds it again
            path, saved = resumed
            if self.model.must.get(path) is not saved:
                self.model.allow_gone(path)
                if saved not in self.model.may.setdefault(path, []):
                    self.model.may[path].append(saved)

    def _replicated_saves(self, buddy: Holdings) -> dict[tuple[int, int], tuple[str, Saved]]:
        """The acknowledged saves the buddy's complete replicas are of (its run and step; a replica of a save
        whose replacement never reached the buddy is one), each readable back whole once node 0 is lost."""
        found = {}
        for replica in buddy.entries:
            if replica["path"] not in buddy.replicas:  # changed bytes, never restored
                continue
            for saved in self.model.history.get(replica["path"], []):
                if saved.run == replica["job"] and saved.step == replica["step"]:
                    found[(saved.inc, saved.sid)] = (replica["path"], saved)
        return found

    def _replicas_persisted(self, replicas: dict[tuple[int, int], tuple[str, Saved]],
                            committed: set[str] | None = None) -> None:
        """The buddy's drain judged node 0 gone and may have persisted each of ``replicas`` (docs/memory.md, Drain):
        a path now on disk (of ``committed``, where given: what the buddy logged committed in its drain) holds one
        of them there, as the model's disk copy of it.

        Such a persist is a commit like node 0's own (``_now_durable``), also of a replica whose snapshot node 0
        dropped before (older than a checkpoint then on disk, which retention may have deleted since): a path
        retention was asked to delete is on disk again, and the persist's retention (its save's ``keep_last``,
        else ``--keep``) counts it by step, then time, as it does any checkpoint (docs/memory.md, "What retention
        counts"), so it may delete a lower step committed after the snapshot was held."""
        for path, saved in replicas.values():
            if not (self._persisted(path) if committed is None else path in committed):
                continue
            if self.model.must.get(path) is saved:
                self._now_durable(saved)
                continue
            self.model.trimmed.discard(path)
            self.model.tier(path).disk = saved
            if path not in self.model.must:
                olds = self.model.may.setdefault(path, [])
                if saved in olds:
                    olds.remove(saved)
                olds.append(saved)  # the newest of the path's possible saves, as retention below counts it
            keep = self._keep(path, saved.keep_last)
            if keep is not None:
                self._retention(path, keep, counted=False)

    def _log_mark(self, node: int) -> int:
        """Where node ``node``'s log ends now (``_committed_since`` reads what it logs after it)."""
        return (self.w.run_dirs[node] / LOG_NAME).stat().st_size

    def _committed_since(self, node: int, mark: int) -> set[str]:
        """The paths node ``node``'s daemon logged committed (``event=committed``) since ``mark``."""
        with open(self.w.run_dirs[node] / LOG_NAME, "rb") as f:
            f.seek(mark)
            lines = f.read().decode(errors="replace").splitlines()
        return {ln.split(" path=", 1)[1].split(" ", 1)[0] for ln in lines if " event=committed path=" in ln}

    def _lose_origin(self) -> None:
        """Node 0's daemon and the job's ranks die of SIGKILL (proven by their exit status)."""
        daemon = self.w.daemon
        daemon.kill()
        assert killed(daemon.proc.returncode), f"node 0's daemon exited {daemon.proc.returncode}"
        codes = self.job.kill()
        assert all(killed(c) for c in codes), f"the job's ranks did not die of SIGKILL: {codes}"
        self.dead_pids += [*self.job.pids, daemon.proc.pid]
        self.model.forget("memory")
        self.last_snapshot = None
        for path, saved in list(self.model.must.items()):
            if not saved.durable:
                self.model.allow_gone(path)

    @precondition(lambda self: self.cfg.buddy and self.world > 1)
    @rule()
    def the_job_restarts_with_another_world_size(self) -> None:
        """The job closes and restarts with one rank fewer; every rank resumes.

        Allowed: what a resume without a loss may return (a snapshot held whole on one node reshards like a
        checkpoint on disk, docs/memory.md), never older than the newest checkpoint on disk."""
        self._begin()
        self.job.exit()
        self._job_gone(self.job)
        self._origin_settled()
        can = self._resumable([], [self._holdings(n) for n in range(self.cfg.nodes)])
        self.world -= 1
        self.job = self._new_job()
        self._resume(can, [], None)

    @precondition(_on("replicated_but_gone"))
    @rule(name=st.sampled_from(NAMES))
    def the_buddy_is_restarted(self, name: str) -> None:
        """Node 0 snapshots ``name`` and replicates it; node 1's daemon is SIGKILLed and started again (its replicas
        die with it).

        Allowed: node 0 shows no snapshot ``replicated`` whose replica the new buddy does not hold: it sends it
        again or shows it not replicated (issue 38, case 7)."""
        self._begin()
        self._snapshot_replicated(name)
        daemon = self.w.daemons[1]
        daemon.kill()
        assert killed(daemon.proc.returncode), f"node 1's daemon exited {daemon.proc.returncode}"
        self.dead_pids.append(daemon.proc.pid)
        self.model.forget("buddy")
        self.last_snapshot = None  # its replica is gone: sent again, or shown not replicated
        self.w.start_daemon(1)

    @precondition(lambda self: self.cfg.buddy)
    @rule(name=st.sampled_from(["step-1", "step-2", "step-3"]))
    def the_buddy_is_paused_past_the_peer_timeout(self, name: str) -> None:
        """Node 1's daemon is stopped (SIGSTOP, proven by its process state) while node 0 holds a new snapshot,
        past ``--peer-timeout``, then continued; the next snapshot is held after it.

        Allowed (docs/memory.md, Outages): the snapshot is acknowledged (replication comes after), its replication
        ``failed`` once the buddy did not answer, never ``replicated``; the next one is streamed on a new connection
        and replicated."""
        self._begin()
        buddy = self.w.daemons[1]
        buddy.proc.send_signal(signal.SIGSTOP)
        try:
            self._wait(lambda: _process_state(buddy.proc.pid) == "T", 30, "node 1's daemon stopped")
            self._save_all("memory", name, True, None, False)
            path = self.w.path("memory", name)
            if path in self.model.must:
                self._wait(lambda: self._replication_of(path) == "failed", PAUSED_S,
                           f"node 0 reporting the replication of {path} to its paused buddy failed "
                           f"(--peer-timeout {PEER_TIMEOUT_S:g})")
        finally:
            buddy.proc.send_signal(signal.SIGCONT)
        self._wait(lambda: _process_state(buddy.proc.pid) != "T", 30, "node 1's daemon continued")
        self._snapshot_replicated("step-3" if name != "step-3" else "step-2")  # on a new connection

    @precondition(_on("paused_origin_calls_its_snapshot_lost"))
    @rule(name=st.sampled_from(NAMES))
    def the_origin_is_paused_while_its_buddy_drains(self, name: str) -> None:
        """Node 0's daemon is stopped (SIGSTOP, proven by its process state) while node 1 drains (``ckptd stop``),
        then continued and drained in turn; both daemons start again, with a new run of the job.

        Allowed (docs/memory.md, Drain): the buddy judges an origin that does not answer within 2 s gone and
        persists its replicas; both drains exit 0, the second writer of the same bytes told it was committed by
        another (issue 38, case 5); node 0's newest snapshot of the directory is on disk, whoever wrote it."""
        self._begin()
        self._snapshot_replicated(name)
        self._origin_settled()
        replicas = self._replicated_saves(self._holdings(1))
        origin, buddy = self.w.daemons
        origin.proc.send_signal(signal.SIGSTOP)
        try:
            self._wait(lambda: _process_state(origin.proc.pid) == "T", 30, "node 0's daemon stopped")
            code = buddy.stop(timeout=120)
            assert code == 0, f"ckptd stop of the buddy (node 1) exited {code}"
        finally:
            origin.proc.send_signal(signal.SIGCONT)
        self.model.forget("buddy")
        self._replicas_persisted(replicas)
        code = origin.stop(timeout=120)
        assert code == 0, f"ckptd stop of node 0, paused while its buddy drained, exited {code}"
        newest = self._newest_held(lambda s: os.path.dirname(self._path_of(s)) == self._directory())
        if newest is not None and not newest.durable and not self._newer_committed(newest):
            self._now_durable(newest)
        self.dead_pids.append(buddy.proc.pid)
        self.w.start_daemon(1)
        self._daemon_lost(0)

    def _snapshot_replicated(self, name: str) -> None:
        """Node 0 snapshots ``name`` (with ``overwrite`` only where the model knows a checkpoint may be: a free
        path's snapshot is persisted without it) and its buddy holds the replica."""
        path = self.w.path("memory", name)
        taken = path in self.model.must or path in self.model.may or path in self.model.trimmed
        self._save_all("memory", name, taken, None, False)
        self._wait(lambda: self._replication_of(path) == "replicated", PAUSED_S, f"{path} replicated")

    def _replication_of(self, path: str) -> str | None:
        """Node 0's word on its snapshot of ``path`` (asked of node 0 alone: node 1 may be stopped)."""
        return next((s["replication"] for s in status(self.w.run_dir)["memory"]["snapshots"] if s["path"] == path),
                    None)
