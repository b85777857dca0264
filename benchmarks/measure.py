"""Repetition, medians, memory sampling and machine load, shared by every section.

Every timed measurement runs one warm-up (first touch of buffers, first
mapping of a slot, the daemon's first write, DCP's first spawn of its
writer process) and then ``repeat`` timed runs, and the report uses the
median: with few repetitions on a shared two-core machine, the median
resists one slow outlier where the mean does not.

Each measurement runs in its own worker process (``benchmarks/worker.py``),
so that one method's allocations (DCP's staging copies, glibc keeping freed
heap) never show up as another method's memory. The orchestrating process
runs a ``Sampler`` thread that, every 20 ms, records:

* for each watched role (the trainer, the writer: ckptd's daemon or DCP's
  checkpoint process, four ranks at once...), RSS and its split from
  ``/proc/<pid>/status``: ``RssAnon`` (private memory), ``RssFile`` (mapped
  files: libraries, a loaded checkpoint's pages), ``RssShmem`` (shared
  memory: ckptd's slots, DCP's shared staging copies);
* the CPU time of the whole machine and of the benchmark's own process tree,
  so that any window's "other CPU" (cores kept busy by everything else:
  other users' work and kernel threads) can be computed afterwards.

Workers send time marks on ``CLOCK_MONOTONIC``, which is the same clock in
every process, so a window is just two marks and its peaks are read off the
recorded series. Before each timed phase the orchestrator waits, within a
budget, for a quiet window: two seconds in which the rest of the machine
used under a quarter of a core.
"""

from __future__ import annotations

import bisect
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TICK = 1.0 / os.sysconf("SC_CLK_TCK")
QUIET_CORES = 0.25
"""Other work below this many cores counts as a quiet machine."""
QUIET_WINDOW_S = 2.0


