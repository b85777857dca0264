"""A restore's read of a replica from a peer (``PeerLink.fetch``), against a fake holder on 127.0.0.1: it answers the
``Fetch`` over CURVE with a ``Ticket`` and sends the shard on its data port (its peer port + 1) as authenticated
frames (AES-256-GCM, as a holder with --peer-encrypt sends them; plain ones are tests/test_peer_data.py's).
The shard comes back bitwise, each frame written in place only once its tag passed; a frame altered on the way, out
of order, or under another key, a stream cut short, and bytes that pass their tags but not the origin's checksum
are each refused with a clear error, never taken."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Callable

import pytest
import zmq

from ckptd.core.keys import KeyPair, Trust
from ckptd.peers import bulk
from ckptd.peers.link import PeerLink
from ckptd.protocol.checksums import checksum
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CHECKSUM_ALGORITHM
from ckptd.protocol.messages import decode
from ckptd.protocol.peer_messages import PEER_TYPES, TOKEN_BYTES, Fetch, Ticket

from helpers import free_port

SIZE = bulk.FRAME * 3 + 12345
"""Several frames, the last one short."""

Serve = Callable[[socket.socket, bytes, bytes], None]
"""How the fake holder sends ``data`` under ``key`` on the data connection (after the token came)."""


def honest(conn: socket.socket, key: bytes, data: bytes) -> None:
    bulk.send(conn, key, memoryview(data))


class FakeHolder:
    """A CURVE ROUTER that answers one ``Fetch`` with a ticket, and a data port that serves it with ``serve``."""

    def __init__(self, data: bytes, serve: Serve = honest) -> None:
        self.data, self.serve = data, serve
        self.public, secret = zmq.curve_keypair()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = self.public, secret
        self.sock.setsockopt(zmq.LINGER, 0)
        port = free_port()  # and port + 1, free too
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.sock.bind(self.endpoint)
        self.listener = socket.create_server(bulk.data_address(self.endpoint))
        self.listener.settimeout(30)
        self.token_seen = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if not self.sock.poll(30_000):
            return
        ident, frame = self.sock.recv_multipart()
        msg = decode(frame, PEER_TYPES)
        assert isinstance(msg, Fetch)
        token, key = bulk.new_stream()
        self.sock.send_multipart([ident, Ticket(msg.id, token, key).to_wire()])
        conn, _ = self.listener.accept()
        with conn:
            got = bytearray(TOKEN_BYTES)
            bulk.recv_exact(conn, memoryview(got))
            self.token_seen = bytes(got)
            try:
                if self.token_seen == token:
                    self.serve(conn, key, self.data)
            except ConnectionError:  # the restorer refused the stream and closed its end: as it should
                pass

    def close(self) -> None:
        self.thread.join(30)
        self.listener.close()
        self.sock.close(0)
        self.ctx.term()


def _frames(key: bytes, shard: bytes) -> bytearray:
    """Every frame ``bulk.send`` would send of ``shard`` under ``key``, as bytes a test may alter."""
    frames = bytearray()

    class Capture:
        def sendall(self, view: memoryview) -> None:
            frames.extend(view)
    bulk.send(Capture(), key, memoryview(shard))  # type: ignore[arg-type]
    return frames


def _fetch(holder: FakeHolder, tmp_path: Path, expected: int) -> bytes:
    """What ``PeerLink.fetch`` wrote into a file of ``SIZE`` zeros (``InvalidCheckpoint`` raised as it is)."""
    trust = Trust(None)
    trust.set_ring((holder.endpoint,), (holder.public.decode(),))
    ctx = zmq.Context()
    link = PeerLink(ctx, holder.endpoint, trust, KeyPair.of(tmp_path / "run"), timeout=30)
    fd = os.open(tmp_path / "shard", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        link.fetch("/ckpt/step-1", 0, SIZE, expected, CHECKSUM_ALGORITHM, fd)
        return os.pread(fd, SIZE + 1, 0)
    finally:
        os.close(fd)
        link.close()
        ctx.term()
        holder.close()


def _written(tmp_path: Path) -> bytes:
    return (tmp_path / "shard").read_bytes()


@pytest.fixture
def data() -> bytes:
    return os.urandom(SIZE)


@pytest.mark.timeout(60)
def test_a_shard_of_several_frames_comes_back_bitwise_on_the_data_port(data: bytes, tmp_path: Path) -> None:
    holder = FakeHolder(data)
    assert _fetch(holder, tmp_path, checksum(data, CHECKSUM_ALGORITHM)) == data
    assert len(holder.token_seen) == TOKEN_BYTES  # the stream came on the data connection the ticket named


@pytest.mark.timeout(60)
def test_a_frame_altered_on_the_way_is_refused_and_never_written(data: bytes, tmp_path: Path) -> None:
    def flip(conn: socket.socket, key: bytes, shard: bytes) -> None:
        frames = _frames(key, shard)
        at = bulk.HEADER.size + bulk.FRAME + bulk.TAG + bulk.HEADER.size + 7  # byte 7 of frame 1's ciphertext
        frames[at] ^= 1
        conn.sendall(frames)
    with pytest.raises(InvalidCheckpoint, match="frame 1 .* fails its authentication tag.*not loaded"):
        _fetch(FakeHolder(data, flip), tmp_path, checksum(data, CHECKSUM_ALGORITHM))
    written = _written(tmp_path)
    assert written[:bulk.FRAME] == data[:bulk.FRAME]  # frame 0 passed and was written
    assert written[bulk.FRAME:] == bytes(SIZE - bulk.FRAME)  # nothing of frame 1 on: never written


@pytest.mark.timeout(60)
def test_a_stream_cut_short_is_refused(data: bytes, tmp_path: Path) -> None:
    def cut(conn: socket.socket, key: bytes, shard: bytes) -> None:
        frames = _frames(key, shard)
        conn.sendall(frames[:len(frames) // 2])
    with pytest.raises(InvalidCheckpoint, match="ended .* bytes short of a frame.*not loaded"):
        _fetch(FakeHolder(data, cut), tmp_path, checksum(data, CHECKSUM_ALGORITHM))


@pytest.mark.timeout(60)
def test_frames_out_of_order_or_under_another_key_are_refused(data: bytes, tmp_path: Path) -> None:
    def other_key(conn: socket.socket, key: bytes, shard: bytes) -> None:
        bulk.send(conn, bulk.new_stream()[1], memoryview(shard))
    with pytest.raises(InvalidCheckpoint, match="frame 0 .* fails its authentication tag"):
        _fetch(FakeHolder(data, other_key), tmp_path, checksum(data, CHECKSUM_ALGORITHM))
    assert _written(tmp_path) == bytes(SIZE)

    def reordered(conn: socket.socket, key: bytes, shard: bytes) -> None:
        frames = _frames(key, shard)
        whole = bulk.HEADER.size + bulk.FRAME + bulk.TAG
        conn.sendall(frames[whole:2 * whole] + frames[:whole])  # frame 1 first
    (tmp_path / "shard").unlink()
    with pytest.raises(InvalidCheckpoint, match="frame 1 of .* where frame 0 of at most"):
        _fetch(FakeHolder(data, reordered), tmp_path, checksum(data, CHECKSUM_ALGORITHM))


@pytest.mark.timeout(60)
def test_bytes_that_pass_their_tags_but_not_the_origins_checksum_are_refused(data: bytes, tmp_path: Path) -> None:
    other = bytes([data[0] ^ 1]) + data[1:]  # a holder whose replica differs from what its origin held
    with pytest.raises(InvalidCheckpoint, match="fails its check .* its origin took"):
        _fetch(FakeHolder(other), tmp_path, checksum(data, CHECKSUM_ALGORITHM))
