"""Repetition, medians and memory sampling shared by every measurement.

Every measurement here runs one warm-up (first touch of buffers, first
mapping of a slot, the daemon's first write) and then ``repeat`` timed runs,
and the report uses the median: with few repetitions on a shared two-core
machine, the median resists one slow outlier where the mean does not.

Peak RSS is sampled on a thread rather than read from ``ru_maxrss`` because
the daemon is a separate process, and because the peak per phase (machine
limits, ``torch.save``, each ckptd mode) says more than one peak for the run.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil


@dataclass
class Series:
    """Timings of one quantity over the repetitions, in seconds."""

    values: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.values.append(seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def spread(self) -> str:
        """``min-max`` of the repetitions, for the detailed listing."""
        return f"{min(self.values):.3f}-{max(self.values):.3f}"


def timed(fn: Callable[[], object], *, repeat: int, warmup: int = 1,
          cleanup: Callable[[], None] | None = None) -> Series:
    """Median-ready timings of ``fn()``; ``cleanup()`` runs untimed after each call."""
    series = Series()
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        if cleanup is not None:
            cleanup()
        if i >= warmup:
            series.add(elapsed)
    return series


@dataclass
class Peak:
    """Peak resident set sizes seen during one phase, in bytes."""

    trainer: int = 0
    daemon: int = 0


class RssSampler:
    """Samples the RSS of this process and of the daemon, peak per phase.

    RSS counts the pages of shared-memory mappings a process has touched, so
    a trainer's staging slots and the daemon's read-only mapping of them both
    show up; that is the memory a user sees in ``top``.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peaks: dict[str, Peak] = {}
        self._phase = "setup"
        self._me = psutil.Process()
        self._daemon: psutil.Process | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def watch_daemon(self, pid: int | None) -> None:
        with self._lock:
            self._daemon = psutil.Process(pid) if pid is not None else None

    def phase(self, name: str) -> None:
        """Attribute samples from now on to ``name``."""
        self.sample()
        with self._lock:
            self._phase = name
        self.sample()

    def sample(self) -> None:
        with self._lock:
            peak = self.peaks.setdefault(self._phase, Peak())
            peak.trainer = max(peak.trainer, self._me.memory_info().rss)
            if self._daemon is not None:
                try:
                    peak.daemon = max(peak.daemon, self._daemon.memory_info().rss)
                except psutil.Error:  # the daemon exited; keep what we saw
                    self._daemon = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> dict[str, Peak]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peaks
