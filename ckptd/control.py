"""One request, one reply: how the CLI (just another client) talks to a daemon."""

from __future__ import annotations

from pathlib import Path

import zmq

from ckptd.protocol.endpoint import endpoint_for, no_daemon_at
from ckptd.protocol.errors import DaemonUnavailable
from ckptd.protocol.messages import Message, Ping, Pong, decode


def request(run_dir: Path, msg: Message, *, timeout: float) -> Message:
    """Send ``msg`` to the daemon of ``run_dir`` and return its reply.

    Raises ``DaemonUnavailable`` when no daemon answers within ``timeout``.
    """
    endpoint = endpoint_for(run_dir)
    why_not = no_daemon_at(endpoint)
    if why_not:
        raise DaemonUnavailable(f"no ckptd daemon is running on {run_dir}: {why_not}")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(msg.to_wire())
        if not sock.poll(int(timeout * 1000)):
            raise DaemonUnavailable(f"the ckptd daemon at {endpoint} did not answer within {timeout:g} s")
        return decode(sock.recv())
    finally:
        sock.close()


def probe(run_dir: Path, *, timeout: float) -> bool:
    """Whether a daemon answers on ``run_dir``."""
    try:
        return isinstance(request(run_dir, Ping(1), timeout=timeout), Pong)
    except DaemonUnavailable:
        return False
