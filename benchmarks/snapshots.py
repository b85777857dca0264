"""Memory snapshots: their blocking against a disk save's and a memcpy; restore from memory against a cold disk load.

One client and one daemon: disk saves, then snapshots (each to a new path, the daemon keeping the newest), blocking
from the call to its return (sync staging); restores are ``ckptd.load`` of the newest snapshot (owning copies,
checksums verified), set against a memcpy of the same bytes into one fresh buffer (as restore reads a shard; fresh
tensors of up to 32 MiB would reuse the heap glibc kept from the last repetition) and a cold ``ckptd.load`` of its
persisted copy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ckptd
import torch

from .limits import memcpy_reused, timed
from .limits import evict, files_under
from .saves import BenchDaemon


def snapshots(state: Any, tensors: list[torch.Tensor], nbytes: int, scratch: Path, repeat: int) -> dict:
    root, reps = scratch / "snapshots", {}
    with BenchDaemon(scratch) as daemon, ckptd.Client(run_dir=daemon.run_dir, spawn=False) as client:
        for key, persist in (("disk_blocking", True), ("blocking", False)):
            reps[key] = []
            for i in range(1 + repeat):
                t0 = time.perf_counter()
                fut = client.save_async(state, root / f"{key}-{i}", step=i, persist=persist)
                reps[key].append(time.perf_counter() - t0)
                fut.result()
            del reps[key][0]  # the warm-up made the slot
        newest = ckptd.latest(root, run_dir=daemon.run_dir)
        reps["restore"] = timed(lambda: ckptd.load(newest, run_dir=daemon.run_dir), repeat)
        reps["memcpy_fresh"] = timed(lambda: torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]), repeat)
        reps["memcpy"] = memcpy_reused(tensors, nbytes, repeat)
        client.persist(newest)
        reps["cold_load"] = timed(lambda: ckptd.load(newest), repeat, cleanup=lambda: evict(files_under(newest)))
    return {"reps": reps}
