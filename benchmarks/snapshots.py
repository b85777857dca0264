"""Memory snapshots: their blocking against a disk save's and a memcpy; restore from memory against a cold disk load.

One client and one daemon: disk saves, then snapshots (each to a new path, the daemon keeping the newest), blocking
from the call to its return (sync staging); restores are ``ckptd.load`` of the newest snapshot (owning copies,
checksums verified), set against a memcpy of the same bytes into one fresh buffer (as restore reads a shard; fresh
tensors of up to 32 MiB would reuse the heap glibc kept from the last repetition) and a cold ``ckptd.load`` of its
persisted copy. ``load_into`` of the newest snapshot into a state of the same shapes (touched once, as a trainer's
are), with and without the checksum, is set against a memcpy of the same bytes into the same targets (``memmove`` per
tensor, on one thread, as the load's reads are).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import ckptd
import torch

from .limits import memcpy_reused, timed
from .limits import evict, files_under
from .saves import BenchDaemon


def _like(obj: Any) -> Any:
    """A state of the same structure whose tensors are new (and touched), to restore into."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _like(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_like(v) for v in obj)
    return obj


def _pairs(dst: Any, src: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, saved) tensors of two states of the same structure."""
    if isinstance(dst, torch.Tensor):
        return [(dst, src)]
    if isinstance(dst, dict):
        return [p for k in dst for p in _pairs(dst[k], src[k])]
    if isinstance(dst, (list, tuple)):
        return [p for d, s in zip(dst, src) for p in _pairs(d, s)]
    return []


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
        target = _like(state)
        pairs = _pairs(target, state)
        assert all(d.is_contiguous() and s.is_contiguous() for d, s in pairs), "memcpy_into copies whole tensors"

        def memcpy_into() -> None:  # one memcpy per tensor, on one thread (torch's copy_ spreads over its OpenMP team)
            for dst, src in pairs:
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        # Interleaved, so that a change of load on the machine meets all three alike.
        reps["restore_into"], reps["restore_into_unverified"], reps["memcpy_into"] = [], [], []
        for _ in range(1 + repeat):
            reps["restore_into"].append(_once(lambda: ckptd.load_into(target, newest, run_dir=daemon.run_dir)))
            reps["restore_into_unverified"].append(
                _once(lambda: ckptd.load_into(target, newest, run_dir=daemon.run_dir, verify=False)))
            reps["memcpy_into"].append(_once(memcpy_into))
        for key in ("restore_into", "restore_into_unverified", "memcpy_into"):
            del reps[key][0]  # the warm-up
        client.persist(newest)
        reps["cold_load"] = timed(lambda: ckptd.load(newest), repeat, cleanup=lambda: evict(files_under(newest)))
    return {"reps": reps}


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
