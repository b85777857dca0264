"""The peer endpoint: a CurveZMQ ROUTER socket for other nodes' daemons only (``--peer-listen``).

Off unless ``--peer-listen tcp://HOST:PORT`` is given: without it the daemon
opens no TCP port. The socket is a CURVE server with this daemon's key pair
(``keys.KeyPair``); pyzmq's ZAP authenticator asks ``keys.Trust`` (the keys file's and the ring's) about
every connecting key, so a peer whose key is not trusted is refused in the
handshake, before any message of it reaches the loop. What comes through is
decoded against the peer protocol only (``protocol/peer_messages.py``) and
answered like a local request: any exception becomes an ``Error`` reply
through ``replies.error_reply``, and no message can take the daemon down.

The loop thread polls this socket beside the local one; the bytes of
replicas move on the ``replica`` pool (``replicas.ReplicaBook``).
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ckptd.protocol.errors import BadMessage
from ckptd.protocol.messages import MAX_MESSAGE_BYTES, Message, decode, request_id
from ckptd.protocol.peer_messages import PEER_TYPES, Chunk, Fetch, Forget, Offer, Replicas, Seal

from ckptd.core.replies import error_reply
from ckptd.core.stats import Stats
from ckptd.core.keys import KeyPair, Trust
from ckptd.peers.replicas import ReplicaBook

log = logging.getLogger("ckptd")
ZAP_DOMAIN = "ckptd-peers"


class PeerEndpoint:
    """Serve other daemons: offers, chunks and seals of replicas, listings, and fetches of them."""

    def __init__(self, ctx: zmq.Context, listen: str, pair: KeyPair, keys: Trust, book: ReplicaBook,
                 stats: Stats) -> None:
        self.book, self.stats = book, stats
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("ckptd.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=keys)
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.curve_server = True
        self.socket.curve_publickey, self.socket.curve_secretkey = pair.public, pair.secret
        self.socket.zap_domain = ZAP_DOMAIN.encode()
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(listen)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"--peer-listen {listen}: cannot listen there: {exc}") from None
        self.listen = listen
        log.info("event=peer_listen endpoint=%s", listen)

    def drain(self) -> None:
        """Handle every message waiting on the socket (the loop thread)."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            if len(frames) not in (2, 3):
                self._send(ident, error_reply(self.stats, 0, BadMessage(
                    f"a peer message is one frame and, for a chunk, its bytes: got {len(frames) - 1} frames")))
                continue
            origin = frames[1].get("User-Id") or ident.hex()
            data = frames[2].buffer if len(frames) == 3 else None
            self._handle(ident, origin, frames[1].bytes, data)

    def _handle(self, ident: bytes, origin: str, payload: bytes, data: memoryview | None) -> None:
        rid = 0

        def reply(msg: Message, extra: Any = None) -> None:
            self._send(ident, msg, extra)
        try:
            msg = decode(payload, PEER_TYPES)
            rid = msg.id
            if (data is not None) != isinstance(msg, Chunk):
                raise BadMessage(f"{msg.type}: {'unexpected bytes frame' if data is not None else 'no bytes frame'}")
            if isinstance(msg, Offer):
                self.book.offer(ident, origin, msg, reply)
            elif isinstance(msg, Chunk):
                assert data is not None
                self.book.chunk(ident, msg, data, reply)
            elif isinstance(msg, Seal):
                self.book.seal(ident, msg, reply)
            elif isinstance(msg, Forget):
                reply(self.book.forget(origin, msg))
            elif isinstance(msg, Replicas):
                reply(self.book.listing(msg.id))
            elif isinstance(msg, Fetch):
                self.book.fetch(msg, reply)
            else:
                raise BadMessage(f"{msg.type!r} is a reply; a peer does not send it as a request")
        except Exception as exc:  # a peer's mistake, or a bug: answered, never fatal
            self._send(ident, error_reply(self.stats, rid or request_id(payload), exc))

    def _send(self, ident: bytes, msg: Message, data: Any = None) -> None:
        frames = [ident, msg.to_wire()] + ([data] if data is not None else [])
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # the peer went: it times out and tries again
            log.warning("event=peer_reply_dropped type=%s error=%s", msg.type, exc)

    def close(self) -> None:
        self.socket.close(0)
        self.auth.stop()
