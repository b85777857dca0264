"""A loopback TCP proxy a test can cut: an endpoint outage between a daemon and its object store.

Stopping the S3 server (``tests/s3server.py``) takes the endpoint away for every
process at once, the test's own checks included; this proxy stands between the
daemon and the server instead, so the test decides when the daemon's uploads see
an outage while it keeps reading the bucket directly. It listens on 127.0.0.1
only, and it stops by itself after ``lifetime`` seconds, so a test that forgets
it leaves no thread serving for long.

Between two daemons' peer endpoints it stands for the link: ``peer=True`` listens on two adjacent ports and
forwards them to the target's peer port and its data port (port + 1, ``ckptd/peers/bulk.py``), so an outage or a
stall hits both, and ``flip_data_byte`` alters one byte of the next data connection on its way.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from types import TracebackType

BUFFER = 256 * 1024
"""Bytes moved per read: large enough that a multipart upload is not syscall-bound."""


class TcpProxy:
    """Forwards connections from ``127.0.0.1:port`` to ``target_host:target_port`` until cut.

    ``cut()`` resets every open connection and every new one (a peer sees "connection reset", as when an
    endpoint goes away); ``restore()`` forwards again; ``close()`` stops listening."""

    def __init__(self, target_host: str, target_port: int, *, lifetime: float = 3600.0, peer: bool = False) -> None:
        self.target = (target_host, target_port)
        self._listeners = _adjacent(2) if peer else [socket.create_server(("127.0.0.1", 0))]
        for listener in self._listeners:
            listener.settimeout(0.2)
        self._listener = self._listeners[0]
        self.port: int = self._listener.getsockname()[1]
        self._flip: int | None = None
        """Where the next data connection's byte is flipped (``flip_data_byte``), counted from its first byte."""
        self.flipped = threading.Event()
        self.data_seen = bytearray()
        """Every byte the data connections carried towards the target (what a wiretap on the link would see)."""
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self.refuse_data = False
        """Reset every new data connection (the peer port + 1) while the peer port forwards: a firewall that opened
        only the peer port."""
        self._budget: int | None = None
        """Bytes still forwarded towards the target before a cut or a stall; None: no limit."""
        self._stall = False
        self._flowing = threading.Event()
        self._flowing.set()
        self.stalled = threading.Event()
        """Set once ``stall_after``'s bytes went through and the stream is held."""
        self._closed = threading.Event()
        self._deadline = time.monotonic() + lifetime
        self.connections = 0
        """Connections accepted while forwarding (a test can see that traffic went through)."""
        self.resets = 0
        """Connections reset by ``cut()`` or refused while cut (a test can see that the outage was met)."""
        for index, listener in enumerate(self._listeners):
            threading.Thread(target=self._accept, args=(listener, index), name=f"proxy-{self.port + index}",
                             daemon=True).start()

    @property
    def url(self) -> str:
        """The endpoint as clients reach it through the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Reset every connection, and every new one until ``restore()``."""
        with self._lock:
            self._cut = True
            doomed, self._open = self._open, set()
            self.resets += len(doomed) // 2  # each connection is two sockets
        for s in doomed:
            _reset(s)

    def cut_after(self, nbytes: int) -> None:
        """Forward ``nbytes`` more towards the target, then ``cut()``: an outage in the middle of a stream, at a
        point the test chose rather than a moment it raced for."""
        with self._lock:
            self._budget, self._stall = nbytes, False

    def stall_after(self, nbytes: int) -> None:
        """Forward ``nbytes`` more towards the target, then hold what comes (the sender's buffers fill; nothing is
        reset) until ``restore()``: a stream held at a point the test chose (``stalled`` is set once it is)."""
        with self._lock:
            self._budget, self._stall = nbytes, True
            self.stalled.clear()

    def flip_data_byte(self, at: int) -> None:
        """Flip the lowest bit of byte ``at`` of the next data connection towards the target (its token is bytes
        0-15), once; ``flipped`` is set when it went through."""
        with self._lock:
            self._flip = at
            self.flipped.clear()

    def restore(self) -> None:
        with self._lock:
            self._cut = False
            self._budget = None
        self._flowing.set()

    @property
    def is_cut(self) -> bool:
        return self._cut

    def close(self) -> None:
        self._closed.set()
        self.cut()
        for listener in self._listeners:
            listener.close()

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _accept(self, listener: socket.socket, index: int) -> None:
        while not self._closed.is_set() and time.monotonic() < self._deadline:
            try:
                conn, _ = listener.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                cut = self._cut or (index == 1 and self.refuse_data)
            if cut:
                with self._lock:
                    self.resets += 1
                _reset(conn)
                continue
            try:
                upstream = socket.create_connection((self.target[0], self.target[1] + index), timeout=5)
            except OSError:
                _reset(conn)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._cut:  # cut while connecting
                    _reset(conn)
                    _reset(upstream)
                    continue
                self._open |= {conn, upstream}
                self.connections += 1
                flip, self._flip = (self._flip, None) if index == 1 else (None, self._flip)
            ends = [0]  # directions of this connection that ended by their sender closing it
            for a, b, towards_target in ((conn, upstream, True), (upstream, conn, False)):
                threading.Thread(target=self._pump, args=(a, b, towards_target, flip if towards_target else None,
                                                          towards_target and index == 1, ends), daemon=True).start()
        self._closed.set()
        self.cut()

    def _pump(self, src: socket.socket, dst: socket.socket, towards_target: bool, flip: int | None,
              record: bool, ends: list[int]) -> None:
        """Copy one direction until its sender closes it (passed on as a close, the bytes before it delivered: a
        reset would discard what the receiver has not read yet) or either side fails (both reset). ``flip``: the
        byte whose lowest bit is flipped on the way; ``record``: what passes is kept in ``data_seen``."""
        seen = 0
        try:
            while True:
                data = src.recv(BUFFER)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    with self._lock:
                        ends[0] += 1
                        if ends[0] < 2:
                            return  # the other direction goes on
                        self._open.discard(src)
                        self._open.discard(dst)
                    src.close()
                    dst.close()
                    return
                if flip is not None and seen <= flip < seen + len(data):
                    data = data[:flip - seen] + bytes([data[flip - seen] ^ 1]) + data[flip - seen + 1:]
                    self.flipped.set()
                seen += len(data)
                if record:
                    with self._lock:
                        self.data_seen += data
                if towards_target and self._spend(len(data)):
                    if not self._stall:
                        self.cut()
                        break
                    self.stalled.set()
                    while not self._flowing.wait(0.2):
                        if self._closed.is_set():
                            return
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open.discard(src)
            self._open.discard(dst)
        for s in (src, dst):
            _reset(s)


    def _spend(self, nbytes: int) -> bool:
        """Count ``nbytes`` against ``cut_after``'s budget; True once it is spent (the bytes are not sent)."""
        with self._lock:
            if self._budget is None:
                return False
            if nbytes > self._budget:
                self._budget = None
                if self._stall:
                    self._flowing.clear()
                return True
            self._budget -= nbytes
            return False


def _reset(s: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), so the peer fails at once instead of waiting on a half-closed stream."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def _adjacent(count: int) -> list[socket.socket]:
    """Listeners on ``count`` adjacent ports of 127.0.0.1, below the ephemeral range (``helpers.free_port``'s)."""
    pick = random.SystemRandom()
    while True:
        first, listeners = pick.randrange(20000, 32768 - count), []
        try:
            for port in range(first, first + count):
                listeners.append(socket.create_server(("127.0.0.1", port)))
            return listeners
        except OSError:
            for listener in listeners:
                listener.close()
