"""The peer endpoint's trust and limits, with real daemons as nodes on 127.0.0.1: an unknown key is refused before
anything of it is read, a replica that does not fit the buddy's budget is refused and said so, garbage on the peer
port harms nothing, and a start with a peer option it cannot honour is refused naming it."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import ckptd
from ckptd.client.memory import held_snapshots
from ckptd.core.keys import KeyPair
from ckptd.peers import bulk
from ckptd.protocol.checksums import updater
from ckptd.protocol.errors import ErrorCode, InvalidCheckpoint
from ckptd.protocol.index import CHECKSUM_ALGORITHM
from ckptd.protocol.layout import TensorEntry
from ckptd.protocol.messages import Error, Ok, Restore, decode
from ckptd.protocol.peer_messages import PEER_TYPES, Fetch, Offer, Seal, Ticket

from helpers import (Daemon, ckptd_cli, free_port, raw_socket, segments_of, short_tempdir, start_daemon,
                     wait_until)
from test_fuzz_peers import SNAPSHOT, _peer_socket

LOG = "ckptd.log"


def _node(keys: Path, lines: list[str]) -> tuple[Path, str]:
    """A run directory and its endpoint, its key line added to ``lines`` (written to ``keys`` by the caller)."""
    run_dir, endpoint = short_tempdir("ckp-"), f"tcp://127.0.0.1:{free_port()}"
    lines.append(ckptd_cli("peer-key", "--run-dir", str(run_dir), "--endpoint", endpoint).stdout)
    return run_dir, endpoint


@dataclass
class Pair:
    """An origin node and its buddy, both trusting each other's key (``keys``, with one line per node)."""

    keys: Path
    lines: list[str]
    origin_dir: Path
    buddy_dir: Path
    buddy_ep: str
    origin_ep: str
    origin: Daemon
    buddy: Daemon

    def kill(self) -> None:
        self.origin.kill()
        self.buddy.kill()


def _pair(root: Path, tmp_path: Path, buddy_extra: tuple[str, ...] = (), origin_extra: tuple[str, ...] = (),
          ring: bool = False, buddy_faults: list[dict] | None = None, origin_faults: list[dict] | None = None) -> Pair:
    """``ring``: the buddy replicates to the origin as well; ``*_faults``: that daemon's (tests/faults.py)."""
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, origin_ep = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    keys.write_text("".join(lines))
    if ring:
        buddy_extra = ("--peer", origin_ep, *buddy_extra)
    buddy = start_daemon(buddy_dir, root, "--peer-listen", buddy_ep, "--peer-keys", str(keys), *buddy_extra,
                         faults=buddy_faults)
    origin = start_daemon(origin_dir, root, "--peer-listen", origin_ep, "--peer", buddy_ep, "--peer-keys", str(keys),
                          *origin_extra, faults=origin_faults)
    return Pair(keys, lines, origin_dir, buddy_dir, buddy_ep, origin_ep, origin, buddy)


def _snapshot(run_dir: Path, path: Path, mib: int = 1) -> Any:
    client = ckptd.Client(run_dir=run_dir, spawn=False)
    fut = client.save_async({"w": torch.ones(mib * 262144)}, path, step=1, persist=False)
    fut.result(60)
    return client, fut


def _replace_origin(pair: Pair, *extra: str, faults: list[dict] | None = None) -> Path:
    """The origin node is lost whole; a replacement starts in a new run directory with a key of its own."""
    pair.origin.kill()
    new_dir, _ = _node(pair.keys, pair.lines)
    pair.keys.write_text("".join(pair.lines))
    pair.origin = start_daemon(new_dir, pair.origin.root, "--peer", pair.buddy_ep, "--peer-keys", str(pair.keys),
                               *extra, faults=faults)
    return new_dir


