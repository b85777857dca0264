"""Keeping only the newest K checkpoints in a directory, safely.

Runs on the daemon that committed, after the commit (``Retainer`` subscribes to ``Committed``, and the mirror
asks again after an upload), on the maintenance thread.
A directory is only ever deleted if it is a committed ckptd checkpoint
holding nothing but ckptd's files (``ownership.why_not_replaceable``), it is
not the newest, and no save is writing it. A victim first gets this daemon's
owner marker, then is renamed to a ``.incomplete`` name, so readers see it
vanish at once, and only then removed: a daemon that dies between the rename
and the removal leaves a ``.incomplete`` directory whose only owner is dead,
which the next start-up sweep removes. A trainer's ``Delete`` (``Client.delete``,
the Lightning plugin's ``remove_checkpoint``) is the same delete
(``delete_judged``), on the same thread, under the same publish lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptd.protocol.errors import Conflict, InvalidCheckpoint
from ckptd.protocol.index import committed_in
from ckptd.protocol.objects import display
from ckptd.protocol.names import INDEX_NAME

from ckptd.core.config import DaemonConfig
from ckptd.core.events import Committed, Deleted, Events
from ckptd.core.replies import logged
from ckptd.core.stats import Stats
from ckptd.core.workers import Workers
from ckptd.storage.backends import Backends
from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import Files
from ckptd.storage.ownership import UNEXAMINED, why_not_replaceable

log = logging.getLogger("ckptd")


def apply_retention(storage: Checkpoints | Backends, newest: Path, keep_last: int, in_flight: set[Path],
                    keep: Callable[[Path], bool] | None = None,
                    publishing: AbstractContextManager[Any] = nullcontext(),
                    spare_later: bool = True, failed: list[Path] | None = None,
                    committed_at: float | None = None) -> list[Path]:
    """Delete committed checkpoints beside ``newest`` beyond the newest ``keep_last``.

    ``newest`` (the checkpoint just committed) is not deleted, whatever its
    step (a second run's first save is its newest), unless ``keep_last``
    others are newer than it by step and by time alike: a memory snapshot
    persisted while newer checkpoints committed beside it (its index records
    when it was held), which had been deleted by their retention had its
    persist ended first. Neither is one newer than it that committed meanwhile (this
    runs later, off the loop thread); neither is anything in ``in_flight``, nor a checkpoint that holds
    files ckptd did not write (it is logged and kept), nor one ``keep`` asks to keep (the mirror lacks it).
    ``keep`` is asked of each victim right before it goes, never of a listing made earlier: under load
    this run starts seconds after it was asked for, and a checkpoint may have been saved again since. And
    ``keep`` may itself take seconds (it asks the mirror's store): so the victim is set aside only if its
    index is still the one it had before ``keep`` was asked, checked under ``publishing`` (the lock a commit
    holds while it takes a name), so an overwrite committed meanwhile is never the version deleted.
    ``spare_later=False`` (the mirror's ``--mirror-keep``, run for the newest checkpoint on the store in
    retention's order, one directory at a time) keeps only the newest ``keep_last`` in that order: an older
    step uploaded after a newer one was created later than it, and sparing it kept it on the store for good.
    A victim whose deletion failed (an ``OSError``: the store away) is logged, kept, and added to ``failed``.
    ``committed_at``: when ``newest`` was committed, where that is later than the time its index records (a
    persisted memory snapshot records when it was held): a checkpoint committed between the two is spared only if
    it is newer by step, as retention orders by step, then time, never by when a persist ran.
    Returns what was deleted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    found = committed_in(newest.parent, storage.files)
    mine = next((key for key, path in found if path == newest), (-1, float("inf")))
    since = max(mine[1], committed_at or mine[1])
    others = [(key, path) for key, path in found if path != newest]

    def later(key: tuple[int, float]) -> bool:  # committed after newest: stays
        return key[1] > since or (key > mine and key[1] > mine[1])
    victims = [p for key, p in others[: max(0, len(others) - (keep_last - 1))]
               if p not in in_flight and not (spare_later and later(key))]
    outranked_by = [p for key, p in others if key > mine and key[1] > mine[1] and p not in in_flight]
    if len(outranked_by) >= keep_last and newest not in in_flight and newest in (p for _, p in found):
        victims.append(newest)
    deleted = []
    for victim in victims:
        judged = storage.index_bytes(victim)
        if keep is not None and keep(victim):
            log.info("event=retention_keep path=%s reason=not_on_mirror", victim)
            continue
        reason = why_not_replaceable(storage.files, victim)
        if reason is not None:
            log.warning("event=retention_skip path=%s reason=%s", victim, reason)
            if failed is not None and reason.startswith(UNEXAMINED):
                failed.append(victim)
            continue
        try:
            gone = storage.delete(victim, judged=judged, publishing=publishing)
        except OSError as exc:
            log.warning("event=retention_skip path=%s error=%s", victim, exc.strerror or exc)
            if failed is not None:
                failed.append(victim)
            continue
        if gone is None:
            log.info("event=retention_skip path=%s reason=saved_again", victim)
        elif gone:
            deleted.append(victim)
            log.info("event=retention_deleted path=%s", victim)
    return deleted


def delete_on_request(storage: Checkpoints | Backends, checkpoint: Path,
                      publishing: AbstractContextManager[Any]) -> bool:
    """A trainer's ``Delete`` (``Client.delete``): True once ``checkpoint`` is deleted, False if nothing is there;
    ``InvalidCheckpoint`` naming why if what is there is not a committed ckptd checkpoint (maintenance thread)."""
    if storage.files.stat(checkpoint) is None:
        if not _holds_anything(storage.files, checkpoint):
            return False
        raise InvalidCheckpoint(f"{display(checkpoint)} is not deleted: it is not a committed ckptd checkpoint: "
                                f"it has no {INDEX_NAME}")
    judged = storage.index_bytes(checkpoint)
    reason = why_not_replaceable(storage.files, checkpoint)
    if reason is not None:
        raise InvalidCheckpoint(f"{display(checkpoint)} is not deleted: {reason}")
    gone = storage.delete(checkpoint, judged=judged, publishing=publishing)
    if gone is None:
        raise Conflict(f"{display(checkpoint)} is not deleted: it was saved again while the daemon examined it")
    return gone


def _holds_anything(storage: Files, path: Path) -> bool:
    """Whether anything is listed under ``path``: on a store a prefix exists only as the objects under it, so
    stray objects without an index are something there, not nothing."""
    try:
        return bool(storage.scandir(path))
    except OSError:
        return False


@dataclass(frozen=True)
class Retention:
    """One request to apply retention beside ``newest``, with the saves in flight when it was made."""

    newest: Path
    keep_last: int
    in_flight: frozenset[Path]
    committed_at: float | None = None
    """When ``newest`` was committed (None: after an upload, judged by its index's time)."""


class RetentionQueue:
    """At most one retention run waiting per directory (and ``keep_last``): a newer request replaces it.

    Retention runs on the daemon's one maintenance thread. On a busy node
    that thread falls behind the commits, and one run queued per commit made
    the backlog, and the checkpoints it had yet to delete, grow without bound.
    One run for the newest checkpoint does what the runs waiting for older
    ones would have done, so those need not run. A run that has started is
    never replaced: a request made meanwhile gets a run of its own after it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[tuple[Path, int], Retention] = {}

    def offer(self, request: Retention) -> tuple[Path, int] | None:
        """Queue ``request``; the key to ``take`` it by if a run must be submitted, None if one is waiting."""
        key = (request.newest.parent, request.keep_last)
        with self._lock:
            waiting = key in self._waiting
            self._waiting[key] = request
        return None if waiting else key

    def take(self, key: tuple[Path, int]) -> Retention:
        """What a run starting now does: the newest request offered under ``key``."""
        with self._lock:
            return self._waiting.pop(key)


class Retainer:
    """Runs retention after each commit and each upload, one waiting run per directory (``RetentionQueue``).

    Subscribed to ``Committed`` (``server.py``); the mirror calls ``after_upload``. The ``keep_last`` a save
    asked for wins over its directory's ``--keep``; with neither, nothing is deleted.
    """

    def __init__(self, storage: Backends, workers: Workers, config: DaemonConfig, stats: Stats, events: Events,
                 publishing: AbstractContextManager[Any], in_flight: Callable[[], Iterable[Path]],
                 not_uploaded: Callable[[Path], bool] | None = None) -> None:
        self.storage, self.workers, self.config, self.stats = storage, workers, config, stats
        self.events = events
        """Told of each checkpoint deleted: a snapshot held in memory is no longer on disk once its copy goes."""
        self.publishing, self.in_flight = publishing, in_flight
        self.not_uploaded = not_uploaded
        """Asked of each victim right before it goes (off the loop): the mirror lacks it, so it stays."""
        self.queue = RetentionQueue()

    def committed(self, event: Committed) -> None:
        self.retain(event.path, event.keep_last, committed_at=time.time())

    def after_upload(self, newest: Path, keep_last: int | None) -> None:
        """Beside a checkpoint just mirrored, which local retention may now delete (mirror thread)."""
        self.workers.call_soon(lambda: self.retain(newest, keep_last))

    def retain(self, newest: Path, keep_last: int | None, committed_at: float | None = None) -> None:
        """Retention beside ``newest`` on the maintenance thread (loop thread); never deletes what the mirror
        lacks. A run still waiting for the thread there does this request instead."""
        keep = keep_last or self.config.retention_for(newest)
        if keep is None:
            return
        key = self.queue.offer(Retention(newest, keep, frozenset(self.in_flight()), committed_at))
        if key is None:
            return

        def run() -> list[Path]:
            request = self.queue.take(key)
            return apply_retention(self.storage, request.newest, request.keep_last,
                                   set(request.in_flight), self.not_uploaded, self.publishing,
                                   committed_at=request.committed_at)

        self.workers.submit("maintenance", run, lambda fut: self._done(newest, fut), failed=logged(self.stats))

    def delete(self, final: Path, answer: Callable[[BaseException | None], None]) -> None:
        """A trainer's ``Delete`` of ``final`` (loop thread): refused while a save to it is in flight, else the
        two-phase delete on the maintenance thread (the one retention runs on, under the same publish lock);
        ``answer(None)`` once done (or the error), and ``Deleted`` published after it."""
        if final in set(self.in_flight()):
            answer(Conflict(f"{display(final)} is not deleted: a save to it is in progress"))
            return

        def done(fut: Future) -> None:
            if fut.exception() is not None:
                answer(fut.exception())
                return
            answer(None)
            if fut.result():
                log.info("event=deleted path=%s reason=request", final)
                self.events.publish(Deleted(final))

        self.workers.submit("maintenance", lambda: delete_on_request(self.storage, final, self.publishing), done,
                            failed=answer)

    def _done(self, newest: Path, fut: Future) -> None:
        if fut.exception() is not None:
            log.error("event=retention_failed path=%s error=%r", newest, fut.exception())
            self.stats.error(f"retention after {newest} failed: {fut.exception()!r}")
            return
        for deleted in fut.result():
            self.events.publish(Deleted(deleted))
