"""One daemon's connection to another's peer endpoint, as its CurveZMQ client.

Used from the ``peer`` pool's one thread only (a ZeroMQ socket belongs to
one thread): streaming a shard to the buddy (``stream``), asking a peer what
it holds (``replicas``), and reading a replica back (``fetch``). Each call
waits for its answers at most ``timeout`` seconds between two of them; a
peer that does not answer in time (down, partitioned, or refusing this
daemon's key, which CURVE does by never completing the handshake) fails the
call with ``PeerUnavailable``, and the socket is made anew for the next call
so that no late answer is taken for another's.

A shard streams in ``MAX_PIECE`` chunks with ``WINDOW`` of them unanswered
at most: the buddy answers each once written, so neither side holds more
than the window in memory, and the link runs at the slower of the two
memcpys and the network.

A replica is read back (``fetch``) in ``FETCH_PIECE`` pieces with
``FETCH_WINDOW`` asked for and not yet arrived: small enough that the
buddy's CURVE encryption of one piece, its decryption here and the write
and checksum of the one before run at once (each end's ZeroMQ I/O thread
ciphers a whole message before the next step sees any of it), and each
piece is written into the file with ``pwrite``, not through a fresh
mapping, whose page faults cost more than the copy (docs/memory.md,
issue 40).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import zmq

from ckptd.protocol.checksums import updater
from ckptd.protocol.errors import CkptdError, DaemonUnavailable, InvalidCheckpoint, error_for_code
from ckptd.protocol.messages import MAX_MESSAGE_BYTES, Error, Message, Ok, decode
from ckptd.protocol.peer_messages import (
    MAX_PIECE, PEER_TYPES, Chunk, Fetch, Forget, Offer, Piece, ReplicaList, Replicas, Seal,
)

from ckptd.core.keys import KeyPair, Trust

log = logging.getLogger("ckptd")
WINDOW = 4
"""Chunks sent and not yet answered, at most."""
FETCH_PIECE = 2 * 1024 * 1024
"""Bytes a restore asks for in one ``Fetch``: a piece the two ends' ciphers and the write here work on at once.
Measured restoring 30 MiB between two daemons on one loaded two-core machine (load 14, medians of 6, the file's
pages mapped ahead in each): the fetch took 139 ms in 16 MiB pieces (4 ahead), 73 ms in 2 MiB (8 ahead), 100 ms
in 1 MiB (16 ahead); the whole profile is in benchmarks/RESULTS.md."""
FETCH_WINDOW = 8
"""Pieces of a restore asked for and not yet arrived, at most (16 MiB in flight)."""


class PeerUnavailable(DaemonUnavailable):
    """A peer did not answer in time."""


class PeerLink:
    """Requests to the peer at ``endpoint``, whose public key the peer keys file or the ring names (asked again
    for each call: a replacement node at the same endpoint has a key of its own)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: Trust, pair: KeyPair, timeout: float) -> None:
        self.ctx, self.endpoint, self.keys, self.pair = ctx, endpoint, keys, pair
        self.timeout_ms = int(timeout * 1000)
        self._socket: zmq.Socket | None = None
        self._server_key = b""
        self._ids = itertools.count(1)

    def _sock(self) -> zmq.Socket:
        """The socket, made anew when the keys file or the ring names another key for the peer (a replacement node at the
        same endpoint: a socket made for the old key would never complete its handshake)."""
        try:
            server_key = self.keys.key_for(self.endpoint)
        except (OSError, ValueError) as exc:
            raise PeerUnavailable(f"peer {self.endpoint}: no key to reach it: {exc}") from None
        if self._socket is not None and server_key != self._server_key:
            self.reset()
        if self._socket is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.curve_serverkey = self._server_key = server_key
            sock.curve_publickey, sock.curve_secretkey = self.pair.public, self.pair.secret
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.connect(self.endpoint)
            self._socket = sock
        return self._socket

    def reset(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def _send(self, msg: Message, data: Any = None) -> None:
        try:
            self._sock().send_multipart([msg.to_wire(), *([data] if data is not None else [])], copy=False)
        except zmq.Again:
            self.reset()
            raise PeerUnavailable(f"peer {self.endpoint} takes nothing (down, or it does not trust this "
                                  f"daemon's key)") from None

    def _answer(self) -> tuple[Message, memoryview | None]:
        """The next answer; ``PeerUnavailable`` after ``timeout`` without one, or the peer's error raised."""
        sock = self._socket
        if sock is None:
            raise PeerUnavailable(f"peer {self.endpoint}: the link was reset while a call waited")
        if not sock.poll(self.timeout_ms, zmq.POLLIN):
            self.reset()
            raise PeerUnavailable(f"peer {self.endpoint} did not answer within {self.timeout_ms / 1000:g} s (down, "
                                  f"partitioned, or it does not trust this daemon's key)")
        frames = sock.recv_multipart(copy=False)
        msg = decode(frames[0].bytes, PEER_TYPES)
        if isinstance(msg, Error):
            self.reset()  # answers still in flight for this call belong to no one
            raise error_for_code(msg.code, f"peer {self.endpoint}: {msg.message}")
        return msg, (frames[1].buffer if len(frames) > 1 else None)

    def _call(self, msg: Message) -> tuple[Message, memoryview | None]:
        self._send(msg)
        while True:
            answer, data = self._answer()
            if answer.id == msg.id:
                return answer, data

    def stream(self, offer: Offer, data: memoryview) -> None:
        """Offer one shard, send its bytes, seal it; returns once the peer holds it (its checksum matched)."""
        try:
            self._call(offer)
            unanswered: set[int] = set()
            for offset in range(0, len(data), MAX_PIECE):
                while len(unanswered) >= WINDOW:
                    unanswered.discard(self._answer()[0].id)
                chunk = Chunk(next(self._ids), offer.id, offset)
                self._send(chunk, data[offset:offset + MAX_PIECE])
                unanswered.add(chunk.id)
            while unanswered:
                unanswered.discard(self._answer()[0].id)
            answer, _ = self._call(Seal(next(self._ids), offer.id))
            if not isinstance(answer, Ok):
                raise InvalidCheckpoint(f"peer {self.endpoint} answered a seal with {answer.type}")
        except CkptdError:
            raise
        except zmq.ZMQError as exc:
            self.reset()
            raise PeerUnavailable(f"peer {self.endpoint}: {exc}") from None

    def forget(self, path: str, ranks: tuple[int, ...]) -> None:
        """Tell the peer this daemon let its snapshot of ``path`` (of ``ranks``) go for good: it drops its replica."""
        self._call(Forget(next(self._ids), path, ranks))

    def replicas(self) -> list[dict[str, Any]]:
        """The complete replicas the peer holds."""
        answer, _ = self._call(Replicas(next(self._ids)))
        if not isinstance(answer, ReplicaList):
            raise InvalidCheckpoint(f"peer {self.endpoint} answered a listing with {answer.type}")
        return list(answer.replicas)

    def fetch(self, path: str, rank: int, size: int, checksum: int, algorithm: str, into: int) -> None:
        """Read a replica's shard into the file ``into`` (a descriptor, written from offset 0), checking its bytes
        against ``checksum`` (the origin's) as they come; ``InvalidCheckpoint`` if they differ. The pieces are
        asked for ``FETCH_WINDOW`` ahead, so the buddy always has the next ones to send."""
        update, crc = updater(algorithm), 0
        offsets = iter(range(0, size, FETCH_PIECE))
        pending: dict[int, int] = {}
        arrived: dict[int, memoryview] = {}
        next_offset = 0
        while True:
            while len(pending) < FETCH_WINDOW and (ask := next(offsets, None)) is not None:
                req = Fetch(next(self._ids), path, rank, ask, min(FETCH_PIECE, size - ask))
                self._send(req)
                pending[req.id] = ask
            if not pending:
                break
            answer, data = self._answer()
            if answer.id not in pending or not isinstance(answer, Piece) or data is None:
                continue
            offset = pending.pop(answer.id)
            if len(data) != min(FETCH_PIECE, size - offset):
                self.reset()  # the pieces still in flight belong to no one
                raise InvalidCheckpoint(f"peer {self.endpoint} answered a fetch of {path} rank {rank} at {offset} "
                                        f"with {len(data)} bytes, not the {min(FETCH_PIECE, size - offset)} asked for")
            arrived[offset] = data
            while next_offset in arrived:  # checksummed in order, whatever order the pieces come in
                piece = arrived.pop(next_offset)
                written = 0
                while written < len(piece):
                    written += os.pwrite(into, piece[written:], next_offset + written)
                crc = update(piece, crc)
                next_offset += len(piece)
        if next_offset != size or crc != checksum:
            raise InvalidCheckpoint(f"the replica of {path} rank {rank} on peer {self.endpoint} fails its check "
                                    f"({next_offset} of {size} bytes, checksum {crc:#x}, its origin took "
                                    f"{checksum:#x}); it is not loaded")

    def close(self) -> None:
        self.reset()
