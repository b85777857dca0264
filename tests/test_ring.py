"""Placement by the ranks: daemons started with ``--peer-listen`` alone (no ``--peer``, no ``--peer-keys``) learn
their buddy and their peers' keys from the ranks of the job they serve (``Ring``, ``ckptd/peers/placement.py``).

Three simulated nodes on 127.0.0.1, each its own run directory, daemon and peer port, one rank each over gloo: the
ranks set the ring, each snapshot is replicated on the next node, and a node killed whole is replaced by one with a
new key at a new port, whose ranks resume bitwise from its buddy's memory once the job's restarted ranks exchanged
keys again. Nothing is ever on disk: the daemons run ``--persist-on-exit never`` and the checkpoint directory stays
empty. Beside it, with hand-made requests on a daemon's own socket: a bad ring is refused naming what is wrong, keys
are taken only from a rank of the run the ring names, a daemon without ``--peer-listen`` ignores a ring, and a
static ``--peer`` wins over the ring's buddy. And the same with nothing started by hand: each rank's client spawns
its node's daemon, whose peer endpoint comes from ``CKPTD_PEER_LISTEN`` in the rank's environment.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import torch.distributed as dist
import zmq

import ckptd
from ckptd.protocol import __version__
from ckptd.protocol.errors import ErrorCode, InvalidCheckpoint
from ckptd.protocol.messages import (
    MESSAGE_TYPES, Error, Hello, Message, Ok, PeerIdentity, PeerIdentityReply, Ring, decode,
)
from ckptd.protocol.peer_messages import PEER_TYPES

from ckptd.protocol.endpoint import endpoint_for, running_daemon_pid
from ckptd.protocol.request import answers

from helpers import (
    Daemon, ckptd_cli, free_port, raw_socket, short_tempdir, start_daemon, status, wait_for_ranks, wait_until,
)
from node_trainer import report_and_train_on, resume, snapshot, state
from zygote import start_ranks

NODES = 3
LOG = "ckptd.log"
JOB = "run:ring-test"


# --------------------------------------------------------------------------- hand-made requests


def _ask(sock: zmq.Socket, msg: Message | dict[str, Any]) -> Message:
    """Send a message (or a raw wire map, to reach the checks at decode) and return the reply to it."""
    data = msg.to_wire() if isinstance(msg, Message) else msgpack.packb({"v": 1, **msg}, use_bin_type=True)
    rid = msg.id if isinstance(msg, Message) else msg["id"]
    sock.send(data)
    while True:
        reply = decode(sock.recv())
        if reply.id == rid:
            return reply


def _rank_socket(daemon: Daemon, *, job: str = JOB, rank: int = 0, world_size: int = 2) -> zmq.Socket:
    """A raw client of ``daemon`` that said hello as ``rank`` of ``world_size`` of run ``job``."""
    sock = raw_socket(daemon)
    assert _ask(sock, Hello(1, os.getpid(), os.getuid(), __version__, rank, world_size, job)).type == "welcome"
    return sock


def _identity(daemon: Daemon) -> tuple[str, str]:
    sock = raw_socket(daemon)
    reply = _ask(sock, PeerIdentity(1))
    sock.close()
    assert isinstance(reply, PeerIdentityReply)
    return reply.key, reply.endpoint


def _key(run_dir: Path) -> str:
    return ckptd_cli("peer-key", "--run-dir", str(run_dir)).stdout.strip()


def _refused(reply: Message, *says: str) -> str:
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_MESSAGE, reply
    for words in says:
        assert words in reply.message, reply.message
    return reply.message


def test_a_bad_ring_from_a_local_client_is_refused_naming_what_is_wrong(root: Path) -> None:
    port = free_port()
    daemon = start_daemon(short_tempdir("ckr-"), root, "--peer-listen", f"tcp://127.0.0.1:{port}")
    try:
        key, endpoint = _identity(daemon)
        assert (key, endpoint) == (_key(daemon.run_dir), f"tcp://127.0.0.1:{port}")
        other_key, other = _key(short_tempdir("ckr-")), f"tcp://127.0.0.1:{free_port()}"
        good = {"type": "ring", "job": JOB, "node": 0, "endpoints": [endpoint, other], "keys": [key, other_key]}
        sock = _rank_socket(daemon)
        bad: list[tuple[dict[str, Any], str]] = [
            ({"keys": [key, "not-a-key"]}, "ring node 1: key 'not-a-key' is not a CurveZMQ public key"),
            ({"endpoints": [endpoint, "127.0.0.1:47000"]}, "ring node 1: endpoint '127.0.0.1:47000' is not tcp://"),
            ({"endpoints": [endpoint, "tcp://127.0.0.1:70000"]}, "PORT in 1..65535"),
            ({"node": 2}, "ring.node 2 is not one of its 2 nodes"),
            ({"keys": [key]}, "2 endpoints and 1 keys"),
            ({"endpoints": [endpoint], "keys": [key]}, "for 2 to"),
            ({"endpoints": [endpoint, endpoint]}, f"ring.endpoints names '{endpoint}' twice"),
            ({"keys": [key, key]}, "ring.keys names"),
            ({"job": ""}, "ring.job is empty"),
            ({"node": -1}, "ring.node must be an integer"),
            ({"endpoints": "tcp://x:1"}, "ring.endpoints must be a list"),
        ]
        for i, (change, says) in enumerate(bad, 10):
            _refused(_ask(sock, {**good, **change, "id": i}), says)
        # well formed, but it does not place this daemon where it is: refused, naming both
        misplaced = {**good, "node": 1, "id": 30}
        _refused(_ask(sock, misplaced), f"places node 1 at {other}", f"but this daemon is {endpoint} with key {key}")
        assert daemon.status()["peers"]["buddy"] is None  # nothing of them was taken
        assert isinstance(_ask(sock, {**good, "id": 31}), Ok)  # the same ring, well made, is
        assert daemon.status()["peers"]["buddy"] == other
        sock.close()
        with pytest.raises(Exception, match="unknown message type 'ring'"):  # never from a peer: not its protocol
            decode(Ring(1, JOB, 0, (endpoint, other), (key, other_key)).to_wire(), PEER_TYPES)
        assert "ring" in MESSAGE_TYPES and daemon.proc.poll() is None
    finally:
        daemon.kill()


def test_keys_of_a_job_are_taken_only_from_a_rank_of_that_job_on_the_daemons_own_socket(
        root: Path, tmp_path: Path) -> None:
    """A rogue daemon knows the victim's key and endpoint; its key reaches the victim's trust only through a ring
    from a client that said hello as a rank of the run the ring names."""
    victim = start_daemon(short_tempdir("ckr-"), root, "--peer-listen", f"tcp://127.0.0.1:{free_port()}")
    rogue_dir, keys = short_tempdir("ckr-"), tmp_path / "rogue-keys"
    try:
        victim_key, victim_ep = _identity(victim)
        keys.write_text(f"{victim_key} {victim_ep}\n")
        rogue = start_daemon(rogue_dir, root, "--peer", victim_ep, "--peer-keys", str(keys), "--peer-timeout", "2")
        rogue_key, rogue_ep = _key(rogue_dir), f"tcp://127.0.0.1:{free_port()}"
        ring = {"type": "ring", "job": JOB, "node": 0, "endpoints": [victim_ep, rogue_ep],
                "keys": [victim_key, rogue_key]}

        stranger = raw_socket(victim)  # said no hello
        reply = _ask(stranger, {**ring, "id": 5})
        assert isinstance(reply, Error) and reply.code == ErrorCode.UNKNOWN_CLIENT, reply
        stranger.close()
        for job, world_size, says in [("", 1, "said hello as no named run of world size 1"),
                                      ("run:other", 2, "as rank of run 'run:other'"),
                                      (JOB, 1, "of world size 1")]:
            sock = _rank_socket(victim, job=job, world_size=world_size, rank=0)
            _refused(_ask(sock, {**ring, "id": 6}), f"a ring comes from a rank of the run it names ('{JOB}')", says)
            sock.close()

        client = ckptd.Client(run_dir=rogue_dir, spawn=False)
        fut = client.save_async({"w": torch.ones(1000)}, root / "step-1", step=1, persist=False)
        with pytest.raises(InvalidCheckpoint, match="not replicated: peer .* did not answer"):
            fut.wait_replicated(60)
        assert "event=peer_refused" in (victim.run_dir / LOG).read_text()  # refused in the handshake
        assert victim.status()["peers"]["replicas_held"]["held"] == []

        rank = _rank_socket(victim, rank=1)  # a rank of the run: its ring is taken, and the rogue's key with it
        assert isinstance(_ask(rank, {**ring, "id": 7}), Ok)
        client.save_async({"w": torch.ones(1000)}, root / "step-2", step=2, persist=False).wait_replicated(60)
        client.close()
        rank.close()
        held = victim.status()["peers"]["replicas_held"]["held"]
        assert [(r["path"], r["origin"]) for r in held] == [(str(root / "step-2"), rogue_key)]
        rogue.kill()
    finally:
        victim.kill()


def test_a_daemon_without_peer_listen_ignores_a_ring_and_a_static_peer_wins_over_the_rings_buddy(
        root: Path, tmp_path: Path) -> None:
    plain = start_daemon(short_tempdir("ckr-"), root)
    static_buddy, other = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    keys, buddy_key, other_key = tmp_path / "keys", _key(short_tempdir("ckr-")), _key(short_tempdir("ckr-"))
    keys.write_text(f"{buddy_key} {static_buddy}\n")
    static = start_daemon(short_tempdir("ckr-"), root, "--peer-listen", f"tcp://127.0.0.1:{free_port()}",
                          "--peer", static_buddy, "--peer-keys", str(keys))
    try:
        assert _identity(plain) == ("", "")
        sock = _rank_socket(plain)
        ring = {"type": "ring", "id": 3, "job": JOB, "node": 0, "endpoints": [other, static_buddy],
                "keys": [other_key, buddy_key]}
        assert isinstance(_ask(sock, ring), Ok)  # taken as said, and ignored: the client goes on
        sock.close()
        assert "event=ring_ignored" in (plain.run_dir / LOG).read_text()
        assert "peers" not in plain.status()  # no peer endpoint, no replicas

        key, endpoint = _identity(static)
        sock = _rank_socket(static)
        assert isinstance(_ask(sock, {**ring, "endpoints": [endpoint, other], "keys": [key, other_key]}), Ok)
        sock.close()
        peers = static.status()["peers"]
        assert (peers["buddy"], peers["peers"], peers["replicas"]) == (static_buddy, [static_buddy], 1)
    finally:
        plain.kill()
        static.kill()


# --------------------------------------------------------------------------- three nodes, one rank each


def _rank(rank: int, init_file: str, run_dirs: list[str], root: str, out: str, snapshots: list[int]) -> None:
    """One trainer: its client sets the ring with the others', it resumes from the newest checkpoint and takes
    memory snapshots, each replicated, then stays alive (as a trainer does) until its job is killed."""
    _train(rank, init_file, run_dirs[rank], root, out, snapshots, run_dir=run_dirs[rank], spawn=False)


def _train(rank: int, init_file: str, node_dir: str, root: str, out: str, snapshots: list[int],
           **client: Any) -> None:
    """A rank's life, whoever starts its daemon (the one of run directory ``node_dir``): its client (made with
    ``client``) sets the ring, it resumes, snapshots, and trains on until its job is killed."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=NODES)
    log: dict[str, Any] = {}
    try:
        client_ = ckptd.Client(commit_timeout=60, timeout=10, heartbeat=0.2, **client)
        log["ring"] = client_.ring
        resume(rank, root, node_dir, log)
        snapshot(client_, rank, root, snapshots)
        log["saved"] = snapshots
    except BaseException:
        log["crash"] = traceback.format_exc()
    report_and_train_on(out, rank, log)


