"""Surviving the loss of a node: three simulated nodes on one machine, each with its own run directory, daemon,
peer endpoint on 127.0.0.1 and rank process, in a ring (node i's snapshots are replicated on node i+1).

A node is lost whole (its daemon and its rank SIGKILLed; the job's other ranks die with the job), a replacement
starts in a new run directory with a key pair of its own (another host, as far as its peers can tell), and the
job's ranks resume through ``ckptd.latest`` and ``ckptd.load_into`` as they always do. The checkpoints they
resume from were never on disk: the daemons run ``--persist-on-exit never``, and the test asserts only the one
early disk checkpoint exists.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import ckptd

from helpers import Daemon, ckptd_cli, free_port, short_tempdir, start_daemon, wait_for_ranks, wait_until
from docs_reference import status_paths
from test_docs import documented_status_paths
from node_trainer import report_and_train_on, resume, snapshot, state
from zygote import start_ranks

NODES = 3
LOG = "ckptd.log"


def _warnings_kept() -> dict[str, Any]:
    """A rank's report, whose ``warnings`` collects what the ``ckptd`` logger warns of in this process."""
    log: dict[str, Any] = {"warnings": []}
    warned = logging.Handler(logging.WARNING)
    warned.emit = lambda record: log["warnings"].append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptd").addHandler(warned)
    return log


def _rank(rank: int, init_file: str, run_dirs: list[str], root: str, out: str, persist: list[int],
          snapshots: list[int]) -> None:
    """One trainer: resume from the newest checkpoint, save, then stay alive (as a trainer does) until killed."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=len(run_dirs))
    log = _warnings_kept()
    try:
        client = ckptd.Client(run_dir=run_dirs[rank], spawn=False, commit_timeout=60, timeout=10, heartbeat=0.2)
        resume(rank, root, run_dirs[rank], log)
        for step in persist:
            client.save_async(state(rank, step), Path(root) / f"step-{step}", step=step).result(60)
        snapshot(client, rank, root, snapshots)
        log["saved"] = persist + snapshots
    except BaseException:
        log["crash"] = traceback.format_exc()
    report_and_train_on(out, rank, log)


def _rollback_rank(rank: int, init_file: str, run_dirs: list[str], root: str, out: str) -> None:
    """One trainer: ``root/cur`` on disk at step 20, then a memory snapshot of it at step 3 over it (a rollback,
    ``overwrite=True``), replicated; then it stays alive until killed."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=len(run_dirs))
    log = _warnings_kept()
    try:
        client = ckptd.Client(run_dir=run_dirs[rank], spawn=False, commit_timeout=60, timeout=10, heartbeat=0.2)
        client.save_async(state(rank, 20), Path(root) / "cur", step=20).result(60)
        fut = client.save_async(state(rank, 3), Path(root) / "cur", step=3, persist=False, overwrite=True)
        fut.result(60)
        fut.wait_replicated(60)
    except BaseException:
        log["crash"] = traceback.format_exc()
    report_and_train_on(out, rank, log)


