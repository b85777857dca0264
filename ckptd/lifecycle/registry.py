"""Every attempt in progress on this daemon, disk or memory: their books, the one code that moves and ends them,
and the one housekeeping over them.

Each pipeline keeps its attempts by path in books the registry gives it (``book``: ``Commits.pending``,
``SnapshotBook.current`` and ``SnapshotBook.replacing``). A book is read-only to everyone but the registry: an attempt
enters one through ``open`` (at its kind's entry state, ``Tracked.entry``), moves from the replacing book to the
held one through ``promote``, and leaves every book when it ends. Its state changes through ``move`` (a step along
``attempt.NEXT_STATES`` that does not end it) and it ends through ``end`` only, once: ``end`` takes it out of every
book, then hands it to the pipeline of its kind (``Pipeline.ended``), which answers every rank still waiting,
releases what the attempt held (slots, directories, pins) and publishes the event last. So no book ever holds an
ended attempt nor forgets one that goes on, and nothing leaves the books without being released (a test scans the
daemon for any other caller of ``move_to``, and for writes to the books). At exit ``close`` empties the books and
hands each pipeline what it still had (``Pipeline.exited``): an exit ends no attempt, but releases all. A failed
attempt, disk or memory, is remembered for its late ranks, which are told its error at once
(``remember_failure``, ``refuse_late_rank``).

Its third pipeline is the buddy's: ``peers/replicas.ReplicaBook`` keeps the replicas it holds for its peers in two
books of the registry's (``incoming``, ``held``, keyed by origin and path), and ends them here too (receiving, held,
then dropped or adopted: ``attempt.NEXT_REPLICA_STATES``), a stalled one by this housekeeping (``Replica.overdue``).

The two pipelines of this node's own saves (``saves.Saves``: attempts at a disk checkpoint; ``holding.Holding``:
memory snapshots) gather their ranks the same way (``attempt.Attempt``). So what ends an attempt whose ranks will never all come is judged
once, here, for either kind, each housekeeping round (``Registry.housekeep``, called by the loop) and when a rank
of another run arrives at its path (``end_orphaned``): ranks still missing after the attempt's timeout, a rank of a
named run whose process died before it saved, contributors that died while ranks were missing.

Bookkeeping only, on the loop thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Mapping, Protocol, Sequence, TypeVar

from ckptd.protocol.errors import CkptdError, InternalError
from ckptd.protocol.messages import Message, ReplicationState, StagedShard

from ckptd.lifecycle.attempt import ENDED, NEXT_REPLICATION, Attempt, AttemptState, PeerCopy, Tracked
from ckptd.lifecycle.contributors import Contributors

A = TypeVar("A", bound=Tracked)
log = logging.getLogger("ckptd")
FAILED_MEMORY_S = 600.0
"""How long a failed attempt's error waits for its late ranks (at least; its commit timeout if longer).

