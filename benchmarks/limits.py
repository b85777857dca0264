"""What this machine can do at best with the state's bytes (the floors ckptd is measured against), and what a case
reads about processes and files (memory, CPU time, peaks, eviction, from ``/proc``).

Blocking: a ``copy_`` per tensor into a buffer touched before (pinned for CUDA), as staging does (into a new
``/dev/shm`` file: without reused slots). Durable: an O_DIRECT write in the daemon's ``pwrite`` size + ``fsync``. Loading: a
sequential read into one reused buffer. ``Sampler`` keeps the peaks of groups of processes (the case, the daemon,
DCP's writer, the ranks): RSS, ``RssAnon`` (private), ``RssFile`` (mapped files), ``RssShmem`` (slots, staging copies).
"""
from __future__ import annotations
import contextlib
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable
import psutil
import torch
from ckptd.core.config import DEFAULT_CHUNK_BYTES

CHUNK, PAGE = 8 << 20, 4096

def timed(fn: Callable[[], object], repeat: int, cleanup: Callable[[], None] | None = None) -> list[float]:
    """Seconds of ``repeat`` calls of ``fn`` after one warm-up; ``cleanup`` runs untimed after each."""
    out = []
    for _ in range(1 + repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if cleanup is not None:
            cleanup()
    return out[1:]

def copy_into(buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` back to back into the uint8 tensor ``buf``, as staging does."""
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=t.is_cuda)
        offset += n
    if any(t.is_cuda for t in tensors[:1]):
        torch.cuda.synchronize()

def memcpy_reused(tensors: list[torch.Tensor], nbytes: int, repeat: int,
                  cleanup: Callable[[], None] | None = None) -> list[float]:
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=tensors[0].is_cuda)
    buf.fill_(0)
    return timed(lambda: copy_into(buf, tensors), repeat, cleanup)

def memcpy_fresh_shm(tensors: list[torch.Tensor], nbytes: int, repeat: int) -> list[float]:
    path = Path(f"/dev/shm/ckbench-{os.getpid()}")
    def once() -> None:
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            with mmap.mmap(f.fileno(), nbytes) as m:
                copy_into(torch.frombuffer(m, dtype=torch.uint8), tensors)
    return timed(once, repeat, cleanup=lambda: path.unlink(missing_ok=True))

def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned, touched anonymous buffer of ``nbytes`` rounded up to a page."""
    m = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE)
    torch.frombuffer(m, dtype=torch.uint8).fill_(0xA5)
    return m

def write_file(path: Path, data: memoryview, nbytes: int, *, direct: bool = True) -> None:
    """Create ``path``, write ``nbytes`` of ``data`` in pieces the daemon's size, fsync."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    with open(path, "wb", buffering=0, opener=lambda p, _: os.open(p, flags, 0o644)) as f:
        end, offset = len(data) if direct else nbytes, 0
        while offset < end:
            offset += os.pwrite(f.fileno(), data[offset:min(offset + DEFAULT_CHUNK_BYTES, end)], offset)
        os.ftruncate(f.fileno(), nbytes)
        os.fsync(f.fileno())

def parallel_writes(scratch: Path, nbytes: int, writers: int, repeat: int, *, direct: bool = True) -> list[float]:
    """``writers`` threads each writing ``nbytes // writers`` to its own file at once (one writer: a plain write)."""
    each = nbytes // writers
    targets = [scratch / f"raw-{direct}-{i}.bin" for i in range(writers)]
    def once() -> None:
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(lambda t: write_file(t, view, each, direct=direct), targets))
    def cleanup() -> None:  # evicted and removed: the next write starts alike
        evict(targets)
        for t in targets:
            t.unlink()
    with aligned_buffer(each) as buf, memoryview(buf) as view:
        return timed(once, repeat, cleanup)

def read_files(paths: list[Path], *, direct: bool = False) -> int:
    """Read ``paths`` sequentially in ``CHUNK`` pieces into one reused buffer; returns the bytes read."""
    total = 0
    with aligned_buffer(CHUNK) as buf, memoryview(buf) as view:
        for path in paths:
            with open(path, "rb", buffering=0, opener=lambda p, f: os.open(p, f | (os.O_DIRECT if direct else 0))) as f:
                while (n := os.readv(f.fileno(), [view])) > 0:
                    total += n
    return total

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

def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of ``pid`` (default this process), all its threads (0 if it is gone)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return sum(psutil.Process(pid).cpu_times()[:2])
    return 0.0

def machine_seconds(path: Path, groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU s of each group of pids and of the machine, busy s of the disk under ``path``, the time (for deltas)."""
    t, dev = psutil.cpu_times(), os.stat(path).st_dev
    disk = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve().name
    return {**{k: sum(map(cpu_seconds, pids)) for k, pids in groups.items()}, "busy": t.user + t.nice + t.system +
            t.irq + t.softirq, "disk": psutil.disk_io_counters(perdisk=True)[disk].busy_time / 1e3, "wall": time.monotonic()}

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
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, name="sampler", daemon=True)
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
