"""Where a first save's blocking time goes: the fresh slot's pages, against the copy into them (issue #30).

    python -m benchmarks.first_save --mib 256 --repeat 3

Last, a snapshot client's saves one after the other (``persist=False``, ``--snapshots`` saves, a pause of a step
between them): each lends its slot to the daemon, so the second one needs a slot of its own (prepared on a helper
thread when the first was lent, ``SlotPool.lend``).

Then, through a real daemon and ``ckptd.Client()`` without ``reserve_bytes``: the transformer state of the same
size, a fresh client's first save against its next ones (sync staging, each client fresh, ``--repeat`` clients),
and the two ways of setting up a fresh slot timed side by side: ``pwritev`` of the tensors into the empty file
(what ``Slot.fill`` does now, on 1 and 2 threads) and allocate + populate + copy (what the first save did before).

A client's first save makes its slot: ``posix_fallocate`` (tmpfs allocates and zeroes every page) and a
populate for writing (``MADV_POPULATE_WRITE``: every page table entry), then the copy. A steady save only copies
into the reused slot. This times each part on one thread, and the allocate+populate split over 2 and 4
threads (what a pipelined or parallel slot set-up could reach on this machine), beside the copy into fresh and
into reused memory, all in one run, and says whether ``/dev/shm`` can use huge pages (``shmem_enabled``), which
cut the faults 512-fold where allowed.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

from ckptd.client.prefault import populate
from ckptd.protocol.shm import shm_dir

SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def _prepare(fd: int, base: int, offset: int, size: int) -> None:
    os.posix_fallocate(fd, offset, size)
    populate(base + offset, base + offset + size)


def one(size: int, threads: int, src: torch.Tensor) -> dict[str, float]:
    """One fresh slot of ``size`` bytes: allocate+populate on ``threads`` threads, then two copies into it."""
    path = shm_dir() / f"ckptd-bench-first-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        buf = (ctypes.c_char * size).from_buffer(m)
        base, part = ctypes.addressof(buf), size // threads
        started = time.perf_counter()
        if threads == 1:
            os.posix_fallocate(fd, 0, size)
            allocated = time.perf_counter()
            populate(base, base + size)
        else:
            workers = [threading.Thread(target=_prepare, args=(fd, base, i * part, part)) for i in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            allocated = started
        prepared = time.perf_counter()
        dst = torch.frombuffer(buf, dtype=torch.uint8)
        dst.copy_(src)
        copied = time.perf_counter()
        dst.copy_(src)
        reused = time.perf_counter()
        del dst, buf
        m.close()
        return {"fallocate": allocated - started if threads == 1 else float("nan"), "prepare": prepared - started,
                "copy_fresh_slot": copied - prepared, "copy_reused": reused - copied}
    finally:
        os.close(fd)
        os.unlink(path)


def pwrite_fresh(size: int, threads: int, src: torch.Tensor) -> float:
    """``pwritev`` of ``src`` into an empty tmpfs file on ``threads`` threads, as ``client/fill.py`` writes a fresh
    slot; seconds."""
    from ckptd.client.fill import _write_batch
    from concurrent.futures import ThreadPoolExecutor
    path = shm_dir() / f"ckptd-bench-first-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    view = memoryview((ctypes.c_char * size).from_address(src.data_ptr())).cast("B")
    pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None
    try:
        os.ftruncate(fd, size)
        started = time.perf_counter()
        _write_batch(fd, [(0, view)], threads, pool)
        return time.perf_counter() - started
    finally:
        if pool is not None:
            pool.shutdown()
        os.close(fd)
        os.unlink(path)


def client_saves(mib: int, repeat: int) -> dict[str, list[float]]:
    """Blocking seconds of a fresh client's first save (no ``reserve_bytes``) and of its next three, ``repeat``
    clients one after the other on one daemon."""
    import tempfile
    import ckptd
    from .saves import BenchDaemon
    from .state import build
    bench = build("transformer", mib / 1024)
    out: dict[str, list[float]] = {"first": [], "steady": []}
    with tempfile.TemporaryDirectory(prefix="ckbench-first-") as root, BenchDaemon(Path(root)) as daemon:
        for c in range(repeat):
            with ckptd.Client(run_dir=daemon.run_dir, spawn=False, max_inflight=1) as client:
                for i in range(4):
                    t0 = time.perf_counter()
                    fut = client.save_async(bench.state, Path(root) / f"c{c}-{i}", step=i)
                    (out["first"] if i == 0 else out["steady"]).append(time.perf_counter() - t0)
                    fut.result()
                    shutil.rmtree(Path(root) / f"c{c}-{i}")
    return out


def snapshot_saves(mib: int, repeat: int, saves: int, pause: float) -> list[list[float]]:
    """Blocking seconds of each of a fresh snapshot client's first ``saves`` saves (``persist=False``, ``pause``
    seconds between them, as a training step would leave), ``repeat`` clients one after the other on one daemon."""
    import tempfile
    import ckptd
    from .saves import BenchDaemon
    from .state import build
    bench = build("transformer", mib / 1024)
    out: list[list[float]] = [[] for _ in range(saves)]
    with tempfile.TemporaryDirectory(prefix="ckbench-first-") as root, \
            BenchDaemon(Path(root), "--persist-on-exit", "never") as daemon:
        for c in range(repeat):
            with ckptd.Client(run_dir=daemon.run_dir, spawn=False) as client:
                for i in range(saves):
                    t0 = time.perf_counter()
                    fut = client.save_async(bench.state, Path(root) / f"s{c}-{i}", step=i, persist=False)
                    out[i].append(time.perf_counter() - t0)
                    fut.result()
                    time.sleep(pause)
                client.delete(Path(root) / f"s{c}-{saves - 1}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--snapshots", type=int, default=5, help="saves per snapshot client (0: none)")
    args = parser.parse_args()
    size = args.mib << 20
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    thp = SHMEM_THP.read_text().strip() if SHMEM_THP.exists() else "unknown"
    print(f"{args.mib} MiB, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, shmem_enabled: {thp}")
    for threads in (1, 2, 4):
        runs = [one(size, threads, src) for _ in range(args.repeat)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        first = med["prepare"] + med["copy_fresh_slot"]
        print(f"threads {threads}: fallocate {med['fallocate']:.3f} s, allocate+populate {med['prepare']:.3f} s, "
              f"copy {med['copy_fresh_slot']:.3f} s, steady copy {med['copy_reused']:.3f} s; "
              f"first ÷ steady {first / med['copy_reused']:.2f}")
    for threads in (1, 2):
        runs = [pwrite_fresh(size, threads, src) for _ in range(args.repeat)]
        print(f"pwritev into an empty slot file, {threads} thread(s): {statistics.median(runs):.3f} s "
              f"({', '.join(f'{r:.3f}' for r in runs)})")
    saves = client_saves(args.mib, args.repeat)
    first, steady = statistics.median(saves["first"]), statistics.median(saves["steady"])
    print(f"ckptd.Client without reserve_bytes, transformer state of {args.mib} MiB: first save blocking {first:.3f} s, "
          f"steady {steady:.3f} s: first ÷ steady {first / steady:.2f} (firsts: "
          f"{', '.join(f'{r:.3f}' for r in saves['first'])}; steadies: "
          f"{', '.join(f'{r:.3f}' for r in saves['steady'])})")
    if args.snapshots:
        snaps = snapshot_saves(args.mib, args.repeat, args.snapshots, pause=0.3)
        print(f"snapshot client (persist=False), blocking of save 1..{args.snapshots}, medians: "
              f"{', '.join(f'{statistics.median(b):.3f}' for b in snaps)} s (each: "
              f"{'; '.join(', '.join(f'{x:.3f}' for x in b) for b in snaps)})")


if __name__ == "__main__":
    main()
