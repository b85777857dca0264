"""The data port: the plain TCP listener beside the peer endpoint that carries shards' bytes (``bulk.py``).

It takes a connection only for a stream the CURVE control channel announced
(``announce``: a ``Ticket`` the peer received, authenticated): the first 16
bytes must be that stream's token, each token is good for one connection, and
a connection with any other token (or none within the peer timeout) is closed
before anything more of it is read. The token is also what binds the
connection to the peer that was authenticated: nothing else on the data port
is trusted.

Each connection runs on a thread of its own (``MAX_CONNECTIONS`` at most;
one more is closed at once), so a slow or stalled peer holds only its own
stream. What a stream does with its bytes (write a replica's shard, send one
back) is the ``Transfer``'s ``run``; how it ended reaches the loop thread
through ``call_soon``, as the pools' results do. A stream whose connection
never comes is ended by ``expire`` after the peer timeout; one that must stop
(its replica dropped) is cancelled: its connection is shut down and the
cancel returns once its thread has let go of the shard's memory.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptd.protocol.errors import CkptdError

from ckptd.core.config import peer_listen_named
from ckptd.peers.bulk import TOKEN_BYTES, FrameError, data_address, new_stream, recv_exact

log = logging.getLogger("ckptd")
MAX_CONNECTIONS = 64
"""Data connections served at once; one more is closed without a byte read (a flood cannot take every thread)."""


class StreamEnded(Exception):
    """How a stream on the data port failed, said in words (its cause's traceback is let go at once: it held the
    shard's memory)."""


@dataclass(eq=False)
class Transfer:
    """One stream announced to a peer: ``run(connection)`` does its work on the connection's thread once the token
    came; ``ended(error, result)`` runs on the loop thread after it (error None: it ran to its end)."""

    token: bytes
    key: bytes
    run: Callable[[socket.socket], Any]
    ended: Callable[[StreamEnded | None, Any], None]
    what: str
    """What it carries, for the log (``replica of /ckpt/step-5 rank 0``)."""
    announced: float = field(default_factory=time.monotonic)
    state: str = "waiting"
    """``waiting`` for its connection, ``running`` on it, ``ended``."""
    conn: socket.socket | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    cancelled: str = ""


class DataServer:
    """The data port of the peer endpoint ``listen`` (its port + 1)."""

    def __init__(self, listen: str, timeout: float, call_soon: Callable[[Callable[[], None]], None]) -> None:
        host, port = data_address(listen)
        try:
            self.listener = socket.create_server((host, port), backlog=MAX_CONNECTIONS)
        except OSError as exc:
            raise CkptdError(f"{peer_listen_named(listen)} {listen}: cannot open its data port {port} (the peer port "
                             f"+ 1, which carries the replicas' bytes): {exc.strerror or exc}") from None
        self.port, self.timeout, self.call_soon = port, timeout, call_soon
        self._lock = threading.Lock()
        self._waiting: dict[bytes, Transfer] = {}
        self._running: set[Transfer] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ckptd-data", daemon=True)
        self._thread.start()
        log.info("event=peer_data_listen port=%d", port)

    def announce(self, run: Callable[[socket.socket], Any], ended: Callable[[StreamEnded | None, Any], None],
                 what: str) -> Transfer:
        """A new stream, its token and key fresh; its connection is awaited from now."""
        token, key = new_stream()
        transfer = Transfer(token, key, run, ended, what)
        with self._lock:
            self._waiting[token] = transfer
        return transfer

    def cancel(self, transfer: Transfer, why: str) -> None:
        """Stop ``transfer`` (any thread): not taken if it still waits, its connection shut down if it runs, and
        back only once its thread has let go of what it read or wrote. Its ``ended`` runs after, with ``why``."""
        with self._lock:
            transfer.cancelled = why
            waiting = self._waiting.pop(transfer.token, None) is transfer
            conn = transfer.conn
        if waiting:
            self._end(transfer, StreamEnded(why), None)
            return
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if transfer.state == "running" and not transfer.finished.wait(self.timeout):
            log.error("event=peer_data_cancel_stuck stream=%s", transfer.what)

    def expire(self, now: float) -> None:
        """End the streams whose connection did not come within the peer timeout (on the loop's housekeeping)."""
        with self._lock:
            late = [t for t in self._waiting.values() if now - t.announced > self.timeout]
            for transfer in late:
                del self._waiting[transfer.token]
        for transfer in late:
            log.warning("event=peer_data_missing stream=%s timeout_s=%g", transfer.what, self.timeout)
            self._end(transfer, StreamEnded(f"its data connection did not come within {self.timeout:g} s "
                                            f"(port {self.port})"), None)

    def _end(self, transfer: Transfer, error: StreamEnded | None, result: Any) -> None:
        transfer.state = "ended"
        transfer.finished.set()
        if not self._closed:  # else the loop is gone, and the book closes every shard itself
            self.call_soon(lambda: transfer.ended(error, result))

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors, or the like: try again
                continue
            if not self._slots.acquire(blocking=False):
                log.warning("event=peer_data_refused peer=%s reason=too_many_connections", peer[0])
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer[0]), name="ckptd-data-stream",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.settimeout(self.timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            token = bytearray(TOKEN_BYTES)
            try:
                recv_exact(conn, memoryview(token))
            except (OSError, FrameError) as exc:
                log.warning("event=peer_data_refused peer=%s reason=no_token error=%s", peer, exc)
                return
            with self._lock:
                transfer = self._waiting.pop(bytes(token), None)
                if transfer is not None:
                    transfer.state, transfer.conn = "running", conn
                    self._running.add(transfer)
            if transfer is None:
                log.warning("event=peer_data_refused peer=%s reason=unknown_token", peer)
                return
            error, result = None, None
            try:
                result = transfer.run(conn)
            except Exception as exc:  # the stream's failure, never the daemon's
                error = StreamEnded(transfer.cancelled or _words(exc))
                traceback.clear_frames(exc.__traceback__)  # its frames held views of the shard's memory
                del exc
            with self._lock:
                self._running.discard(transfer)
                transfer.conn = None
            self._end(transfer, error, result)
        finally:
            conn.close()
            self._slots.release()

    def close(self) -> None:
        """Stop listening and cancel every stream (the daemon exits)."""
        self._closed = True
        self.listener.close()  # (the accept thread sees it closed and ends)
        with self._lock:
            every = [*self._waiting.values(), *self._running]
        for transfer in every:
            self.cancel(transfer, "the daemon is stopping")


def _words(exc: BaseException) -> str:
    if isinstance(exc, FrameError):
        return str(exc)
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "its peer sent nothing for the peer timeout"
    if isinstance(exc, OSError):
        return f"its connection broke ({exc.strerror or exc})"
    return f"{type(exc).__name__}: {exc}"
