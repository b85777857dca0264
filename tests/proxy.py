"""An outage a test controls: a TCP proxy on loopback in front of an endpoint (the S3 server).

``cut()`` closes every open connection and refuses new ones (connections are
accepted and closed at once, as a stopped endpoint's host answers), so the
client sees the endpoint go away mid-request; ``restore()`` lets
connections through again. Bounded: a few threads per connection, loopback
only, and every thread ends when ``close()`` is called or the test process
ends (daemon threads).
"""

from __future__ import annotations

import socket
import threading
from typing import Any

BUFFER = 64 * 1024


class TcpProxy:
    """127.0.0.1:``port`` forwarding to ``target_host``:``target_port`` until ``cut()``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """The outage: close every connection now, and every new one as soon as it is accepted."""
        with self._lock:
            self._cut = True
            doomed, self._open = self._open, set()
        for sock in doomed:
            _shut(sock)

    def restore(self) -> None:
        """The end of the outage: new connections go through again."""
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._thread.join(5)
        self._listener.close()

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._lock:
                cut = self._cut
            if cut:
                _shut(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _shut(client)
                continue
            with self._lock:
                if self._cut:  # cut while connecting
                    _shut(client)
                    _shut(upstream)
                    continue
                self._open |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), name="tcp-proxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(BUFFER)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open.discard(src)
            self._open.discard(dst)
        _shut(src)
        _shut(dst)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