@dataclass
class Cluster:
    """Three nodes in a ring; a node is replaced in a new run directory, at the same peer endpoint."""

    root: Path
    work: Path
    keys: Path
    ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(NODES)])
    daemons: list[Daemon | None] = field(default_factory=lambda: [None] * NODES)
    run_dirs: list[Path | None] = field(default_factory=lambda: [None] * NODES)
    lines: list[str] = field(default_factory=lambda: [""] * NODES)
    jobs: int = 0

    def endpoint(self, node: int) -> str:
        return f"tcp://127.0.0.1:{self.ports[node % NODES]}"

    def prepare(self, node: int) -> Path:
        """A new run directory for ``node``: its key line replaces the node's line in the keys file (which every
        daemon reads again when it changes), as a deployment gathers one line per node."""
        run_dir = short_tempdir(f"ckn{node}-")
        line = ckptd_cli("peer-key", "--run-dir", str(run_dir), "--endpoint", self.endpoint(node)).stdout.strip()
        self.lines[node] = line
        self.keys.write_text("".join(f"{ln}\n" for ln in self.lines if ln))
        self.run_dirs[node] = run_dir
        return run_dir

    def start(self, node: int, *extra: str, peers: tuple[int, ...] | None = None) -> Daemon:
        """A daemon for ``node`` in the run directory ``prepare`` made (a new one if it ran before); its ``--peer``s
        are ``peers`` (the first its buddy), by default the next node in the ring alone."""
        run_dir = self.run_dirs[node]
        if run_dir is None or self.daemons[node] is not None:
            run_dir = self.prepare(node)
        listed = [arg for peer in (peers or (node + 1,)) for arg in ("--peer", self.endpoint(peer))]
        daemon = start_daemon(run_dir, self.root, "--peer-listen", self.endpoint(node), *listed, "--peer-keys",
                              str(self.keys), "--persist-on-exit", "never", *extra)
        self.daemons[node] = daemon
        return daemon

    def lose(self, node: int) -> None:
        """The node is gone, and everything it held in memory with it."""
        daemon = self.daemons[node]
        assert daemon is not None
        daemon.kill()
        assert daemon.proc.returncode == -signal.SIGKILL

    def job(self, persist: list[int], snapshots: list[int]) -> tuple[Any, list[dict[str, Any]]]:
        """Run the job's three ranks until each has saved; returns them alive (their context) and their logs."""
        self.jobs += 1
        out = self.work / f"job-{self.jobs}"
        out.mkdir()
        run_dirs = [str(d.run_dir) for d in self.daemons if d is not None]
        ctx = start_ranks(_rank, (str(out / "init"), run_dirs, str(self.root), str(out), persist, snapshots), NODES)
        wait_for_ranks(out, "done", NODES, ctx, time.monotonic() + 180, "the job's ranks did not finish saving")
        logs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(NODES)]
        for log in logs:
            assert "crash" not in log, log["crash"]
        return ctx, logs

    def status(self, node: int) -> dict[str, Any]:
        daemon = self.daemons[node]
        assert daemon is not None
        return daemon.status()

    def close(self) -> None:
        for daemon in self.daemons:
            if daemon is not None and daemon.proc.poll() is None:
                daemon.kill()


def _kill_job(ctx: Any) -> None:
    """The job dies with its node (a launcher kills the ranks left)."""
    for p in ctx.processes:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL


@pytest.fixture
def cluster(root: Path, tmp_path: Path) -> Any:
    c = Cluster(root, tmp_path, tmp_path / "peer-keys")
    for node in range(NODES):
        c.prepare(node)
    for node in range(NODES):
        c.start(node)
    try:
        yield c
    finally:
        c.close()


def _held(status: dict[str, Any], name: str) -> dict[str, Any]:
    (snap,) = [s for s in status["memory"]["snapshots"] if s["path"].endswith(f"/{name}")]
    return snap


