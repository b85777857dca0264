"""The daemon's worker pools, and the one way their results get back to the loop thread.

The loop thread never does file I/O. Everything that does runs here:

- ``admit``: one thread, FIFO. Resolving paths, mapping slots
  (``MAP_POPULATE``), remembering checkpoint directories for the start-up
  sweep, creating ``.incomplete`` directories, setting a failed
  attempt's directory aside. FIFO matters: a retry's directory is only
  created after the failed attempt's directory was moved out of its way.
- ``write``: the node's write slots (``max_concurrent_writes``), FIFO.
- ``checksum``: one CRC thread per write slot, beside its write.
- ``commit``: one thread; index, rename, fsync of the parent.
- ``maintenance``: one thread for retention, tree removals, the start-up
  sweep, reclaiming dead clients' slots, dropping mappings of unlinked slots. A slow
  tree removal delays only other maintenance, never a commit.
- ``status``: one thread for the free-space numbers of ``ckptd status`` and metrics.

``submit(pool, work, then)`` runs ``work`` on a pool; ``then(future)`` runs
back on the loop thread (a queue plus an eventfd that wakes its poll).
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
POOLS = ("admit", "write", "checksum", "commit", "maintenance", "status")


_PR_SET_NAME = 15


def _name_os_thread() -> None:
    """Give the OS thread its pool's name (``write_0``), so ``top -H`` and ``/proc/PID/task/*/comm`` tell the
    threads apart: the per-thread CPU accounting of the benchmarks reads it."""
    name = threading.current_thread().name.removeprefix("ckptd-")[:15].encode()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the names are only a convenience
        pass


class Workers:
    """The pools and the completion queue; ``in_flight`` counts work not yet applied."""

    def __init__(self, write_slots: int) -> None:
        sizes = {"write": write_slots, "checksum": write_slots}
        self.pools = {name: ThreadPoolExecutor(sizes.get(name, 1), thread_name_prefix=f"ckptd-{name}",
                                               initializer=_name_os_thread) for name in POOLS}
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._finished: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.in_flight = 0

    @property
    def checksums(self) -> ThreadPoolExecutor:
        return self.pools["checksum"]

    def submit(self, pool: str, work: Callable[[], object], then: Callable[[Future], None] | None = None) -> None:
        """Run ``work`` on ``pool``; ``then(future)`` runs later on the loop thread (``apply_finished``)."""
        self.in_flight += 1

        def report(fut: Future) -> None:
            self._finished.put(lambda: self._done(fut, then))
            os.eventfd_write(self.wake_fd, 1)

        self.pools[pool].submit(work).add_done_callback(report)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (safe from any thread)."""
        self._finished.put(fn)
        os.eventfd_write(self.wake_fd, 1)

    def _done(self, fut: Future, then: Callable[[Future], None] | None) -> None:
        self.in_flight -= 1
        try:
            if then is not None:
                then(fut)
            elif fut.exception() is not None:
                log.error("event=background_failed error=%r", fut.exception())
        except Exception:  # a bug in a completion must not end the loop
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
        """Wait for every pool, apply what finished, release the wake-up fd."""
        for name in POOLS:
            self.pools[name].shutdown(wait=True)
        self.apply_finished()
        os.close(self.wake_fd)
