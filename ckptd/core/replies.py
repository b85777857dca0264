"""The one place an exception becomes what a rank is told: an ``Error`` reply, or an attempt's failure.

A ``CkptdError`` is the client's: its code and message go back as they are.
Anything else is a defect in the daemon: it is logged with its traceback and
answered as an ``InternalError``, and the daemon keeps serving. Either way
the message joins the recent errors ``ckptd status`` shows. A synchronous
handler answers its request with ``error_reply``; an attempt that fails
(``Registry.end`` with ``failed``, its pipeline telling the ranks; also when a pool completion raised:
``Workers.submit``'s ``failed``) tells every waiting rank ``as_error``'s.
"""

from __future__ import annotations

import logging
from typing import Callable

from ckptd.protocol.errors import CkptdError, InternalError
from ckptd.protocol.messages import Error

from ckptd.core.stats import Stats

log = logging.getLogger("ckptd")


def as_error(stats: Stats, exc: BaseException) -> CkptdError:
    """What the ranks are told of ``exc``: itself if it is a ``CkptdError``, else an ``InternalError`` (the defect
    logged with its traceback); recorded in ``stats`` either way."""
    if not isinstance(exc, CkptdError):
        log.error("event=internal_error error=%r", exc, exc_info=exc)
        exc = InternalError(f"internal error in ckptd: {exc!r}")
    stats.error(exc.message)
    return exc


def error_reply(stats: Stats, rid: int, exc: BaseException) -> Error:
    """The ``Error`` that answers request ``rid`` for ``exc`` (``as_error``)."""
    return Error.of(rid, as_error(stats, exc))


def logged(stats: Stats) -> Callable[[BaseException], None]:
    """The failure path (``Workers.submit``'s ``failed``) of a completion no rank, request or peer waits on: the
    defect is logged and shown among ``ckptd status``'s recent errors (``as_error``), and nobody is to be told."""

    def log_it(exc: BaseException) -> None:
        as_error(stats, exc)

    return log_it