def test_a_peer_whose_key_is_not_trusted_is_refused_and_its_snapshot_is_reported_not_replicated(
        root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines: list[str] = []
    buddy_keys, rogue_keys = tmp_path / "buddy-keys", tmp_path / "rogue-keys"
    buddy_dir, buddy_ep = _node(buddy_keys, lines)
    rogue_dir, rogue_ep = _node(rogue_keys, lines)
    buddy_keys.write_text(lines[0])  # the buddy trusts nobody but itself
    rogue_keys.write_text("".join(lines))  # the rogue knows the buddy's key, so it can try
    buddy = start_daemon(buddy_dir, root, "--peer-listen", buddy_ep, "--peer-keys", str(buddy_keys))
    rogue = start_daemon(rogue_dir, root, "--peer-listen", rogue_ep, "--peer", buddy_ep, "--peer-keys",
                         str(rogue_keys), "--peer-timeout", "2")
    try:
        client, fut = _snapshot(rogue_dir, root / "step-1")
        with pytest.raises(InvalidCheckpoint, match="not replicated: peer .* did not answer"):
            fut.wait_replicated(60)
        client.close()
        assert "event=peer_refused" in (buddy_dir / LOG).read_text()  # refused in the handshake: the fault fired
        replicas = buddy.status()["peers"]["replicas_held"]
        assert (replicas["held"], replicas["bytes"], replicas["receiving"]) == ([], 0, 0)
        (snap,) = rogue.status()["memory"]["snapshots"]
        assert snap["replication"] == "failed" and "did not answer" in snap["replication_error"]
        # a node that looks for its snapshots on its peers (as a replacement does) is told one did not answer,
        # not handed an empty list it would take for "nothing to restore"
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            listed = held_snapshots(rogue_dir, peers=True)
        assert [s["path"] for s in listed] == [str(root / "step-1")]  # its own, held here
        (warned,) = [r.getMessage() for r in caplog.records if "were not looked at" in r.getMessage()]
        assert f"peer {buddy_ep} did not answer" in warned, warned
    finally:
        rogue.kill()
        buddy.kill()


def test_a_replica_beyond_the_buddys_budget_is_refused_and_the_origin_says_why(root: Path, tmp_path: Path) -> None:
    pair = _pair(root, tmp_path, buddy_extra=("--memory-budget", "2MiB"))
    try:
        client, fut = _snapshot(pair.origin_dir, root / "big", mib=3)
        with pytest.raises(InvalidCheckpoint, match="not replicated: .*memory budget"):
            fut.wait_replicated(60)
        small = client.save_async({"w": torch.ones(1000)}, root / "small", step=2, persist=False)
        small.wait_replicated(60)  # what fits is still replicated
        client.close()
        held = pair.buddy.status()["peers"]["replicas_held"]["held"]
        assert [r["path"] for r in held] == [str(root / "small")]
    finally:
        pair.kill()


def test_garbage_on_the_peer_port_harms_nothing(root: Path, tmp_path: Path) -> None:
    pair = _pair(root, tmp_path)
    buddy, buddy_ep = pair.buddy, pair.buddy_ep
    host, port = buddy_ep.removeprefix("tcp://").split(":")
    try:
        for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 64):
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                raw.sendall(junk)
        plain = zmq.Context.instance().socket(zmq.DEALER)  # ZeroMQ without CURVE: no handshake, nothing read
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(buddy_ep)
        plain.send(b"\x81\xa1v\x01")
        assert not plain.poll(500)
        plain.close()
        client, fut = _snapshot(pair.origin_dir, root / "after-junk")
        fut.wait_replicated(60)
        client.close()
        assert buddy.proc.poll() is None
        assert [r["path"] for r in buddy.status()["peers"]["replicas_held"]["held"]] == [str(root / "after-junk")]
    finally:
        pair.kill()