@dataclass
class Nodes:
    """Three daemons with a peer endpoint each and nothing else: no --peer, no --peer-keys."""

    root: Path
    work: Path
    daemons: list[Daemon | None] = field(default_factory=lambda: [None] * NODES)
    endpoints: list[str] = field(default_factory=lambda: [""] * NODES)
    jobs: int = 0

    def start(self, node: int) -> Daemon:
        """A daemon for ``node`` in a new run directory (a new key pair) at a new port."""
        self.endpoints[node] = f"tcp://127.0.0.1:{free_port()}"
        daemon = start_daemon(short_tempdir(f"ckr{node}-"), self.root, "--peer-listen", self.endpoints[node],
                              "--persist-on-exit", "never")
        self.daemons[node] = daemon
        return daemon

    def daemon(self, node: int) -> Daemon:
        daemon = self.daemons[node]
        assert daemon is not None
        return daemon

    def lose(self, node: int) -> None:
        """The node is gone, and everything it held in memory with it."""
        daemon = self.daemon(node)
        daemon.kill()
        assert daemon.proc.returncode == -signal.SIGKILL

    def job(self, snapshots: list[int]) -> tuple[Any, list[dict[str, Any]]]:
        """Run the job's three ranks until each has saved; returns them alive (their context) and their logs."""
        self.jobs += 1
        out = self.work / f"job-{self.jobs}"
        out.mkdir()
        run_dirs = [str(self.daemon(n).run_dir) for n in range(NODES)]
        ctx = start_ranks(_rank, (str(out / "init"), run_dirs, str(self.root), str(out), snapshots), NODES)
        wait_for_ranks(out, "done", NODES, ctx, time.monotonic() + 180, "the job's ranks did not finish saving")
        logs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(NODES)]
        for log in logs:
            assert "crash" not in log, log["crash"]
        return ctx, logs

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


