"""Holding a node-wide load lease from the daemon for the length of a load."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

from ckptd.protocol.endpoint import default_run_dir, endpoint_for
from ckptd.protocol.messages import Bye, Granted, Lease, Release

from .connection import Connection
from .spawn import answers, ensure_daemon


@contextlib.contextmanager
def load_lease(limit: int | None, *, run_dir: str | os.PathLike | None = None, spawn: bool = True,
               timeout: float = 3600.0) -> Iterator[float | None]:
    """Hold a lease while the body runs; yields the seconds waited for it.

    With ``limit`` None the daemon's default applies, and if no daemon runs
    there is no limit to honour, so no lease is taken (yields None). With a
    limit, a daemon is needed (spawned if allowed). The lease is released
    when the body ends, or by the daemon when this process dies.
    """
    directory = Path(run_dir).absolute() if run_dir is not None else default_run_dir()
    endpoint = endpoint_for(directory) if run_dir is not None else endpoint_for()
    if limit is None and not answers(endpoint, timeout=0.25):
        yield None
        return
    ensure_daemon(directory, endpoint, spawn=spawn)
    conn = Connection(endpoint, heartbeat=1.0, timeout=30.0)
    try:
        conn.introduce()
        started = time.monotonic()
        granted = conn.call(Lease(conn.next_id(), limit), timeout=timeout)
        assert isinstance(granted, Granted)
        try:
            yield time.monotonic() - started
        finally:
            conn.call(Release(conn.next_id()))
            conn.call(Bye(conn.next_id()))
    finally:
        conn.close()
