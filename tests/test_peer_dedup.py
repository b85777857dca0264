"""Send only what changed (``ckptd/peers/chunks.py``), with real daemons as two nodes on 127.0.0.1: a state most of
which is frozen crosses the data port whole once and then as its changed chunks, and comes back bitwise; a replica
gone before its successor is built from it leaves that successor sent whole; a chunk damaged in the buddy's memory
is caught by the checksum of the shard built from it, which is never held, and the snapshot is sent whole instead.
What is asserted is what the daemons count and log (bytes sent, bytes built), never a time."""

from __future__ import annotations

import dataclasses
import re
import socket
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.core.keys import KeyPair
from ckptd.peers import bulk, chunks
from ckptd.protocol.checksums import checksum
from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.messages import Error, Ok
from ckptd.protocol.peer_messages import CHUNK_BYTES, Forget, Seal, Ticket

from helpers import SHM, wait_until
from test_fuzz_peers import _peer_socket
from test_peers import LOG, Pair, _answers, _held_replicas, _pair, _raw_offer, _read_back, _replace_origin

MIB = 1 << 20


def _lora(step: int) -> dict:
    """A frozen base layer (36 MiB, the same at every step) and an adapter that trains (4 MiB, new each step): 90%
    of the state frozen, as in LoRA fine-tuning."""
    frozen = torch.Generator().manual_seed(1234)
    trained = torch.Generator().manual_seed(step)
    return {"model": {"base.weight": torch.randn(9 * MIB, generator=frozen),
                      "lora.weight": torch.randn(MIB, generator=trained)}, "step": step}


def _sent(pair) -> int:
    return pair.origin.status()["peers"]["replicated_sent_bytes_total"]


def _shard_bytes(pair, path: Path) -> int:
    (snap,) = [s for s in pair.origin.status()["memory"]["snapshots"] if s["path"] == str(path)]
    return snap["bytes"]


def _restores_bitwise(pair, root: Path, path: Path, state: dict) -> None:
    """The origin is lost; its replacement finds ``path`` the newest and reads it back from the buddy, bitwise."""
    new_dir = _replace_origin(pair, "--persist-on-exit", "never")
    assert ckptd.latest(root / "run", run_dir=new_dir) == path
    back = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    ckptd.load_into(back, path, run_dir=new_dir)
    assert back["step"] == state["step"]
    for name, tensor in state["model"].items():
        assert torch.equal(back["model"][name], tensor), name


def _step_one(pair: Pair, root: Path) -> tuple[ckptd.Client, int]:
    """A client of the origin whose first snapshot (``run/step-1``) is replicated; the bytes sent so far."""
    client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
    client.save_async(_lora(1), root / "run" / "step-1", step=1, persist=False).wait_replicated(60)
    return client, _sent(pair)


@pytest.mark.timeout(180)
def test_a_state_ninety_percent_frozen_sends_at_most_fifteen_percent_of_it_again_and_restores_bitwise(
        root: Path, tmp_path: Path) -> None:
    pair = _pair(root, tmp_path)
    try:
        client, first = _step_one(pair, root)
        nbytes = _shard_bytes(pair, root / "run" / "step-1")
        assert first == nbytes  # nothing to build from: every byte crossed
        state = _lora(2)
        client.save_async(state, root / "run" / "step-2", step=2, persist=False).wait_replicated(60)
        client.close()
        second = _sent(pair) - first
        assert second <= 0.15 * nbytes, f"{second} of {nbytes} bytes sent again"
        link = pair.origin.status()["peers"]["links"][0]
        assert link["bytes_built"] == nbytes - second
        assert re.search(rf"event=snapshot_replicated path=\S+step-2 .* sent={second} built={nbytes - second}\b",
                         (pair.origin_dir / LOG).read_text())
        assert re.search(rf"event=replica_shard_built path=\S+step-2 rank=0 bytes={nbytes} reused={nbytes - second}\b",
                         (pair.buddy_dir / LOG).read_text())
        wait_until(lambda: [p for p, _ in _held_replicas(pair.buddy)] == [str(root / "run" / "step-2")], 30,
                   lambda: f"the buddy holds {_held_replicas(pair.buddy)}")  # the replica built from is let go
        _restores_bitwise(pair, root, root / "run" / "step-2", state)
    finally:
        pair.kill()


@pytest.mark.timeout(180)
def test_a_snapshot_whose_previous_replica_is_gone_is_sent_whole_and_restores_bitwise(
        root: Path, tmp_path: Path) -> None:
    """The origin deleted step 1, so the buddy forgot its replica before step 2 was offered: nothing to build from."""
    pair = _pair(root, tmp_path)
    try:
        client, first = _step_one(pair, root)
        client.delete(root / "run" / "step-1")
        wait_until(lambda: _held_replicas(pair.buddy) == [], 30, lambda: f"the buddy holds {_held_replicas(pair.buddy)}")
        state = _lora(2)
        client.save_async(state, root / "run" / "step-2", step=2, persist=False).wait_replicated(60)
        client.close()
        assert _sent(pair) - first == _shard_bytes(pair, root / "run" / "step-2")
        _restores_bitwise(pair, root, root / "run" / "step-2", state)
    finally:
        pair.kill()


