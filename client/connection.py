"""The client's link to its node's daemon: one I/O thread owns the socket.

ZeroMQ sockets are not thread-safe, so callers never touch the DEALER.
``request`` puts a message on a queue, pokes an eventfd, and returns a
``Future`` that the I/O thread resolves with the final reply. While
requests are pending the thread sends heartbeats; if the daemon's process
disappears or it stays silent past ``timeout``, every pending future fails
with ``DaemonUnavailable`` instead of hanging the training loop.

If the daemon restarted (it answers ``UNKNOWN_CLIENT``), the thread says
hello again and resends the request once.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from ckptd.protocol import __version__
from ckptd.protocol.errors import DaemonUnavailable, ErrorCode, error_for_code
from ckptd.protocol.messages import Accepted, Error, Hello, Message, Ping, Welcome, decode
from ckptd.protocol.processes import pid_alive

log = logging.getLogger("ckptd.client")


@dataclass
class _Pending:
    wire: bytes
    future: Future
    accepted: Future | None = None
    resend: Message | None = None
    """What to send a restarted daemon instead of ``wire`` (a commit with its whole tensor table)."""
    retried: bool = False
    sent_at: float = field(default_factory=time.monotonic)


class Connection:
    """A DEALER connection to the daemon, driven by a private thread."""

    def __init__(self, endpoint: str, *, heartbeat: float, timeout: float, rank: int = 0, world_size: int = 1,
                 job: str = "") -> None:
        self.endpoint = endpoint
        self.heartbeat = heartbeat
        self.timeout = timeout
        self._hello = Hello(0, os.getpid(), os.getuid(), __version__, rank, world_size, job)
        """The one hello of this connection: sent by ``introduce`` and again to a restarted daemon."""
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue[tuple[int, bytes, _Pending | None]] = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closing = threading.Event()
        self.daemon_pid: int | None = None
        self.lost: DaemonUnavailable | None = None
        self._thread = threading.Thread(target=self._run, name="ckptd-client-io", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        return next(self._ids)

    def _numbered_hello(self) -> Hello:
        return dataclasses.replace(self._hello, id=self.next_id())

    def introduce(self) -> Welcome:
        """Say hello and wait for the daemon's Welcome."""
        welcome = self.call(self._numbered_hello())
        assert isinstance(welcome, Welcome)
        return welcome

    def request(self, msg: Message, *, accepted: Future | None = None, resend: Message | None = None) -> Future:
        """Send ``msg``; the future resolves with the final reply or fails typed.

        ``accepted`` (for commits) resolves when the daemon admits the request.
        ``resend``: what a restarted daemon gets instead (it knows none of the
        layouts a commit may name by digest).
        The message is encoded here, on the caller's thread: one that cannot
        be encoded fails its own future and never reaches the I/O thread,
        whose failure would fail every other request too.
        """
        fut: Future = Future()
        if self.lost is not None:
            fut.set_exception(DaemonUnavailable(str(self.lost)))
            return fut
        try:
            wire = msg.to_wire()
        except Exception as exc:
            fut.set_exception(ValueError(f"cannot encode {msg.type} request: {exc}"))
            return fut
        self._outbox.put((msg.id, wire, _Pending(wire, fut, accepted, resend)))
        os.eventfd_write(self._wake, 1)
        return fut

    def notify(self, msg: Message) -> None:
        """Send a message that gets no reply (a ``Staged`` notice)."""
        if self.lost is None:
            self._outbox.put((msg.id, msg.to_wire(), None))
            os.eventfd_write(self._wake, 1)

    def call(self, msg: Message, timeout: float | None = None) -> Message:
        return self.request(msg).result(timeout if timeout is not None else self.timeout)

    def close(self) -> None:
        """Stop the I/O thread (pending requests fail); safe to call twice."""
        if self._closing.is_set():
            return
        self._closing.set()
        os.eventfd_write(self._wake, 1)
        self._thread.join()
        os.close(self._wake)

    # -- the I/O thread ---------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        last_heard = last_ping = time.monotonic()
        try:
            while not (self._closing.is_set() and self._outbox.empty()):
                events = dict(poller.poll(int(self.heartbeat * 1000 / 2)))
                if self._wake in events:
                    os.eventfd_read(self._wake)
                self._send_outbox(sock)
                if sock in events:
                    while True:
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_heard = time.monotonic()
                        self._on_reply(sock, data)
                now = time.monotonic()
                if not self._pending:
                    last_heard = now
                    continue
                if now - last_ping >= self.heartbeat:
                    sock.send(Ping(0).to_wire())
                    last_ping = now
                reason = self._lost_reason(now - last_heard)
                if reason:
                    self._fail_all(DaemonUnavailable(reason))
        except Exception as exc:  # a bug here must fail requests loudly, never leave them hanging
            log.exception("ckptd client I/O thread failed")
            self.lost = DaemonUnavailable(f"the ckptd client's I/O thread failed: {exc!r}")
            self._fail_all(self.lost)
        finally:
            sock.close()
            self._fail_all(DaemonUnavailable("the ckptd client was closed with this request pending"))

    def _send_outbox(self, sock: zmq.Socket) -> None:
        while True:
            try:
                rid, wire, pending = self._outbox.get_nowait()
            except queue.Empty:
                return
            if pending is not None:
                self._pending[rid] = pending
            sock.send(wire)

    def _on_reply(self, sock: zmq.Socket, data: bytes) -> None:
        try:
            reply = decode(data)
        except Exception as exc:
            log.error("undecodable reply from daemon: %s", exc)
            return
        if isinstance(reply, Welcome):  # also the one answering a re-hello after a restart
            self.daemon_pid = reply.daemon_pid
        pending = self._pending.get(reply.id)
        if pending is None:
            return  # a heartbeat answer, or a reply to a request already failed
        if isinstance(reply, Accepted):
            if pending.accepted is not None and not pending.accepted.done():
                pending.accepted.set_result(reply)
            return
        if isinstance(reply, Error) and reply.code == ErrorCode.UNKNOWN_CLIENT and not pending.retried:
            pending.retried = True  # the daemon restarted: introduce ourselves again
            sock.send(self._numbered_hello().to_wire())
            sock.send(pending.resend.to_wire() if pending.resend is not None else pending.wire)
            return
        del self._pending[reply.id]
        if isinstance(reply, Error):
            _fail(pending, error_for_code(reply.code, reply.message))
        else:
            pending.future.set_result(reply)

    def daemon_running(self) -> bool:
        """Whether the daemon that welcomed this connection still runs (True before any welcome)."""
        return self.daemon_pid is None or pid_alive(self.daemon_pid)

    def _lost_reason(self, silent_for: float) -> str | None:
        # A dead pid counts only after a heartbeat of silence: a restarted
        # daemon answers first, and its Welcome brings the new pid.
        if silent_for > self.heartbeat and not self.daemon_running():
            return f"the ckptd daemon (pid {self.daemon_pid}) exited (it died or was stopped) with saves pending"
        if silent_for > self.timeout:
            return (f"the ckptd daemon at {self.endpoint} has not answered for {silent_for:.0f} s; "
                    "the outcome of a save it already had is unknown: it may still commit")
        return None

    def _fail_all(self, exc: DaemonUnavailable) -> None:
        if self._pending and not self._closing.is_set():
            self.lost = exc
        pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            _fail(p, DaemonUnavailable(exc.message))


def _fail(pending: _Pending, exc: BaseException) -> None:
    for fut in (pending.accepted, pending.future):
        if fut is not None and not fut.done():
            fut.set_exception(exc)
