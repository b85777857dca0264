"""The stateful test's machine: random sequences of saves, crashes, restarts and outages against a model.

Real daemons, real rank processes (``tests/jobs.py``), real files, real shared
memory and a real S3 endpoint (moto's server, ``tests/s3server.py``) behind a
loopback proxy the machine can cut (``tests/proxy.py``). The model records what
was acknowledged (every rank's future resolved) and where it must be; after
every step each checkpoint the model knows must load, on every rank, bitwise
equal to the one save the model says it holds, and when the daemon is idle
nothing may be left over: no ``.incomplete``/``.discarded-``/``.deleting``
directories, no shared memory of dead processes, no stray objects in the
bucket, no attempt kept alive by dead ranks (a multipart upload an outage cut
off is the one exception, see ``_bucket_clean``).

Used by ``tests/test_stateful.py`` (a short, derandomized run in ``make
test``) and ``tests/soak/test_soak_stateful.py`` (many more examples).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import ckptd
from crashes import same
from helpers import SHM, Daemon, short_tempdir, start_daemon, status, wait_until
from jobs import Job, killed, tagged_state
from proxy import TcpProxy
from s3server import S3Server

WORLD = 2
NAMES = ("step-1", "step-2", "step-3")
"""Few names, so saves collide: overwrites, re-saves after crashes, retention of older steps."""
TIERS = ("disk", "memory", "s3", "s3-memory", "mirror")
SNAPSHOTS = ("memory", "s3-memory")
"""Tiers saved with ``persist=False``: held in the daemon's memory, persisted to the directory or bucket later."""
MIRROR_KEEP_LOCAL = 2
"""``--keep mir=2``: local retention in the mirrored directory."""
IDLE_S = 60.0
"""How long the daemon may take to settle (uploads retried after an outage back off up to this order)."""
@dataclass
class Saved:
    """One acknowledged save: which incarnation and save id wrote it, and in what order it committed."""

    inc: int
    sid: int
    step: int
    seq: int
    durable: bool = True
    """False for a memory snapshot not yet written to disk (a daemon kill may lose it)."""
    held_by: int | None = None
    """For a memory snapshot: the pid of the daemon holding it."""
    overwrite: bool = False
    """Saved with ``overwrite=True``: on a mirror, too, it replaces what was there."""


@dataclass
class Model:
    """What must exist. ``must`` loads exactly as recorded; ``may`` is absent or loads as recorded (a snapshot
    the daemon was allowed to lose, a checkpoint retention was asked to delete but may not have yet)."""

    must: dict[str, Saved] = field(default_factory=dict)
    may: dict[str, list[Saved]] = field(default_factory=dict)
    trimmed: set[str] = field(default_factory=set)
    """Paths retention was asked to delete: gone once the daemon is idle."""

    def allow_gone(self, path: str) -> None:
        saved = self.must.pop(path, None)
        if saved is not None:
            self.may.setdefault(path, []).append(saved)


class World:
    """The processes and places one example uses: a root, a bucket, the proxy, the daemon."""

    def __init__(self, s3: S3Server) -> None:
        self.s3 = s3
        self.run_dir = short_tempdir("ckst-")
        self.root = short_tempdir("ckst-root-")
        self.fifos = short_tempdir("ckst-fifo-")
        for d in ("run", "mem", "mir"):
            (self.root / d).mkdir()
        self.bucket = s3.new_bucket()
        self.proxy = TcpProxy("127.0.0.1", s3.port)
        self.daemon_pids: list[int] = []
        self.daemon: Daemon | None = None

    def path(self, tier: str, name: str) -> str:
        return {"disk": str(self.root / "run" / name), "memory": str(self.root / "mem" / name),
                "mirror": str(self.root / "mir" / name), "s3": f"s3://{self.bucket}/run/{name}",
                "s3-memory": f"s3://{self.bucket}/snap/{name}"}[tier]

    def mirrored(self, path: str) -> str:
        """Where the mirror rule puts a checkpoint of the mirrored directory."""
        return f"s3://{self.bucket}/mirror/{Path(path).name}"

    def start_daemon(self) -> None:
        """Start the daemon with the daemon's view of the store going through the proxy."""
        with _env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.proxy.port}"):
            self.daemon = start_daemon(
                self.run_dir, self.root, "--root", f"s3://{self.bucket}/run", "--root", f"s3://{self.bucket}/snap",
                "--keep-snapshots", "16",
                "--mirror", f"{self.root / 'mir'}=s3://{self.bucket}/mirror",
                "--keep", f"{self.root / 'mir'}={MIRROR_KEEP_LOCAL}", "--drain-timeout", "30")
        self.daemon_pids.append(self.daemon.proc.pid)

    def close(self) -> None:
        if self.daemon is not None and self.daemon.proc.poll() is None:
            self.daemon.kill()
        self.proxy.close()
        for d in (self.run_dir, self.root, self.fifos):
            shutil.rmtree(d, ignore_errors=True)


