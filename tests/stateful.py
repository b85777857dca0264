"""The stateful test's machine: random sequences of saves, crashes, restarts and outages against a model.

Real daemons (one per node), real rank processes (``tests/jobs.py``) started
as each launcher starts them (``stateful_world.LAUNCH_FORMS``), real files,
real shared memory and a real S3 endpoint (moto's server,
``tests/s3server.py``) behind a loopback proxy the machine can cut
(``tests/proxy.py``). The model records what was acknowledged (every rank's
future resolved) and where it must be; after every step each checkpoint the
model knows must load, on every rank, bitwise equal to the one save the model
says it holds (so never a mix of two saves or two runs), and when the daemons
are idle nothing may be left over: no ``.incomplete``/``.discarded-``/
``.deleting`` directories, no shared memory of dead processes, no stray objects
in the bucket, no attempt kept alive by dead ranks (a multipart upload an
outage cut off is the one exception, see ``_bucket_clean``). Every save's
outcome is checked against the set of outcomes the documented behaviour
allows (``_allowed``): never "anything goes".

``stateful_world.CONFIGS`` names the configurations; ``tests/test_stateful.py``
runs each briefly (derandomized, in ``make test``), and
``tests/soak/test_soak_stateful.py`` runs many more examples of each.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from dataclasses import replace

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from jobs import Job, killed
from s3server import S3Server
from stateful_checks import Checks
from stateful_nodes import NodeLoss, NodeLossRules
from stateful_tiers import INTERLEAVED, TierRules
from stateful_world import CONFIGS, KILL_POINTS, NAMES, SNAPSHOTS, Config, Model, Saved, World, launch_for

HANG_S = 240.0
"""How long a step may wait for a state before it counts as hung: only a guard, never a pace (ranks start and
agree over gloo on two cores busy with other test workers: a minute was once too little)."""
REFUSED_BY_ANOTHER_RUN = {"Conflict", "CheckpointExists"}
"""What a run whose save met another live run's save of the path may be told: refused while the other's attempt
lives (``Conflict``), or after it committed (``CheckpointExists``, without overwrite)."""


class CheckpointMachine(NodeLoss, Checks, RuleBasedStateMachine):
    """Saves of every tier by jobs of 1-6 ranks on one to three nodes; crashes of ranks, jobs and daemons (also
    inside a write, a publish, a retention); overlapping live runs; outages. With peers, ``NodeLossMachine`` adds
    nodes lost whole and resumes."""

    s3: S3Server  # set by run_stateful before the machine runs
    cfg: Config

    def __init__(self) -> None:
        super().__init__()
        self.w = World(self.s3, self.cfg)
        self.model = Model()
        self.incs = iter(range(1, 10**6))
        self.sids = iter(range(1, 10**9))
        self.seq = 0
        self.dead_pids: list[int] = []
        self.steps_started = self.steps_checked = 0
        self.ran: list[str] = []
        self.job: Job | None = None
        self.world = 2
        self.form = "unnamed"
        self.runs = 0
        try:
            for node in range(self.cfg.nodes):
                self.w.start_daemon(node)
        except BaseException:  # no teardown follows a failed __init__: nothing may outlive it
            self.w.close()
            raise

    @initialize(data=st.data())
    def launch(self, data: st.DataObject) -> None:
        """The job's world size and how its launcher names runs, for the whole example."""
        self.world = data.draw(st.sampled_from(self.cfg.worlds), label="world")
        self.form = data.draw(st.sampled_from(self.cfg.forms), label="launcher")
        self.job = self._new_job()
        # Every example opens with what its configuration is for, whatever rules are drawn after it.
        if self.cfg.overlap:
            self.a_second_live_run_saves_the_same_path(data, data.draw(st.sampled_from(NAMES), label="name"),
                                                       data.draw(st.booleans(), label="overwrite"))
        if self.cfg.kills_inside:
            self.daemon_is_killed_inside(data.draw(st.sampled_from(sorted(KILL_POINTS)), label="point"))
        if self.cfg.outage_restarts:
            self.saves_during_an_outage_then_the_daemon_is_killed(
                data.draw(st.permutations(NAMES), label="names"), data.draw(st.sampled_from([None, 1, 2]),
                                                                            label="keep_last"))
        if self.cfg.peers:  # a checkpoint, a snapshot held on every node and replicated, then a node lost
            self._save_all("disk", data.draw(st.sampled_from(NAMES), label="name"), False, None, False)
            self._save_all("memory", data.draw(st.sampled_from(NAMES), label="name"), False, None, False)
            self.node_is_lost(data.draw(st.integers(0, self.cfg.nodes - 1), label="node"),
                              data.draw(st.booleans(), label="buddy_too"), data.draw(st.booleans(), label="corrupt"))
        elif self.cfg.buddy:  # checkpoints and snapshots in one directory, then the node holding them lost
            self.snapshots_and_checkpoints_of_one_directory_interleaved(data.draw(INTERLEAVED, label="saves"))
            self.the_origin_node_is_lost()
            self._opening(data)
        elif self.cfg.nodes > 1:
            self.job_crashes_mid_save(data, data.draw(st.sampled_from(NAMES), label="name"), False)

    # -- processes ------------------------------------------------------------------------------------------

    def _new_job(self, overlapping: bool = False) -> Job:
        """A new run of the job: a restart of the current run's launch (its launcher's restart count goes up), or
        (``overlapping``) another launch beside it, numbered by the run."""
        self.runs += 1
        launch_no, restarts = (self.runs, 0) if overlapping or self.job is None else (
            self.job.launch_no, self.job.restarts + 1)
        job = Job(self.w.run_dirs[:self.cfg.job_nodes], self.w.fifos, self.world, next(self.incs),
                  launch=launch_for(self.form, self.runs, restarts, launch_no, self.cfg.dist))
        job.launch_no, job.restarts = launch_no, restarts
        return job

    def _send(self, job: Job, rank: int, op: str, sid: int, tier: str, name: str, *, overwrite: bool = False,
              keep_last: int | None = None, path: str | None = None, step: int | None = None) -> int:
        cid = job.next_id()
        job.ranks[rank].send(op=op, id=cid, sid=sid, step=int(name.split("-")[1]) if step is None else step,
                             path=path or self.w.path(tier, name), overwrite=overwrite, keep_last=keep_last,
                             persist=tier not in SNAPSHOTS)
        job.ranks[rank].wait_for("returned", cid)
        return cid

    def _save(self, job: Job, ranks: list[int], tier: str, name: str, *, overwrite: bool = False,
              keep_last: int | None = None, dcp: bool = False, path: str | None = None,
              step: int | None = None) -> tuple[int, dict[int, int]]:
        """Send one save to ``ranks`` of ``job`` (in that order); returns the save id and each rank's command id."""
        sid = next(self.sids)
        cids = {r: self._send(job, r, "dcp" if dcp else "save", sid, tier, name, overwrite=overwrite,
                              keep_last=keep_last, path=path, step=step) for r in ranks}
        return sid, cids

    # -- rules ----------------------------------------------------------------------------------------------

    @rule(data=st.data(), name=st.sampled_from(NAMES), overwrite=st.booleans(),
          keep_last=st.sampled_from([None, None, 1, 2]), reverse=st.booleans())
    def save(self, data: st.DataObject, name: str, overwrite: bool, keep_last: int | None, reverse: bool) -> None:
        """Every rank saves; the save is acknowledged when every future resolves."""
        self._begin()
        tier = data.draw(st.sampled_from(self.cfg.tiers), label="tier")
        dcp = self.cfg.dcp and tier not in SNAPSHOTS and data.draw(st.booleans(), label="dcp")
        # With peers, snapshots share the disk checkpoints' directory, where keep_last would count them too.
        self._save_all(tier, name, overwrite, None if tier in SNAPSHOTS or self.cfg.peers else keep_last, reverse,
                       dcp=dcp)

    def _save_all(self, tier: str, name: str, overwrite: bool, keep_last: int | None, reverse: bool,
                  dcp: bool = False, step: int | None = None) -> None:
        """Every rank saves ``name`` of ``tier`` (at ``step``, else the name's); recorded if acknowledged."""
        allowed = self._allowed(tier, name, overwrite, dcp=dcp)
        ranks = list(range(self.world))[::-1] if reverse else list(range(self.world))
        sid, cids = self._save(self.job, ranks, tier, name, overwrite=overwrite, keep_last=keep_last, dcp=dcp,
                               step=step)
        what = (f"{'dcp.save' if dcp else 'save'} {sid} of {self.w.path(tier, name)} (incarnation {self.job.inc}, "
                f"job {self.job.job!r}, overwrite={overwrite})")
        if self._check(what, self._outcomes(self.job, cids), allowed) == "ok":
            self._record(tier, name, sid, self.job, overwrite, keep_last, dcp=dcp, step=step)

    def _record(self, tier: str, name: str, sid: int, job: Job, overwrite: bool, keep_last: int | None,
                dcp: bool = False, step: int | None = None) -> None:
        self.seq += 1
        held_by = self.w.daemon.proc.pid if tier in SNAPSHOTS else None
        saved = Saved(job.inc, sid, int(name.split("-")[1]) if step is None else step, self.seq,
                      durable=held_by is None, held_by=held_by, overwrite=overwrite, dcp=dcp, keep_last=keep_last,
                      run=job.job)
        self._acknowledged(tier, name, saved, keep_last)
        self._snapshot_held(tier, saved)

    @rule(data=st.data(), name=st.sampled_from(NAMES), resave=st.booleans())
    def job_crashes_mid_save(self, data: st.DataObject, name: str, resave: bool) -> None:
        """Some ranks' shards are in; the whole job is SIGKILLed (a rank died, the launcher killed the rest) and
        restarted as a new run, which may save the same path again, its last rank first."""
        self._begin()
        if self.world < 2:
            return
        tier = data.draw(st.sampled_from([t for t in self.cfg.tiers if t != "mirror"]), label="tier")
        before = data.draw(st.integers(1, self.world - 1), label="before")
        path = self.w.path(tier, name)
        since = time.time()
        _, cids = self._save(self.job, list(range(before)), tier, name)
        # On several nodes a refused rank is not answered either: its future waits for the ranks' agreement, which
        # the ranks that never save hold up until the commit timeout; its daemon's refusal is what it reaches.
        self._wait(lambda: self._shards_in(path) >= before or self._finished(self.job, cids)
                   or self._settled(path, list(range(before)), since), HANG_S,
                   f"{before} shards of {path} durable or held, or refused by their daemons")
        self._crash_job()
        if resave:
            self._save_all(tier, name, False, None, True)

    @rule()
    def job_restarts(self) -> None:
        """The job exits cleanly (its clients close) and a new run starts."""
        self._begin()
        self.job.exit()
        self._job_gone(self.job)
        self.job = self._new_job()

    @rule()
    def rank_is_killed_between_saves(self) -> None:
        """A rank dies; the launcher kills the rest and starts a new run."""
        self._begin()
        self._crash_job()

    @precondition(lambda self: self.cfg.overlap)
    @rule(data=st.data(), name=st.sampled_from(NAMES), overwrite=st.booleans())
    def a_second_live_run_saves_the_same_path(self, data: st.DataObject, name: str, overwrite: bool) -> None:
        """Another launch of the job starts while this run lives (its own name, or the one every launch of its
        launcher shares) and both save one path, their ranks' requests interleaved in a drawn order.

        Allowed: a run is either acknowledged on every rank or refused on every rank it was decided for (each
        rank ``Conflict`` while the other run's attempt lives, ``CheckpointExists`` once it committed, or the tier's
        ordinary refusal of an existing path); at least one run is acknowledged unless the path held a checkpoint
        it could not replace (on one node: on several, both may be refused); the path then loads as exactly one
        acknowledged run's save. A refused run is killed, as its launcher would after a rank raised."""
        self._begin()
        tier = data.draw(st.sampled_from([t for t in self.cfg.tiers if t in ("disk", "s3")]), label="tier")
        dcp = self.cfg.dcp and data.draw(st.booleans(), label="dcp")
        other = self._new_job(overlapping=True)
        order = data.draw(st.permutations([(j, r) for j in (0, 1) for r in range(self.world)]), label="order")
        alone = self._allowed(tier, name, overwrite, dcp=dcp)
        jobs, sids = (self.job, other), (next(self.sids), next(self.sids))
        cids: tuple[dict[int, int], dict[int, int]] = ({}, {})
        for j, r in order:
            cids[j][r] = self._send(jobs[j], r, "dcp" if dcp else "save", sids[j], tier, name, overwrite=overwrite)
        results = self._race_outcomes(jobs, cids)
        what = f"save of {self.w.path(tier, name)} by two live runs (jobs {jobs[0].job!r}, {jobs[1].job!r})"
        outcomes = [self._check_run(f"{what}, run {jobs[j].inc}", results[j], alone | REFUSED_BY_ANOTHER_RUN)
                    for j in (0, 1)]
        won = [j for j in (0, 1) if outcomes[j] == "ok"]
        # On several nodes each daemon admits the run whose rank reached it first, so each run may meet the other's
        # attempt on some node and both be refused (found by this rule; safe, never a mix, but no run saves).
        assert won or "ok" not in alone or self.cfg.nodes > 1, f"{what}: neither run was acknowledged: {results}"
        if won:  # both only when one committed, then the other replaced it (overwrite): the path holds the later
            path = self.w.path(tier, name)
            winner = won[0] if len(won) == 1 else won[self._which_run(path, [(jobs[j].inc, sids[j]) for j in won])]
            self._record(tier, name, sids[winner], jobs[winner], overwrite, None, dcp=dcp)
        for j in (0, 1):
            if outcomes[j] != "ok":
                codes = jobs[j].kill()
                assert all(killed(c) for c in codes), f"ranks did not die of SIGKILL: {codes}"
                self._job_gone(jobs[j])
        survivors = [jobs[j] for j in (0, 1) if outcomes[j] == "ok"]
        if not survivors:
            self.job = self._new_job()
        else:
            self.job = survivors[0]
            for extra in survivors[1:]:
                extra.exit()
                self._job_gone(extra)

    @precondition(lambda self: self.cfg.job_nodes == 1  # a snapshot spanning nodes is not persisted (docs/memory.md)
                  and any(not s.durable and s.inc == self.job.inc for s in self.model.must.values()))
    @rule(tier=st.sampled_from(SNAPSHOTS), name=st.sampled_from(NAMES))
    def persist(self, tier: str, name: str) -> None:
        self._begin()
        path = self.w.path(tier, name)
        saved = self.model.must.get(path)
        if saved is None or saved.durable or saved.inc != self.job.inc:
            return
        cids = {}
        for rank in self.job.ranks:
            cid = self.job.next_id()
            rank.send(op="persist", id=cid, path=path)
            cids[rank.rank] = cid
        outcomes = self._outcomes(self.job, cids)
        assert all(o["ok"] for o in outcomes.values()), f"persist of held snapshot {path}: {outcomes}"
        self._now_durable(saved)
        assert self._persisted(path), f"persist of {path} returned, but it is not on disk"

    @precondition(lambda self: self.model.must)
    @rule(node=st.integers(0, 1))
    def daemon_is_killed_and_restarted(self, node: int) -> None:
        """A daemon (of one node) is SIGKILLed between saves, and started again with a new run of the job."""
        self._begin()
        node %= self.cfg.job_nodes  # a buddy restarted is a rule of its own (tests/stateful_tiers.py)
        daemon = self.w.daemons[node]
        daemon.kill()
        assert killed(daemon.proc.returncode), "the daemon did not die of SIGKILL"
        self._daemon_lost(node)

    def _daemon_lost(self, node: int) -> None:
        self.model.forget("memory" if node < self.cfg.job_nodes else "buddy")
        for path, saved in list(self.model.must.items()):
            if not saved.durable:  # memory snapshots do not survive the daemon (on several nodes: its shards)
                self.model.allow_gone(path)
        self.last_snapshot = None
        self._restart_job_and_daemons([node])

    @precondition(lambda self: self.cfg.kills_inside)
    @rule(point=st.sampled_from(sorted(KILL_POINTS)))
    def daemon_is_killed_inside(self, point: str) -> None:
        """The daemon SIGKILLs itself at a kill point (inside a shard's write, before or after the publishing
        rename, inside retention's removal of a victim), proven by its exit status and the fault it logged last.

        Allowed: the save is never acknowledged by a daemon that died before answering (``DaemonUnavailable``),
        but a save that committed before the kill (the retention point: its replies may be out first) may be, on
        some ranks or all (the replies are queued when retention starts; a SIGKILL drops those not yet sent: a
        rank told ``DaemonUnavailable`` learns nothing false, and one told ``ok`` makes the checkpoint a must); after
        the restart a checkpoint killed before its rename is absent, one killed after it is absent or whole as that
        save, and retention's victim is absent or whole; nothing of the killed work is left behind."""
        self._begin()
        name, _ = KILL_POINTS[point]
        where = self.w.kill_dir(self.w.kill_cycle)
        path = str(where / name)
        if point == "retention":  # a first checkpoint, then a save whose keep_last=1 makes it the victim
            sid, cids = self._save(self.job, list(range(self.world)), "disk", "step-0", path=path)
            assert self._check(f"save {sid} of {path}", self._outcomes(self.job, cids), {"ok"}) == "ok"
            self.seq += 1
            self.model.must[path] = Saved(self.job.inc, sid, 0, self.seq)
            self.model.allow_gone(path)  # retention was asked to delete it; the kill may leave it whole
            self.model.trimmed.add(path)
            path = str(where / "step-5")
        sid, cids = self._save(self.job, list(range(self.world)), "disk", path.rsplit("/", 1)[1], path=path,
                               keep_last=1 if point == "retention" else None)
        daemon = self.w.daemon
        try:
            code = daemon.proc.wait(60)
        except Exception:
            raise AssertionError(f"the daemon did not die at its {point} kill point saving {path}") from None
        assert killed(code), f"the daemon exited {code}, not of SIGKILL, at its {point} kill point"
        fault = self.w.last_fault()
        op = KILL_POINTS[point][1]["op"]
        assert f"op={op} " in fault and "action=kill" in fault, f"the daemon's last fault was not its {point}: {fault}"
        outcomes = self._outcomes(self.job, cids)
        what = f"save {sid} of {path} killed at {point}"
        if point == "retention":  # committed, its Done replies queued: the kill may come before all are out
            told = {"ok" if o["ok"] else o["error"] for o in outcomes.values()}
            assert told <= {"ok", "DaemonUnavailable"}, f"{what}: {outcomes}"
            outcome = "ok" if "ok" in told else "DaemonUnavailable"
        else:
            outcome = self._check(what, outcomes, {"DaemonUnavailable"})
        saved = Saved(self.job.inc, sid, int(path.rsplit("-", 1)[1]), self.seq + 1)
        if outcome == "ok":
            self.seq += 1
            self.model.must[path] = saved
        elif point in ("published", "retention"):  # committed before the kill, but nobody was told
            self.model.may[path] = [saved]
        self.w.kill_cycle += 1
        self._daemon_lost(0)
        if point in ("write", "publish"):
            assert not os.path.exists(path), f"{path}, killed at {point}, is visible after the restart"

    @precondition(lambda self: self.model.must and self.cfg.persists_on_exit)
    @rule(outage=st.booleans())
    def daemon_is_stopped_and_restarted(self, outage: bool) -> None:
        """SIGTERM drains: the newest held snapshot of each directory is persisted first, also when the store
        is away for a moment as the drain begins (``outage``). Not with peers: their snapshots span nodes, which
        no drain persists (``ckptd stop`` exits 3 naming them, docs/memory.md). With a buddy, both daemons drain at
        once: whether node 0 still answers when the buddy's drain asks is a race, so the buddy may persist the
        replicas it holds, a replica of a snapshot node 0 dropped before included (the newest of its directory,
        which a buddy keeps); what it committed is read from its log (``_replicas_persisted``)."""
        self._begin()
        replicas, mark = {}, 0
        if self.cfg.buddy:  # what the buddy holds as its drain begins, and where its log stands
            self._origin_settled()
            replicas, mark = self._replicated_saves(self._holdings(1)), self._log_mark(1)
        if outage:
            self.w.proxy.cut()
        try:
            for daemon in self.w.daemons:
                daemon.proc.send_signal(signal.SIGTERM)
            if outage:  # the drain has begun and meets the outage; the store comes back within the drain's deadline
                self._wait(lambda: self.w.daemon.proc.poll() is not None or self._draining(), HANG_S, "the drain begun")
        finally:
            self.w.proxy.restore()
        for daemon in self.w.daemons:
            code = daemon.stop(timeout=120)
            assert code == 0, f"ckptd stop exited {code}"
        parents = {os.path.dirname(p) for p, s in self.model.must.items() if s.held_by is not None}
        for parent in parents:
            newest = self._newest_held(lambda s, parent=parent: os.path.dirname(self._path_of(s)) == parent)
            if newest is not None and not self._newer_committed(newest):
                self._now_durable(newest)
        if self.cfg.buddy:  # both were signalled at once: a buddy whose drain began after node 0 exited judged it
            # gone and persisted its replicas (docs/memory.md, Drain), after node 0's own persists
            self._replicas_persisted(replicas, self._committed_since(1, mark))
        self.model.forget("memory")
        self.model.forget("buddy")
        self.last_snapshot = None
        for path, saved in list(self.model.must.items()):
            if not saved.durable:
                self.model.allow_gone(path)
        self._restart_job_and_daemons(list(range(self.cfg.nodes)))

    @precondition(lambda self: any(t in ("s3", "mirror") for t in self.cfg.tiers))
    @rule(data=st.data(), name=st.sampled_from(NAMES))
    def store_outage_during_a_save(self, data: st.DataObject, name: str) -> None:
        """The endpoint goes away while a save (direct) or its upload (mirror) is under way, and comes back."""
        self._begin()
        tiers = [t for t in ("s3", "mirror") if t in self.cfg.tiers]
        if not tiers:
            return
        tier = data.draw(st.sampled_from(tiers), label="tier")
        path = self.w.path(tier, name)
        allowed = self._allowed(tier, name, False)
        if tier == "s3" and "ok" in allowed:  # the direct save itself meets the outage: it may fail for it
            allowed = allowed | {"WriteFailed"}
        resets = self.w.proxy.resets
        self.w.proxy.cut()
        try:
            sid, cids = self._save(self.job, list(range(self.world)), tier, name)
            if tier == "mirror":  # committed locally (or refused); its upload meets the outage
                self._outcomes(self.job, cids)
            # until the daemon met the outage (a save may also end without touching the store: refused)
            self._wait(lambda: self.w.proxy.resets > resets or (self._finished(self.job, cids) and self._idle()), HANG_S,
                       f"the daemon meeting the outage while saving {path}")
        finally:
            self.w.proxy.restore()
        ok = self._check(f"save {sid} of {path} through an outage", self._outcomes(self.job, cids), allowed) == "ok"
        if ok and tier == "mirror" and self.cfg.mirror_keep is None:  # its upload ran into the outage
            assert self.w.proxy.resets > resets, f"the upload of {path} never met the outage"
        if ok:
            self._record(tier, name, sid, self.job, False, None)

    @precondition(lambda self: self.cfg.outage_restarts)
    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True),
          keep_last=st.sampled_from([None, 1, 2]))
    def saves_during_an_outage_then_the_daemon_is_killed(self, names: list[str], keep_last: int | None) -> None:
        """The store is away while the job saves into the mirrored directory (commits are local; uploads wait),
        the daemon is SIGKILLed, and starts again with the store back: it uploads what the store lacks, and local
        retention (``keep_last``) and ``--mirror-keep`` catch up (issue 26, items 3 and 4)."""
        self._begin()
        self.w.proxy.cut()
        try:
            for name in names:
                self._save_all("mirror", name, False, keep_last, False)
            self.w.daemon.kill()
        finally:
            self.w.proxy.restore()
        self._daemon_lost(0)

    @rule()
    def settle(self) -> None:
        """Wait until the daemons are idle, then everything must be clean and in place."""
        self._begin()
        self._idle_checks()

    @invariant()
    def every_acknowledged_checkpoint_loads_as_saved(self) -> None:
        if self.job is None:
            return
        self._check_loads()
        self.steps_checked = self.steps_started

    def teardown(self) -> None:
        if os.environ.get("STATEFUL_VERBOSE") == "1":
            print(f"stateful example ({self.world} ranks, {self.form}): {' '.join(self.ran)}", flush=True)
        STATS.append((self.ran, self.world, self.form))
        try:
            if self.job is not None and self.steps_checked == self.steps_started:  # passed so far: must end clean
                self._idle_checks()
        finally:
            try:
                if self.job is not None:
                    self.job.kill()
            finally:
                self.w.close()

    def _begin(self) -> None:
        """Count a rule as started (teardown checks the end state only if every started rule passed)."""
        self.steps_started += 1
        self.ran.append(sys._getframe(1).f_code.co_name)

    def _wait(self, cond, timeout: float, what) -> None:
        from helpers import wait_until
        wait_until(cond, timeout, what)


