"""Checks of the arguments users pass to the client API, made before any work.

A bad argument must fail its own call with a ``ValueError``/``TypeError``
naming it, at once and on the caller's thread: an int too big for the wire
format or a non-finite timeout must never reach the I/O thread, where it
could fail a different save. ``Client()``, ``save_async``, ``load`` and
``load_into`` call these; every bound lives here or in ``protocol``.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ckptd.protocol.messages import MAX_INT, MAX_JOB, MAX_TIMEOUT, MAX_WORLD_SIZE
from ckptd.protocol.objects import check_url


def check_int(name: str, value: Any, *, low: int = 0, high: int = MAX_INT, optional: bool = False) -> int | None:
    """``value`` as an int in ``[low, high]`` (bool is refused: ``True`` is no step number)."""
    if value is None and optional:
        return None
    if type(value) is bool or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return int(value)


def check_seconds(name: str, value: Any, *, high: float = math.inf) -> float:
    """A positive, finite number of seconds no larger than ``high``."""
    if type(value) is bool or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r:.40}")
    if not (math.isfinite(value) and 0 < value <= high):
        limit = f" and at most {high:g}" if math.isfinite(high) else ""
        raise ValueError(f"{name} must be a finite number of seconds above 0{limit}, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.40}")
    return value


def check_path(name: str, value: Any) -> str:
    """A path as ``str``; bytes, None and other objects are refused, naming ``name``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__} {value!r:.40}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{name} must be a text path, got {type(path).__name__}")
    if not path or "\x00" in path:
        raise ValueError(f"{name} must be a non-empty path without NUL bytes, got {path!r:.80}")
    try:
        check_url(value)  # a str as typed: s3:/b (one slash) is a typo; a Path of s3://b prints so
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return path


def check_keep_last(value: Any) -> int | None:
    return check_int("keep_last", value, low=1, optional=True)


def check_step(value: Any) -> int | None:
    return check_int("step", value, optional=True)


def check_limit(value: Any) -> int | None:
    """``max_concurrent_per_node`` of ``load``/``load_into``."""
    return check_int("max_concurrent_per_node", value, low=1, optional=True)


def check_load_rank(value: Any, *, allow_all: bool) -> int | str | None:
    if allow_all and value == "all" and isinstance(value, str):
        return value
    if isinstance(value, str):
        allowed = 'an int, None or "all"' if allow_all else "an int or None"
        raise ValueError(f"rank must be {allowed}, got {value!r:.40}")
    return check_int("rank", value, high=MAX_WORLD_SIZE - 1, optional=True)


def check_client_args(*, max_inflight: Any, rank: Any, world_size: Any, local_rank: Any, commit_timeout: Any,
                      keep_last: Any, heartbeat: Any, timeout: Any, spawn: Any, background_staging: Any,
                      stream_commit: Any, job: Any) -> None:
    """Every argument of ``Client()``; ranks are checked again once detected."""
    check_int("max_inflight", max_inflight, low=1, high=1024)
    check_int("rank", rank, high=MAX_WORLD_SIZE - 1, optional=True)
    check_int("world_size", world_size, low=1, high=MAX_WORLD_SIZE, optional=True)
    check_int("local_rank", local_rank, high=MAX_WORLD_SIZE - 1, optional=True)
    check_seconds("commit_timeout", commit_timeout, high=MAX_TIMEOUT)
    check_keep_last(keep_last)
    check_seconds("heartbeat", heartbeat, high=3600.0)
    check_seconds("timeout", timeout)
    for name, flag in (("spawn", spawn), ("background_staging", background_staging)):
        check_bool(name, flag)
    if job is not None:
        if not isinstance(job, str):
            raise TypeError(f"job must be a str or None, got {type(job).__name__} {job!r:.40}")
        if not 0 < len(job) <= MAX_JOB or not job.isprintable() or not job.strip():
            raise ValueError(f"job must be 1 to {MAX_JOB} printable characters, not all spaces, got {job!r:.60}")
    if stream_commit is not None and type(stream_commit) is not bool:
        raise TypeError(f"stream_commit must be True, False or None (chosen by the core count), "
                        f"got {type(stream_commit).__name__} {stream_commit!r:.40}")