@pytest.mark.parametrize("args, says", [
    (["--peer", "tcp://127.0.0.1:47999"], "need --peer-keys"),
    (["--peer-listen", "127.0.0.1:47999", "--peer-keys", "KEYS"], "expected tcp://HOST:PORT"),
    (["--peer", "tcp://127.0.0.1:47999", "--peer-keys", "KEYS"], "names no key for it"),
    (["--replicas", "2", "--peer-keys", "KEYS"], "replicas must be 0 or 1"),
    (["--replicas", "1", "--peer-keys", "KEYS"], "1 needs a --peer"),
    (["--peer-listen", "tcp://127.0.0.1:47999", "--peer-keys", "MISSING"], "--peer-keys MISSING: cannot read it"),
])
def test_a_start_with_a_peer_option_it_cannot_honour_is_refused_naming_it(
        root: Path, tmp_path: Path, args: list[str], says: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# no peer yet\n")
    missing = tmp_path / "no-such-dir" / "keys"
    named = {"KEYS": str(keys), "MISSING": str(missing)}
    done = ckptd_cli("start", "--foreground", "--run-dir", str(short_tempdir("ckp-")), "--root", str(root),
                     *[named.get(a, a) for a in args])
    assert done.returncode == 2 and says.replace("MISSING", str(missing)) in done.stderr, done.stderr


def test_a_garbled_keys_file_is_refused_naming_its_line(root: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# nodes\nnot-a-key tcp://127.0.0.1:1\n")
    done = ckptd_cli("start", "--foreground", "--run-dir", str(short_tempdir("ckp-")), "--root", str(root),
                     "--peer-keys", str(keys))
    assert done.returncode == 2 and f"{keys}:2" in done.stderr and "KEY" in done.stderr, done.stderr


def test_one_node_restored_from_its_buddy_resumes_and_its_next_snapshot_replaces_the_restored_one(
        root: Path, tmp_path: Path) -> None:
    never = ("--persist-on-exit", "never")
    pair = _pair(root, tmp_path, origin_extra=never)
    state = {"w": torch.randn(1000), "step": 1}
    try:
        new_dir, back = _lost_and_restored(pair, root, state, never)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 1 and not (root / "step-1").exists()
        client = ckptd.Client(run_dir=new_dir, spawn=False)
        client.save_async({**back, "step": 2}, root / "step-2", step=2, persist=False).wait_replicated(60)
        client.close()
        assert [s["path"] for s in pair.origin.status()["memory"]["snapshots"]] == [str(root / "step-2")]
        assert [r["path"] for r in pair.buddy.status()["peers"]["replicas_held"]["held"]] == [str(root / "step-2")]
    finally:
        pair.kill()


def _lost_and_restored(pair: Any, root: Path, state: dict[str, Any], extra: tuple[str, ...]
                       ) -> tuple[Path, dict[str, Any]]:
    """``state`` snapshotted at ``root/step-1`` on the origin and replicated, the origin lost and replaced (its
    daemon started with ``extra``): the replacement's run directory, and the state it loaded back from the buddy."""
    client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
    client.save_async(state, root / "step-1", step=1, persist=False).wait_replicated(60)
    client.close()
    new_dir = _replace_origin(pair, *extra)
    assert ckptd.latest(root, run_dir=new_dir) == root / "step-1"
    back = {"w": torch.zeros_like(state["w"]), "step": 0}
    ckptd.load_into(back, root / "step-1", run_dir=new_dir)
    return new_dir, back


@pytest.mark.timeout(120)
def test_a_shard_of_many_frames_goes_to_the_buddy_and_comes_back_bitwise(root: Path, tmp_path: Path) -> None:
    """Replication and the restore both stream the shard on the data port in ``bulk.FRAME`` frames, each decrypted
    where it belongs: a shard of several frames, its last one short, of bytes that differ everywhere, comes back
    as it was, and neither stream went through the CURVE socket."""
    never = ("--persist-on-exit", "never")
    pair = _pair(root, tmp_path, origin_extra=never)
    state = {"w": torch.randn((bulk.FRAME * 3 + 4100) // 4), "step": 1}
    try:
        new_dir, back = _lost_and_restored(pair, root, state, never)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 1
        assert "event=snapshot_restored" in (new_dir / LOG).read_text()
        assert "event=peer_data_listen" in (pair.buddy_dir / LOG).read_text()
    finally:
        pair.kill()


def test_a_replica_file_shortened_in_the_buddys_memory_is_refused_at_restore_and_the_buddy_serves_on(
        root: Path, tmp_path: Path) -> None:
    """A mapping read past its file's end would kill the buddy (SIGBUS) with its own snapshots and every replica it
    holds: a new-user pass found it with ``truncate``."""
    never = ("--persist-on-exit", "never")
    pair = _pair(root, tmp_path, origin_extra=never)
    try:
        client, fut = _snapshot(pair.origin_dir, root / "step-1")
        fut.wait_replicated(60)
        client.close()
        ((_, name, *_),) = pair.buddy.status()["peers"]["replicas_held"]["held"][0]["shards"]
        os.truncate(Path(pair.buddy.status()["shm"]["dir"]) / name, 1000)
        new_dir = _replace_origin(pair, *never)
        assert ckptd.latest(root, run_dir=new_dir) is None  # never loaded; nothing else to resume from
        assert "was shortened" in (new_dir / LOG).read_text()  # the restore was tried, and refused for that
        assert pair.buddy.proc.poll() is None and pair.buddy.status()["peers"]["replicas_held"]["held"]
    finally:
        pair.kill()


def test_older_steps_saved_after_a_newer_one_leave_the_buddy_two_replicas_as_the_origin_holds_two(
        root: Path, tmp_path: Path) -> None:
    """The origin keeps a newer snapshot it never drops for an older one (a run saving older steps after a newer,
    as one restarted from scratch does), so it holds that one and its newest save; the buddy holds their replicas,
    where each older save used to add one more replica until the budget refused."""
    pair = _pair(root, tmp_path)
    client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
    try:
        for step in (9, 3, 2, 1):
            client.save_async({"w": torch.full((50_000,), float(step))}, root / "run" / f"step-{step}", step=step,
                              persist=False).wait_replicated(60)
        origin = sorted(s["step"] for s in pair.origin.status()["memory"]["snapshots"])
        buddy = sorted(r["step"] for r in pair.buddy.status()["peers"]["replicas_held"]["held"])
        assert origin == buddy == [1, 9], (origin, buddy)
    finally:
        client.close()
        pair.kill()


@pytest.mark.parametrize("floats", [50_000, 50_304], ids=["any_size", "512_not_4096"])
def test_a_drained_buddy_persists_the_replica_of_an_origin_that_is_gone(root: Path, tmp_path: Path,
                                                                         floats: int) -> None:
    """In a ring (the buddy's own buddy is the origin, which will be gone). A replica's file is exactly its shard's
    size, not page-sized as a trainer's slot is: one whose size is a multiple of 512 bytes but not of a page had its
    O_DIRECT write loop for ever past the file's end, and the drain with it (found by a new-user pass)."""
    pair = _pair(root, tmp_path, origin_extra=("--persist-on-exit", "never"), ring=True)
    state = {"w": torch.randn(floats), "step": 7}
    path = root / "run" / "step-7"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async(state, path, step=7, persist=False).wait_replicated(60)
        client.close()
        (held,) = pair.buddy.status()["peers"]["replicas_held"]["held"]
        if floats == 50_304:  # the size the fault needs
            assert held["bytes"] % 512 == 0 and held["bytes"] % 4096 != 0, held["bytes"]
        assert not path.exists()  # in memory only, on both nodes
        pair.origin.kill()
        assert pair.origin.proc.returncode == -signal.SIGKILL  # the origin is gone, and its snapshot with it
        stopped = pair.buddy.cli("stop", timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert pair.buddy.proc.wait(30) == 0
        log = (pair.buddy_dir / LOG).read_text()
        assert "event=drain_persist_replica" in log and "did not answer" in log
        assert "event=replication_failed" not in log  # the replica it persisted was not streamed anywhere
        assert ckptd.latest(root / "run", run_dir=pair.buddy_dir) == path
        back = ckptd.load(path)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 7
    finally:
        pair.kill()


@pytest.mark.parametrize("first", ["buddy", "origin"])
def test_draining_both_nodes_persists_each_snapshot_once_in_either_order(root: Path, tmp_path: Path,
                                                                        first: str) -> None:
    """The origin persists its own snapshot at its drain: a buddy drained while the origin answers leaves its
    replica alone, and one drained after the origin finds the checkpoint committed; neither writes it again."""
    pair = _pair(root, tmp_path, origin_extra=("--persist-on-exit", "never"))
    state = {"w": torch.randn(50_000), "step": 3}
    path = root / "run" / "step-3"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async(state, path, step=3, persist=False).wait_replicated(60)
        client.close()
        order = [pair.buddy, pair.origin] if first == "buddy" else [pair.origin, pair.buddy]
        for daemon in order:
            stopped = daemon.cli("stop", timeout=120)
            assert stopped.returncode == 0, stopped.stderr
            assert daemon.proc.wait(30) == 0
        buddy_log = (pair.buddy_dir / LOG).read_text()
        reason = "origin_alive" if first == "buddy" else "committed_already"
        assert f"event=replica_not_persisted path={path} origin={pair.origin_ep} reason={reason}" in buddy_log
        held = next(line for line in buddy_log.splitlines() if f"event=replica_held path={path} " in line)
        assert held.endswith(f" origin={pair.origin_ep}")  # the origin's endpoint, not a piece of its key
        assert "event=drain_persist_replica" not in buddy_log
        assert "event=persist path=" in (pair.origin_dir / LOG).read_text()  # the origin wrote it, once
        assert torch.equal(ckptd.load(path)["w"], state["w"])
    finally:
        pair.kill()


def test_after_a_node_was_replaced_draining_its_buddy_then_it_persists_the_snapshot_once_and_both_exit_clean(
        root: Path, tmp_path: Path) -> None:
    """The replacement took the lost node's line of the keys file (same endpoint, a key of its own): the buddy
    judges the replica's origin gone and persists it; the replacement, which restored the same snapshot, finds it
    committed at its own drain, which is no loss."""
    never = ("--persist-on-exit", "never")
    pair = _pair(root, tmp_path, origin_extra=never)
    state = {"w": torch.randn(50_000), "step": 4}
    path = root / "run" / "step-4"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async(state, path, step=4, persist=False).wait_replicated(60)
        client.close()
        pair.origin.kill()
        new_dir = short_tempdir("ckp-")
        pair.lines[0] = ckptd_cli("peer-key", "--run-dir", str(new_dir), "--endpoint", pair.origin_ep).stdout
        pair.keys.write_text("".join(pair.lines))  # the lost node's line is replaced, as a deployment does
        pair.origin = start_daemon(new_dir, root, "--peer-listen", pair.origin_ep, "--peer", pair.buddy_ep,
                                   "--peer-keys", str(pair.keys), *never)
        assert ckptd.latest(root / "run", run_dir=new_dir) == path  # restored from the buddy's replica
        for daemon in (pair.buddy, pair.origin):
            stopped = daemon.cli("stop", timeout=120)
            assert stopped.returncode == 0, stopped.stderr
            assert daemon.proc.wait(30) == 0
        buddy_log, new_log = (pair.buddy_dir / LOG).read_text(), (new_dir / LOG).read_text()
        assert "event=drain_persist_replica" in buddy_log and "no line of the peer keys file" in buddy_log
        assert f"event=snapshot_not_persisted path={path} reason=committed_by_another" in new_log
        back = ckptd.load(path)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 4
    finally:
        pair.kill()



@pytest.mark.timeout(180)
def test_a_path_a_second_run_overwrote_at_a_lower_step_comes_back_with_the_second_runs_bytes(
        root: Path, tmp_path: Path) -> None:
    """Run 1 snapshots run/last at step 100, its node is lost; run 2 on the replacement snapshots the same path at
    step 10 (overwrite=True). The buddy kept run 1's replica beside run 2's (the newer step of the directory
    stayed), so a second loss restored run 1's bytes; it holds only run 2's, as the origin does."""
    never = ("--persist-on-exit", "never")
    pair = _pair(root, tmp_path, origin_extra=never)
    path = root / "run" / "last"
    second = {"w": torch.full((50_000,), 2.0), "step": 10}
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.full((50_000,), 1.0), "step": 100}, path, step=100,
                          persist=False).wait_replicated(60)
        client.close()
        new_dir = _replace_origin(pair, *never)
        client = ckptd.Client(run_dir=new_dir, spawn=False)
        client.save_async(second, path, step=10, persist=False, overwrite=True).wait_replicated(60)
        client.close()
        held = pair.buddy.status()["peers"]["replicas_held"]["held"]
        assert [(r["path"], r["step"]) for r in held] == [(str(path), 10)], held
        third_dir = _replace_origin(pair, *never)
        assert ckptd.latest(root / "run", run_dir=third_dir) == path
        back = {"w": torch.zeros(50_000), "step": 0}
        ckptd.load_into(back, path, run_dir=third_dir)
        assert torch.equal(back["w"], second["w"]) and back["step"] == 10
    finally:
        pair.kill()


@pytest.mark.timeout(180)
def test_a_path_rolled_back_again_and_again_leaves_the_buddy_one_replica_file_and_one_spare(
        root: Path, tmp_path: Path) -> None:
    """Each snapshot of the same path at a lower step replaced the buddy's replica in its books without unlinking
    its file: one file per rollback, outside the budget and every listing, until the buddy exited. Now the replaced
    one's file is the spare the next replica takes (``peers/spares.py``): one file more at most, in the budget."""
    pair = _pair(root, tmp_path)
    path = root / "run" / "last"
    client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
    try:
        for step in (5, 4, 3, 2, 1):
            client.save_async({"w": torch.full((50_000,), float(step))}, path, step=step, persist=False,
                              overwrite=True).wait_replicated(60)
        held = pair.buddy.status()["peers"]["replicas_held"]
        assert [(r["path"], r["step"]) for r in held["held"]] == [(str(path), 1)], held
        ((_, name, size, *_),) = held["held"][0]["shards"]
        assert held["bytes"] == size and held["spare_bytes"] == size  # the same size: one spare, as large
        wait_until(lambda: len(segments_of(pair.buddy.proc.pid)) == 2 and name in segments_of(pair.buddy.proc.pid),
                   30, lambda: f"the buddy's files in /dev/shm are {segments_of(pair.buddy.proc.pid)}, not {name} "
                               f"and one spare")
    finally:
        client.close()
        pair.kill()


def _raw_offer(rid: int, path: Path, fill: int, nbytes: int = 8 * bulk.FRAME) -> tuple[Offer, bytes]:
    """An offer of rank 0's shard of a one-rank snapshot of ``path`` (``nbytes``, every byte ``fill``), as a
    trusted peer's own code would make it, and the shard's bytes."""
    snap = dataclasses.replace(SNAPSHOT, path=str(path), rank=0, world_size=1, nbytes=nbytes, staged=nbytes,
                               tensors=(TensorEntry("w", "U8", (nbytes - 4096,), 0, nbytes - 4096),))
    data = bytes([fill]) * nbytes
    return Offer(rid, snap.to_wire(), updater(CHECKSUM_ALGORITHM)(data, 0), CHECKSUM_ALGORITHM, 1.0, (0,)), data


def _send_shard(sock: zmq.Socket, endpoint: str, offer: Offer, ticket: Ticket, data: bytes) -> int:
    """``offer``'s shard on the data port of the peer at ``endpoint`` under ``ticket``, then its seal, sent without
    waiting for its answer; the seal's request id."""
    with socket.create_connection(bulk.data_address(endpoint), timeout=30) as conn:
        conn.sendall(ticket.token)
        bulk.send(conn, ticket.key, memoryview(data))
    sock.send(Seal(offer.id + 1, offer.id).to_wire())
    return offer.id + 1


def _read_back(sock: zmq.Socket, endpoint: str, rid: int, path: Path, size: int) -> bytes:
    """Rank 0's shard of the replica of ``path`` that the peer at ``endpoint`` holds, read back as a restore does."""
    sock.send(Fetch(rid, str(path), 0).to_wire())
    ticket = _answers(sock, [rid])[rid]
    assert isinstance(ticket, Ticket), ticket
    out = bytearray(size)
    with socket.create_connection(bulk.data_address(endpoint), timeout=30) as conn:
        conn.sendall(ticket.token)
        for _ in bulk.receive(conn, ticket.key, size, lambda offset, n: memoryview(out)[offset:offset + n]):
            pass
    return bytes(out)


def _answers(sock: zmq.Socket, ids: list[int]) -> dict[int, Any]:
    """One answer to each of ``ids`` (a second answer to one, or none within 30 s, fails)."""
    got: dict[int, Any] = {}
    while set(got) != set(ids):
        assert sock.poll(30_000), f"no answer to requests {sorted(set(ids) - set(got))}"
        msg = decode(sock.recv_multipart()[0], PEER_TYPES)
        assert msg.id in ids and msg.id not in got, f"an answer no request was waiting for: {msg}"
        got[msg.id] = msg
    return got


@pytest.mark.timeout(180)
def test_a_peer_offering_a_shard_again_before_its_seal_is_answered_leaves_only_the_new_replica(
        root: Path, tmp_path: Path) -> None:
    """A trusted peer seals a shard and offers it again at once: the new offer dropped the first attempt, then the
    seal's check completed that dropped attempt (files unlinked) in the books and deleted the new attempt instead,
    so the buddy listed a replica that failed every read with an internal error, and the new seal failed too.
    Here the seal comes while half the first stream is still to come (its answer waits for the stream's end), and
    the new offer before that: the first stream is stopped, its seal refused saying so, the new shard is held and
    read back, and no file is left over."""
    pair = _pair(root, tmp_path, buddy_extra=("--memory-budget", "256MiB"))
    sock = _peer_socket(pair.buddy_ep, KeyPair.of(pair.buddy_dir).public, KeyPair.of(pair.origin_dir))
    path = root / "raced" / "step-1"
    try:
        first, first_data = _raw_offer(1, path, 1)
        sock.send(first.to_wire())
        ticket = _answers(sock, [first.id])[first.id]
        assert isinstance(ticket, Ticket), ticket
        with socket.create_connection(bulk.data_address(pair.buddy_ep), timeout=30) as conn:
            conn.sendall(ticket.token)
            bulk.send(conn, ticket.key, memoryview(first_data)[:len(first_data) // 2])  # frames 0..3 of 8
            sock.send(Seal(2, first.id).to_wire())
            second, second_data = _raw_offer(100, path, 2)
            sock.send(second.to_wire())  # before the seal's answer, which waits for the stream
            answers = _answers(sock, [2, second.id])
            assert conn.recv(1) == b""  # the first stream was stopped: its connection closed by the buddy
        seal = answers[2]
        assert isinstance(seal, Error) and seal.code == ErrorCode.CONFLICT, seal
        assert "dropped before its stream ended" in seal.message, seal
        assert isinstance(answers[second.id], Ticket), answers[second.id]
        sealed = _send_shard(sock, pair.buddy_ep, second, answers[second.id], second_data)
        assert isinstance(_answers(sock, [sealed])[sealed], Ok)
        (held,) = pair.buddy.status()["peers"]["replicas_held"]["held"]
        assert held["path"] == str(path) and held["shards"][0][3] == second.checksum
        assert _read_back(sock, pair.buddy_ep, 200, path, len(second_data)) == second_data
        wait_until(lambda: segments_of(pair.buddy.proc.pid) == [held["shards"][0][1]], 30,
                   lambda: f"the buddy's files in /dev/shm: {segments_of(pair.buddy.proc.pid)}")
        assert "event=internal_error" not in (pair.buddy_dir / LOG).read_text()
    finally:
        sock.close()
        pair.kill()


@pytest.mark.timeout(120)
def test_a_replica_offered_outside_the_buddys_roots_is_refused_naming_the_path_and_the_roots(
        root: Path, tmp_path: Path) -> None:
    """A peer's path was taken as given: the buddy held, and its drain would have written, a replica of a path its
    own --root never allowed. It passes the roots as a local save does, before any byte is taken."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pair = _pair(root, tmp_path, origin_extra=("--root", str(elsewhere)))
    try:
        client, fut = _snapshot(pair.origin_dir, elsewhere / "step-1")
        with pytest.raises(InvalidCheckpoint, match=f"not replicated: .*{elsewhere / 'step-1'} is not strictly "
                                                    f"below the daemon's allowed roots \\({root}\\)"):
            fut.wait_replicated(60)
        client.close()
        replicas = pair.buddy.status()["peers"]["replicas_held"]
        assert (replicas["held"], replicas["bytes"], replicas["receiving"]) == ([], 0, 0)
        assert segments_of(pair.buddy.proc.pid) == []
        (snap,) = pair.origin.status()["memory"]["snapshots"]
        assert snap["replication"] == "failed" and "allowed roots" in snap["replication_error"]
    finally:
        pair.kill()


@pytest.mark.timeout(120)
def test_a_restore_of_a_path_outside_this_nodes_roots_is_refused_before_any_byte_is_read(
        root: Path, tmp_path: Path) -> None:
    """The buddy allows both directories and holds the replica; the replacement node allows only ``root``: it held
    the snapshot read back from the buddy under a path it would refuse from its own ranks, and could persist it
    there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    never = ("--persist-on-exit", "never")
    wide = ("--root", str(elsewhere))
    pair = _pair(root, tmp_path, buddy_extra=wide, origin_extra=(*wide, *never))
    path = elsewhere / "step-1"
    try:
        client, fut = _snapshot(pair.origin_dir, path)
        fut.wait_replicated(60)
        client.close()
        _replace_origin(pair, *never)
        sock = raw_socket(pair.origin)
        try:
            sock.send(Restore(1, str(path), rank=0).to_wire())
            reply = decode(sock.recv())
        finally:
            sock.close()
        assert isinstance(reply, Error) and reply.code == ErrorCode.PATH_NOT_ALLOWED, reply
        assert str(path) in reply.message and str(root) in reply.message, reply.message
        assert pair.origin.status()["memory"]["snapshots"] == [] and segments_of(pair.origin.proc.pid) == []
    finally:
        pair.kill()


@pytest.mark.timeout(180)
def test_a_drain_never_persists_a_replica_whose_directory_now_leads_outside_the_roots(
        root: Path, tmp_path: Path) -> None:
    """The replica's path was within the roots when it came; its directory was then made, as a link to a directory
    outside them. The drain of a buddy whose origin is gone wrote the replica through the link; it is refused,
    named among what the drain could not persist (``ckptd stop`` exits 3), and nothing is written there."""
    pair = _pair(root, tmp_path, origin_extra=("--persist-on-exit", "never"), ring=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.randn(50_000)}, root / "run" / "step-7", step=7,
                          persist=False).wait_replicated(60)
        client.close()
        (root / "run").symlink_to(elsewhere)
        pair.origin.kill()
        stopped = pair.buddy.cli("stop", timeout=120)
        assert list(elsewhere.iterdir()) == []
        assert stopped.returncode == 3, (stopped.returncode, stopped.stderr)
        log = (pair.buddy_dir / LOG).read_text()
        assert "reason=outside_roots" in log and "event=drain_persist_replica" not in log
        assert "not strictly below the daemon's allowed roots" in stopped.stderr + log
    finally:
        pair.kill()


def _replication(daemon: Daemon, path: Path) -> tuple[str, str]:
    """(replication, replication_error) of the snapshot of ``path`` ``daemon`` holds."""
    (snap,) = [s for s in daemon.status()["memory"]["snapshots"] if s["path"] == str(path)]
    return snap["replication"], snap["replication_error"]


@pytest.mark.timeout(180)
def test_a_snapshot_whose_buddy_restarted_is_found_gone_and_sent_again(root: Path, tmp_path: Path) -> None:
    """The buddy's daemon restarted, and every replica it held went with it: the origin said ``replicated`` for a
    copy that no longer existed, for as long as it held the snapshot. It asks the buddy what it holds every few
    seconds, finds the copy gone, and sends it again."""
    pair = _pair(root, tmp_path)
    path = root / "run" / "step-3"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.randn(50_000)}, path, step=3, persist=False).wait_replicated(60)
        pair.buddy.kill()
        pair.buddy = start_daemon(pair.buddy_dir, root, "--peer-listen", pair.buddy_ep, "--peer-keys",
                                  str(pair.keys))
        assert pair.buddy.status()["peers"]["replicas_held"]["held"] == []
        wait_until(lambda: [r["path"] for r in pair.buddy.status()["peers"]["replicas_held"]["held"]] == [str(path)],
                   60, lambda: f"the buddy holds {pair.buddy.status()['peers']['replicas_held']['held']}; the origin "
                               f"says {_replication(pair.origin, path)}")
        assert _replication(pair.origin, path)[0] in ("replicating", "replicated")
        wait_until(lambda: _replication(pair.origin, path)[0] == "replicated", 30)
        assert "event=replica_gone" in (pair.origin_dir / LOG).read_text()
        client.close()
    finally:
        pair.kill()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, step", [("last", 1), ("step-9", 9)])
def test_a_snapshot_whose_replica_another_run_replaced_on_the_buddy_is_no_longer_said_replicated(
        root: Path, tmp_path: Path, name: str, step: int) -> None:
    """Another run (another node, a key of its own) snapshots the same path, or a newer step of the same directory,
    and replicates it to the same buddy, which drops the first run's replica for it: the first run's daemon said
    ``replicated`` still. It says ``failed`` and why, and so does ``wait_replicated``; it does not send the copy
    back, which would only drop the other run's in turn."""
    pair = _pair(root, tmp_path)
    other_dir, _ = _node(pair.keys, pair.lines)
    pair.keys.write_text("".join(pair.lines))
    other = start_daemon(other_dir, root, "--peer", pair.buddy_ep, "--peer-keys", str(pair.keys))
    path = root / "run" / "last"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        fut = client.save_async({"w": torch.randn(50_000)}, path, step=5, persist=False)
        fut.wait_replicated(60)
        theirs = ckptd.Client(run_dir=other_dir, spawn=False)
        theirs.save_async({"w": torch.randn(50_000)}, root / "run" / name, step=step, persist=False,
                          overwrite=True).wait_replicated(60)
        theirs.close()
        held = pair.buddy.status()["peers"]["replicas_held"]["held"]
        assert [(r["path"], r["step"]) for r in held] == [(str(root / "run" / name), step)], held
        wait_until(lambda: _replication(pair.origin, path)[0] == "failed", 60,
                   lambda: f"the origin says {_replication(pair.origin, path)}")
        assert f"no longer holds its copy: it holds a replica of {root / 'run' / name}" in _replication(
            pair.origin, path)[1]
        with pytest.raises(InvalidCheckpoint, match="no longer holds its copy"):
            fut.wait_replicated(10)
        client.close()
        assert [(r["path"], r["step"]) for r in pair.buddy.status()["peers"]["replicas_held"]["held"]] == [
            (str(root / "run" / name), step)]
    finally:
        other.kill()
        pair.kill()


@pytest.mark.timeout(180)
def test_an_older_snapshot_kept_beside_a_newer_one_is_superseded_on_the_buddy_not_failed(root: Path,
                                                                                           tmp_path: Path) -> None:
    """With ``--keep-snapshots 2`` the origin keeps two snapshots of a directory, and the buddy one replica per
    directory and ranks: the newer's replica replaces the older's there. The older then says ``superseded`` (its
    directory's newer state is on the buddy), where it said ``failed`` as if another run had taken its place, and
    it says so as soon as the newer one is replicated (it said ``replicated`` for seconds after its copy was gone)."""
    pair = _pair(root, tmp_path, origin_extra=("--keep-snapshots", "2"))
    older, newer = root / "run" / "step-1", root / "run" / "step-2"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        first = client.save_async({"w": torch.randn(50_000)}, older, step=1, persist=False)
        first.wait_replicated(60)
        client.save_async({"w": torch.randn(50_000)}, newer, step=2, persist=False).wait_replicated(60)
        assert _held_replicas(pair.buddy) == [(str(newer), 2)]
        # at once, as the newer one's seal is answered: not replicated until the next check finds the copy gone
        assert _replication(pair.origin, older) == ("superseded", "")
        assert _replication(pair.origin, newer) == ("replicated", "")
        with pytest.raises(InvalidCheckpoint, match="no copy of its own on the buddy: .*took its place on the buddy"):
            first.wait_replicated(10)
        assert "action=superseded" in (pair.origin_dir / LOG).read_text()
        client.close()
    finally:
        pair.kill()


def _held_replicas(daemon: Daemon) -> list[tuple[str, int]]:
    return [(r["path"], r["step"]) for r in daemon.status()["peers"]["replicas_held"]["held"]]


def test_a_snapshot_its_origin_drops_as_older_than_the_disk_leaves_the_buddy_too_and_no_drain_brings_it_back(
        root: Path, tmp_path: Path) -> None:
    """Step 15 snapshotted and replicated, step 20 saved to disk beside it: the origin's exit drops step 15 as older
    than the disk (never persisted). Its replica stayed on the buddy, whose drain, finding the origin gone, wrote
    step 15 back, the directory's newest by step again (found by the stateful model; over a second run restarted
    at lower steps, its keep_last deleted that run's newest). The origin tells its buddy to forget it."""
    pair = _pair(root, tmp_path)
    snap15 = root / "run" / "snap-15"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.randn(50_000)}, snap15, step=15, persist=False).wait_replicated(60)
        assert _held_replicas(pair.buddy) == [(str(snap15), 15)]
        client.save_async({"w": torch.randn(50_000)}, root / "run" / "step-20", step=20).result(60)
        client.close()  # its trainer gone: the persist of step 15 finds step 20 newer and drops it
        wait_until(lambda: "reason=older_than_disk" in (pair.origin_dir / "ckptd.log").read_text(), 60,
                   "the origin dropped step 15 as older than the disk")
        wait_until(lambda: _held_replicas(pair.buddy) == [], 60,
                   lambda: f"the buddy still holds {_held_replicas(pair.buddy)}")
        assert "reason=forgotten" in (pair.buddy_dir / "ckptd.log").read_text()
        pair.origin.kill()
        assert pair.buddy.stop() == 0
        assert not snap15.exists(), "the buddy's drain wrote back a snapshot its origin gave up"
        assert ckptd.latest(root / "run") == root / "run" / "step-20"
    finally:
        pair.kill()


