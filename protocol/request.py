"""One request, one reply, on a socket of its own: the CLI's calls and the client's "is a daemon there?".

The one place a short-lived DEALER is opened, used and closed again. It
uses pyzmq (a dependency of the daemon and the client alike); the rest of
the protocol package stays msgpack and stdlib only.
"""

from __future__ import annotations

import zmq

from .endpoint import no_daemon_at
from .errors import DaemonUnavailable
from .messages import Message, Ping, Pong, decode


def request(endpoint: str, msg: Message, *, timeout: float, where: str | None = None) -> Message:
    """Send ``msg`` to the daemon at ``endpoint`` and return its reply.

    Raises ``DaemonUnavailable`` when nothing listens there or no reply comes
    within ``timeout``; the message names ``where`` (the run directory a
    person gave) if given, else the endpoint.
    """
    why_not = no_daemon_at(endpoint)
    if why_not:
        raise DaemonUnavailable(f"no ckptd daemon is running on {where or endpoint}: {why_not}")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(msg.to_wire())
        if not sock.poll(int(timeout * 1000)):
            raise DaemonUnavailable(f"the ckptd daemon at {endpoint} did not answer within {timeout:g} s")
        return decode(sock.recv())
    finally:
        sock.close()


def answers(endpoint: str, *, timeout: float) -> bool:
    """Whether a daemon replies to a ping at ``endpoint`` within ``timeout``."""
    try:
        return isinstance(request(endpoint, Ping(0), timeout=timeout), Pong)
    except DaemonUnavailable:
        return False
