"""The stateful machine's checks and bookkeeping: allowed outcomes, the model's updates, loads, the idle state.

A mixin of ``tests/stateful.py``'s machine (``self.w`` is its ``World``,
``self.model`` its ``Model``, ``self.job`` the live run): kept apart so each
file holds one thing, the rules there and what they are checked against here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import ckptd
from crashes import same
from helpers import SHM, status, wait_until
from jobs import Job, killed, tagged_state
from stateful_world import IDLE_S, SNAPSHOTS, Saved

RACE_S = 30.0
"""How long the ranks of a run one of whose ranks was acknowledged may take to be acknowledged too (they are in
the same commit)."""


class Checks:
    """What the machine's rules check their outcomes and the world against."""

    # -- outcomes -------------------------------------------------------------------------------------------

    def _allowed(self, tier: str, name: str, overwrite: bool, *, dcp: bool = False) -> set[str]:
        """The outcomes the documented behaviour allows a save of every rank to ``name`` of ``tier``: ``ok`` or
        the name of the error every rank gets.

        - a free path: ``ok``;
        - a committed checkpoint there: ``CheckpointExists``, or ``ok`` with ``overwrite`` (never on a store:
          a store never replaces a checkpoint); a ``dcp.save`` may also replace one without ``overwrite``
          (DCP's own writer does: issue 26, item 6, changes the default);
        - a memory snapshot there, held or persisted: a checkpoint like any other (docs/memory.md): refused
          (``CheckpointExists``), replaced with ``overwrite`` (``ok``); of an ``s3://`` name, replaced only while
          held in memory alone: one the store holds is refused, with ``overwrite`` too (docs/object-storage.md);
        - a path that may or may not hold a checkpoint (a snapshot the daemon was allowed to lose, a checkpoint
          retention was asked to delete and may not have yet): either of the outcomes above.
        """
        path = self.w.path(tier, name)
        replaces = overwrite and tier not in ("s3", "s3-memory")
        if_present = {"ok"} if replaces else ({"ok", "CheckpointExists"} if dcp else {"CheckpointExists"})
        saved = self.model.must.get(path)
        if tier == "s3-memory" and overwrite and saved is not None and not saved.durable:
            return {"ok"}  # held in memory only: replaced there
        maybe = path in self.model.may or (path in self.model.trimmed and tier in (*SNAPSHOTS, "mirror"))
        if maybe:
            return {"ok"} | if_present
        return if_present if path in self.model.must else {"ok"}

    def _outcomes(self, job: Job, cids: dict[int, int], timeout: float = 120) -> dict[int, dict]:
        return {r: job.ranks[r].wait_for("done", cid, timeout) for r, cid in cids.items()}

    def _check(self, what: str, outcomes: dict[int, dict], allowed: set[str]) -> str:
        """The one outcome every rank was told (``ok`` or an error's name); fails unless it is in ``allowed``."""
        told = {r: "ok" if o["ok"] else o["error"] for r, o in outcomes.items()}
        assert len(set(told.values())) == 1, f"{what}: the ranks were told different outcomes: {outcomes}"
        outcome = next(iter(told.values()))
        assert outcome in allowed, f"{what}: {outcome}, where only {sorted(allowed)} are allowed: {outcomes}"
        return outcome

    def _check_run(self, what: str, outcomes: dict[int, dict], allowed: set[str]) -> str:
        """For a run that raced another: ``ok`` if every rank was acknowledged, else ``refused``, each rank with an
        error in ``allowed`` (its ranks are not coordinated on one node: one may meet the other run's live attempt,
        ``Conflict``, another its commit, ``CheckpointExists``). Some ranks acknowledged and others not is a run
        partly in a checkpoint: never allowed."""
        told = {r: "ok" if o["ok"] else o["error"] for r, o in outcomes.items()}
        if "ok" in told.values():
            assert set(told.values()) == {"ok"} and len(told) == self.world, (
                f"{what}: some ranks were acknowledged and some not: {outcomes}")
            assert "ok" in allowed, f"{what}: acknowledged, where only {sorted(allowed)} are allowed"
            return "ok"
        assert set(told.values()) <= allowed - {"ok"}, (
            f"{what}: refused with {sorted(set(told.values()))}, where only {sorted(allowed - {'ok'})} are allowed: "
            f"{outcomes}")
        return "refused"

    def _race_outcomes(self, jobs: tuple[Job, ...], cids: tuple[dict[int, int], ...]) -> list[dict[int, dict]]:
        """Each run's ranks' outcomes once it settled: every rank answered, or one was refused (its other ranks may
        wait for a rank that will never come: the run is killed, as its launcher kills a run whose rank raised).
        A run one of whose ranks was acknowledged must have every rank acknowledged within ``RACE_S``."""
        deadline = time.monotonic() + 120
        acked_at: dict[int, float] = {}
        while True:
            done = [{r: job.ranks[r].seen[("done", c)] for r, c in cid.items() if ("done", c) in job.ranks[r].seen}
                    for job, cid in zip(jobs, cids)]
            settled = []
            for j, outcomes in enumerate(done):
                if any(o["ok"] for o in outcomes.values()):
                    acked_at.setdefault(j, time.monotonic())
                refused = any(not o["ok"] for o in outcomes.values())
                settled.append(len(outcomes) == len(cids[j]) or refused)
                late = time.monotonic() - acked_at.get(j, time.monotonic()) > RACE_S
                assert not late or len(outcomes) == len(cids[j]), (
                    f"run {jobs[j].inc} (job {jobs[j].job!r}): ranks {sorted(outcomes)} were told {outcomes}, the "
                    f"others nothing within {RACE_S:g} s: part of the run is in a checkpoint without the rest")
            if all(settled):
                return done
            assert time.monotonic() < deadline, f"two live runs' saves never settled: {done}"
            time.sleep(0.05)

    # -- the model ------------------------------------------------------------------------------------------

    def _acknowledged(self, tier: str, name: str, saved: Saved, keep_last: int | None) -> None:
        path = self.w.path(tier, name)
        before = [*self.model.may.get(path, []), *([self.model.must[path]] if path in self.model.must else [])]
        self.model.must[path] = saved
        self.model.may.pop(path, None)
        self.model.trimmed.discard(path)
        self.model.history.setdefault(path, []).append(saved)
        tiers = self.model.tier(path)
        if tier in SNAPSHOTS:  # the buddy's copy of the path is vouched for again once it shows replicated
            tiers.memory, tiers.buddy = saved, None
            tiers.beneath = [s for s in [*tiers.beneath, *before] if s.durable or s.held_by is None]
        elif path.startswith("s3://"):
            tiers.store = saved
        else:  # a disk save drops a held snapshot of its path (docs/memory.md)
            tiers.disk, tiers.memory, tiers.beneath = saved, None, []
        if tier == "mirror":
            self.model.mirrored_names.add(name)
        keep = self._keep(path, keep_last)
        if keep is None or tier in SNAPSHOTS:
            return
        self._retention(path, keep - 1, counted=True, gone=tier != "mirror" or self.cfg.mirror_keep is not None)

    def _retention(self, committed: str, slots: int, *, counted: bool, gone: bool = True) -> None:
        """Retention ran after ``committed`` committed in its directory. ``counted``: it is kept and the others share
        ``slots`` (``keep_last - 1``: the one just committed always counts, docs/api.md); else it is one of the
        candidates for ``slots`` (a persisted snapshot never outranks a newer checkpoint, issue 38, case 2).
        Newest by step, then commit time: a checkpoint with ``slots`` certainly newer ones is deleted; one with that
        many possibly newer (a snapshot a daemon persisted unseen, a tie in step with a persisted snapshot, whose
        commit time the model does not know) may be."""
        parent = os.path.dirname(committed)
        certain = {p: s for p, s in self.model.must.items() if s.durable and os.path.dirname(p) == parent}
        possible = {**{p: olds[-1] for p, olds in self.model.may.items() if os.path.dirname(p) == parent}, **certain}
        if counted:
            possible.pop(committed, None)
        for path, saved in possible.items():
            surely = sum(1 for p, s in certain.items() if p != path and p in possible and _newer(s, saved))
            maybe = sum(1 for p, s in possible.items() if p != path and _maybe_newer(s, saved))
            if surely >= slots:
                self._trimmed(path, gone=gone)
            elif maybe >= slots:
                self._unvouched(path)
                self.model.allow_gone(path)

    def _keep(self, path: str, keep_last: int | None) -> int | None:
        """How many checkpoints retention keeps in ``path``'s directory after it commits: its own ``keep_last``,
        else the daemon's ``--keep`` for the directory."""
        if keep_last is not None:
            return keep_last
        parent = os.path.dirname(path)
        if parent == str(self.w.root / "mir"):
            return self.cfg.local_keep
        if parent == str(self.w.root / "run") and self.cfg.run_keep is not None \
                and not self.cfg.awaits("persist_outranks_newer"):
            return self.cfg.run_keep
        return None

    def _trimmed(self, path: str, gone: bool = True) -> None:
        """Retention was asked to delete ``path`` (``gone``: it may then be absent anywhere; else, mirrored, it must
        stay readable from the mirror)."""
        self.model.trimmed.add(path)
        self._unvouched(path)
        if gone:
            self.model.allow_gone(path)

    def _unvouched(self, path: str) -> None:
        """Retention may delete ``path``: the model vouches for no copy of it (a persisted snapshot retention
        deletes leaves memory too)."""
        tiers = self.model.tier(path)
        tiers.disk = tiers.store = tiers.memory = None

    def _which_run(self, path: str, candidates: list[tuple[int, int]]) -> int:
        """Which of ``candidates`` ((incarnation, save id)) ``path``'s rank 0 holds."""
        tag = self._load(path, 0)["tag"].tolist()
        assert (tag[0], tag[1]) in candidates, f"{path} holds save {tag[1]} of run {tag[0]}, not one of {candidates}"
        return candidates.index((tag[0], tag[1]))

    # -- processes ------------------------------------------------------------------------------------------

    def _crash_job(self) -> None:
        codes = self.job.kill()
        assert all(killed(c) for c in codes), f"ranks did not die of SIGKILL: {codes}"
        self._job_gone(self.job)
        self.job = self._new_job()

    def _job_gone(self, job: Job) -> None:
        """``job``'s processes are gone: the daemon persists its newest complete snapshot of each directory
        (--persist-on-exit, unless the configuration turns it off)."""
        self.dead_pids += job.pids
        if not self.cfg.persists_on_exit:
            return
        parents = {os.path.dirname(p) for p, s in self.model.must.items() if s.inc == job.inc}
        for parent in sorted(parents):
            newest = self._newest_held(lambda s, parent=parent: s.inc == job.inc
                                       and os.path.dirname(self._path_of(s)) == parent)
            if newest is None or newest.durable:
                continue
            path = self._path_of(newest)
            if self._newer_committed(newest):  # never persisted over a newer checkpoint (issue 38, case 2): the
                # persist the daemon began drops it, the directory's newest state being on disk (docs/memory.md, "A
                # persist never writes an older state over a newer one"), so it may be gone from memory too
                self.model.tier(path).memory = None
                self.model.allow_gone(path)
                continue
            wait_until(lambda path=path: self._persisted(path), 60,
                       f"the dead job's newest snapshot {path} persisted")
            self._now_durable(newest)

    def _newer_committed(self, snapshot: Saved) -> bool:
        """Whether a checkpoint of a higher step than ``snapshot`` is committed in its directory: persisting the
        snapshot may then be passed over (what is persisted never outranks what was committed after it)."""
        parent = os.path.dirname(self._path_of(snapshot))
        return any(s.durable and s.step > snapshot.step for p, s in self.model.must.items()
                   if os.path.dirname(p) == parent)

    def _now_durable(self, saved: Saved) -> None:
        """A held snapshot was persisted: committed on disk (or in the bucket) as well as in memory."""
        saved.durable = True
        path = self._path_of(saved)
        if path.startswith("s3://"):
            self.model.tier(path).store = saved
        else:
            self.model.tier(path).disk, self.model.tier(path).beneath = saved, []
        keep = None if path.startswith("s3://") else self._keep(path, saved.keep_last)
        if keep is None:
            return
        self._retention(path, keep, counted=False)

    def _restart_job_and_daemons(self, nodes: list[int]) -> None:
        self.dead_pids += [self.w.daemons[node].proc.pid for node in nodes]  # not the others: they live on
        self.job.kill()
        self.dead_pids += self.job.pids
        for node in nodes:
            daemon = self.w.daemons[node]
            if daemon.proc.poll() is None:
                daemon.kill()
            self.w.start_daemon(node)
        self.job = self._new_job()

    def _finished(self, job: Job, cids: dict[int, int]) -> bool:
        return all(("done", cid) in job.ranks[r].seen for r, cid in cids.items())

    def _path_of(self, saved: Saved) -> str:
        return next(p for p, s in self.model.must.items() if s is saved)

    def _newest_held(self, which) -> Saved | None:
        """The newest (step, then commit order) snapshot the running daemon holds among ``which``."""
        held = [(s.step, s.seq, s) for s in self.model.must.values()
                if s.held_by == self.w.daemon.proc.pid and which(s)]
        return max(held, key=lambda t: t[:2])[2] if held else None

    # -- the daemons ----------------------------------------------------------------------------------------

    def _statuses(self) -> list[dict]:
        return [status(d) for d in self.w.run_dirs]

    def _draining(self) -> bool:
        try:
            return status(self.w.run_dir, timeout=2)["daemon"]["draining"]
        except AssertionError:
            return False

    def _persisted(self, path: str) -> bool:
        """Whether ``path`` has an index on disk or in the bucket (not only in the daemon's memory)."""
        if not path.startswith("s3://"):
            return (Path(path) / "ckptd.json").exists()
        key = path.split("/", 3)[3] + "/ckptd.json"
        return bool(self.w.s3.client().list_objects_v2(Bucket=self.w.bucket, Prefix=key).get("KeyCount"))

    def _shards_in(self, path: str) -> int:
        """How many ranks' shards of ``path`` the daemons hold durable or in memory, all nodes together."""
        count = 0
        for info in self._statuses():
            pending = [c["ranks_durable"] for c in info["checkpoints"] if c["path"] == path]
            held = [len(s["ranks_held"]) for s in (info.get("memory") or {}).get("snapshots", [])
                    if s["path"] == path]
            count += max(pending + held + [0])
        return count

    def _settled(self, path: str, ranks: list[int], since: float) -> bool:
        """Whether every node that ``ranks`` of the job sent a shard of ``path`` to made each durable, or refused
        them: an error naming ``path`` since ``since`` (wall clock, as ``status`` stamps errors) and nothing of
        ``path`` in progress there any more (a refused rank of a save across nodes stays unanswered until the
        ranks agree, which a rank that never saves holds up: ``client/coordinate.py``)."""
        for node, info in enumerate(self._statuses()):
            sending = sum(1 for r in ranks if self.job.node_of[r] == node)
            durable = max([c["ranks_durable"] for c in info["checkpoints"] if c["path"] == path] + [0])
            if sending == 0 or durable >= sending:
                continue
            refused = any(e["time"] >= since and path in e["message"] for e in info["errors"])
            busy = any(c["path"] == path for c in [*info["checkpoints"], *info["saves"]])
            if not refused or busy:
                return False
        return True

    def _idle(self) -> bool:
        for info in self._statuses():
            mirror = info.get("mirror") or {}
            if info["saves"] or info["checkpoints"] or mirror.get("uploads"):
                return False
        return True

    # -- loads ----------------------------------------------------------------------------------------------

    def _load(self, path: str, rank: int) -> dict:
        """Rank ``rank``'s state at ``path``, through the daemon of the node that rank saves through (a DCP
        checkpoint holds it under ``rank<r>``)."""
        per_node = -(-self.world // self.cfg.job_nodes)
        state = ckptd.load(path, rank=rank, run_dir=self.w.run_dirs[rank // per_node])
        return state.get(f"rank{rank}", state) if isinstance(state, dict) and "tag" not in state else state

    def _check_loads(self) -> None:
        for path, saved in self.model.must.items():
            if path in self.model.trimmed and "/mir/" in path:
                self._assert_loads(path, saved, alternative=self.w.mirrored(path))
            else:
                self._assert_loads(path, saved)
        for path, olds in self.model.may.items():
            self._assert_loads(path, olds, may=True)

    def _assert_loads(self, path: str, saved: Saved | list[Saved], *, may: bool = False,
                      alternative: str | None = None) -> None:
        """Every rank of ``path`` loads bitwise as one save of one run, and that save is ``saved``."""
        wanted = saved if isinstance(saved, list) else [saved]
        where = path
        try:
            shards = {r: self._load(path, r) for r in range(self.world)}
        except ckptd.InvalidCheckpoint as exc:
            if may:  # gone, or going while it was read (retention removing it)
                return
            if alternative is None:
                raise AssertionError(f"acknowledged checkpoint {path} does not load: {exc}") from None
            where = alternative
            try:
                shards = {r: self._load(alternative, r) for r in range(self.world)}
            except ckptd.InvalidCheckpoint as exc2:
                raise AssertionError(f"acknowledged checkpoint {path} is neither local ({exc}) nor on the mirror "
                                     f"({exc2})") from None
        self._assert_one_save(where, shards, wanted, may)

    def _assert_one_save(self, where: str, shards: dict[int, dict], wanted: list[Saved], may: bool = False) -> None:
        tags = {r: s["tag"].tolist() for r, s in shards.items()}
        assert len({(t[0], t[1]) for t in tags.values()}) == 1, f"{where} mixes saves: (inc, sid, rank, step) {tags}"
        for r, shard in shards.items():
            inc, sid, rank, step = tags[r]
            assert rank == r, f"{where} rank {r} holds rank {rank}'s shard"
            assert same(shard, tagged_state(inc, sid, rank, step)), f"{where} rank {r} is not bitwise its save {sid}"
        inc, sid = tags[0][0], tags[0][1]
        assert any((inc, sid) == (s.inc, s.sid) for s in wanted), (
            f"{where} holds save {sid} of incarnation {inc}; the model says "
            f"{[(s.inc, s.sid) for s in wanted]}" + (" (or absent)" if may else ""))

    # -- the idle state -------------------------------------------------------------------------------------

    def _idle_checks(self) -> None:
        wait_until(self._idle, IDLE_S, lambda: f"the daemons idle; status: {self._statuses()}")
        info = status(self.w.run_dir)
        self._check_loads()
        debris = [str(p) for p in self.w.root.rglob("*")
                  if p.name.endswith(".incomplete") or ".discarded-" in p.name or ".deleting" in p.name]
        assert not debris, f"debris after the daemons became idle: {debris}"
        ours = set(self.dead_pids)
        shm = [p.name for p in SHM.iterdir() if p.name.startswith(f"ckptd-{os.getuid()}-")
               and int(p.name.split("-")[2]) in ours]
        assert not shm, f"shared memory of dead processes left in /dev/shm: {shm}"
        for path in [p for p in self.model.trimmed if p in self.model.must or p in self.model.may]:
            if not path.startswith("s3://"):
                self._eventually(lambda path=path: not (Path(path) / "ckptd.json").exists(),
                                 f"retention deleting {path}")
        self._eventually(self._bucket_clean, "the bucket holding only committed checkpoints")
        if self.cfg.mirror_keep is not None:
            self._eventually(self._mirror_keeps, f"the store holding --mirror-keep {self.cfg.mirror_keep}")
            return
        for path, saved in self.model.must.items():
            if "/mir/" in path:
                unmirrored = [u["source"] for u in (info.get("mirror") or {}).get("unmirrored", [])]
                if saved.overwrite or path not in unmirrored:  # a new save of a name still on the mirror may fail
                    self._eventually(lambda path=path, saved=saved: self._assert_loads(self.w.mirrored(path), saved),
                                     f"{path} on the mirror")

    def _eventually(self, check, what: str) -> None:
        """Wait until ``check`` holds (returns truthy or None without raising); fail with its last word after
        ``IDLE_S``. Idle by status is not the end of the daemon's work: retention queued after an upload, the
        retention of the store after it (``--mirror-keep``) and a start's scan of the mirrored directory run on
        its threads with nothing in ``status`` showing them, so the end state is waited for, not read once."""
        last: list[str] = []

        def holds() -> bool:
            try:
                ok = check()
            except AssertionError as exc:
                last[:] = [str(exc)]
                return False
            return ok is None or bool(ok)

        wait_until(holds, IDLE_S, lambda: f"{what}: {last[0] if last else 'never true'}")

    def _mirror_keeps(self) -> None:
        """``--mirror-keep N``: the store holds the N newest mirrored checkpoints (as many as were ever saved, if
        fewer), each whole as one acknowledged save; it only counts what is on it (issue 26, item 3)."""
        keys = [o["Key"] for o in self.w.s3.client().list_objects_v2(
            Bucket=self.w.bucket, Prefix="mirror/").get("Contents", [])]
        on_store = sorted(k.split("/")[1] for k in keys if k.endswith("/ckptd.json"))
        want = min(self.cfg.mirror_keep, len(self.model.mirrored_names))
        assert len(on_store) == want, (
            f"--mirror-keep {self.cfg.mirror_keep}: the store holds {on_store}, where {want} of the "
            f"{sorted(self.model.mirrored_names)} saved must be")
        for name in on_store:
            url = f"s3://{self.w.bucket}/mirror/{name}"
            path = self.w.path("mirror", name)
            self._assert_loads(url, self.model.history.get(path, []))

    def _bucket_clean(self) -> None:
        client = self.w.s3.client()
        listed = client.list_objects_v2(Bucket=self.w.bucket).get("Contents", [])
        keys = sorted(o["Key"] for o in listed)
        committed = {k.rsplit("/", 1)[0] for k in keys if k.endswith("/ckptd.json")}
        stray = [k for k in keys if k.rsplit("/", 1)[0] not in committed]
        assert not stray, f"objects of no committed checkpoint in the bucket: {stray}"
        # Not checked: multipart uploads an outage or a kill cut off. The client library can neither list nor
        # abort an upload it no longer holds; they are invisible to readers, and docs/object-storage.md asks for a
        # lifecycle rule (AbortIncompleteMultipartUpload) to remove them.
        for key in committed:
            url = f"s3://{self.w.bucket}/{key}"
            if url not in self.model.must and url not in self.model.may and not key.startswith("mirror/"):
                raise AssertionError(f"{url} is committed in the bucket but was never acknowledged")


def _newer(one: Saved, other: Saved) -> bool:
    """Whether retention certainly ranks ``one`` above ``other``: a higher step, or the same step committed later by
    two disk saves (a persist's commit time is not the snapshot's)."""
    if one.step != other.step:
        return one.step > other.step
    return one.seq > other.seq and one.held_by is None and other.held_by is None


def _maybe_newer(one: Saved, other: Saved) -> bool:
    """Whether retention may rank ``one`` above ``other``."""
    return one.step > other.step or (one.step == other.step and (
        one.seq > other.seq or one.held_by is not None or other.held_by is not None))
