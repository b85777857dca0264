"""A restore's read of a replica from a peer (``PeerLink.fetch``), against a fake peer on 127.0.0.1 speaking CURVE:
the pieces are asked for a window ahead, written in place whatever order they come in and checked end to end in
order, and a piece of the wrong length or bytes that fail the origin's checksum are refused, never taken."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

import pytest
import zmq

from ckptd.core.keys import KeyPair, Trust
from ckptd.peers.link import FETCH_PIECE, FETCH_WINDOW, PeerLink
from ckptd.protocol.checksums import checksum
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CHECKSUM_ALGORITHM
from ckptd.protocol.peer_messages import PEER_TYPES, Fetch, Piece
from ckptd.protocol.messages import decode

SIZE = FETCH_PIECE * (FETCH_WINDOW + 2) + 12345
"""More pieces than the window holds, the last one short."""

Answer = Callable[[Fetch, bytes], bytes]


class FakePeer:
    """A CURVE ROUTER that answers every ``Fetch`` with ``answer(fetch, the bytes asked for)``; it takes the requests
    a window at a time (until the client waits 0.2 s) and answers each window last first, and records the most it
    saw asked at once."""

    def __init__(self, data: bytes, answer: Answer = lambda _, piece: piece) -> None:
        self.data, self.answer, self.most_asked = data, answer, 0
        self.public, secret = zmq.curve_keypair()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = self.public, secret
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            asked = []
            while len(asked) < FETCH_WINDOW and self.sock.poll(200):  # what the client asks for before it waits
                ident, frame = self.sock.recv_multipart()
                asked.append((ident, decode(frame, PEER_TYPES)))
            self.most_asked = max(self.most_asked, len(asked))
            for ident, msg in reversed(asked):
                assert isinstance(msg, Fetch)
                piece = self.answer(msg, self.data[msg.offset:msg.offset + msg.length])
                self.sock.send_multipart([ident, Piece(msg.id, msg.offset).to_wire(), piece])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close(0)
        self.ctx.term()


def _fetch(peer: FakePeer, tmp_path: Path, expected: int) -> bytes:
    trust = Trust(None)
    trust.set_ring((peer.endpoint,), (peer.public.decode(),))
    ctx = zmq.Context()
    link = PeerLink(ctx, peer.endpoint, trust, KeyPair.of(tmp_path / "run"), timeout=30)
    fd = os.open(tmp_path / "shard", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        link.fetch("/ckpt/step-1", 0, SIZE, expected, CHECKSUM_ALGORITHM, fd)
        return os.pread(fd, SIZE + 1, 0)
    finally:
        os.close(fd)
        link.close()
        ctx.term()


@pytest.fixture
def data() -> bytes:
    return os.urandom(SIZE)


@pytest.mark.timeout(60)
def test_pieces_answered_out_of_order_are_written_in_place_and_asked_for_a_window_ahead(
        data: bytes, tmp_path: Path) -> None:
    peer = FakePeer(data)
    try:
        assert _fetch(peer, tmp_path, checksum(data, CHECKSUM_ALGORITHM)) == data
        assert peer.most_asked == FETCH_WINDOW  # the next pieces were asked for before the first came back
    finally:
        peer.close()


@pytest.mark.timeout(60)
def test_bytes_that_fail_the_origins_checksum_are_refused(data: bytes, tmp_path: Path) -> None:
    def flip(msg: Fetch, piece: bytes) -> bytes:
        return piece if msg.offset != FETCH_PIECE else bytes([piece[0] ^ 1]) + piece[1:]
    peer = FakePeer(data, flip)
    try:
        with pytest.raises(InvalidCheckpoint, match="fails its check"):
            _fetch(peer, tmp_path, checksum(data, CHECKSUM_ALGORITHM))
    finally:
        peer.close()


@pytest.mark.timeout(60)
def test_a_piece_of_another_length_than_asked_is_refused_before_it_is_written(data: bytes, tmp_path: Path) -> None:
    peer = FakePeer(data, lambda msg, piece: piece + b"x" if msg.offset == 0 else piece)
    try:
        with pytest.raises(InvalidCheckpoint, match="not the 2097152 asked for"):
            _fetch(peer, tmp_path, checksum(data, CHECKSUM_ALGORITHM))
        assert os.path.getsize(tmp_path / "shard") == SIZE  # nothing was written past the shard's end
    finally:
        peer.close()