def test_a_replacement_that_lets_go_of_what_it_restored_makes_the_buddy_forget_its_predecessors_replica(
        root: Path, tmp_path: Path) -> None:
    """The replica a replacement node restored is held on the buddy under its predecessor's key; when the
    replacement drops that snapshot for good (a newer checkpoint on disk), the buddy drops it too: a forget names
    the snapshot's ranks, not only its sender's key (found by a review: the predecessor's copy stayed, for a drain
    of the buddy to write back)."""
    pair = _pair(root, tmp_path)
    snap = root / "run" / "snap-15"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.randn(50_000)}, snap, step=15, persist=False).wait_replicated(60)
        client.close()
        new_dir = _replace_origin(pair, "--persist-on-exit", "never")
        assert ckptd.latest(root / "run", run_dir=new_dir) == snap  # restored from the predecessor's replica
        client = ckptd.Client(run_dir=new_dir, spawn=False)
        client.save_async({"w": torch.randn(50_000)}, root / "run" / "step-20", step=20).result(60)
        with pytest.raises(ckptd.CheckpointExists, match="step-20"):
            client.persist(snap)  # passed over for the newer checkpoint: the replacement lets go of it
        client.close()
        wait_until(lambda: _held_replicas(pair.buddy) == [], 60,
                   lambda: f"the buddy still holds {_held_replicas(pair.buddy)}")
        assert "reason=forgotten" in (pair.buddy_dir / "ckptd.log").read_text()
    finally:
        pair.kill()