def test_a_lost_node_resumes_bitwise_from_its_buddy_and_a_corrupted_replica_is_never_loaded(
        cluster: Cluster, root: Path) -> None:
    ctx, _ = cluster.job(persist=[5], snapshots=[10, 20])
    documented = documented_status_paths()
    for node in range(NODES):
        # --keep-snapshots 1: a multi-node (coordinated) snapshot drops its job's older one once held (they used
        # to pile up until the budget refused the next)
        assert [s["path"] for s in cluster.status(node)["memory"]["snapshots"]] == [str(root / "step-20")]
        assert _held(cluster.status(node), "step-20")["replication"] == "replicated"
        assert not status_paths(cluster.status(node)) - documented, "docs/status.md lacks a key of the peers'"
        held = cluster.status((node + 1) % NODES)["peers"]["replicas_held"]["held"]
        assert [(r["path"], r["ranks_held"]) for r in held] == [(str(root / "step-20"), [node])]
    cluster.lose(1)
    _kill_job(ctx)

    # a replacement: new run directory, new key pair, same endpoint; its ranks resume from node 2's replica
    cluster.start(1)
    ctx, logs = cluster.job(persist=[], snapshots=[30])
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-20"), 20, True)] * 3
    assert sorted(p.name for p in root.iterdir()) == ["step-5"]  # no disk copy of step 20 (nor 10, 30) exists
    assert "event=snapshot_restored" in (cluster.daemons[1].run_dir / LOG).read_text()
    # the rebuilt node holds again, and its new snapshot has a replica on its buddy again
    assert _held(cluster.status(1), "step-30")["replication"] == "replicated"
    cluster.lose(1)
    _kill_job(ctx)

    # node 1's shard of step 30 changes in node 2's memory: detected as it is read back, never loaded, and every
    # rank falls back to the same checkpoint: the newest that every rank holds (node 1's own step 20 went with
    # it, and node 2's replica of it was replaced by step 30's), the one on disk
    (replica,) = cluster.status(2)["peers"]["replicas_held"]["held"]
    ((rank, name, *_),) = replica["shards"]
    shard_file = Path(cluster.status(2)["shm"]["dir"]) / name
    with open(shard_file, "r+b") as f:
        f.seek(os.path.getsize(shard_file) - 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert (replica["path"], rank) == (str(root / "step-30"), 1)
    cluster.start(1)
    ctx, logs = cluster.job(persist=[], snapshots=[])
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-5"), 5, True)] * 3
    assert not any(s["path"].endswith("/step-30") for s in cluster.status(1)["memory"]["snapshots"])
    log_1 = (cluster.daemons[1].run_dir / LOG).read_text()
    assert "event=restore_failed" in log_1 and "fails its check" in log_1
    _kill_job(ctx)



def test_each_restart_takes_over_the_snapshots_its_dead_run_left_so_they_never_pile_up(cluster: Cluster,
                                                                                        root: Path) -> None:
    """A snapshot of several nodes is never persisted whole, so a run that dies leaves its snapshots in memory.
    The run restarted in the same directory resumes from the newest and takes the dead run's over as its own
    for --keep-snapshots (1 here): each node holds its newest snapshot alone, restart after restart, where every
    restart used to leave one more until the budget refused every snapshot (NoSpace)."""
    for step in (10, 20, 30):
        ctx, logs = cluster.job(persist=[], snapshots=[step])
        assert [log.get("step") for log in logs] == [None if step == 10 else step - 10] * 3
        for node in range(NODES):
            assert [s["path"] for s in cluster.status(node)["memory"]["snapshots"]] == [str(root / f"step-{step}")]
        _kill_job(ctx)
    log_0 = (cluster.daemons[0].run_dir / LOG).read_text()
    assert log_0.count("state=dropped") >= 2, "the dead runs' snapshots were not dropped as --keep-snapshots says"


def test_a_node_restoring_from_several_peers_reads_back_the_replica_of_its_own_ranks(cluster: Cluster,
                                                                                     root: Path) -> None:
    """A replacement with several ``--peer``s asks each: the first it asks (node 0) holds a replica of the same
    path for another node (node 2's shard), the second (node 2) the one of this node's rank. It reads back its own,
    bitwise; the listing used to keep the first replica of a path, so the job went back to disk."""
    ctx, _ = cluster.job(persist=[5], snapshots=[10])
    cluster.lose(1)
    _kill_job(ctx)
    cluster.start(1, peers=(0, 2))
    ctx, logs = cluster.job(persist=[], snapshots=[])
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-10"), 10, True)] * 3
    restored = _held(cluster.status(1), "step-10")
    assert (restored["replication"], restored["ranks_held"]) == ("restored", [1])
    _kill_job(ctx)


def test_a_restored_snapshot_gets_a_copy_again_once_its_peer_is_lost_so_a_second_loss_of_its_node_keeps_it(
        cluster: Cluster, root: Path) -> None:
    """Node 1 is lost and its replacement reads step 10 back from node 2 (its buddy); then node 2 is lost, and the
    only copy of node 1's shard is node 1's memory. Node 1 sees its copy gone from node 2's replacement and streams
    the restored snapshot to it, so losing node 1 again still resumes bitwise from memory. A restored snapshot was
    never sent on: the second loss of node 1 sent every rank back to disk (step 5)."""
    ctx, _ = cluster.job(persist=[5], snapshots=[10])
    cluster.lose(1)
    _kill_job(ctx)
    cluster.start(1)
    ctx, logs = cluster.job(persist=[], snapshots=[])
    assert [(log["resumed"], log["step"]) for log in logs] == [(str(root / "step-10"), 10)] * 3
    assert _held(cluster.status(1), "step-10")["replication"] == "restored"
    cluster.lose(2)
    _kill_job(ctx)
    cluster.start(2)
    ctx, logs = cluster.job(persist=[], snapshots=[])  # node 2's replacement reads its own shard back from node 0
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-10"), 10, True)] * 3
    wait_until(lambda: _held(cluster.status(1), "step-10")["replication"] == "replicated", timeout=60,
               what="node 1 never sent its restored snapshot to node 2's replacement")
    held = cluster.status(2)["peers"]["replicas_held"]["held"]
    assert [(r["path"], r["ranks_held"]) for r in held] == [(str(root / "step-10"), [1])]
    assert "action=sent_again" in (cluster.daemons[1].run_dir / LOG).read_text()
    cluster.lose(1)
    _kill_job(ctx)
    cluster.start(1)
    ctx, logs = cluster.job(persist=[], snapshots=[])
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-10"), 10, True)] * 3
    assert sorted(p.name for p in root.iterdir()) == ["step-5"]
    _kill_job(ctx)


def test_a_rollback_over_a_disk_checkpoint_is_what_every_rank_resumes_after_a_node_loss(cluster: Cluster,
                                                                                         root: Path) -> None:
    """``cur`` committed on disk at step 20, then rolled back in memory to step 3 with ``overwrite=True`` on every
    rank, replicated; node 1 is lost. Every rank resumes from the rollback, node 1's replacement reading its shard
    back from node 2. Ranks 0 and 2 read step 3 from memory and rank 1 step 20 from disk, each bitwise its own but
    together two saves: the ranks agreed on the path, and on the disk's save of it (step 20 ranked first), while
    a load prefers a held snapshot."""
    out = cluster.work / "rollback"
    out.mkdir()
    run_dirs = [str(d.run_dir) for d in cluster.daemons if d is not None]
    ctx = start_ranks(_rollback_rank, (str(out / "init"), run_dirs, str(root), str(out)), NODES)
    wait_for_ranks(out, "done", NODES, ctx, time.monotonic() + 180, "the job's ranks did not finish saving")
    for r in range(NODES):
        assert "crash" not in json.loads((out / f"rank-{r}.json").read_text())
    cluster.lose(1)
    _kill_job(ctx)
    cluster.start(1)
    ctx, logs = cluster.job(persist=[], snapshots=[])
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "cur"), 3, True)] * 3
    assert "event=snapshot_restored" in (cluster.daemons[1].run_dir / LOG).read_text()
    _kill_job(ctx)


