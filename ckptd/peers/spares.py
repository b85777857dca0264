"""The files of replicas a newer one replaced, kept for the next replica of the same directory's ranks.

A buddy receives a run's snapshots one after another into the same directory:
each new replica replaces the one before it. Written into a fresh file, every
page of the new one is allocated by tmpfs as its frames land, and the old
one's pages are freed when it is replaced: on this project's machine, 256 MiB
took 0.25-0.31 s through a fresh file where one whose pages were allocated
already took 0.19 s, and the unlink of the old one 0.04-0.06 s more, on the
cores the node's training uses. So the file of a replica that a newer one
replaced (or that its origin let go: a run that keeps one snapshot forgets
the older as the newer is held) waits here (``Spares``), by (origin,
directory, rank), and the next offer of that key takes it over: renamed to the
new shard's name, cut or grown to its size, its pages written over. A replica
that a stream still reads (a restore, a build copying its chunks) is never
made a spare: its file is closed as before.

A spare is memory that holds nothing anyone asked for, so it counts in the
node's memory budget (``bytes``) and is the first thing let go: when a
snapshot of the node's own or another replica needs the room
(``release``), after ``SPARE_S`` without an offer to take it (``expire``),
and when the daemon exits.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

log = logging.getLogger("ckptd")
SPARE_S = 300.0
"""Seconds a spare waits for the next replica of its directory's ranks: a run that snapshots less often than this
(or ended) gets its memory back, and its next replica is written into a fresh file."""

Key = tuple[str, Path, int]
"""(origin key, directory, rank): whose next replica a spare is for."""


@dataclass(eq=False)
class Spare:
    """One replica shard's file, off the books: its name in the shared-memory directory, descriptor, mapping."""

    name: str
    fd: int
    map: mmap.mmap
    size: int
    since: float = field(default_factory=time.monotonic)


class Spares:
    """The spares, on the loop thread; what is let go is unlinked by ``unlink`` (the caller's pool: freeing a
    large file's pages takes tens of milliseconds)."""

    def __init__(self, shm_dir: Path, unlink: Callable[[Callable[[], None]], None]) -> None:
        self.shm_dir, self._unlink = shm_dir, unlink
        self._by_key: dict[Key, Spare] = {}

    @property
    def bytes(self) -> int:
        """What the spares hold of the memory budget."""
        return sum(s.size for s in self._by_key.values())

    def keep(self, key: Key, spare: Spare) -> None:
        """``spare`` waits for the next replica of ``key`` (one kept before it for the same key goes)."""
        old = self._by_key.pop(key, None)
        if old is not None:
            self._let_go([old], "replaced")
        self._by_key[key] = spare

    def take(self, key: Key) -> Spare | None:
        """The spare for ``key``, now the caller's (None: none)."""
        return self._by_key.pop(key, None)

    def release(self, needed: int) -> int:
        """Let spares go, oldest first, until ``needed`` bytes are freed or none is left; the bytes freed."""
        freed, gone = 0, []
        for key, spare in sorted(self._by_key.items(), key=lambda item: item[1].since):
            if freed >= needed:
                break
            gone.append(self._by_key.pop(key))
            freed += spare.size
        self._let_go(gone, "room")
        return freed

    def expire(self, now: float) -> None:
        """Let go the spares no offer took within ``SPARE_S``."""
        old = [key for key, spare in self._by_key.items() if now - spare.since > SPARE_S]
        self._let_go([self._by_key.pop(key) for key in old], "unused")

    def close(self) -> None:
        """The daemon exits: every spare goes, on the calling thread."""
        gone, self._by_key = list(self._by_key.values()), {}
        for spare in gone:
            remove(self.shm_dir, spare)

    def _let_go(self, spares: list[Spare], reason: str) -> None:
        """Unlink ``spares`` on the pool, logged (``reason``: ``room`` needed, ``unused`` for ``SPARE_S``, or
        ``replaced`` by a newer spare of the same key)."""
        if spares:
            log.info("event=replica_spares_released count=%d bytes=%d reason=%s", len(spares),
                     sum(s.size for s in spares), reason)
            shm_dir = self.shm_dir
            self._unlink(lambda: [remove(shm_dir, s) for s in spares])


def adopt(spare: Spare, shm_dir: Path, name: str, size: int) -> tuple[int, mmap.mmap]:
    """Make ``spare``'s file the new shard file ``name`` of ``size`` bytes (renamed, cut or grown, mapped anew if its
    size changed): its descriptor and mapping. Unlinked if that fails."""
    try:
        os.rename(shm_dir / spare.name, shm_dir / name)
        if spare.size == size:
            return spare.fd, spare.map
        spare.map.close()
        os.ftruncate(spare.fd, max(1, size))
        return spare.fd, mmap.mmap(spare.fd, max(1, size), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        remove(shm_dir, spare, name)
        raise


def remove(shm_dir: Path, spare: Spare, *names: str) -> None:
    """Unmap, close and unlink ``spare`` (under its own name, or any of ``names``: a file already gone is fine)."""
    if not spare.map.closed:
        spare.map.close()
    if spare.fd >= 0:
        os.close(spare.fd)
        spare.fd = -1
    for name in (spare.name, *names):
        try:
            os.unlink(shm_dir / name)
        except FileNotFoundError:
            pass