def test_a_daemon_that_exits_when_idle_stays_while_it_holds_a_peers_replica_and_exits_once_it_is_forgotten(
        root: Path, tmp_path: Path) -> None:
    """A spawned daemon (``--exit-when-idle``) whose node's trainers are gone holds its peer's replica past its
    idle limit (``event=idle_kept``: the limit passed, and it stayed), and exits by itself once the origin deletes
    the snapshot and the buddy forgets the replica."""
    pair = _pair(root, tmp_path, buddy_extra=("--exit-when-idle", "10"))  # its own trainer connects within
    # it, even on a loaded machine (the origin starts and a client connects meanwhile)
    snap = root / "run" / "snap-1"
    buddy_log = pair.buddy_dir / "ckptd.log"
    try:
        own = ckptd.Client(run_dir=pair.buddy_dir, spawn=False)  # the buddy node's trainer, as a spawn has one
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.randn(50_000)}, snap, step=1, persist=False).wait_replicated(60)
        own.close()  # the buddy node's trainer is gone: only the replica keeps its daemon
        wait_until(lambda: "event=idle_kept reason=holds_replicas" in buddy_log.read_text(), 60,
                   "the buddy passed its idle limit holding the replica")
        assert pair.buddy.proc.poll() is None and _held_replicas(pair.buddy) == [(str(snap), 1)]
        client.delete(snap)
        assert pair.buddy.proc.wait(60) == 0
        assert "reason=forgotten" in buddy_log.read_text() and "event=idle_exit" in buddy_log.read_text()
        client.close()
    finally:
        pair.kill()