def _replicas_held(daemon: Daemon) -> list[tuple[str, list[int]]]:
    return [(Path(r["path"]).name, r["ranks_held"]) for r in daemon.status()["peers"]["replicas_held"]["held"]]


def test_the_ranks_set_the_ring_and_a_node_lost_whole_resumes_bitwise_from_its_buddy_after_its_replacements_keys_are_exchanged(
        root: Path, tmp_path: Path) -> None:
    nodes = Nodes(root, tmp_path)
    try:
        for node in range(NODES):
            nodes.start(node)
        ctx, logs = nodes.job(snapshots=[10, 20])
        assert [log["ring"] for log in logs] == [{"nodes": NODES, "ring": nodes.endpoints, "refused": []}] * NODES
        for node in range(NODES):  # node i's buddy is node i + 1, and holds node i's shard of the newest snapshot
            assert nodes.daemon(node).status()["peers"]["buddy"] == nodes.endpoints[(node + 1) % NODES]
            assert _replicas_held(nodes.daemon((node + 1) % NODES)) == [("step-20", [node])]
        lost_key = _key(nodes.daemon(1).run_dir)
        nodes.lose(1)
        _kill_job(ctx)

        # its replacement: another run directory (a key pair of its own) at another port; the survivors learn
        # both from the restarted job's ranks, before any of them looks for a checkpoint
        nodes.start(1)
        assert _key(nodes.daemon(1).run_dir) != lost_key
        ctx, logs = nodes.job(snapshots=[30])
        assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-20"), 20, True)] * 3
        assert list(root.iterdir()) == []  # never on disk: every byte came from node memory
        assert "event=snapshot_restored" in (nodes.daemon(1).run_dir / LOG).read_text()
        assert nodes.daemon(0).status()["peers"]["buddy"] == nodes.endpoints[1]  # the survivors follow the ring
        # the rebuilt node holds again: its step 30 has a replica on node 2, and it holds node 0's
        assert _replicas_held(nodes.daemon(2)) == [("step-30", [1])]
        assert _replicas_held(nodes.daemon(1)) == [("step-30", [0])]
        _kill_job(ctx)
    finally:
        nodes.close()


