"""Whatever a trusted peer sends gets exactly one answer, and the daemon replicates on.

Authentication proves who a peer is, not that it is right: a hypothesis-driven peer, holding a key the buddy
trusts, sends it random bytes, msgpack maps of every peer type (and local ones) with random fields, offers whose
shard, checksum, ranks or algorithm are wrong, seals of offers that do not exist, fetches of replicas that are not
there, and messages of the wrong number of frames; and connections to the data port that send garbage, a token no
ticket gave, or nothing. Every message must get exactly one reply: an ``Error`` whose code is not INTERNAL (a bug
in ckptd), or the normal reply when it happens to be valid. Meanwhile a real origin replicates snapshots to the
same buddy, and every one must arrive.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptd
from ckptd.core.keys import KeyPair
from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.messages import Error, decode
from ckptd.peers.bulk import data_address
from ckptd.protocol.peer_messages import PEER_TYPES, Seal

from helpers import ckptd_cli, free_port, short_tempdir, start_daemon
from test_wire_format import GOLDEN

SNAPSHOT = GOLDEN["snapshot"][0]
LEGIT_SAVES = 8
scalars = st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=20), st.binary(max_size=40), st.booleans(),
                    st.none(), st.floats(allow_nan=True))
fields = st.dictionaries(st.sampled_from(["id", "offer", "offset", "path", "rank", "length", "shard", "checksum",
                                          "algorithm", "created", "ranks", "replicas", "code", "message", "x"]),
                         st.one_of(scalars, st.lists(scalars, max_size=4)), max_size=7)


def _map(kind: str, body: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": 1, "type": kind, **body}, use_bin_type=True)


def _offer_wire(rid: int, nbytes: int, checksum: int, ranks: list[int], algorithm: str, shard: bytes | None) -> bytes:
    snap = SNAPSHOT.to_wire() if shard is None else shard
    body = {"id": rid, "shard": snap, "checksum": checksum, "algorithm": algorithm, "created": 1.0, "ranks": ranks}
    if shard is None and nbytes:  # a valid shard of another size: may not fit, or never be completed
        wire = msgpack.unpackb(snap, raw=False)
        wire["nbytes"], wire["staged"] = nbytes, nbytes
        body["shard"] = msgpack.packb(wire, use_bin_type=True)
    return _map("offer", body)


ids = st.integers(0, 50)
cases = st.one_of(
    st.builds(lambda b: [b], st.binary(max_size=200)),
    st.builds(lambda k, f: [_map(k, f)], st.sampled_from([*PEER_TYPES, "snapshots", "hello", "commit"]), fields),
    st.builds(lambda rid, n, c, r, a, s: [_offer_wire(rid, n, c, r, a, s)], ids,
              st.sampled_from([0, 4096 + 32, 1 << 40]), st.integers(0, 2**32 - 1),
              st.lists(st.integers(0, 3), max_size=3), st.sampled_from(["crc32c", "crc32", "md5"]),
              st.one_of(st.none(), st.binary(max_size=60))),
    st.builds(lambda data: ["data port", data], st.binary(max_size=5000)),
    st.builds(lambda rid, o: [Seal(rid, o).to_wire()], ids, ids),
    st.builds(lambda rid, p, r, off, n: [_map("fetch", {"id": rid, "path": p, "rank": r, "offset": off,
                                                        "length": n})],
              ids, st.sampled_from(["/ckpt/step-101", "relative", "/" + "a" * 300]), st.integers(0, 4),
              st.integers(0, 2**63 - 1), st.integers(0, 1 << 25)),
    st.builds(lambda n: [b""] * n, st.integers(2, 4)),
    st.builds(lambda a, b: [Seal(1, 1).to_wire(), a, b], st.binary(max_size=10), st.binary(max_size=10)),
)


def _peer_socket(endpoint: str, server_key: bytes, pair: KeyPair) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.curve_serverkey = server_key
    sock.curve_publickey, sock.curve_secretkey = pair.public, pair.secret
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


@pytest.mark.timeout(300)
def test_every_peer_message_gets_one_reply_and_replication_goes_on(root: Path, tmp_path: Path) -> None:
    keys, lines, dirs, endpoints = tmp_path / "keys", [], [], []
    for _ in range(3):  # the buddy, a real origin, the fuzzing peer
        run_dir, endpoint = short_tempdir("ckf-"), f"tcp://127.0.0.1:{free_port()}"
        lines.append(ckptd_cli("peer-key", "--run-dir", str(run_dir), "--endpoint", endpoint).stdout)
        dirs.append(run_dir)
        endpoints.append(endpoint)
    keys.write_text("".join(lines))
    buddy = start_daemon(dirs[0], root, "--peer-listen", endpoints[0], "--peer-keys", str(keys),
                         "--memory-budget", "64MiB")
    origin = start_daemon(dirs[1], root, "--peer", endpoints[0], "--peer-keys", str(keys))
    sock = _peer_socket(endpoints[0], KeyPair.of(dirs[0]).public, KeyPair.of(dirs[2]))
    outcomes: list[Any] = []

    def replicate() -> None:
        client = ckptd.Client(run_dir=dirs[1], spawn=False)
        try:
            for step in range(LEGIT_SAVES):
                fut = client.save_async({"w": torch.full((50_000,), float(step))}, root / "legit" / f"step-{step}",
                                        step=step, persist=False)
                fut.wait_replicated(120)
                outcomes.append(step)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcomes.append(exc)
        finally:
            client.close()

    (root / "legit").mkdir()
    legit = threading.Thread(target=replicate)
    legit.start()
    sent = 0

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(cases)
    def one(frames: list[Any]) -> None:
        nonlocal sent
        sent += 1
        if frames[0] == "data port":  # no ticket gave its first bytes: closed, nothing of it read further
            with socket.create_connection(data_address(endpoints[0]), timeout=30) as conn:
                try:
                    conn.sendall(frames[1])
                    conn.shutdown(socket.SHUT_WR)
                    assert conn.recv(1) == b""
                except OSError as exc:  # closed while the garbage was still coming (reset, or no longer connected
                    # when the shutdown came): as good; a timeout is not
                    if isinstance(exc, TimeoutError):
                        raise
            return
        sock.send_multipart(frames)
        assert sock.poll(30_000), f"no reply to {frames!r:.300}"
        reply = sock.recv_multipart()
        msg = decode(reply[0], PEER_TYPES)
        if isinstance(msg, Error):
            assert msg.code != ErrorCode.INTERNAL, f"{msg.message} for {frames!r:.300}"

    try:
        one()
        assert not sock.poll(1000), "a request got more than one reply"  # one reply was taken per request
        legit.join(180)
        assert outcomes == list(range(LEGIT_SAVES)), outcomes
        assert buddy.proc.poll() is None
        held = buddy.status()["peers"]["replicas_held"]["held"]
        assert [r["path"] for r in held] == [str(root / "legit" / f"step-{LEGIT_SAVES - 1}")]
    finally:
        sock.close()
        origin.stop()
        assert buddy.stop() == 0
    assert sent >= 100
    log = (dirs[0] / "ckptd.log").read_text()
    assert "event=internal_error" not in log and "event=peer_data_refused" in log
