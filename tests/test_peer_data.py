"""The data port that carries replicas' bytes beside the CURVE peer endpoint (``ckptd/peers/data.py``), with real daemons
as nodes on 127.0.0.1 and, where the link must misbehave, a proxy standing for it (``tests/proxy.py``): the bytes
cross it in the clear or, where a daemon asks, encrypted, and come back bitwise; a connection whose token no ticket
gave is closed before a byte of it is held; a byte altered on the link fails that stream (and only it), and nothing
altered is ever restored; an origin killed mid-stream leaves the buddy nothing, and it serves on."""

from __future__ import annotations

import random
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.core.config import DaemonConfig
from ckptd.core.keys import KeyPair
from ckptd.peers import bulk
from ckptd.protocol.errors import ErrorCode, InvalidCheckpoint
from ckptd.protocol.messages import Error
from ckptd.protocol.peer_messages import Seal, Ticket

from helpers import Daemon, segments_of, start_daemon, wait_until
from proxy import TcpProxy
from test_fuzz_peers import _peer_socket
from test_peer_outages import _through
from test_peers import LOG, _answers, _held_replicas, _node, _pair, _raw_offer

MIB = 1 << 20
NEVER = ("--persist-on-exit", "never")


def _state(mib: int, seed: int) -> dict:
    return {"w": torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(seed)), "step": seed}


@dataclass
class Link:
    """An origin reaching its buddy through ``proxy``, which stands for the link (both its ports)."""

    proxy: TcpProxy
    buddy: Daemon
    origin: Daemon
    keys: Path
    lines: list[str]
    buddy_dir: Path
    buddy_ep: str
    origin_dir: Path

    def replace_origin(self) -> Path:
        """The origin is lost; a replacement starts with a key of its own and reaches the buddy directly."""
        self.origin.kill()
        new_dir, _ = _node(self.keys, self.lines)
        self.keys.write_text("".join(self.lines))
        self.origin = start_daemon(new_dir, self.origin.root, "--peer", self.buddy_ep, "--peer-keys",
                                   str(self.keys), *NEVER)
        return new_dir

    def close(self) -> None:
        self.origin.kill()
        self.buddy.kill()
        self.proxy.close()


def _linked(root: Path, tmp_path: Path, *, buddy_args: tuple[str, ...] = (), origin_args: tuple[str, ...] = ()) -> Link:
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, _ = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    host, port = buddy_ep.removeprefix("tcp://").split(":")
    proxy = TcpProxy(host, int(port), peer=True)
    buddy, origin, _ = _through(proxy, root, keys, lines, buddy_dir, buddy_ep, origin_dir, *NEVER, *origin_args,
                                buddy_args=buddy_args)
    return Link(proxy, buddy, origin, keys, lines, buddy_dir, buddy_ep, origin_dir)