class NodeLossMachine(NodeLossRules, CheckpointMachine):
    """The machine of a configuration with peers: nodes lost whole, and resumes (``tests/stateful_nodes.py``)."""


class TiersMachine(TierRules, CheckpointMachine):
    """The machine of the ``buddy`` configuration: one model for every tier (``tests/stateful_tiers.py``)."""


class Drawn:
    """Stands in for Hypothesis's ``data`` in a rule called by hand (a replayed sequence): each draw is the value
    given for its label."""

    def __init__(self, **values: object) -> None:
        self.values = values

    def draw(self, strategy: object, label: str) -> object:
        return self.values[label]


STATS: list[tuple[list[str], int, str]] = []
"""(rules run, world, launcher) of every example run in this process: the tests report how much they ran."""


def configured(config: str) -> Config:
    """Configuration ``config``, less the cases ``STATEFUL_FIXED`` names (comma-separated, of
    ``stateful_world.AWAITING_ISSUE_38``): their rules run, to try them on a branch with the fixes."""
    cfg = CONFIGS[config]
    fixed = {c for c in os.environ.get("STATEFUL_FIXED", "").split(",") if c}
    return replace(cfg, awaiting_fixes=cfg.awaiting_fixes - fixed)


def run_stateful(s3: S3Server, config: str, *, examples: int, steps: int, derandomize: bool, shrink: bool) -> str:
    """Run ``examples`` sequences of up to ``steps`` rules of configuration ``config``; returns what ran (sequences,
    steps, the world sizes and launchers drawn, how often each rule ran). Shrinking replays sequences against real
    processes (minutes per failure), so the short run leaves it off: the failing sequence is printed either way
    (STATEFUL_VERBOSE=1 prints every sequence run)."""
    cfg = configured(config)
    base = NodeLossMachine if cfg.peers else TiersMachine if cfg.buddy else CheckpointMachine
    machine = type(f"Machine_{config}", (base,), {"s3": s3, "cfg": cfg})
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    STATS.clear()
    started = time.monotonic()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=derandomize, database=None,
        suppress_health_check=list(HealthCheck), phases=phases, print_blob=False,
        verbosity=Verbosity.verbose if os.environ.get("STATEFUL_VERBOSE") == "1" else Verbosity.normal))
    worlds = sorted({w for _, w, _ in STATS})
    forms = sorted({f for _, _, f in STATS})
    rules = Counter(r for ran, _, _ in STATS for r in ran)
    return (f"stateful {config}: {len(STATS)} sequences, {sum(len(ran) for ran, _, _ in STATS)} steps, worlds "
            f"{worlds}, launchers {forms}, {time.monotonic() - started:.0f} s; rules {dict(sorted(rules.items()))}")