def test_a_survivor_sends_what_it_holds_to_a_replacement_buddy_at_another_endpoint_and_never_calls_it_replicated_before(
        root: Path, tmp_path: Path) -> None:
    """Node 1 (node 0's buddy) is lost and replaced at another endpoint; the restarted job resumes and saves nothing
    new. Node 0's snapshot, which its old buddy held, is sent to the new one (found by a new-user pass: it stayed
    ``replicated`` with no copy anywhere, and a second loss of node 0 lost it)."""
    nodes = Nodes(root, tmp_path)
    try:
        for node in range(NODES):
            nodes.start(node)
        ctx, _ = nodes.job(snapshots=[20])
        nodes.lose(1)
        _kill_job(ctx)
        nodes.start(1)
        ctx, logs = nodes.job(snapshots=[])
        assert [log["step"] for log in logs] == [20] * NODES
        wait_until(lambda: ("step-20", [0]) in _replicas_held(nodes.daemon(1)), 60,
                   lambda: f"node 1 holds {_replicas_held(nodes.daemon(1))}, not node 0's step-20")
        held = next(s for s in nodes.daemon(0).status()["memory"]["snapshots"] if s["path"] == str(root / "step-20"))
        assert held["replication"] == "replicated"
        assert "event=replica_gone" in (nodes.daemon(0).run_dir / LOG).read_text()
        _kill_job(ctx)
    finally:
        nodes.close()


