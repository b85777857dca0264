"""What a case reads about processes and files: memory, CPU time, peaks, eviction, all from ``/proc``.

``Sampler`` keeps the peaks of groups of processes (the case, the daemon, DCP's writer, the ranks): RSS, ``RssAnon``
(private), ``RssFile`` (mapped files), ``RssShmem`` (slots, staging copies).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

TICK = 1.0 / os.sysconf("SC_CLK_TCK")
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
INTERVAL_S = 0.02


def memory(pid: int | str = "self") -> dict[str, int]:
    """``FIELDS`` of ``pid`` in bytes (empty if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = [line.split(":", 1) for line in f]
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in fields if k in FIELDS}


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of ``pid``, all its threads (0 if it is gone)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = data[data.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * TICK


def reset_peak_rss() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    """This process's ``VmHWM`` in bytes: its peak RSS since start or the last reset."""
    return next(int(ln.split()[1]) * 1024 for ln in Path("/proc/self/status").read_text().splitlines()
                if ln.startswith("VmHWM:"))


class Sampler:
    """Peaks of each group's summed memory fields while it runs (a context manager)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items() if pids}
        self.peaks: dict[str, dict[str, int]] = {name: dict.fromkeys(FIELDS, 0) for name in self.groups}
        self.first: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def sample(self) -> None:
        for name, pids in self.groups.items():
            each = [memory(pid) for pid in pids]
            total = {k: sum(m.get(k, 0) for m in each) for k in FIELDS}
            self.first.setdefault(name, total)
            self.peaks[name] = {k: max(v, total[k]) for k, v in self.peaks[name].items()}

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self.sample()

    def __enter__(self) -> "Sampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def evict(paths: list[Path]) -> None:
    """Drop the page-cache pages of ``paths`` (``POSIX_FADV_DONTNEED``): the next read is cold."""
    for path in paths:
        with open(path, "rb") as f:
            os.fdatasync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def files_under(path: Path) -> list[Path]:
    """Every file of a checkpoint directory (or the file itself)."""
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
