"""The peer endpoint: a CurveZMQ ROUTER socket for other nodes' daemons only (``--peer-listen``).

Off unless ``--peer-listen tcp://HOST:PORT`` is given: without it the daemon
opens no TCP port. The socket is a CURVE server with this daemon's key pair
(``keys.KeyPair``); pyzmq's ZAP authenticator asks ``keys.Trust`` (the keys file's and the ring's) about
every connecting key, so a peer whose key is not trusted is refused in the
handshake, before any message of it reaches the loop. What comes through is
decoded against the peer protocol only (``protocol/peer_messages.py``) and
served as a local request is (``core/dispatch.py``): any exception becomes an
``Error`` reply through ``replies.error_reply``, and no message can take the
daemon down.

The loop thread polls this socket beside the local one. The bytes of
replicas do not come through it: they move on the data port beside it (the
peer port + 1, ``data.py``), on a stream a ``Ticket`` sent here announced.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ckptd.protocol.errors import CkptdError
from ckptd.protocol.messages import MAX_MESSAGE_BYTES, Message
from ckptd.protocol.peer_messages import PEER_TYPES, Fetch, Forget, Offer, Replicas, Seal

from ckptd.core.config import peer_listen_named
from ckptd.core.dispatch import Dispatch, Sender
from ckptd.core.keys import KeyPair, Trust
from ckptd.core.stats import Stats
from ckptd.peers.data import DataServer
from ckptd.peers.replicas import ReplicaBook

log = logging.getLogger("ckptd")
ZAP_DOMAIN = "ckptd-peers"


class PeerEndpoint:
    """Serve other daemons: offers and seals of replicas, listings, and fetches of them; and the data port their
    bytes take."""

    def __init__(self, ctx: zmq.Context, listen: str, pair: KeyPair, keys: Trust, book: ReplicaBook,
                 stats: Stats, timeout: float) -> None:
        """``timeout``: seconds a data connection may stay silent, or not come (``--peer-timeout``)."""
        self.book, self.stats = book, stats
        self.data: DataServer | None = None
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
            # the machine's state, not the option's form (``DaemonConfig`` checks that): exit 3, as a metrics port
            raise CkptdError(f"{peer_listen_named(listen)} {listen}: cannot listen there: {exc}") from None
        try:
            self.data = book.data = DataServer(listen, timeout, book.workers.call_soon)
        except CkptdError:
            self.close()
            raise
        self.listen = listen
        self.dispatch = Dispatch(self.socket, stats, self._handlers(), types=PEER_TYPES,
                                 authenticated=True, refusal="a peer does not send it as a request",
                                 event="peer_reply_dropped")
        log.info("event=peer_listen endpoint=%s", listen)

    def drain(self) -> None:
        """Handle every message waiting on the socket (the loop thread)."""
        self.dispatch.drain()

    def _handlers(self) -> dict[type[Message], Any]:
        """The peer requests, by type: what a replica's stream, listing, read-back and forgetting do."""
        book = self.book

        def reply(sender: Sender) -> Any:
            return lambda msg, data=None: self.dispatch.send(sender.ident, msg, data)
        return {
            Offer: lambda s, m: book.offer(s.ident, s.origin, m, reply(s)),
            Seal: lambda s, m: book.seal(s.ident, m, reply(s)),
            Forget: lambda s, m: book.forget(s.origin, m),
            Replicas: lambda s, m: book.listing(m.id),
            Fetch: lambda s, m: book.fetch(m, reply(s)),
        }

    def close(self) -> None:
        if self.data is not None:
            self.data.close()
        self.socket.close(0)
        self.auth.stop()
