"""One way to serve a ROUTER socket, for both protocols the daemon speaks.

The local protocol (trainers on this node: ``loop/server.py``) and the peer
protocol (other nodes' daemons: ``peers/endpoint.py``) are served the same
way: every waiting message is received, its frames checked, its payload
decoded against its protocol's types, and the handler its type names is
called; whatever a handler returns is the reply, and whatever it raises
becomes an ``Error`` reply through ``replies.error_reply``, the one place that
turns exceptions into what a sender is told. No message can take the daemon
down, and a reply to a sender that went is logged and dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import zmq

from ckptd.protocol.errors import BadMessage
from ckptd.protocol.messages import Message, decode, request_id

from ckptd.core.replies import error_reply
from ckptd.core.stats import Stats

log = logging.getLogger("ckptd")


@dataclass(frozen=True)
class Sender:
    """Who sent a request: its connection (``ident``, to reply to), the peer's authenticated key where the
    socket authenticates (CURVE's ``User-Id``; empty locally), and the bytes frame a chunk of a replica carries."""

    ident: bytes
    origin: str = ""
    data: memoryview | None = None


Handler = Callable[[Sender, Any], "Message | None"]
"""A request's handler: its reply, or None where it answers later (``Dispatch.send``)."""


class Dispatch:
    """A ROUTER socket's requests to their handlers, by message type."""

    def __init__(self, socket: zmq.Socket, stats: Stats, handlers: Mapping[type[Message], Handler], *,
                 types: Mapping[str, type[Message]] | None = None, data_frame: type[Message] | None = None,
                 authenticated: bool = False, refusal: str = "the daemon does not accept it as a request",
                 event: str = "reply_dropped") -> None:
        """``types``: the protocol decoded against (None: the local one); ``data_frame``: the one type whose
        message carries a second, bytes frame (a replica's chunk); ``authenticated``: a CURVE socket, whose
        messages name their sender's key; ``refusal``: why a type without a handler (a reply) is refused;
        ``event``: the log event of a reply dropped."""
        self.socket, self.stats, self.handlers = socket, stats, handlers
        self.types, self.data_frame, self.authenticated = types, data_frame, authenticated
        self.refusal, self.event = refusal, event

    def drain(self) -> None:
        """Handle every message waiting on the socket (the loop thread)."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            most = 2 if self.data_frame is None else 3
            if not 2 <= len(frames) <= most:
                self.send(ident, error_reply(self.stats, 0, BadMessage(
                    f"a message is one frame{' and, for a chunk, its bytes' if most == 3 else ''}: got "
                    f"{len(frames) - 1} frames")))
                continue
            origin = (frames[1].get("User-Id") or ident.hex()) if self.authenticated else ""
            sender = Sender(ident, origin, frames[2].buffer if len(frames) == 3 else None)
            reply = self._handle(sender, frames[1].bytes)
            if reply is not None:
                self.send(ident, reply)

    def _handle(self, sender: Sender, payload: bytes) -> Message | None:
        rid = 0
        try:
            msg = decode(payload) if self.types is None else decode(payload, self.types)
            rid = msg.id
            if self.data_frame is not None and (sender.data is not None) != isinstance(msg, self.data_frame):
                missing = "unexpected bytes frame" if sender.data is not None else "no bytes frame"
                raise BadMessage(f"{msg.type}: {missing}")
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise BadMessage(f"{msg.type!r} is a reply; {self.refusal}")
            return handler(sender, msg)
        except Exception as exc:  # the sender's mistake, or a bug: answered, never fatal
            return error_reply(self.stats, rid or request_id(payload), exc)

    def send(self, ident: bytes, msg: Message, data: Any = None) -> None:
        """Reply ``msg`` (and a bytes frame) to connection ``ident``; dropped, and logged, if it went."""
        frames = [ident, msg.to_wire(), *([data] if data is not None else [])]
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # the sender went, or its queue is full: it times out and tries again
            log.warning("event=%s type=%s error=%s", self.event, msg.type, exc)