def test_when_both_holders_of_a_shard_are_lost_every_rank_resumes_from_the_newest_persisted_checkpoint(
        cluster: Cluster, root: Path) -> None:
    ctx, _ = cluster.job(persist=[5], snapshots=[10])
    old_run = _held(cluster.status(0), "step-10")["job"]
    # node 1 holds its own shard of step 10, node 2 its replica: both lost (and node 2's own shard with it)
    cluster.lose(1)
    cluster.lose(2)
    _kill_job(ctx)
    cluster.start(1)
    cluster.start(2)
    ctx, logs = cluster.job(persist=[], snapshots=[10])
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-5"), 5, True)] * 3
    # the new run saves step 10 again: it replaces the old run's shard node 0 still holds (latest passed it over),
    # where it used to be refused there (CheckpointExists) and so on every rank
    assert [log.get("saved") for log in logs] == [[10]] * 3, [log.get("crash") for log in logs]
    held = [_held(cluster.status(node), "step-10") for node in range(NODES)]
    assert len({h["job"] for h in held}) == 1 and held[0]["job"] != old_run, held
    assert all(h["replication"] == "replicated" for h in held), held
    # node 1's shard of step 10 has no holder left, so node 2's (on node 0's replica) is not read back either: the
    # ranks agree before any reads back, and none is read that the others cannot match; said, not silent
    assert "event=snapshot_restored" not in (cluster.daemons[2].run_dir / LOG).read_text()
    assert any("step-10" in w and "not by every rank" in w for w in logs[0]["warnings"]), logs[0]["warnings"]
    _kill_job(ctx)


def _resume_rank(rank: int, init_file: str, run_dirs: list[str], root: str, out: str, saved_world: int = NODES
                 ) -> None:
    """A rank of a job restarted with another world size (``len(run_dirs)`` ranks): resume, report, exit. A rank
    beyond the ``saved_world`` ranks that saved takes the per-rank state of one of them (``rank % saved_world``)."""
    world = len(run_dirs)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    log = _warnings_kept()
    try:
        resume(rank, root, run_dirs[rank], log, saved_rank=rank % saved_world if rank >= saved_world else None)
    except BaseException:
        log["crash"] = traceback.format_exc()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(log))
    Path(out, f"done-{rank}").touch()
    dist.destroy_process_group()


