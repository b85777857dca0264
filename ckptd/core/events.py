"""What happens to checkpoints, told to whoever reacts to it.

The lifecycle publishes, as the last step of each end (``Registry.end``
hands an attempt to its pipeline, which answers its waiters, releases what
it held, then publishes): the save pipeline (``saves.py``) that a checkpoint
committed or failed, the memory tier (``holding.py``) that a snapshot is held,
dropped or failed, the buddy's book (``peers/replicas.py``) that a replica
it held for a peer was dropped or adopted; retention that it deleted a
checkpoint. Stats (and through them status and metrics), the mirror,
retention and the memory tier subscribe; ``server.py`` wires them. So the
module that commits imports none of the modules that react to a commit, and
a new reaction is one more subscription, not another hook inside the pipeline.

Handlers run on the loop thread, synchronously and in the order they
subscribed, after the lifecycle has answered the ranks. A handler that raises
is a defect: it is logged with its traceback and handed to ``defect`` (the
daemon's: an internal error in ``ckptd status``'s recent errors and count),
never swallowed, and the others still run: a defect in one reaction can
neither undo a commit nor keep the next reaction from happening. So nothing
anyone waits on is ended by a handler: the persist of a held snapshot ends
through a direct call from its disk attempt's end (``HeldBytes.ended``),
which answers its waiters even when it fails.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar, Union

from ckptd.protocol.errors import CkptdError

log = logging.getLogger("ckptd")


@dataclass(frozen=True)
class Committed:
    """A checkpoint took its final name, durably (its ranks were told ``Done``)."""

    path: Path
    step: int | None
    nbytes: int
    seconds: float
    """From the attempt's first rank to its publication."""
    keep_last: int | None
    """The save's own retention (``save_async(keep_last=)``), None: the directory's ``--keep``, if any."""
    snapshot: bool = False
    """It persisted a snapshot held in memory (whose end the save pipeline told the memory tier directly)."""


@dataclass(frozen=True)
class Failed:
    """A checkpoint attempt ended without a checkpoint (its ranks were told why)."""

    path: Path
    error: CkptdError
    snapshot: bool = False
    """It was the persist of a snapshot held in memory (held again; the memory tier was told directly)."""


@dataclass(frozen=True)
class SnapshotHeld:
    """Every rank of a snapshot is held in node memory (its ranks were told ``HeldInMemory``)."""

    path: Path
    step: int | None
    nbytes: int


@dataclass(frozen=True)
class SnapshotDropped:
    """A held snapshot left node memory (its slots go back to their clients or are unlinked)."""

    path: Path
    step: int | None
    reason: str
    """``budget`` (evicted for a newer one), ``newer`` (beyond ``keep_snapshots``) or ``saved_to_disk``."""
    ranks: tuple[int, ...] = ()
    """The ranks held of it here (its replica on the buddy is theirs, whichever node's key sent it)."""


@dataclass(frozen=True)
class SnapshotFailed:
    """A snapshot ended before it was held whole (its ranks were told why): nothing of it is kept."""

    path: Path
    step: int | None
    error: CkptdError


@dataclass(frozen=True)
class ReplicaEnded:
    """A replica this node held for a peer ended: dropped (its files unlinked, or kept as spares for the next
    replica of its directory) or adopted (a drain made it a snapshot of this node's own)."""

    path: Path
    origin: str
    """The public key of the peer that sent it."""
    adopted: bool
    reason: str
    """Why it ended: ``replaced``, ``forgotten``, ``stalled``, ``stream_failed``, ``checksum``, ``offered_again``,
    ``offer_refused``; ``origin_gone`` when adopted."""


@dataclass(frozen=True)
class Deleted:
    """A committed checkpoint was deleted: by retention (``keep_last``, ``--keep``) or a trainer's ``Delete``."""

    path: Path


Event = Union[Committed, Failed, SnapshotHeld, SnapshotDropped, SnapshotFailed, ReplicaEnded, Deleted]
E = TypeVar("E", Committed, Failed, SnapshotHeld, SnapshotDropped, SnapshotFailed, ReplicaEnded, Deleted)


class Events:
    """Subscriptions by event type; ``publish`` calls each of the type's handlers (loop thread only)."""

    def __init__(self, defect: Callable[[BaseException], None] = lambda exc: None) -> None:
        self._handlers: defaultdict[type, list[Callable[[Event], None]]] = defaultdict(list)
        self._defect = defect
        """Told of each handler that raised, after it is logged (the daemon records it as an internal error)."""

    def subscribe(self, kind: type[E], handler: Callable[[E], None]) -> None:
        self._handlers[kind].append(handler)  # type: ignore[arg-type]

    def publish(self, event: Event) -> None:
        for handler in self._handlers[type(event)]:
            try:
                handler(event)
            except Exception as exc:  # one reaction's defect must not stop the others
                log.error("event=subscriber_failed kind=%s path=%s handler=%r error=%r", type(event).__name__,
                          event.path, handler, exc, exc_info=exc)
                self._defect(exc)