@contextmanager
def _env(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class CheckpointMachine(RuleBasedStateMachine):
    """Saves of every tier by a job of ``WORLD`` ranks; crashes of ranks, jobs and the daemon; outages."""

    s3: S3Server  # set by the test before the machine runs

    def __init__(self) -> None:
        super().__init__()
        self.w = World(self.s3)
        self.model = Model()
        self.incs = iter(range(1, 10**6))
        self.sids = iter(range(1, 10**9))
        self.seq = 0
        self.dead_pids: list[int] = []
        self.steps_started = self.steps_checked = 0
        self.ran: list[str] = []
        try:
            self.w.start_daemon()
            self.job = self._new_job()
        except BaseException:  # no teardown follows a failed __init__: nothing may outlive it
            self.w.close()
            raise

    # -- processes ------------------------------------------------------------------------------------------

    def _new_job(self) -> Job:
        return Job(self.w.run_dir, self.w.fifos, WORLD, next(self.incs))

    def _save(self, job: Job, ranks: list[int], tier: str, name: str, *, overwrite: bool = False,
              keep_last: int | None = None) -> tuple[int, dict[int, int]]:
        """Send one save to ``ranks`` of ``job`` (in that order); returns the save id and each rank's command id."""
        sid = next(self.sids)
        step = int(name.split("-")[1])
        cids = {}
        for r in ranks:
            cid = job.next_id()
            job.ranks[r].send(op="save", id=cid, sid=sid, step=step, path=self.w.path(tier, name),
                              overwrite=overwrite, keep_last=keep_last, persist=tier not in SNAPSHOTS)
            job.ranks[r].wait_for("returned", cid)
            cids[r] = cid
        return sid, cids

    def _outcomes(self, job: Job, cids: dict[int, int], timeout: float = 120) -> dict[int, dict]:
        return {r: job.ranks[r].wait_for("done", cid, timeout) for r, cid in cids.items()}

    # -- the model ------------------------------------------------------------------------------------------

    def _acknowledged(self, tier: str, name: str, saved: Saved, keep_last: int | None) -> None:
        path = self.w.path(tier, name)
        self.model.must[path] = saved
        self.model.may.pop(path, None)
        self.model.trimmed.discard(path)
        keep = keep_last if keep_last is not None else (MIRROR_KEEP_LOCAL if tier == "mirror" else None)
        if keep is None or tier in SNAPSHOTS:
            return
        siblings = [(s.step, s.seq, p) for p, s in self.model.must.items()
                    if p != path and str(Path(p).parent) == str(Path(path).parent)]
        for _, _, old in sorted(siblings, reverse=True)[keep - 1:]:
            if tier == "mirror":  # gone locally once uploaded: it must stay readable from the mirror
                self.model.trimmed.add(old)
                continue
            self.model.allow_gone(old)
            self.model.trimmed.add(old)

    def _expect_refused(self, tier: str, name: str, overwrite: bool) -> bool | None:
        """Whether the documented behaviour refuses this save (None: either outcome is documented)."""
        path = self.w.path(tier, name)
        if path in self.model.may or (tier in SNAPSHOTS and path in self.model.trimmed):
            return None
        if tier == "s3":  # a store never replaces a checkpoint
            return path in self.model.must
        if tier == "mirror" and path in self.model.trimmed:
            return None  # maybe deleted locally by now
        if path in self.model.must:
            return not overwrite if tier not in SNAPSHOTS else None
        return False

    def _check_outcomes(self, what: str, outcomes: dict[int, dict], refused: bool | None) -> bool:
        oks = {r: o["ok"] for r, o in outcomes.items()}
        assert len(set(oks.values())) == 1, f"{what}: the ranks were told different outcomes: {outcomes}"
        ok = next(iter(oks.values()))
        if refused is True:
            assert not ok, f"{what}: acknowledged, but the path held a committed checkpoint and overwrite was off"
        if refused is False:
            assert ok, f"{what}: failed on a healthy daemon and store: {outcomes}"
        return ok

    # -- rules ----------------------------------------------------------------------------------------------

    @rule(tier=st.sampled_from(TIERS), name=st.sampled_from(NAMES), overwrite=st.booleans(),
          keep_last=st.sampled_from([None, None, 1, 2]), reverse=st.booleans())
    def save(self, tier: str, name: str, overwrite: bool, keep_last: int | None, reverse: bool) -> None:
        """Every rank saves; the save is acknowledged when every future resolves."""
        self._begin()
        if tier in SNAPSHOTS:
            keep_last = None
        refused = self._expect_refused(tier, name, overwrite)
        ranks = list(range(WORLD))[::-1] if reverse else list(range(WORLD))
        sid, cids = self._save(self.job, ranks, tier, name, overwrite=overwrite, keep_last=keep_last)
        what = f"save {sid} of {self.w.path(tier, name)} (incarnation {self.job.inc}, overwrite={overwrite})"
        if self._check_outcomes(what, self._outcomes(self.job, cids), refused):
            self.seq += 1
            held_by = self.w.daemon.proc.pid if tier in SNAPSHOTS else None
            self._acknowledged(tier, name, Saved(self.job.inc, sid, int(name[-1]), self.seq, durable=held_by is None,
                                                 held_by=held_by, overwrite=overwrite), keep_last)

    @rule(tier=st.sampled_from(("disk", "memory", "s3")), name=st.sampled_from(NAMES),
          before=st.integers(1, WORLD - 1), resave=st.booleans())
    def job_crashes_mid_save(self, tier: str, name: str, before: int, resave: bool) -> None:
        """Some ranks' shards are in; the whole job is SIGKILLed (a rank died, the launcher killed the rest) and
        restarted as a new incarnation, which may save the same path again, its last rank first."""
        self._begin()
        path = self.w.path(tier, name)
        _, cids = self._save(self.job, list(range(before)), tier, name)
        wait_until(lambda: self._shards_in(path) >= before or self._finished(cids), 60,
                   f"{before} shards of {path} durable or held")
        self._crash_job()
        if resave:
            self.save(tier, name, False, None, True)

    @rule()
    def job_restarts(self) -> None:
        """The job exits cleanly (its clients close) and a new incarnation starts."""
        self._begin()
        self.job.exit()
        self._job_gone()
        self.job = self._new_job()

    @rule()
    def rank_is_killed_between_saves(self) -> None:
        """A rank dies; the launcher kills the rest and starts a new incarnation."""
        self._begin()
        self._crash_job()

    @precondition(lambda self: any(not s.durable and s.inc == self.job.inc for s in self.model.must.values()))
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
        saved.durable = True
        assert self._persisted(path), f"persist of {path} returned, but it is not on disk"

    @precondition(lambda self: self.model.must)
    @rule()
    def daemon_is_killed_and_restarted(self) -> None:
        self._begin()
        assert self.w.daemon is not None
        self.w.daemon.kill()
        assert killed(self.w.daemon.proc.returncode), "the daemon did not die of SIGKILL"
        for path, saved in list(self.model.must.items()):
            if not saved.durable:
                self.model.allow_gone(path)  # memory snapshots do not survive the daemon
        self._restart_job_and_daemon()

    @precondition(lambda self: self.model.must)
    @rule(outage=st.booleans())
    def daemon_is_stopped_and_restarted(self, outage: bool) -> None:
        """SIGTERM drains: the newest held snapshot of each directory is persisted first, also when the store
        is away for a moment as the drain begins (``outage``)."""
        self._begin()
        assert self.w.daemon is not None
        if outage:
            self.w.proxy.cut()
        try:
            self.w.daemon.proc.send_signal(signal.SIGTERM)
            if outage:  # the drain has begun and meets the outage; the store comes back within the drain's deadline
                wait_until(lambda: self.w.daemon.proc.poll() is not None or self._draining(), 30, "the drain begun")
        finally:
            self.w.proxy.restore()
        code = self.w.daemon.stop(timeout=120)
        assert code == 0, f"ckptd stop exited {code}"
        for parent in {str(Path(p).parent) for p, s in self.model.must.items() if s.held_by is not None}:
            newest = self._newest_held(lambda s, parent=parent: str(Path(self._path_of(s)).parent) == parent)
            if newest is not None:
                newest.durable = True
        for path, saved in list(self.model.must.items()):
            if not saved.durable:
                self.model.allow_gone(path)
        self._restart_job_and_daemon()

    @rule(tier=st.sampled_from(("s3", "mirror")), name=st.sampled_from(NAMES))
    def store_outage_during_a_save(self, tier: str, name: str) -> None:
        """The endpoint goes away while a save (direct) or its upload (mirror) is under way, and comes back."""
        self._begin()
        path = self.w.path(tier, name)
        refused = self._expect_refused(tier, name, False)
        resets = self.w.proxy.resets
        self.w.proxy.cut()
        try:
            sid, cids = self._save(self.job, list(range(WORLD)), tier, name)
            if tier == "mirror":  # committed locally (or refused); its upload meets the outage
                self._outcomes(self.job, cids)
            # until the daemon met the outage (a save may also end without touching the store: refused)
            wait_until(lambda: self.w.proxy.resets > resets or (self._finished(cids) and self._idle()), 60,
                       f"the daemon meeting the outage while saving {path}")
        finally:
            self.w.proxy.restore()
        outcomes = self._outcomes(self.job, cids)
        ok = self._check_outcomes(f"save {sid} of {path} through an outage", outcomes,
                                  None if tier == "s3" and refused is False else refused)
        if ok and tier == "mirror":  # its upload ran into the outage: the rule tested what it says
            assert self.w.proxy.resets > resets, f"the upload of {path} never met the outage"
        if ok:
            self.seq += 1
            self._acknowledged(tier, name, Saved(self.job.inc, sid, int(name[-1]), self.seq), None)

    @rule()
    def settle(self) -> None:
        """Wait until the daemon is idle, then everything must be clean and in place."""
        self._begin()
        self._idle_checks()

    # -- checks ---------------------------------------------------------------------------------------------

    @invariant()
    def every_acknowledged_checkpoint_loads_as_saved(self) -> None:
        self._check_loads()
        self.steps_checked = self.steps_started

    def _check_loads(self) -> None:
        for path, saved in self.model.must.items():
            if path in self.model.trimmed and "/mir/" in path:
                self._assert_loads(path, saved, alternative=self.w.mirrored(path))
            else:
                self._assert_loads(path, saved)
        for path, olds in self.model.may.items():
            self._assert_loads(path, olds, may=True)

    def teardown(self) -> None:
        if os.environ.get("STATEFUL_VERBOSE") == "1":
            print(f"stateful example: {' '.join(self.ran)}", flush=True)
        try:
            if self.steps_checked == self.steps_started:  # the example passed so far: it must end clean
                self._idle_checks()
        finally:
            try:
                self.job.kill()
            finally:
                self.w.close()

    # -- helpers --------------------------------------------------------------------------------------------

    def _begin(self) -> None:
        """Count a rule as started (teardown checks the end state only if every started rule passed)."""
        self.steps_started += 1
        self.ran.append(sys._getframe(1).f_code.co_name)

    def _crash_job(self) -> None:
        codes = self.job.kill()
        assert all(killed(c) for c in codes), f"ranks did not die of SIGKILL: {codes}"
        self._job_gone()
        self.job = self._new_job()

    def _job_gone(self) -> None:
        """The job's processes are gone: the daemon persists its newest complete snapshot (--persist-on-exit)."""
        self.dead_pids += self.job.pids
        newest = self._newest_held(lambda s: s.inc == self.job.inc)
        if newest is not None and not newest.durable:
            path = self._path_of(newest)
            wait_until(lambda: self._persisted(path), 60,
                       f"the dead job's newest snapshot {path} persisted")
            newest.durable = True

    def _path_of(self, saved: Saved) -> str:
        return next(p for p, s in self.model.must.items() if s is saved)

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

    def _newest_held(self, which) -> Saved | None:
        """The newest (step, then commit order) snapshot the running daemon holds among ``which``."""
        held = [(s.step, s.seq, s) for s in self.model.must.values()
                if s.held_by == self.w.daemon.proc.pid and which(s)]
        return max(held, key=lambda t: t[:2])[2] if held else None

    def _restart_job_and_daemon(self) -> None:
        self.dead_pids += self.w.daemon_pids
        self.job.kill()
        self.dead_pids += self.job.pids
        self.w.start_daemon()
        self.job = self._new_job()

    def _finished(self, cids: dict[int, int]) -> bool:
        return all(("done", cid) in self.job.ranks[r].seen for r, cid in cids.items())

    def _in_flight(self, path: str) -> bool:
        info = status(self.w.run_dir)
        return any(s["path"] == path for s in info["saves"]) or any(c["path"] == path for c in info["checkpoints"])

    def _shards_in(self, path: str) -> int:
        info = status(self.w.run_dir)
        pending = [c["ranks_durable"] for c in info["checkpoints"] if c["path"] == path]
        held = [len(s["ranks_held"]) for s in (info.get("memory") or {}).get("snapshots", []) if s["path"] == path]
        return max(pending + held + [0])

    def _assert_loads(self, path: str, saved: Saved | list[Saved], *, may: bool = False,
                      alternative: str | None = None) -> None:
        """Every rank of ``path`` loads bitwise as one save of one incarnation, and that save is ``saved``."""
        wanted = saved if isinstance(saved, list) else [saved]
        where = path
        try:
            shards = {r: ckptd.load(path, rank=r, run_dir=self.w.run_dir) for r in range(WORLD)}
        except ckptd.InvalidCheckpoint as exc:
            if may:  # gone, or going while it was read (retention removing it)
                return
            if alternative is None:
                raise AssertionError(f"acknowledged checkpoint {path} does not load: {exc}") from None
            where = alternative
            try:
                shards = {r: ckptd.load(alternative, rank=r) for r in range(WORLD)}
            except ckptd.InvalidCheckpoint as exc2:
                raise AssertionError(f"acknowledged checkpoint {path} is neither local ({exc}) nor on the mirror "
                                     f"({exc2})") from None
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

    def _idle(self) -> bool:
        info = status(self.w.run_dir)
        mirror = info.get("mirror") or {}
        return not info["saves"] and not info["checkpoints"] and not mirror.get("uploads")

    def _idle_checks(self) -> None:
        wait_until(self._idle, IDLE_S, lambda: f"the daemon idle; status: {status(self.w.run_dir)}")
        info = status(self.w.run_dir)
        self._check_loads()
        debris = [str(p) for p in self.w.root.rglob("*")
                  if p.name.endswith(".incomplete") or ".discarded-" in p.name or ".deleting" in p.name]
        assert not debris, f"debris after the daemon became idle: {debris}"
        ours = set(self.dead_pids)
        shm = [p.name for p in SHM.iterdir() if p.name.startswith(f"ckptd-{os.getuid()}-")
               and int(p.name.split("-")[2]) in ours]
        assert not shm, f"shared memory of dead processes left in /dev/shm: {shm}"
        for path in [p for p in self.model.trimmed if p in self.model.must or p in self.model.may]:
            if not path.startswith("s3://"):
                assert not (Path(path) / "ckptd.json").exists(), f"retention never deleted {path}"
        self._bucket_clean()
        for path, saved in self.model.must.items():
            if "/mir/" in path:
                unmirrored = [u["source"] for u in (info.get("mirror") or {}).get("unmirrored", [])]
                if saved.overwrite or path not in unmirrored:  # a new save of a name still on the mirror may fail
                    self._assert_loads(self.w.mirrored(path), saved)

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


def run_stateful(s3: S3Server, *, examples: int, steps: int, derandomize: bool, shrink: bool) -> None:
    """Run ``examples`` sequences of up to ``steps`` rules. Shrinking replays sequences against real processes
    (minutes per failure), so the short run leaves it off: the failing sequence is printed either way
    (STATEFUL_VERBOSE=1 prints every sequence run)."""
    machine = type("Machine", (CheckpointMachine,), {"s3": s3})
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=derandomize, database=None,
        suppress_health_check=list(HealthCheck), phases=phases, print_blob=False,
        verbosity=Verbosity.verbose if os.environ.get("STATEFUL_VERBOSE") == "1" else Verbosity.normal))
