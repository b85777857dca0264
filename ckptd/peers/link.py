"""One daemon's connection to another's peer endpoint, as its CurveZMQ client.

Used from the ``peer`` pool's one thread only (a ZeroMQ socket belongs to
one thread): streaming a shard to the buddy (``stream``), asking a peer what
it holds (``replicas``), and reading a replica back (``fetch``). Each call
waits for its answers at most ``timeout`` seconds between two of them; a
peer that does not answer in time (down, partitioned, or refusing this
daemon's key, which CURVE does by never completing the handshake) fails the
call with ``PeerUnavailable``, and the socket is made anew for the next call
so that no late answer is taken for another's.

A shard's bytes do not go over the CURVE socket, whose cipher held a stream
to 0.18-0.35 x a plain TCP socket (``benchmarks/RESULTS.md``): the peer that
serves the stream answers with a ``Ticket`` (a token and a fresh AES-256-GCM
key, over CURVE), and the bytes go as AEAD frames on a plain TCP connection to
its data port (``bulk.py``): to the buddy for a replica (``stream``), from the
holder for a restore (``fetch``, written into the file with ``pwrite``, not
through a fresh mapping, whose page faults cost more than the copy). Every
socket operation of the data connection waits at most ``timeout`` too.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from typing import Any

import zmq

from ckptd.protocol.checksums import updater
from ckptd.protocol.errors import CkptdError, DaemonUnavailable, InvalidCheckpoint, error_for_code
from ckptd.protocol.index import CHECKSUM_ALGORITHM
from ckptd.protocol.messages import MAX_MESSAGE_BYTES, Error, Message, Ok, decode
from ckptd.protocol.peer_messages import PEER_TYPES, Fetch, Forget, Offer, ReplicaList, Replicas, Seal, Ticket

from ckptd.core.keys import KeyPair, Trust
from ckptd.peers import bulk, chunks

log = logging.getLogger("ckptd")
class PeerUnavailable(DaemonUnavailable):
    """A peer did not answer in time."""


class BuildFailed(InvalidCheckpoint):
    """The buddy built a shard from a replica it held and did not hold it: its checksum differed, or what it built
    from was dropped while it did (``chunks.py``). Sent whole, it may be held."""

    def __init__(self, message: str, sent: int) -> None:
        super().__init__(message)
        self.sent = sent
        """Bytes of the shard that crossed the data port all the same."""


class PeerLink:
    """Requests to the peer at ``endpoint``, whose public key the peer keys file or the ring names (asked again
    for each call: a replacement node at the same endpoint has a key of its own)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: Trust, pair: KeyPair, timeout: float, *,
                 encrypt: bool = False) -> None:
        self.ctx, self.endpoint, self.keys, self.pair = ctx, endpoint, keys, pair
        self.encrypt = encrypt
        """This daemon's ``--peer-encrypt``: its requests ask for plain frames only without it, and a ticket for
        plain frames is refused with it."""
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

    def _ticket(self, msg: Message) -> Ticket:
        """Ask for a data stream (an offer, a fetch): the peer's ticket, refused if it sends in the clear what this
        daemon's ``--peer-encrypt`` wants encrypted (the request said so: only a peer at fault answers so)."""
        answer, _ = self._call(msg)
        if not isinstance(answer, Ticket):
            self.reset()
            raise InvalidCheckpoint(f"peer {self.endpoint} answered a {msg.type} with {answer.type}, not a ticket")
        if self.encrypt and not answer.encrypted:
            self.reset()
            raise InvalidCheckpoint(f"peer {self.endpoint} answered a {msg.type} with a ticket for plain frames; "
                                    f"this daemon runs with --peer-encrypt and asked for encrypted ones")
        return answer

    def _connect(self, ticket: Ticket) -> socket.socket:
        """The data connection of ``ticket``'s stream, its token sent; ``PeerUnavailable`` if it cannot be made."""
        host, port = bulk.data_address(self.endpoint)
        try:
            conn = socket.create_connection((host, port), timeout=self.timeout_ms / 1000)
        except OSError as exc:
            self.reset()  # the peer's answer to what follows belongs to no one
            raise PeerUnavailable(f"peer {self.endpoint}: cannot connect to its data port {port} (the peer port "
                                  f"+ 1): {exc.strerror or exc}") from None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(ticket.token)
        except OSError as exc:
            conn.close()
            self.reset()
            raise PeerUnavailable(f"peer {self.endpoint}: its data port {port} closed the connection: "
                                  f"{exc.strerror or exc}") from None
        return conn

    def stream(self, offer: Offer, data: memoryview, pace: bulk.Pacer | None = None) -> tuple[int, int]:
        """Offer one shard, send its bytes on the data port (those of the chunks the buddy does not build from a
        replica it holds, as its ticket says: ``chunks.py``), seal it; returns once the peer holds it (its checksum
        matched over every byte, sent or built): (bytes sent, bytes built there). If the data connection breaks,
        the seal's answer says why when the buddy knows (a frame it refused); a buddy that does not answer is
        ``PeerUnavailable``; a shard the buddy built that it did not hold is ``BuildFailed``."""
        nbytes = len(data)
        try:
            ticket = self._ticket(offer)
            try:
                reused = chunks.reused_of(ticket.reused, nbytes) if offer.digests else set()
                if ticket.reused and not offer.digests:
                    raise ValueError("a bitmap for an offer without digests")
            except ValueError as exc:
                self.reset()
                raise InvalidCheckpoint(f"peer {self.endpoint} answered an offer with a ticket that is no "
                                        f"plan of its shard: {exc}") from None
            conn = self._connect(ticket)
            broke: OSError | None = None
            sent = 0
            try:
                sent = bulk.send(conn, ticket.key, data, pace=pace, spans=chunks.spans(reused, nbytes) if reused
                                 else None, encrypted=ticket.encrypted)
            except OSError as exc:
                broke = exc
            finally:
                conn.close()
            try:
                answer, _ = self._call(Seal(next(self._ids), offer.id))
            except PeerUnavailable as exc:
                if broke is None:
                    raise
                raise PeerUnavailable(f"peer {self.endpoint}: the data connection broke mid-stream "
                                      f"({broke.strerror or broke}), and then: {exc}") from None
            except CkptdError as exc:
                if reused:
                    raise BuildFailed(str(exc), sent) from None
                raise
            if not isinstance(answer, Ok):
                raise InvalidCheckpoint(f"peer {self.endpoint} answered a seal with {answer.type}")
            if broke is not None:  # the buddy holds it after all?  Not without every byte: a defect if so
                raise InvalidCheckpoint(f"peer {self.endpoint} sealed a replica whose data connection broke")
            return sent, (nbytes - sum(length for _, length in chunks.spans(reused, nbytes))) if reused else 0
        except CkptdError:
            raise
        except zmq.ZMQError as exc:
            self.reset()
            raise PeerUnavailable(f"peer {self.endpoint}: {exc}") from None

    def replicate(self, shards: list[tuple[bytes, int, memoryview]], ranks: tuple[int, ...], created: float,
                  pace: bulk.Pacer | None = None, *, changed_only: bool = True) -> tuple[int, int]:
        """Stream every shard of one snapshot ((its ``Snapshot`` message, checksum, bytes)), each offered with its
        chunks' digests so the buddy builds what it holds already; (bytes sent, bytes built there). A shard the
        buddy built but did not hold (its checksum differed: a chunk of what it built from was damaged in its
        memory, or that replica was dropped meanwhile) ends that attempt there, every shard of it: the whole
        snapshot is sent again once, without digests, so nothing of it is built (``event=replica_build_failed``).
        ``changed_only`` False (``--peer-send-all``): no digests at all, every byte sent."""
        sent = built = 0
        if changed_only:
            try:
                for wire, checksum, view in shards:
                    digests = chunks.digests(view) if chunks.digestible(len(view)) else b""
                    got = self.stream(Offer(0, wire, checksum, CHECKSUM_ALGORITHM, created, ranks, digests,
                                            plain=not self.encrypt), view, pace)
                    sent, built = sent + got[0], built + got[1]
                return sent, built
            except BuildFailed as exc:
                sent += exc.sent
                log.warning("event=replica_build_failed peer=%s error=%s action=send_whole", self.endpoint, exc)
        for wire, checksum, view in shards:
            sent += self.stream(Offer(0, wire, checksum, CHECKSUM_ALGORITHM, created, ranks, plain=not self.encrypt),
                                view, pace)[0]
        return sent, 0

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
        """Read a replica's shard into the file ``into`` (a descriptor, written from offset 0) over the data port,
        checking its bytes against ``checksum`` (the origin's) as they come; ``InvalidCheckpoint`` if a frame fails
        its tag, the stream ends short, or the checksum differs. A frame is written only once its tag passed."""
        ticket = self._ticket(Fetch(next(self._ids), path, rank, plain=not self.encrypt))
        update, crc, got = updater(algorithm), 0, 0
        scratch = memoryview(bytearray(min(bulk.FRAME, max(size, 1))))
        conn = self._connect(ticket)
        try:
            for offset, piece in bulk.receive(conn, ticket.key, size, lambda _, n: scratch[:n],
                                              encrypted=ticket.encrypted):
                written = 0
                while written < len(piece):
                    written += os.pwrite(into, piece[written:], offset + written)
                crc = update(piece, crc)
                got = offset + len(piece)
        except bulk.FrameError as exc:
            raise InvalidCheckpoint(f"the replica of {path} rank {rank} on peer {self.endpoint} fails its check "
                                    f"after {got} of {size} bytes: {exc}; it is not loaded") from None
        except OSError as exc:
            raise PeerUnavailable(f"peer {self.endpoint}: the data connection of {path} rank {rank} broke after "
                                  f"{got} of {size} bytes: {exc.strerror or exc}") from None
        finally:
            conn.close()
        if crc != checksum:
            raise InvalidCheckpoint(f"the replica of {path} rank {rank} on peer {self.endpoint} fails its check "
                                    f"({got} of {size} bytes, checksum {crc:#x}, its origin took {checksum:#x}); "
                                    f"it is not loaded")

    def close(self) -> None:
        self.reset()
