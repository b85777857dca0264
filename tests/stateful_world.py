"""The stateful test's world and model: configurations, launches, what was acknowledged, the daemons.

``tests/stateful.py`` holds the machine (its rules and checks); this module
holds what it runs against: a ``Config`` (world sizes, nodes, tiers, the
launchers whose names the runs carry, which rule families are on), the
``Launch`` each launcher form gives a run (``launch_for``), the ``Model`` of
what must exist, and the ``World`` of daemons, root, bucket and proxy.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ckptd.protocol.names import LOG_NAME
from helpers import Daemon, ckptd_cli, free_port, short_tempdir, start_daemon
from jobs import Launch
from proxy import TcpProxy
from s3server import S3Server

NAMES = ("step-1", "step-2", "step-3")
"""Few names, so saves collide: overwrites, re-saves after crashes, retention of older steps."""
TIERS = ("disk", "memory", "s3", "s3-memory", "mirror")
SNAPSHOTS = ("memory", "s3-memory")
"""Tiers saved with ``persist=False``: held in the daemon's memory, persisted to the directory or bucket later."""
PEER_TIMEOUT_S = 2.0
"""``--peer-timeout`` of the ``buddy`` configuration: a paused buddy fails a replication this soon."""
IDLE_S = 60.0
"""How long the daemon may take to settle (uploads retried after an outage back off up to this order)."""

LAUNCH_FORMS = ("unnamed", "job", "torchrun-static", "torchrun-c10d", "slurm", "drawn")
"""How a job's runs are named:

- ``unnamed``: no launcher, no ``job=``, no torch.distributed: runs are told apart by their processes alone, so a
  second *live* run may join the first's save (``docs/api.md`` says so); the overlap rule never runs there.
- ``job``: ``Client(job="train-<n>")``, a new name for every run.
- ``torchrun-static``: torchrun with ``--master-port`` (static rendezvous): ``TORCHELASTIC_RUN_ID=none`` and
  ``TORCHELASTIC_RESTART_COUNT=0`` in *every* launch, ranks under torch.distributed (issue 26, item 1).
- ``torchrun-c10d``: c10d rendezvous, a real ``--rdzv-id`` kept across restarts (the count goes up); a second
  launch beside it has an id of its own.
- ``slurm``: ``SLURM_JOB_ID``/``SLURM_STEP_ID``/``SLURM_RESTART_COUNT`` (a requeue counts up; a second live
  step of the allocation has its own step id), ranks not under torch.distributed.
- ``drawn``: no launcher, ranks under torch.distributed: rank 0 draws a name and the ranks agree on it.
"""