def _restored(link: Link, root: Path, path: Path, state: dict) -> None:
    """A replacement of the origin finds ``path`` the newest and loads it back bitwise from the buddy."""
    new_dir = link.replace_origin()
    assert ckptd.latest(root, run_dir=new_dir) == path
    back = {"w": torch.zeros_like(state["w"]), "step": 0}
    ckptd.load_into(back, path, run_dir=new_dir)
    assert torch.equal(back["w"], state["w"]) and back["step"] == state["step"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("encrypting", ["neither", "buddy", "origin"])
def test_a_replica_crosses_the_link_in_the_clear_unless_a_daemon_asks_for_encryption_and_comes_back_bitwise(
        root: Path, tmp_path: Path, encrypting: str) -> None:
    """What a wiretap on the link sees of a replica: as many bytes as the shard and then some (a tag per frame);
    the shard's own bytes where neither daemon runs with --peer-encrypt, and not one 64-byte run of them where
    either does (the buddy says which it took)."""
    link = _linked(root, tmp_path, buddy_args=("--peer-encrypt",) if encrypting == "buddy" else (),
                   origin_args=("--peer-encrypt",) if encrypting == "origin" else ())
    state = _state(9, 1)
    try:
        client = ckptd.Client(run_dir=link.origin_dir, spawn=False)
        client.save_async(state, root / "step-1", step=1, persist=False).wait_replicated(60)
        client.close()
        plain = state["w"].numpy().tobytes()
        seen = bytes(link.proxy.data_seen)
        assert len(seen) > len(plain)  # the whole shard went over the data port
        runs = [plain[i:i + 64] in seen for i in range(0, len(plain) - 64, len(plain) // 97)]
        encrypted = encrypting != "neither"
        assert not any(runs) if encrypted else all(runs)
        held = [line for line in (link.buddy_dir / LOG).read_text().splitlines() if "event=replica_held" in line]
        assert len(held) == 1 and f" encrypted={str(encrypted).lower()} origin=" in held[0], held
        _restored(link, root, root / "step-1", state)
    finally:
        link.close()


def _on_the_wire(data: bytes, encrypted: bool, key: bytes, frame: int) -> bytes:
    """The bytes ``bulk.send`` puts on a connection for ``data``."""
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=lambda: (bulk.send(a, key, memoryview(data), frame, encrypted=encrypted),
                                                  a.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while chunk := b.recv(1 << 20):
            got += chunk
        sender.join()
    return bytes(got)


def _taken(wire: bytes, encrypted: bool, key: bytes, size: int, frame: int) -> bytes:
    """What ``bulk.receive`` takes of ``wire``, frame by frame (``FrameError`` at the first that fails)."""
    a, b = socket.socketpair()
    with a, b:
        feeder = threading.Thread(target=lambda: (a.sendall(wire), a.shutdown(socket.SHUT_WR)))
        feeder.start()
        out = bytearray(size)
        try:
            for offset, piece in bulk.receive(b, key, size, lambda o, n: memoryview(out)[o:o + n], frame,
                                              encrypted=encrypted):
                assert bytes(piece) == bytes(out[offset:offset + len(piece)])
        finally:
            b.close()
            feeder.join()
    return bytes(out)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_frames_plain_or_encrypted_come_back_whole_and_any_byte_altered_or_frame_moved_fails_its_tag(
        encrypted: bool) -> None:
    """Both kinds of frame carry the same guarantees: every payload byte, its length and its place in the stream
    are under the tag, so a byte flipped in a payload or a tag, a frame's number changed, or a frame from another
    stream's key fails; plain frames carry the payload itself, encrypted ones not a 64-byte run of it."""
    key, frame = bulk.new_stream()[1], 4096
    data = bytes(random.Random(7).randbytes(3 * frame + 100))
    wire = _on_the_wire(data, encrypted, key, frame)
    assert len(wire) == len(data) + 4 * (bulk.HEADER.size + bulk.TAG)
    assert (data[frame:frame + 64] in wire) is not encrypted
    assert _taken(wire, encrypted, key, len(data), frame) == data
    step = bulk.HEADER.size + frame + bulk.TAG
    payload_byte, tag_byte = step + bulk.HEADER.size + 10, 2 * step - 1
    for at in (payload_byte, tag_byte):
        altered = bytearray(wire)
        altered[at] ^= 0x01
        with pytest.raises(bulk.FrameError, match="frame 1 .*fails its authentication tag"):
            _taken(bytes(altered), encrypted, key, len(data), frame)
    swapped = wire[step:2 * step] + wire[:step] + wire[2 * step:]  # frames 1 and 0 in each other's places
    with pytest.raises(bulk.FrameError, match="frame 1 of 4096 bytes where frame 0"):
        _taken(swapped, encrypted, key, len(data), frame)
    renumbered = bytearray(wire[:step])
    bulk.HEADER.pack_into(renumbered, 0, 1, frame)  # frame 0 under frame 1's number, then frame 1 dropped
    with pytest.raises(bulk.FrameError, match="frame 0 .*fails its authentication tag|where frame 0 of"):
        _taken(bytes(renumbered) + wire[2 * step:], encrypted, key, len(data), frame)
    with pytest.raises(bulk.FrameError, match="frame 0 .*fails its authentication tag"):
        _taken(wire, encrypted, bulk.new_stream()[1], len(data), frame)


@pytest.mark.timeout(120)
def test_a_connection_with_a_token_no_ticket_gave_is_closed_before_a_byte_of_it_is_held(
        root: Path, tmp_path: Path) -> None:
    """A trusted peer's offer gets a ticket; a connection with another token then sends frames under the ticket's
    own key: it is closed, the shard's file stays zeros, and the stream whose connection never came is dropped
    after the peer timeout, its seal saying why."""
    pair = _pair(root, tmp_path, buddy_extra=("--peer-timeout", "2"))
    sock = _peer_socket(pair.buddy_ep, KeyPair.of(pair.buddy_dir).public, KeyPair.of(pair.origin_dir))
    try:
        offer, data = _raw_offer(1, root / "forged" / "step-1", 7, nbytes=bulk.FRAME)
        sock.send(offer.to_wire())
        ticket = _answers(sock, [offer.id])[offer.id]
        assert isinstance(ticket, Ticket), ticket
        (name,) = segments_of(pair.buddy.proc.pid)  # the shard's file, made for the offer
        forged = bytes(b ^ 0xFF for b in ticket.token)
        with socket.create_connection(bulk.data_address(pair.buddy_ep), timeout=30) as conn:
            conn.sendall(forged)
            try:
                bulk.send(conn, ticket.key, memoryview(data))
                closed = conn.recv(1) == b""
            except ConnectionError:  # closed while the frames still came
                closed = True
            assert closed  # by the buddy
        assert Path("/dev/shm", name).read_bytes() == bytes(len(data))  # nothing of it reached the shard
        assert "event=peer_data_refused" in (log := (pair.buddy_dir / LOG).read_text())
        assert "reason=unknown_token" in log
        sock.send(Seal(2, offer.id).to_wire())
        seal = _answers(sock, [2])[2]
        assert isinstance(seal, Error) and seal.code == ErrorCode.WRITE_FAILED, seal
        assert "data connection did not come within 2 s" in seal.message
        replicas = pair.buddy.status()["peers"]["replicas_held"]
        assert (replicas["held"], replicas["receiving"]) == ([], 0)
        wait_until(lambda: not segments_of(pair.buddy.proc.pid), 30, "the refused shard's file was never removed")
    finally:
        sock.close()
        pair.kill()


@pytest.mark.timeout(180)
def test_a_byte_altered_on_the_link_fails_that_stream_only_and_nothing_altered_is_restored(
        root: Path, tmp_path: Path) -> None:
    link = _linked(root, tmp_path)
    states = {1: _state(9, 1), 2: _state(9, 2)}
    try:
        client = ckptd.Client(run_dir=link.origin_dir, spawn=False)
        link.proxy.flip_data_byte(bulk.TOKEN_BYTES + bulk.HEADER.size + 1000)  # in frame 0's ciphertext
        altered = client.save_async(states[1], root / "step-1", step=1, persist=False)
        with pytest.raises(InvalidCheckpoint, match="not replicated: .*frame 0 .*fails its authentication tag"):
            altered.wait_replicated(60)
        assert link.proxy.flipped.is_set()  # the byte was altered on the way: the fault fired
        assert "event=replica_stream_failed" in (link.buddy_dir / LOG).read_text()
        wait_until(lambda: not segments_of(link.buddy.proc.pid), 30, "the buddy kept the altered stream's file")
        assert link.buddy.status()["peers"]["replicas_held"]["held"] == []
        client.save_async(states[2], root / "step-2", step=2, persist=False).wait_replicated(60)  # the next: held
        client.close()
        _restored(link, root, root / "step-2", states[2])  # never step 1, whose replica was never held
        assert link.buddy.proc.poll() is None
    finally:
        link.close()


@pytest.mark.timeout(180)
def test_an_origin_killed_mid_stream_leaves_the_buddy_nothing_and_it_takes_the_next(
        root: Path, tmp_path: Path) -> None:
    link = _linked(root, tmp_path)
    proxy, buddy, origin = link.proxy, link.buddy, link.origin
    try:
        client = ckptd.Client(run_dir=link.origin_dir, spawn=False)
        proxy.stall_after(8 * MIB)  # the stream is held part-way, so the kill lands in its middle
        client.save_async(_state(48, 1), root / "step-1", step=1, persist=False).result(60)
        assert proxy.stalled.wait(60)
        wait_until(lambda: buddy.status()["peers"]["replicas_held"]["receiving"] == 1, 30,
                   "the buddy never started receiving the replica")
        origin.kill()
        assert origin.proc.returncode == -signal.SIGKILL
        proxy.restore()
        wait_until(lambda: buddy.status()["peers"]["replicas_held"]["receiving"] == 0, 30,
                   "the buddy kept the half stream of an origin that died")
        wait_until(lambda: not segments_of(buddy.proc.pid), 30, "the half stream's file was never removed")
        assert "event=replica_stream_failed" in (link.buddy_dir / LOG).read_text()
        assert buddy.proc.poll() is None and buddy.status()["peers"]["replicas_held"]["held"] == []
        client.close()  # its next snapshot's slot, made when the first was lent, goes with it
        state = _state(1, 2)
        client = ckptd.Client(run_dir=link.replace_origin(), spawn=False)
        client.save_async(state, root / "step-2", step=2, persist=False).wait_replicated(60)
        client.close()
        assert [r["step"] for r in buddy.status()["peers"]["replicas_held"]["held"]] == [2]
    finally:
        link.close()


def test_a_pacer_keeps_streams_together_to_its_rate_a_frame_at_a_time() -> None:
    """``--peer-rate``'s pacing, on a clock of the test's: frames of two streams share one rate, each waits for
    its turn, and none waits when the link's share is free."""
    now, slept = [100.0], []

    def sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))
        now[0] += seconds

    pace = bulk.Pacer(1000, clock=lambda: now[0], sleep=sleep)
    pace.before(500)  # the share is free: at once
    pace.before(500)  # half a second after the first
    pace.before(1000)  # a second after that
    assert slept == [0.5, 0.5]
    now[0] += 10  # a long quiet spell earns no burst beyond one frame's wait
    pace.before(2000)
    pace.before(1)
    assert slept == [0.5, 0.5, 2.0]


def test_a_peer_rate_too_slow_for_the_peer_timeout_is_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--peer-rate 100000 bytes/s is too slow.*--peer-timeout \(10 s\)"):
        DaemonConfig(run_dir=tmp_path / "run", roots=(tmp_path,), peer_rate=100_000)
    assert DaemonConfig(run_dir=tmp_path / "run", roots=(tmp_path,), peer_rate=2_000_000_000).peer_rate == 2_000_000_000


@pytest.mark.timeout(120)
def test_replication_under_a_peer_rate_takes_at_least_its_share_and_arrives(root: Path, tmp_path: Path) -> None:
    """12 MiB at 1 MiB a second: its three frames go 4 s apart, so the copy takes 8 s at least (a bound from below,
    which load can only lengthen; unpaced it takes well under a second), and the buddy holds it (its checksum
    checked end to end)."""
    pair = _pair(root, tmp_path, origin_extra=("--peer-rate", "1MiB"))
    path = root / "run" / "paced"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.randn(3 * 1024 * 1024)}, path, step=1, persist=False).wait_replicated(60)
        held = next(s for s in pair.origin.status()["memory"]["snapshots"] if s["path"] == str(path))
        assert held["replication_lag_s"] >= 8.0, held
        assert _held_replicas(pair.buddy) == [(str(path), 1)]
        client.close()
    finally:
        pair.kill()