def _mixed_rank(rank: int, init_file: str, run_dirs: list[str], root: str, out: str) -> None:
    """A rank of a two-node job whose second node's daemon has no peer endpoint: it trains on, unreplicated."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    log: dict[str, Any] = {}
    try:
        client = ckptd.Client(run_dir=run_dirs[rank], spawn=False, commit_timeout=60, timeout=10, heartbeat=0.2)
        log["ring"] = client.ring
        fut = client.save_async(state(rank, 1), Path(root) / "step-1", step=1, persist=False)
        fut.result(60)  # held on both nodes
        try:
            fut.wait_replicated(60)
        except InvalidCheckpoint as exc:
            log["not_replicated"] = exc.message
        client.close()
    except BaseException:
        log["crash"] = traceback.format_exc()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(log))
    Path(out, f"done-{rank}").touch()


def test_a_node_without_a_peer_endpoint_leaves_the_job_with_no_ring_and_its_ranks_train_on(
        root: Path, tmp_path: Path) -> None:
    listening = start_daemon(short_tempdir("ckr-"), root, "--peer-listen", f"tcp://127.0.0.1:{free_port()}")
    plain = start_daemon(short_tempdir("ckr-"), root)
    try:
        run_dirs = [str(listening.run_dir), str(plain.run_dir)]
        ctx = start_ranks(_mixed_rank, (str(tmp_path / "init"), run_dirs, str(root), str(tmp_path)), 2)
        wait_for_ranks(tmp_path, "done", 2, ctx, time.monotonic() + 180, "the job's ranks did not finish")
        logs = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
        assert all("crash" not in log for log in logs), logs
        assert [log["ring"] for log in logs] == [{"nodes": 2, "ring": [], "refused": []}] * 2
        assert all("not replicated" in log["not_replicated"] for log in logs), logs
        (snap,) = listening.status()["memory"]["snapshots"]
        assert snap["replication"] == "off" and listening.status()["peers"]["buddy"] is None
        assert "peers" not in plain.status()
        ctx.join(60)
    finally:
        listening.kill()
        plain.kill()


# --------------------------------------------------------------------------- daemons spawned by the ranks' clients


def _spawning_rank(rank: int, init_file: str, run_dirs: list[str], endpoints: list[str], root: str, out: str,
                   snapshots: list[int]) -> None:
    """One trainer on a node where nothing was started by hand: the node's environment names its run directory,
    its roots and its peer endpoint (``CKPTD_PEER_LISTEN``), and the rank's client spawns the daemon."""
    os.environ.update(CKPTD_RUN_DIR=run_dirs[rank], CKPTD_ROOTS=root, CKPTD_PEER_LISTEN=endpoints[rank])
    os.environ.pop("CKPTD_FAULTS", None)
    _train(rank, init_file, run_dirs[rank], root, out, snapshots, spawn=True)


def _daemon_pid(run_dir: Path) -> int | None:
    return running_daemon_pid(endpoint_for(run_dir))