def launch_for(form: str, run: int, restarts: int, overlapping: int, dist: bool) -> Launch:
    """The launch of run ``run`` of a job started with ``form``, after ``restarts`` restarts of its launch, as
    the ``overlapping``-th launch alive at once (0: the job's own); ``dist`` forces torch.distributed (several
    nodes and DCP need it)."""
    if form == "unnamed":
        return Launch(dist=dist)
    if form == "job":
        return Launch(job=f"train-{run}", dist=dist)
    if form == "torchrun-static":
        return Launch(env={"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}, dist=True)
    if form == "torchrun-c10d":
        return Launch(env={"TORCHELASTIC_RUN_ID": f"rdzv-{overlapping}", "TORCHELASTIC_RESTART_COUNT": str(restarts)},
                      dist=True)
    if form == "slurm":
        return Launch(env={"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": str(overlapping),
                           "SLURM_RESTART_COUNT": str(restarts)}, dist=dist)
    assert form == "drawn", form
    return Launch(dist=True)


@dataclass(frozen=True)
class Config:
    """One configuration of the machine: what its examples may draw and which rules run."""

    worlds: tuple[int, ...] = (2,)
    nodes: int = 1
    """Daemons, one run dir each, sharing the root (ranks split evenly over them, under torch.distributed)."""
    tiers: tuple[str, ...] = TIERS
    forms: tuple[str, ...] = ("unnamed",)
    overlap: bool = False
    """A second live run of the job saving the path the first saves."""
    kills_inside: bool = False
    """Daemon SIGKILLs inside a write, a publish and a retention (the fault-injecting storage's kill points)."""
    mirror_keep: int | None = None
    local_keep: int | None = 2
    """``--keep mir=N`` on the mirrored directory (None: only the saves' ``keep_last``)."""
    dcp: bool = False
    """Saves through ``ckptd.dcp.StorageWriter`` (``dcp.save``) beside the client's own."""
    outage_restarts: bool = False
    """Saves to the mirrored directory during an outage, then a daemon SIGKILL and a start with the store back."""
    peers: bool = False
    """Each node's daemon replicates its snapshots to the next node's (a ring over ``--peer-listen`` ports on
    127.0.0.1, one keys file), runs ``--persist-on-exit never`` (a snapshot spanning nodes is never persisted), and
    keeps its snapshots in the disk checkpoints' directory, so a resume chooses among both; nodes are lost whole
    and replaced (``node_is_lost``)."""
    buddy: bool = False
    """One model for every tier (``tests/stateful_tiers.py``): the job runs on node 0 alone, node 1 is its buddy
    (static ``--peer``, a short ``--peer-timeout``), snapshots share the disk checkpoints' directory and
    ``keep_last``, and the daemons persist on exit as by default; node 0 is lost whole and replaced, the buddy
    restarted and paused, the job restarted with another world size."""
    run_keep: int | None = None
    """``--keep run=N`` on the directory of the disk checkpoints (and, with ``buddy``, of the snapshots)."""
    awaiting_fixes: frozenset[str] = frozenset()
    """Issue 38's cases still open whose rules are left out (``AWAITING_ISSUE_38``): once a case's fix is merged,
    take it out and the derandomized run exercises its rules again."""

    def awaits(self, case: str) -> bool:
        return case in self.awaiting_fixes

    @property
    def job_nodes(self) -> int:
        """The nodes the job's ranks run on (with ``buddy``, node 1 only holds replicas)."""
        return 1 if self.buddy else self.nodes

    @property
    def peer_ring(self) -> bool:
        """Whether the daemons listen for peers (a key pair each, one keys file)."""
        return self.peers or self.buddy

    @property
    def dist(self) -> bool:
        return self.job_nodes > 1 or self.dcp

    @property
    def persists_on_exit(self) -> bool:
        """Whether a dead job's newest snapshot of each directory is persisted (the daemons' default)."""
        return not self.peers


AWAITING_ISSUE_38: frozenset[str] = frozenset()
"""Issue 38's open cases the ``one_model`` rules find (``Config.awaiting_fixes``), each off until its fix merges:
``persist_outranks_newer`` turns off the rule persisting a snapshot under a newer checkpoint, a snapshot's own
``keep_last`` and ``--keep`` on its directory; ``replica_of_a_replaced_save`` the rollback rule and the check that
a replicated snapshot is the buddy's only copy of its path (another run's overwrite of a restored snapshot's path
finds it too); ``replicated_but_gone`` the buddy's restart and the check that the buddy holds what node 0 shows
replicated; ``paused_origin_calls_its_snapshot_lost`` the origin paused while its buddy drains."""

CONFIGS: dict[str, Config] = {
    "tiers": Config(forms=("unnamed", "job")),
    "named_runs": Config(worlds=(1, 2, 3), tiers=("disk", "s3", "memory"), overlap=True,
                         forms=("job", "torchrun-static", "torchrun-c10d", "slurm", "drawn")),
    "kills_inside": Config(worlds=(1, 2), tiers=("disk", "memory", "mirror"), kills_inside=True,
                           forms=("unnamed", "torchrun-c10d")),
    "mirror_keep": Config(worlds=(1, 2), tiers=("mirror", "disk"), mirror_keep=1, local_keep=None,
                          outage_restarts=True, forms=("job",)),
    "two_nodes": Config(worlds=(2, 4), nodes=2, tiers=("disk", "s3"), overlap=True,
                        forms=("job", "torchrun-static", "drawn")),
    "dcp": Config(worlds=(2, 3, 4), tiers=("disk", "s3", "mirror"), dcp=True, overlap=True,
                  forms=("torchrun-c10d", "drawn")),
    "node_lost": Config(worlds=(3,), nodes=3, tiers=("disk", "memory"), peers=True, forms=("torchrun-c10d",)),
    "node_lost_wide": Config(worlds=(3, 6), nodes=3, tiers=("disk", "memory"), peers=True,
                             forms=("torchrun-c10d", "drawn", "job")),
    "one_model": Config(worlds=(1, 2), nodes=2, tiers=("disk", "memory", "s3"), buddy=True, forms=("job",),
                        run_keep=2, awaiting_fixes=AWAITING_ISSUE_38),
}
"""The configurations the short run and the soak run, by name (``tests/test_stateful.py``)."""


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
    dcp: bool = False
    """Saved by ``dcp.save``: each rank's state is under the key ``rank<r>``."""
    keep_last: int | None = None
    """The save's ``keep_last``: a snapshot's persist applies it (docs/memory.md)."""
    run: str = ""
    """The name its run's clients gave (``job`` in ``status``)."""


@dataclass
class Tiers:
    """Per path, the newest acknowledged state in each tier (``None``: none the model vouches for there)."""

    disk: Saved | None = None
    """Committed on the local filesystem: saved to disk, or a snapshot persisted (explicitly, on exit, on drain)."""
    memory: Saved | None = None
    """Held in node 0's daemon (a snapshot, persisted or not)."""
    buddy: Saved | None = None
    """A replica on node 1, once node 0's status said ``replicated``."""
    store: Saved | None = None
    """Committed in the bucket."""
    beneath: list[Saved] = field(default_factory=list)
    """What the path's copy on disk may still be while a snapshot that replaced it is held in memory only (a
    persisted predecessor, perhaps one retention may have deleted): what it may hold once that snapshot is lost."""


@dataclass
class Model:
    """What must exist. ``must`` loads exactly as recorded; ``may`` is absent or loads as recorded (a snapshot
    the daemon was allowed to lose, a checkpoint retention was asked to delete but may not have yet)."""

    must: dict[str, Saved] = field(default_factory=dict)
    may: dict[str, list[Saved]] = field(default_factory=dict)
    trimmed: set[str] = field(default_factory=set)
    """Paths retention was asked to delete: gone once the daemon is idle."""
    mirrored_names: set[str] = field(default_factory=set)
    """Every name ever acknowledged in the mirrored directory (``--mirror-keep`` counts them)."""
    history: dict[str, list[Saved]] = field(default_factory=dict)
    """Every save ever acknowledged, by path (a mirror may hold an older version of a name)."""
    tiers: dict[str, Tiers] = field(default_factory=dict)
    """Per path, what each tier holds (kept by the ``buddy`` configuration's machine, ``tests/stateful_tiers.py``)."""

    def tier(self, path: str) -> Tiers:
        return self.tiers.setdefault(path, Tiers())

    def forget(self, tier: str) -> None:
        """The daemon holding ``tier`` (``memory``, ``buddy``) died: none of its copies is vouched for."""
        for tiers in self.tiers.values():
            setattr(tiers, tier, None)

    def allow_gone(self, path: str) -> None:
        saved = self.must.pop(path, None)
        if saved is not None:
            self.may.setdefault(path, []).append(saved)
            tiers = self.tier(path)  # a snapshot replaced in memory leaves its persisted predecessor
            for persisted in [tiers.disk, *tiers.beneath]:
                if persisted is not None and persisted not in self.may[path]:
                    self.may[path].append(persisted)


KILL_POINTS = {
    "write": ("step-7", {"op": "write", "match": "/step-7.incomplete/"}),
    "publish": ("step-8", {"op": "rename", "exact": True}),
    "published": ("step-9", {"op": "rename", "exact": True, "after": True}),
    "retention": ("step-0", {"op": "remove_tree", "match": "/step-0.deleting"}),
}
"""Where the daemon SIGKILLs itself (``tests/faults.py``): inside a shard's write, before and after the rename that
publishes a checkpoint, and inside retention's removal of a victim it set aside. Each point has a name of its
own in a directory of its own per cycle (``World.kill_dir``), so no other rule ever reaches it."""


class World:
    """The processes and places one example uses: a root, a bucket, the proxy, one daemon per node."""

    def __init__(self, s3: S3Server, cfg: Config) -> None:
        self.s3, self.cfg = s3, cfg
        self.run_dirs = [short_tempdir("ckst-") for _ in range(cfg.nodes)]
        self.every_run_dir = list(self.run_dirs)
        """Every node's run directories, replaced ones too (removed at the end)."""
        self.root = short_tempdir("ckst-root-")
        self.fifos = short_tempdir("ckst-fifo-")
        for d in ("run", "mem", "mir", "kill"):
            (self.root / d).mkdir()
        self.bucket = s3.new_bucket()
        self.proxy = TcpProxy("127.0.0.1", s3.port)
        self.daemons: list[Daemon | None] = [None] * cfg.nodes
        self.kill_cycle = 0
        """The kill points of the running node-0 daemon are armed in ``kill_dir(kill_cycle)``."""
        self.ports = [free_port() for _ in range(cfg.nodes)] if cfg.peer_ring else []
        self.keys_file = self.fifos / "peer-keys"
        self.key_lines = [self._key_line(node) for node in range(len(self.ports))]
        self._write_keys()

    @property
    def run_dir(self) -> Path:
        return self.run_dirs[0]

    @property
    def daemon(self) -> Daemon:
        daemon = self.daemons[0]
        assert daemon is not None
        return daemon

    def path(self, tier: str, name: str) -> str:
        if self.cfg.peer_ring and tier == "memory":  # beside the disk checkpoints: a resume chooses among both
            return str(self.root / "run" / f"snap-{name.split('-')[1]}")
        return {"disk": str(self.root / "run" / name), "memory": str(self.root / "mem" / name),
                "mirror": str(self.root / "mir" / name), "s3": f"s3://{self.bucket}/run/{name}",
                "s3-memory": f"s3://{self.bucket}/snap/{name}"}[tier]

    def mirrored(self, path: str) -> str:
        """Where the mirror rule puts a checkpoint of the mirrored directory."""
        return f"s3://{self.bucket}/mirror/{Path(path).name}"

    def kill_dir(self, cycle: int) -> Path:
        return self.root / "kill" / f"c{cycle}"

    def kill_faults(self) -> list[dict]:
        where = self.kill_dir(self.kill_cycle)
        where.mkdir(exist_ok=True)
        faults = []
        for name, fault in KILL_POINTS.values():
            match = str(where / name) if fault.get("exact") else str(where) + fault["match"]
            faults.append({**{k: v for k, v in fault.items() if k != "match"}, "match": match, "errno": 0,
                           "kill": True})
        return faults

    def start_daemon(self, node: int = 0) -> None:
        """Start node ``node``'s daemon, its view of the store going through the proxy. Node 0 holds the mirror
        rule and the local retention rule (it commits); with kill points on, node 0 is armed for the next cycle."""
        extra = ["--root", f"s3://{self.bucket}/run", "--root", f"s3://{self.bucket}/snap", "--keep-snapshots", "16",
                 "--drain-timeout", "30"]
        if node == 0:
            extra += ["--mirror", f"{self.root / 'mir'}=s3://{self.bucket}/mirror"]
            if self.cfg.local_keep is not None:
                extra += ["--keep", f"{self.root / 'mir'}={self.cfg.local_keep}"]
            if self.cfg.mirror_keep is not None:
                extra += ["--mirror-keep", str(self.cfg.mirror_keep)]

        if self.cfg.run_keep is not None and not self.cfg.awaits("persist_outranks_newer"):  # every node: a buddy
            extra += ["--keep", f"{self.root / 'run'}={self.cfg.run_keep}"]  # persists replicas there on a drain
        if self.cfg.peers:
            extra += ["--peer-listen", self.endpoint(node), "--peer", self.endpoint(node + 1), "--peer-keys",
                      str(self.keys_file), "--persist-on-exit", "never"]
        if self.cfg.buddy:
            extra += ["--peer-listen", self.endpoint(node), "--peer", self.endpoint(node + 1), "--peer-keys",
                      str(self.keys_file), "--peer-timeout", str(PEER_TIMEOUT_S)]
        faults = self.kill_faults() if self.cfg.kills_inside and node == 0 else None
        with _env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.proxy.port}"):
            daemon = start_daemon(self.run_dirs[node], self.root, *extra, faults=faults)
        self.daemons[node] = daemon

    # -- peers ----------------------------------------------------------------------------------------------

    def endpoint(self, node: int) -> str:
        """Node ``node``'s peer endpoint (modulo the nodes: the last node's buddy is node 0); a replacement keeps
        its predecessor's, as a rescheduled pod keeps its service name."""
        return f"tcp://127.0.0.1:{self.ports[node % len(self.ports)]}"

    def buddy(self, node: int) -> int:
        """The node holding ``node``'s replicas."""
        return (node + 1) % self.cfg.nodes

    def _key_line(self, node: int) -> str:
        """A key pair in ``node``'s run directory; its line of the peer keys file."""
        return ckptd_cli("peer-key", "--run-dir", str(self.run_dirs[node]), "--endpoint",
                         self.endpoint(node)).stdout.strip()

    def _write_keys(self) -> None:
        """One line per node, as a deployment gathers them; every daemon reads the file again when it changes."""
        if self.key_lines:
            self.keys_file.write_text("".join(f"{line}\n" for line in self.key_lines))

    def replace_node(self, node: int) -> None:
        """A replacement for lost node ``node``: a new run directory with a new key pair (another host, as far as
        its peers can tell), its line replacing its predecessor's in the keys file, and its daemon started."""
        assert self.daemons[node] is not None and self.daemons[node].proc.poll() is not None, "replacing a live node"
        self.run_dirs[node] = short_tempdir("ckst-")
        self.every_run_dir.append(self.run_dirs[node])
        self.key_lines[node] = self._key_line(node)
        self._write_keys()
        self.start_daemon(node)

    def last_fault(self, node: int = 0) -> str:
        """The last ``event=fault`` line node ``node``'s daemon logged (what it hit just before it died)."""
        lines = [ln for ln in (self.run_dirs[node] / LOG_NAME).read_text().splitlines() if "event=fault" in ln]
        return lines[-1] if lines else ""

    def close(self) -> None:
        for daemon in self.daemons:
            if daemon is not None and daemon.proc.poll() is None:
                daemon.kill()
        self.proxy.close()
        for d in (*self.every_run_dir, self.root, self.fifos):
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