@dataclass
class Series:
    """Timings of one quantity over the repetitions, in seconds."""

    values: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.values.append(seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def listing(self) -> str:
        """Every repetition in order, for the detailed listing (outliers show)."""
        return ", ".join(f"{v:.3f}" for v in self.values)

    def spread(self) -> float:
        """Slowest over fastest repetition (1.0 for one value)."""
        lo = min(self.values)
        return max(self.values) / lo if lo > 0 else 1.0

    def to_json(self) -> list[float]:
        return list(self.values)

    @classmethod
    def of(cls, values: list[float] | None) -> "Series | None":
        return cls(list(values)) if values else None


def timed(fn: Callable[[], object], *, repeat: int, warmup: int = 1,
          before: Callable[[], None] | None = None, cleanup: Callable[[], None] | None = None) -> Series:
    """Median-ready timings of ``fn()``; ``before()`` and ``cleanup()`` run untimed around each call."""
    series = Series()
    for i in range(warmup + repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        if cleanup is not None:
            cleanup()
        if i >= warmup:
            series.add(elapsed)
    return series


# --- /proc readers -----------------------------------------------------------

MEM_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def proc_memory(pid: int | str = "self") -> tuple[int, int, int, int] | None:
    """(RSS, RssAnon, RssFile, RssShmem) of ``pid`` in bytes, or None if it is gone."""
    values = dict.fromkeys(MEM_FIELDS, 0)
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                k = key.decode()
                if k in values:
                    values[k] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return None
    return values["VmRSS"], values["RssAnon"], values["RssFile"], values["RssShmem"]


def peak_rss_self() -> int:
    """``VmHWM`` of this process in bytes: its peak RSS since start or the last reset."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _machine_busy() -> float:
    """CPU seconds the whole machine has spent not idle since boot (from /proc/stat)."""
    with open("/proc/stat", "rb") as f:
        parts = f.readline().split()
    # user nice system idle iowait irq softirq steal guest guest_nice
    v = [int(x) for x in parts[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) * TICK


def _cpu_of(pid: int) -> float:
    """utime+stime of ``pid`` plus those of its reaped children, seconds (0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = data[data.rindex(b")") + 2:].split()
    # fields[0] is state (field 3); utime is field 14 -> index 11
    return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) * TICK


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant."""
    seen, stack = [], [root]
    while stack:
        p = stack.pop()
        seen.append(p)
        stack.extend(_children(p))
    return seen


# --- the sampler -------------------------------------------------------------

@dataclass
class MemPeak:
    """Peaks of one role over a window, bytes; each field's own peak."""

    rss: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    first_rss: int = 0
    """RSS at the first sample of the window (the baseline for growth)."""
    first_anon: int = 0
    first_file: int = 0

    def to_json(self) -> dict:
        return self.__dict__.copy()


@dataclass
class Window:
    """What a window of the recorded series says."""

    seconds: float
    others: float | None
    """Average cores used by everything outside the benchmark's process tree."""
    peaks: dict[str, MemPeak]
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds each role used in the window (user + system, reaped children included)."""


class Sampler:
    """Samples roles' memory and the machine's CPU every ``interval`` s, keeping the series."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self._me = os.getpid()
        self._roles: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._t: list[float] = []
        self._busy: list[float] = []
        self._ours: list[float] = []
        self._mem: list[dict[str, tuple[int, int, int, int]]] = []
        self._cpu: list[dict[str, float]] = []

    def start(self) -> "Sampler":
        self.sample()
        self._thread.start()
        return self

    def watch(self, role: str, *pids: int) -> None:
        """Sample ``pids`` (their sum) as ``role`` from now on; replaces earlier pids of the role."""
        with self._lock:
            self._roles[role] = list(pids)

    def unwatch(self, role: str) -> None:
        with self._lock:
            self._roles.pop(role, None)

    def sample(self) -> None:
        now = time.monotonic()
        busy = _machine_busy()
        # CPU of our own tree: each process's own time plus that of its reaped
        # children (cutime), so a worker that exits keeps counting, through
        # its parent, and nothing is counted twice.
        ours = sum(_cpu_of(pid) for pid in process_tree(self._me))
        with self._lock:
            roles = {r: list(p) for r, p in self._roles.items()}
        mem: dict[str, tuple[int, int, int, int]] = {}
        cpu: dict[str, float] = {}
        for role, pids in roles.items():
            tot = [0, 0, 0, 0]
            alive = False
            cpu[role] = sum(_cpu_of(pid) for pid in pids)
            for pid in pids:
                m = proc_memory(pid)
                if m is not None:
                    alive = True
                    for i in range(4):
                        tot[i] += m[i]
            if alive:
                mem[role] = (tot[0], tot[1], tot[2], tot[3])
        with self._lock:
            self._t.append(now)
            self._busy.append(busy)
            self._ours.append(ours)
            self._mem.append(mem)
            self._cpu.append(cpu)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # a /proc race must never stop sampling
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    # --- reading the series back ----------------------------------------------

    def window(self, t0: float, t1: float | None = None) -> Window:
        """Peaks and other CPU between monotonic times ``t0`` and ``t1`` (default now)."""
        with self._lock:
            t1 = t1 if t1 is not None else (self._t[-1] if self._t else t0)
            i0 = max(0, bisect.bisect_left(self._t, t0) - 1)
            i1 = min(len(self._t) - 1, bisect.bisect_right(self._t, t1))
            peaks: dict[str, MemPeak] = {}
            for i in range(i0, i1 + 1):
                for role, (rss, anon, file, shmem) in self._mem[i].items():
                    p = peaks.get(role)
                    if p is None:
                        p = peaks[role] = MemPeak(first_rss=rss, first_anon=anon, first_file=file)
                    p.rss, p.anon = max(p.rss, rss), max(p.anon, anon)
                    p.file, p.shmem = max(p.file, file), max(p.shmem, shmem)
            cpu: dict[str, float] = {}
            if i1 > i0:
                # Cumulative CPU only grows while a process lives: the window's highest value is its end
                # (a process that exits inside the window still counts), its first value the start.
                first: dict[str, float] = {}
                high: dict[str, float] = {}
                for c in self._cpu[i0:i1 + 1]:
                    for role, value in c.items():
                        first.setdefault(role, value)
                        high[role] = max(high.get(role, value), value)
                cpu = {role: high[role] - first[role] for role in high}
            others = None
            if i1 > i0 and self._t[i1] > self._t[i0]:
                dt = self._t[i1] - self._t[i0]
                others = max(0.0, (self._busy[i1] - self._busy[i0]) - (self._ours[i1] - self._ours[i0])) / dt
        return Window(t1 - t0, others, peaks, cpu)

    def others_recent(self, seconds: float) -> float | None:
        """Other CPU over the last ``seconds`` (None until that much is recorded)."""
        with self._lock:
            if not self._t or self._t[-1] - self._t[0] < seconds:
                return None
            end = self._t[-1]
        return self.window(end - seconds, end).others


@dataclass
class QuietLog:
    """How long each phase waited for a quiet machine, and whether it got one."""

    budget: float
    spent: float = 0.0
    entries: list[tuple[str, float, float | None, bool]] = field(default_factory=list)
    """(phase, waited s, other CPU when it started, quiet reached)."""

    def noisy_starts(self) -> list[tuple[str, float | None]]:
        return [(name, others) for name, _, others, ok in self.entries if not ok]


def wait_quiet(sampler: Sampler, log: QuietLog, phase: str, *, max_wait: float = 30.0,
               threshold: float = QUIET_CORES, window: float = QUIET_WINDOW_S) -> None:
    """Wait until the rest of the machine used under ``threshold`` cores for ``window`` s.

    Gives up after ``max_wait`` s or when the run's budget is spent, and
    records the phase as started on a busy machine; the report says so.
    """
    start = time.monotonic()
    allowed = max(0.0, min(max_wait, log.budget - log.spent))
    others = sampler.others_recent(window)
    while True:
        others = sampler.others_recent(window)
        quiet = others is not None and others < threshold
        waited = time.monotonic() - start
        if quiet or waited >= allowed:
            break
        time.sleep(0.2)
    log.spent += waited
    log.entries.append((phase, waited, others, quiet))


def evict(paths: list[Path], mode: str = "fadvise") -> None:
    """Drop the page-cache pages of ``paths``: a cold read next.

    ``fadvise`` (default) asks the kernel to drop these files' clean,
    unmapped pages (``POSIX_FADV_DONTNEED``) and leaves everyone else's cache
    alone; ``drop_caches`` writes 3 to ``/proc/sys/vm/drop_caches`` (root
    only), dropping every clean page on the machine.
    """
    if mode == "drop_caches":
        for path in paths:
            _datasync(path)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _datasync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def resident_fraction(paths: list[Path]) -> float:
    """Fraction of the pages of ``paths`` in the page cache now (``mincore``)."""
    import ctypes
    import mmap as _mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = _mmap.PAGESIZE
    total = resident = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = libc.mmap(None, size, _mmap.PROT_READ, _mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            try:
                n = -(-size // page)
                vec = (ctypes.c_ubyte * n)()
                if libc.mincore(addr, size, vec) == 0:
                    total += n
                    resident += sum(b & 1 for b in vec)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0
