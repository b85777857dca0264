"""The one place an exception becomes an ``Error`` reply.

A ``CkptdError`` is the client's: its code and message go back as they are.
Anything else is a defect in the daemon: it is logged with its traceback and
answered as an ``InternalError``, and the daemon keeps serving. Either way
the message joins the recent errors ``ckptd status`` shows.
"""

from __future__ import annotations

import logging

from ckptd.protocol.errors import CkptdError, InternalError
from ckptd.protocol.messages import Error

from .stats import Stats

log = logging.getLogger("ckptd")


def error_reply(stats: Stats, rid: int, exc: BaseException) -> Error:
    """The ``Error`` that answers request ``rid`` for ``exc`` (recorded in ``stats``)."""
    if not isinstance(exc, CkptdError):
        log.error("event=internal_error error=%r", exc, exc_info=exc)
        exc = InternalError(f"internal error in ckptd: {exc!r}")
    stats.error(exc.message)
    return Error(rid, exc.code, exc.message)