@pytest.mark.parametrize("then", ["replaced", "buddy_drains"])
def test_a_rollback_over_a_disk_checkpoint_survives_its_nodes_loss_restored_or_persisted_by_the_buddy(
        root: Path, tmp_path: Path, then: str) -> None:
    """``run/cur`` committed on disk at step 20, then a snapshot of it at step 3 with ``overwrite=True`` (a
    rollback), replicated; the origin is lost. Its replacement resumes from the rollback, read back from the buddy;
    or, with no replacement, the buddy's drain persists the rollback over the disk checkpoint it replaced. The
    replacement resumed from the disk's step 20 (ordered by step, where the path's version written last is the
    path), and the drain skipped the replica as committed already, so the acknowledged rollback was lost."""
    never = ("--persist-on-exit", "never")
    pair = _pair(root, tmp_path, origin_extra=never)
    cur = root / "run" / "cur"
    first, rollback = {"w": torch.full((1000,), 20.0), "step": 20}, {"w": torch.full((1000,), 3.0), "step": 3}
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async(first, cur, step=20).result(60)
        client.save_async(rollback, cur, step=3, persist=False, overwrite=True).wait_replicated(60)
        client.close()
        back = {"w": torch.zeros(1000), "step": 0}
        if then == "replaced":
            new_dir = _replace_origin(pair, *never)
            assert ckptd.latest(root / "run", run_dir=new_dir) == cur
            ckptd.load_into(back, cur, run_dir=new_dir)
            assert "event=snapshot_restored" in (new_dir / LOG).read_text()
        else:
            pair.origin.kill()
            stopped = pair.buddy.cli("stop", timeout=120)
            assert stopped.returncode == 0, stopped.stderr
            assert f"event=drain_persist_replica path={cur}" in (pair.buddy_dir / LOG).read_text()
            ckptd.load_into(back, cur)
        assert torch.equal(back["w"], rollback["w"]) and back["step"] == 3
    finally:
        pair.kill()