def _dead(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@dataclass
class SpawnedNodes:
    """Three nodes whose daemons the ranks' clients spawn, each told its peer endpoint by ``CKPTD_PEER_LISTEN``."""

    root: Path
    work: Path
    run_dirs: list[Path] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    every_run_dir: list[Path] = field(default_factory=list)
    jobs: int = 0

    def new(self, node: int) -> None:
        """A new node ``node``: a run directory of its own (no daemon in it yet) and a port of its own."""
        run_dir, endpoint = short_tempdir(f"cks{node}-"), f"tcp://127.0.0.1:{free_port()}"
        if node < len(self.run_dirs):
            self.run_dirs[node], self.endpoints[node] = run_dir, endpoint
        else:
            self.run_dirs.append(run_dir)
            self.endpoints.append(endpoint)
        self.every_run_dir.append(run_dir)

    def status(self, node: int) -> dict[str, Any]:
        return status(self.run_dirs[node])

    def job(self, snapshots: list[int]) -> tuple[Any, list[dict[str, Any]]]:
        self.jobs += 1
        out = self.work / f"job-{self.jobs}"
        out.mkdir()
        args = (str(out / "init"), [str(d) for d in self.run_dirs], self.endpoints, str(self.root), str(out), snapshots)
        ctx = start_ranks(_spawning_rank, args, NODES)
        wait_for_ranks(out, "done", NODES, ctx, time.monotonic() + 240, "the job's ranks did not finish saving")
        logs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(NODES)]
        for log in logs:
            assert "crash" not in log, log["crash"]
        return ctx, logs

    def lose(self, node: int) -> None:
        """The node's daemon is killed outright, and everything it held in memory with it."""
        pid = _daemon_pid(self.run_dirs[node])
        assert pid is not None, f"no daemon runs in {self.run_dirs[node]}"
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: _dead(pid), 30, f"the daemon of node {node} (pid {pid}) to die")
        assert _daemon_pid(self.run_dirs[node]) is None
        assert not answers(endpoint_for(self.run_dirs[node]), timeout=1.0)

    def close(self) -> None:
        """Every daemon spawned here is stopped (or, failing that, killed)."""
        for run_dir in self.every_run_dir:
            pid = _daemon_pid(run_dir)
            if pid is None:
                continue
            ckptd_cli("stop", "--run-dir", str(run_dir), timeout=60)
            if not _dead(pid):
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda: _dead(pid), 30, f"the spawned daemon {pid} to die")


def test_clients_spawn_daemons_with_a_peer_endpoint_from_the_environment_and_a_node_lost_whole_resumes_bitwise_from_its_buddy(
        root: Path, tmp_path: Path) -> None:
    """``CKPTD_PEER_LISTEN`` is all a node needs: each rank's client spawns its node's daemon, which opens its peer
    endpoint, the ranks set the ring, and a node lost whole (daemon and trainer) is replaced by a new node (another
    run directory and port, its daemon spawned the same way) whose rank resumes bitwise from its buddy."""
    nodes = SpawnedNodes(root, tmp_path)
    try:
        for node in range(NODES):
            nodes.new(node)
        ctx, logs = nodes.job(snapshots=[10, 20])
        assert [log["ring"] for log in logs] == [{"nodes": NODES, "ring": nodes.endpoints, "refused": []}] * NODES
        for node in range(NODES):
            spawned = nodes.status(node)
            assert spawned["peers"]["buddy"] == nodes.endpoints[(node + 1) % NODES]
            held = [(Path(r["path"]).name, r["ranks_held"]) for r in
                    status(nodes.run_dirs[(node + 1) % NODES])["peers"]["replicas_held"]["held"]]
            assert held == [("step-20", [node])]
        nodes.lose(1)
        _kill_job(ctx)

        nodes.new(1)  # the replacement: nothing runs in its run directory until its rank's client spawns it
        assert _daemon_pid(nodes.run_dirs[1]) is None
        ctx, logs = nodes.job(snapshots=[30])
        assert [(log["resumed"], log["step"], log["bitwise"]) for log in logs] == [(str(root / "step-20"), 20, True)] * 3
        assert list(root.iterdir()) == []  # never on disk: every byte came from node memory
        assert "event=snapshot_restored" in (nodes.run_dirs[1] / LOG).read_text()
        assert nodes.status(0)["peers"]["buddy"] == nodes.endpoints[1]
        _kill_job(ctx)
    finally:
        nodes.close()
