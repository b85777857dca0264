"""The daemon's worker pools, and the one way their results get back to the loop thread.

The loop thread never does file I/O. Everything that does runs here:

- ``admit``: one thread, FIFO. Resolving paths, mapping slots,
  remembering checkpoint directories for the start-up
  sweep, creating ``.incomplete`` directories, setting a failed
  attempt's directory aside. FIFO matters: a retry's directory is only
  created after the failed attempt's directory was moved out of its way.
- ``write``: the node's write slots (``max_concurrent_writes``), FIFO.
- ``checksum``: one CRC thread per write slot, beside its write.
- ``commit``: one thread; index, rename, fsync of the parent.
- ``maintenance``: one thread for retention, tree removals, the start-up
  sweep, reclaiming dead clients' slots, dropping mappings of unlinked slots. A slow
  tree removal delays only other maintenance, never a commit. Its work may
  ask the mirror's store (retention keeps what the mirror lacks), and a
  stalled store holds a request for its whole timeout: a drain past its
  deadline abandons it (``abandonable``), and its thread is a daemon thread
  so that it cannot hold up the exit either. Everything it does is
  crash-safe, so abandoning it is as safe as a crash.
- ``status``: one thread for the free-space numbers of ``ckptd status`` and metrics.
- ``replica``: one thread, FIFO: the bytes of replicas held for peers (created, written, checked, read back).
- ``peer``: one thread: streams of snapshots to the buddy (``ckptd/peers/replication.py``), one at a time.
- ``peer_ask``: one thread: questions to peers and restores from them, never behind a stream.

``submit(pool, work, then, failed)`` runs ``work`` on a pool; ``then(future)``
runs back on the loop thread (a queue plus an eventfd that wakes its poll). A
completion that raises is a defect, but ranks, requests or peers may wait on
it: ``failed(exc)`` answers them at once instead of at their timeout (through
``replies.py``). Both are required, so no call site can leave its waiters
silent by forgetting one; work with no completion (nothing waits on it) is
``background``'s, and its failure is logged.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

log = logging.getLogger("ckptd")
POOLS = ("admit", "write", "checksum", "commit", "maintenance", "status", "replica", "peer", "peer_ask")
ABANDONABLE = "maintenance"
"""The pool a drain past its deadline neither waits for nor joins."""


_PR_SET_NAME = 15


def _name_os_thread() -> None:
    """Give the OS thread its pool's name (``write_0``), so ``top -H`` and ``/proc/PID/task/*/comm`` tell the
    threads apart: the per-thread CPU accounting of the benchmarks reads it."""
    name = threading.current_thread().name.removeprefix("ckptd-")[:15].encode()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the names are only a convenience
        pass


class DaemonPool:
    """One daemon thread, FIFO, with ``ThreadPoolExecutor``'s ``submit``: the interpreter joins every
    executor thread at exit, so work that may stall (a store request) must run on a thread it does not join."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Callable[[], object]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], object]) -> Future:
        fut: Future = Future()
        self._queue.put((fut, work))
        return fut

    def abandon(self) -> None:
        """Run nothing more; what runs now is left to finish or die with the process."""
        self._queue.put(None)

    def _run(self) -> None:
        _name_os_thread()
        while (item := self._queue.get()) is not None:
            fut, work = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(work())
                except BaseException as exc:  # noqa: BLE001 - reported through the future, as an executor does
                    fut.set_exception(exc)


class Workers:
    """The pools and the completion queue; ``in_flight`` counts work not yet applied."""

    def __init__(self, write_slots: int) -> None:
        sizes = {"write": write_slots, "checksum": write_slots}
        self.pools = {name: ThreadPoolExecutor(sizes.get(name, 1), thread_name_prefix=f"ckptd-{name}",
                                               initializer=_name_os_thread) for name in POOLS if name != ABANDONABLE}
        self.abandonable = DaemonPool(f"ckptd-{ABANDONABLE}")
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._finished: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.in_flight = 0
        self.abandonable_in_flight = 0
        self.closed = False
        """Of ``in_flight``, the work on the ``ABANDONABLE`` pool."""

    @property
    def checksums(self) -> ThreadPoolExecutor:
        return self.pools["checksum"]

    def submit(self, pool: str, work: Callable[[], object], then: Callable[[Future], None],
               failed: Callable[[BaseException], None]) -> None:
        """Run ``work`` on ``pool``; ``then(future)`` runs later on the loop thread (``apply_finished``), and
        ``failed(exc)`` if ``then`` raised ``exc``: whoever waits on the work is answered now, not at its timeout
        (required: about fifteen completions had none, and left Status, Restore, peer requests and replication
        waiting on a defect)."""
        self._run(pool, work, then, failed)

    def background(self, pool: str, work: Callable[[], object]) -> None:
        """Run ``work`` on ``pool`` with nothing after it on the loop: nothing waits on it, and a failure is logged."""
        self._run(pool, work, None, None)

    def _run(self, pool: str, work: Callable[[], object], then: Callable[[Future], None] | None,
             failed: Callable[[BaseException], None] | None) -> None:
        self.in_flight += 1
        abandonable = pool == ABANDONABLE
        self.abandonable_in_flight += abandonable

        def report(fut: Future) -> None:
            if self.closed:  # abandoned work that finished during the exit: its fd may be another's now
                return
            self._finished.put(lambda: self._done(fut, then, failed, abandonable))
            os.eventfd_write(self.wake_fd, 1)

        (self.abandonable if abandonable else self.pools[pool]).submit(work).add_done_callback(report)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (safe from any thread; dropped once closed)."""
        if self.closed:
            return
        self._finished.put(fn)
        os.eventfd_write(self.wake_fd, 1)

    def _done(self, fut: Future, then: Callable[[Future], None] | None,
              failed: Callable[[BaseException], None] | None, abandonable: bool) -> None:
        self.in_flight -= 1
        self.abandonable_in_flight -= abandonable
        try:
            if then is not None:
                then(fut)
            elif fut.exception() is not None:
                log.error("event=background_failed error=%r", fut.exception())
        except Exception as exc:  # a bug in a completion must not end the loop
            assert failed is not None  # ``submit`` requires one with every ``then``
            try:
                failed(exc)  # logs it with its traceback (``replies.as_error``)
            except Exception:
                log.exception("event=internal_error")

    def woken(self) -> None:
        """Clear the wake-up fd after the poll saw it."""
        os.eventfd_read(self.wake_fd)

    def apply_finished(self) -> None:
        """Run the loop-thread halves of finished work (on the loop thread only)."""
        while True:
            try:
                self._finished.get_nowait()()
            except queue.Empty:
                return

    def close(self) -> None:
        """Wait for every pool but the abandonable one, apply what finished, release the wake-up fd.

        The loop only ends with abandonable work in flight past a drain's
        deadline: that work is abandoned, and logged.
        """
        self.abandonable.abandon()
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        self.apply_finished()
        if self.abandonable_in_flight:
            log.warning("event=maintenance_abandoned count=%d note=crash_safe", self.abandonable_in_flight)
        self.closed = True
        os.close(self.wake_fd)