def test_a_job_restarted_with_another_world_size_resumes_from_disk_never_from_a_snapshot_split_across_nodes(
        cluster: Cluster, root: Path, tmp_path: Path) -> None:
    """A snapshot that spans nodes holds each rank's shard on that rank's node only: a world of another size could
    not read it whole (a rank's shard on a node it no longer runs on), so every rank resumes from the newest
    persisted checkpoint instead, together; never some ranks from memory and others from disk."""
    ctx, _ = cluster.job(persist=[5], snapshots=[10])
    _kill_job(ctx)
    node_0 = str(cluster.daemons[0].run_dir)
    out = tmp_path / "smaller"
    out.mkdir()
    ctx = start_ranks(_resume_rank, (str(out / "init"), [node_0, node_0], str(root), str(out)), 2)
    wait_for_ranks(out, "done", 2, ctx, time.monotonic() + 180, "the restarted ranks did not finish resuming")
    logs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert all("crash" not in log for log in logs), logs
    assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-5"), 5, True)] * 2
    assert _held(cluster.status(0), "step-10")["complete"]  # still held: passed over, not dropped
    _warned_of_another_world(logs, root)


def _warned_of_another_world(logs: list[dict[str, Any]], root: Path) -> None:
    """Rank 0, and only rank 0, names the snapshot passed over for its world size."""
    said = [w for w in logs[0]["warnings"] if "passed over" in w]
    assert len(said) == 1 and str(root / "step-10") in said[0] and "spans nodes" in said[0], logs[0]["warnings"]
    assert not any("passed over" in w for log in logs[1:] for w in log["warnings"]), logs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 3])
def test_a_job_restarted_on_a_replacement_node_with_another_world_size_never_reads_back_half_a_snapshot(
        world: int, root: Path, tmp_path: Path) -> None:
    """Two ranks on two nodes placed by their ring hold a snapshot, each rank's shard replicated on the other node;
    node 0 is lost, and the job restarts on its replacement (its run directory and key pair kept, its memory lost,
    the surviving node as its ``--peer``) with another world size. The replica of rank 0's shard was read back and
    resumed from as if it were the whole snapshot (a world of one: rank 0's half, silently); a replica is passed
    over by the rule a snapshot held here is, and every rank resumes from the newest persisted checkpoint."""
    never = ("--persist-on-exit", "never")
    dirs, ports = [short_tempdir(f"ckw{node}-") for node in range(2)], [free_port() for _ in range(2)]
    endpoints = [f"tcp://127.0.0.1:{port}" for port in ports]
    daemons = [start_daemon(d, root, "--peer-listen", ep, *never) for d, ep in zip(dirs, endpoints)]
    try:
        out = tmp_path / "saved"
        out.mkdir()
        ctx = start_ranks(_rank, (str(out / "init"), [str(d) for d in dirs], str(root), str(out), [5], [10]), 2)
        wait_for_ranks(out, "done", 2, ctx, time.monotonic() + 180, "the job's ranks did not finish saving")
        assert all("crash" not in json.loads((out / f"rank-{r}.json").read_text()) for r in range(2))
        daemons[0].kill()  # node 0 is lost, and the job with it
        _kill_job(ctx)
        keys = tmp_path / "peer-keys"
        keys.write_text(ckptd_cli("peer-key", "--run-dir", str(dirs[1]), "--endpoint", endpoints[1]).stdout)
        daemons[0] = start_daemon(dirs[0], root, "--peer-listen", endpoints[0], "--peer", endpoints[1],
                                  "--peer-keys", str(keys), *never)
        replicas = daemons[1].status()["peers"]["replicas_held"]["held"]
        assert [(r["path"], r["ranks_held"]) for r in replicas] == [(str(root / "step-10"), [0])]

        out = tmp_path / "restarted"
        out.mkdir()
        run_dirs = [str(dirs[0]), str(dirs[1]), str(dirs[0])][:world]
        ctx = start_ranks(_resume_rank, (str(out / "init"), run_dirs, str(root), str(out), 2), world)
        wait_for_ranks(out, "done", world, ctx, time.monotonic() + 180, "the restarted ranks did not finish resuming")
        logs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
        assert all("crash" not in log for log in logs), logs
        resumed = [(log["resumed"], log["step"], log["bitwise"]) for log in logs]
        assert resumed == [(str(root / "step-5"), 5, True)] * world
        _warned_of_another_world(logs, root)
        assert not daemons[0].status()["memory"]["snapshots"]  # nothing read back
        assert "event=snapshot_restored" not in (dirs[0] / LOG).read_text()
    finally:
        for daemon in daemons:
            daemon.kill()