@pytest.mark.timeout(180)
def test_a_corrupted_chunk_of_the_previous_replica_is_caught_never_held_and_the_snapshot_is_sent_whole(
        root: Path, tmp_path: Path) -> None:
    """A byte of step 1's replica changes in the buddy's memory (in the frozen part, which step 2 reuses): the
    shard built from it fails its checksum and is not held; the origin sends step 2 whole, and that is what a
    replacement reads back."""
    pair = _pair(root, tmp_path)
    try:
        client, first = _step_one(pair, root)
        (replica,) = pair.buddy.status()["peers"]["replicas_held"]["held"]
        (_, name, size, _, _), = replica["shards"]
        with open(SHM / name, "r+b") as f:  # a byte of the frozen base, 30 MiB in
            f.seek(30 * MIB)
            byte = f.read(1)
            f.seek(30 * MIB)
            f.write(bytes([byte[0] ^ 0x40]))
        state = _lora(2)
        client.save_async(state, root / "run" / "step-2", step=2, persist=False).wait_replicated(60)
        client.close()
        nbytes = _shard_bytes(pair, root / "run" / "step-2")
        assert _sent(pair) - first > nbytes  # the changed chunks, then every byte again
        assert pair.origin.status()["peers"]["links"][0]["bytes_built"] == 0
        assert "event=replica_build_failed" in (pair.origin_dir / LOG).read_text()
        assert re.search(r"event=replica_refused path=\S+step-2 .*built from a replica held here",
                         (pair.buddy_dir / LOG).read_text())
        _restores_bitwise(pair, root, root / "run" / "step-2", state)
    finally:
        pair.kill()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("connected", [False, True], ids=["before_its_connection", "with_its_connection_open"])
def test_a_replica_dropped_between_the_offer_built_from_it_and_its_stream_fails_that_build_and_a_whole_send_is_held(
        root: Path, tmp_path: Path, connected: bool) -> None:
    """A trusted peer offers step 2, whose first three chunks step 1's replica holds, and gets a ticket saying so;
    then, before its data connection comes (or with it open, the build under way or about to be, its one sent chunk
    not yet sent), the peer forgets step 1. The build is stopped (its seal refused saying why, nothing held), and
    step 2 offered again without digests is sent whole, held, and read back bitwise."""
    pair = _pair(root, tmp_path)
    conn = None
    sock = _peer_socket(pair.buddy_ep, KeyPair.of(pair.buddy_dir).public, KeyPair.of(pair.origin_dir))
    try:
        one, data = _raw_offer(1, root / "run" / "step-1", 7, nbytes=4 * CHUNK_BYTES)
        one = dataclasses.replace(one, digests=chunks.digests(memoryview(data)))
        sock.send(one.to_wire())
        ticket = _answers(sock, [1])[1]
        assert isinstance(ticket, Ticket) and ticket.reused == b""  # nothing held to build from
        _stream(pair.buddy_ep, ticket, data, set())
        sock.send(Seal(2, 1).to_wire())
        assert isinstance(_answers(sock, [2])[2], Ok)

        two, _ = _raw_offer(3, root / "run" / "step-2", 7, nbytes=4 * CHUNK_BYTES)
        data2 = data[:3 * CHUNK_BYTES] + bytes([9]) * CHUNK_BYTES
        two = dataclasses.replace(two, checksum=checksum(data2), digests=chunks.digests(memoryview(data2)))
        sock.send(two.to_wire())
        ticket = _answers(sock, [3])[3]
        assert isinstance(ticket, Ticket) and chunks.reused_of(ticket.reused, len(data2)) == {0, 1, 2}
        if connected:
            conn = socket.create_connection(bulk.data_address(pair.buddy_ep), timeout=30)
            conn.sendall(ticket.token)
        sock.send(Forget(4, str(root / "run" / "step-1"), (0,)).to_wire())
        assert isinstance(_answers(sock, [4])[4], Ok)
        wait_until(lambda: _held_replicas(pair.buddy) == [], 30, lambda: f"the buddy holds {_held_replicas(pair.buddy)}")
        sock.send(Seal(5, 3).to_wire())
        refused = _answers(sock, [5])[5]
        assert isinstance(refused, Error) and refused.code == ErrorCode.WRITE_FAILED, refused
        assert "built from here was dropped" in refused.message
        if conn is not None:
            conn.close()

        whole = dataclasses.replace(two, id=6, digests=b"")
        sock.send(whole.to_wire())
        ticket = _answers(sock, [6])[6]
        assert isinstance(ticket, Ticket) and ticket.reused == b""
        _stream(pair.buddy_ep, ticket, data2, set())
        sock.send(Seal(7, 6).to_wire())
        assert isinstance(_answers(sock, [7])[7], Ok)
        assert _read_back(sock, pair.buddy_ep, 8, root / "run" / "step-2", len(data2)) == data2
    finally:
        if conn is not None:
            conn.close()
        sock.close(0)
        pair.kill()


def _stream(endpoint: str, ticket: Ticket, data: bytes, reused: set[int]) -> None:
    """What an origin sends on the data port for ``ticket``: the chunks not in ``reused``."""
    with socket.create_connection(bulk.data_address(endpoint), timeout=30) as conn:
        conn.sendall(ticket.token)
        bulk.send(conn, ticket.key, memoryview(data), spans=chunks.spans(reused, len(data)) if reused else None)


@pytest.mark.timeout(180)
def test_an_origin_started_with_peer_send_all_sends_every_byte_of_every_snapshot(root: Path, tmp_path: Path) -> None:
    pair = _pair(root, tmp_path, origin_extra=("--peer-send-all",))
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        for step in (1, 2):
            client.save_async(_lora(step), root / "run" / f"step-{step}", step=step, persist=False).wait_replicated(60)
        client.close()
        assert _sent(pair) == 2 * _shard_bytes(pair, root / "run" / "step-2")
        assert pair.origin.status()["peers"]["links"][0]["bytes_built"] == 0
    finally:
        pair.kill()
