"""One request, one reply: how the CLI (just another client) talks to a daemon."""

from __future__ import annotations

from pathlib import Path

from ckptd.protocol.endpoint import endpoint_for
from ckptd.protocol.messages import Message
from ckptd.protocol.request import answers
from ckptd.protocol.request import request as request_at


def request(run_dir: Path, msg: Message, *, timeout: float) -> Message:
    """Send ``msg`` to the daemon of ``run_dir`` and return its reply.

    Raises ``DaemonUnavailable`` when no daemon answers within ``timeout``.
    """
    return request_at(endpoint_for(run_dir), msg, timeout=timeout, where=str(run_dir))


def probe(run_dir: Path, *, timeout: float) -> bool:
    """Whether a daemon answers on ``run_dir``."""
    return answers(endpoint_for(run_dir), timeout=timeout)