A late rank is by definition late by more than the timeout that failed its
attempt, so remembering the failure only that long would make it start a
fresh attempt, wait its own timeout for the ranks that did come, and blame them."""


@dataclass
class Failure:
    """Why an attempt failed, as its ranks were told, kept so its late ranks fail the same way at once."""

    error: CkptdError
    ranks_seen: set[int]
    expires: float
    contributors: Contributors


@dataclass(eq=False)
class Releasing:
    """An ended attempt whose release is still under way, and what waits for it to be over."""

    attempt: Attempt
    then: list[Callable[[], None]] = field(default_factory=list)


@dataclass(frozen=True)
class DeadRank:
    """A rank of a named run whose process died (its client's connection is torn down)."""

    job: str
    world_size: int
    rank: int
    pid: int


class Book(Mapping[Any, A], Generic[A]):
    """What the registry owns of one kind, by ``Tracked.key`` (an attempt's path; a replica's origin and path):
    read by their pipeline, written by the registry only."""

    def __init__(self) -> None:
        self._by_key: dict[Any, A] = {}

    def __getitem__(self, key: Any) -> A:
        return self._by_key[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)


class Pipeline(Protocol):
    """What the registry needs of a pipeline: the kind of attempt it runs, its attempts, and how one ends."""

    kind: type[Tracked]

    def attempts(self) -> list[Tracked]:
        """Its attempts in progress (a copy: ending one changes the books)."""
        ...

    def ended(self, attempt: Tracked, state: AttemptState, error: BaseException | None, reason: str) -> None:
        """``attempt`` ended in ``state`` (out of the books already): answer every rank still waiting (``error``
        for a failure), release what it held, publish the event last; ``reason`` says why (a snapshot dropped, a
        disk attempt let go)."""
        ...

    def tidy(self, now: float) -> None:
        """What the pipeline itself keeps up each round (forgetting old failures, looking at settled attempts)."""
        ...

    def exited(self, attempts: list[Tracked]) -> None:
        """The daemon exits (its workers closed): ``attempts``, its attempts still in the books (out of them
        already) and its ended ones still releasing, and whatever else it keeps, are released on the calling
        thread. Nobody is told and nothing is published: an exit ends no attempt (a snapshot's replica stays on
        its buddy; a disk attempt's ``.incomplete`` is the next start's sweep's)."""
        ...


class Registry:
    """The attempts of every pipeline: their books, their moves and ends, and the one place that ends those whose
    ranks will never all come."""

    def __init__(self, defect: Callable[[BaseException], CkptdError] = lambda exc: InternalError(repr(exc))) -> None:
        self._books: list[Book] = []
        self.pipelines: tuple[Pipeline, ...] = ()
        self._defect = defect
        """Records a defect (status's internal errors) and makes the error its waiters are told."""
        self._send: Callable[[bytes, Message], None] = lambda client, msg: None
        """Answers a local client (``keep`` sets the daemon's): what a failed end hook's waiters are told through."""
        self._failures: dict[tuple[str, Path], Failure] = {}
        """Attempts that failed, by kind (``Tracked.noun``) and path, for their late ranks (``remember_failure``)."""
        self._releasing: list[Releasing] = []
        """Ended attempts that still hold what they held (``releasing``)."""

    def book(self) -> Book:
        """A new book of attempts by path, for a pipeline to read its attempts in (``open`` writes it)."""
        book: Book = Book()
        self._books.append(book)
        return book

    def keep(self, pipelines: Sequence[Pipeline], send: Callable[[bytes, Message], None] | None = None) -> None:
        """The pipelines whose attempts ``housekeep`` looks at and ``end`` hands over (built after their books),
        and how their ranks are answered (``send``) should a pipeline's end hook fail."""
        self.pipelines = tuple(pipelines)
        if send is not None:
            self._send = send

    def open(self, book: Book[A], attempt: A) -> A:
        """``attempt``, new at its kind's entry state, is ``book``'s at its path (none may be there)."""
        if attempt.state is not attempt.entry:
            raise InternalError(f"{attempt.noun} {attempt.path} opened at {attempt.state.value}, not at "
                                f"{attempt.entry.value}")
        if attempt.key in book:
            raise InternalError(f"{attempt.noun} {attempt.path} opened where one is in progress")
        book._by_key[attempt.key] = attempt
        return attempt

    def promote(self, attempt: A, source: Book[A], target: Book[A]) -> A | None:
        """``attempt`` leaves ``source`` for ``target`` at its path; returns the attempt it displaced there (still
        going: the caller ends it), or None."""
        if source.get(attempt.key) is not attempt:
            raise InternalError(f"{attempt.noun} {attempt.path} promoted from a book it is not in")
        del source._by_key[attempt.key]
        old = target.get(attempt.key)
        target._by_key[attempt.key] = attempt
        return old

    def move(self, attempt: Tracked, state: AttemptState) -> None:
        """Move ``attempt`` to ``state``, a step along ``NEXT_STATES`` that does not end it (``end`` does that;
        ``Tracked.move_to`` refuses a move its kind's table lacks)."""
        if state in ENDED:
            raise InternalError(f"{attempt.noun} {attempt.path} ends through Registry.end, not move ({state.value})")
        attempt.move_to(state)

    def end(self, attempt: Tracked, state: AttemptState, error: BaseException | None = None, *,
            reason: str = "") -> None:
        """The one way an attempt ends: moved to ``state`` (one of ``ENDED``; an attempt ends once), out of every
        book, then its pipeline's ``ended`` answers its ranks, releases what it held and publishes the event."""
        if state not in ENDED:
            raise InternalError(f"{attempt.noun} {attempt.path} cannot end in {state.value}")
        attempt.move_to(state)
        why = reason or (type(error).__name__ if error is not None else "")
        log.info("event=attempt_ended kind=%s path=%s state=%s why=%s", attempt.noun, attempt.path, state.value, why)
        for book in self._books:
            if book.get(attempt.key) is attempt:
                del book._by_key[attempt.key]
        for pipeline in self.pipelines:
            if isinstance(attempt, pipeline.kind):
                try:
                    pipeline.ended(attempt, state, error, reason)
                except Exception as exc:  # noqa: BLE001 - a defect of the hook: its attempt has ended all the same
                    self._hook_failed(attempt, state, exc)
                return
        if self.pipelines:  # a registry without pipelines is a test's (``tests/test_node_state.py``)
            self._defect(InternalError(f"{attempt.noun} {attempt.path} ended, and no pipeline takes its kind"))

    def _hook_failed(self, attempt: Tracked, state: AttemptState, exc: BaseException) -> None:
        """``attempt``'s end hook raised (a defect): logged with its traceback and counted, and every rank still
        waiting is told it as an internal error at once, never left to its timeout; the attempt stays ended (its
        caller's own failure path finds it so, and does not end it again)."""
        log.error("event=end_hook_failed kind=%s path=%s state=%s error=%r", attempt.noun, attempt.path, state.value,
                  exc, exc_info=exc)
        internal = self._defect(exc)
        if isinstance(attempt, Attempt):  # a replica's peer is answered by its own request's failure path
            attempt.tell_failed(self._send, internal)

    def end_orphaned(self, attempt: Tracked, arriving_job: str) -> bool:
        """A rank of run ``arriving_job`` arrived at ``attempt``'s path: fail ``attempt`` if it still misses ranks
        and some of its contributors died (``Attempt.orphaned``), as no rank of their run can complete it. Logged
        ``abandoned`` when the newcomer is another run's, else ``orphaned`` (as housekeeping's own finding of the
        same is). True if it ended."""
        why = attempt.orphaned()
        if why is not None:
            reason = "abandoned" if arriving_job != attempt.contributors.job else "orphaned"
            self.end(attempt, attempt.judged_end, why, reason=reason)
        return why is not None

    def remember_failure(self, attempt: Attempt, error: CkptdError) -> None:
        """``attempt`` failed with ``error`` (its end hook told its ranks): a rank of its run that arrives later
        at its path is told the same at once (``refuse_late_rank``), not made to wait its own timeout for the
        ranks that came and blame them. An attempt over several nodes is not kept: its ranks' own agreement tells
        its late ranks."""
        if attempt.coordinated:
            return
        self._failures[(attempt.noun, attempt.path)] = Failure(
            type(error)(error.message), set(attempt.arrived),  # a bare copy: no traceback pins frames
            time.monotonic() + max(attempt.timeout, FAILED_MEMORY_S), attempt.contributors)

    def refuse_late_rank(self, kind: type[Attempt], path: Path, msg: StagedShard) -> None:
        """Raise the error of ``kind``'s failed attempt at ``path`` if ``msg`` is a late rank of it: of its run,
        not yet seen, its contributors alive, within ``FAILED_MEMORY_S``. Any other rank (a retry of one that was
        in, another run's, a restarted job's) forgets the failure, and starts afresh."""
        failure = self._failures.get((kind.noun, path))
        if failure is None:
            return
        if (time.monotonic() > failure.expires or msg.rank in failure.ranks_seen
                or msg.job != failure.contributors.job or failure.contributors.dead()):
            del self._failures[(kind.noun, path)]
            return
        failure.ranks_seen.add(msg.rank)
        raise type(failure.error)(failure.error.message)

    def releasing(self, attempt: Attempt) -> None:
        """``attempt`` ended (its end hook calls this), and what it holds goes back later, when the hook's pipeline
        says so (``released``): a failed checkpoint's directory still being set aside, a dropped snapshot a reader
        still pins. Until then it is in no book, but is kept here: the budget still counts it, an attempt of its
        kind at its path waits for it (``after_release``), and an exit releases it (``close``)."""
        if not attempt.ended:
            raise InternalError(f"{attempt.noun} {attempt.path} is releasing before it ended ({attempt.state.value})")
        self._releasing.append(Releasing(attempt))

    def released(self, attempt: Attempt) -> list[Callable[[], None]]:
        """``attempt`` holds nothing any more: what waited for it, to run now (none while another ended attempt of
        its kind at its path is still releasing: they wait for that one too)."""
        done = next((r for r in self._releasing if r.attempt is attempt), None)
        if done is None:
            return []
        self._releasing.remove(done)
        other = next((r for r in self._releasing if type(r.attempt) is type(attempt)
                      and r.attempt.path == attempt.path), None)
        if other is not None:
            other.then.extend(done.then)
            return []
        return done.then

    def after_release(self, kind: type[Attempt], path: Path, then: Callable[[], None]) -> bool:
        """Keep ``then`` until no ended attempt of ``kind`` at ``path`` is releasing; False if none is (the caller
        goes on now). A retry must never lose its new directory to the old attempt's cleanup."""
        waiting = next((r for r in self._releasing if isinstance(r.attempt, kind) and r.attempt.path == path), None)
        if waiting is None:
            return False
        waiting.then.append(then)
        return True

    def still_releasing(self, kind: type[A]) -> list[A]:
        """The ended attempts of ``kind`` still releasing."""
        return [r.attempt for r in self._releasing if isinstance(r.attempt, kind)]

    def close(self) -> None:
        """The daemon exits: every book is emptied, and each pipeline is handed the attempts it still had, those
        still releasing included, to release (``Pipeline.exited``), in the order the pipelines were kept."""
        left = [*(a for book in self._books for a in book.values()), *(r.attempt for r in self._releasing)]
        for book in self._books:
            book._by_key.clear()
        self._releasing.clear()
        for pipeline in self.pipelines:
            pipeline.exited([a for a in left if isinstance(a, pipeline.kind)])

    def replicate(self, snap: Any, state: ReplicationState, *, endpoint: str | None = None, error: str = "",
                  unanswered: bool = False, lag_s: float | None = None,
                  checksums: tuple[tuple[int, int], ...] = ()) -> None:
        """Move held snapshot ``snap``'s copy on a peer (``PeerCopy``) to ``state`` along ``NEXT_REPLICATION`` (any
        other move is a defect, raised as ``InternalError``), as a new record: on ``endpoint`` (None: the same
        peer), ``error`` saying why it failed (``unanswered``: the peer did not answer), and once ``replicated``
        its ``lag_s`` and the ``checksums`` the peer sealed."""
        if state not in NEXT_REPLICATION[snap.copy.state]:
            raise InternalError(f"snapshot {snap.path}'s replication cannot go from {snap.copy.state.value} to "
                                f"{state.value}")
        snap.copy = PeerCopy(state, snap.copy.endpoint if endpoint is None else endpoint, error, unanswered,
                             lag_s if lag_s is not None else snap.copy.lag_s, checksums)

    def housekeep(self, now: float, died: Sequence[DeadRank] = ()) -> None:
        """One round (``now``: monotonic): fail what is overdue, waits for a rank that died, or was left by
        contributors that died; forget the failures whose late ranks can no longer come."""
        for pipeline in self.pipelines:
            for attempt in pipeline.attempts():
                if attempt.ended:  # ended by an earlier one's hook this round
                    continue
                judged = _why_it_fails(attempt, now, died)
                if judged is not None:
                    self.end(attempt, attempt.judged_end, judged[1], reason=judged[0])
            pipeline.tidy(now)
        for key in [k for k, f in self._failures.items() if now > f.expires]:  # no late rank of theirs can come
            del self._failures[key]


def _why_it_fails(attempt: Tracked, now: float, died: Sequence[DeadRank]) -> tuple[str, BaseException] | None:
    """Why housekeeping ends ``attempt`` (the end's reason, and the error its ranks are told), if it does."""
    why: BaseException | None = attempt.overdue(now)
    if why is not None:
        return attempt.overdue_reason, why
    for dead in died:
        why = attempt.rank_died(dead.job, dead.world_size, dead.rank, dead.pid)
        if why is not None:
            return "rank_died", why
    why = attempt.orphaned()
    return ("orphaned", why) if why is not None else None
