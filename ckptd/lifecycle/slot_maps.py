"""The daemon's view of clients' shared-memory slots.

A client creates its slots as ``/dev/shm/ckptd-<uid>-<pid>-<n>`` (the
directory is ``$CKPTD_SHM_DIR`` if set, see ``ckptd.protocol.shm``) and reuses
them for every save. The daemon maps each slot read-only once and keeps the
mapping while the slot keeps its identity (inode and size), so a steady
stream of saves costs no page-table set-up after the first. A slot is only
accepted from the process whose pid is in its name, and only if it belongs
to the daemon's own user.

A mapping pins the slot's memory even after the client unlinks the file (a
client replaces a slot that became too small), so the daemon keeps each
slot's fd and drops a mapping whose file has no name left (``st_nlink == 0``)
as soon as it notices: when the same client commits again, and in
housekeeping. Closing a mapping never raises: if something still holds a view
of it, that is logged and the memory goes when the view does.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from ckptd.protocol.errors import BadSlot
from ckptd.protocol.processes import pid_alive
from ckptd.protocol.shm import DEFAULT_SHM_DIR, SHM_DIR_ENV
from ckptd.protocol.shm import shm_dir as default_shm_dir
from ckptd.protocol.shm import slot_name, slot_owner

log = logging.getLogger("ckptd")


@dataclass
class MappedSlot:
    name: str
    inode: int
    size: int
    map: mmap.mmap
    fd: int
    """Kept open so that ``fstat`` tells whether the client has unlinked the slot."""
    users: int = 0
    """Writes in flight over this mapping; it is only closed at zero."""
    header: tuple[bytes, int, tuple, int, tuple | None] | None = None
    """The last header parsed in this slot: its bytes, the shard size, its entries by offset, its data start, and
    the checked table (``CheckedTable``) it last matched."""

    @property
    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        """Unmap and close the fd; never raises (a view still held keeps the memory until it goes)."""
        try:
            self.map.close()
        except BufferError:
            log.error("event=slot_view_leak slot=%s bytes=%d: a view of the mapping is still held; it is "
                      "unmapped when that view goes", self.name, self.size)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotMaps:
    """Read-only mappings of client slots, cached by name.

    ``acquire`` maps on the admission worker (without ``MAP_POPULATE``: the
    write and the checksum fault the pages in) while the loop releases and
    forgets, so every method holds one lock.
    """

    def __init__(self, shm_dir: Path | None = None) -> None:
        self.shm_dir = shm_dir if shm_dir is not None else default_shm_dir()
        self._maps: dict[str, MappedSlot] = {}
        self._lock = threading.RLock()
        self._own = itertools.count()

    def own_name(self) -> str:
        """A new slot name of this daemon's own pid (a held snapshot's, a replica's): the next daemon with that
        pid, or any daemon's start once this one is dead, unlinks what is left under it."""
        return slot_name(os.getuid(), os.getpid(), next(self._own))

    def acquire(self, name: str, *, pid: int, nbytes: int) -> MappedSlot:
        """Map slot ``name`` of client ``pid`` holding at least ``nbytes``."""
        with self._lock:
            return self._acquire(name, pid=pid, nbytes=nbytes)

    def _acquire(self, name: str, *, pid: int, nbytes: int) -> MappedSlot:
        owner = slot_owner(name)
        if owner != (os.getuid(), pid):
            raise BadSlot(f"slot {name!r} is not named {slot_name(os.getuid(), pid, 0)[:-1]}<n> for this client "
                          f"(pid {pid})")
        try:  # O_NONBLOCK: a FIFO planted under a slot's name must not block the daemon
            fd = os.open(self.shm_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise BadSlot(f"cannot open slot {name!r}: the daemon looked in {self.shm_dir} and it is not there; "
                          f"the client and the daemon must share the same {SHM_DIR_ENV} (unset for both means "
                          f"{DEFAULT_SHM_DIR})") from None
        except OSError as exc:
            raise BadSlot(f"cannot open slot {name!r} in {self.shm_dir}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadSlot(f"slot {name!r} is not a regular file")
            if st.st_uid != os.getuid():
                raise BadSlot(f"slot {name!r} belongs to uid {st.st_uid}, not to this daemon's user")
            if st.st_size < nbytes:
                raise BadSlot(f"slot {name!r} holds {st.st_size} bytes but the commit claims {nbytes}")
            self.drop_unlinked(pid)
            cached = self._maps.get(name)
            if cached and (cached.inode, cached.size) == (st.st_ino, st.st_size):
                cached.users += 1
                os.close(fd)
                return cached
            # No MAP_POPULATE: it costs ~0.1 s per GiB here, on admission, which the client's first save waits
            # for; the write and the checksum fault the pages in instead (reads fault around, O_DIRECT faults
            # in the kernel), once: the mapping is reused for every later save from this slot.
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        if cached:
            self._drop(cached)
        slot = MappedSlot(name, st.st_ino, st.st_size, mapping, fd, users=1)
        self._maps[name] = slot
        return slot

    def release(self, slot: MappedSlot) -> None:
        with self._lock:
            slot.users -= 1
            if slot.users == 0 and self._maps.get(slot.name) is not slot:
                slot.close()

    def forget_pid(self, pid: int) -> None:
        """Drop cached mappings of a client that left (closed once idle)."""
        with self._lock:
            for name in [n for n in self._maps if (slot_owner(n) or (0, 0))[1] == pid]:
                self._drop(self._maps[name])

    def drop_unlinked(self, pid: int | None = None) -> int:
        """Drop mappings of slots their client has unlinked (of ``pid``; None: every client's); returns how many.

        One still being written from is closed when its last write ends (``release``).
        """
        with self._lock:
            gone = [s for n, s in self._maps.items() if pid in (None, (slot_owner(n) or (0, 0))[1]) and s.unlinked]
            for slot in gone:
                self._drop(slot)
            return len(gone)

    def share(self, slot: MappedSlot) -> None:
        """One more user of a mapping already held (a held snapshot's slot being persisted)."""
        with self._lock:
            slot.users += 1

    def adopt(self, slot: MappedSlot, name: str) -> None:
        """Take a client's slot over (it holds a snapshot): rename it ``name``, a name of the daemon's own pid.

        No sweep then takes it for a dead client's, not this daemon's
        housekeeping nor another daemon's start-up sweep, and its client's
        own exit never unlinks it. The mapping stays; it leaves the cache.
        """
        with self._lock:
            os.rename(self.shm_dir / slot.name, self.shm_dir / name)
            if self._maps.get(slot.name) is slot:
                del self._maps[slot.name]
            slot.name = name

    def give_back(self, slot: MappedSlot, name: str) -> None:
        """Rename a held slot back to its client's ``name`` (the client reuses it) and drop the daemon's hold.

        The mapping goes back into the cache under that name, so the
        client's next save into the slot finds it mapped (a fresh
        ``MAP_POPULATE`` of a big slot costs that save tens of ms).
        """
        with self._lock:
            os.rename(self.shm_dir / slot.name, self.shm_dir / name)
            slot.name = name
            self._maps.setdefault(name, slot)
            self.release(slot)  # closes it only if another mapping had taken the name meanwhile

    def trim(self, slot: MappedSlot, nbytes: int) -> int:
        """Shrink a held slot's file to ``nbytes``, the shard it holds in whole pages (I/O); returns the bytes
        given back.

        For a slot whose client is gone: a slot only grows, so a small
        snapshot taken into one grown for a larger state (or left by a save
        that gave up) would keep all of it in ``/dev/shm`` for as long as the
        snapshot is held, while the budget counts only its shard. Nobody reads
        past the shard's last page: the daemon's mapping keeps its length, and
        its pages past the new end are never touched. A live client's slot is never
        trimmed: it gets the slot back and stages its next save into it.
        """
        with self._lock:
            if slot.size <= nbytes:
                return 0
            os.truncate(self.shm_dir / slot.name, nbytes)
            freed, slot.size = slot.size - nbytes, nbytes
            return freed

    def reclaim(self, pid: int) -> int:
        """Unlink the slots of dead client ``pid``; returns how many.

        Mappings still in use keep their memory until released, so a save the
        client committed before dying still completes.
        """
        self.forget_pid(pid)
        removed = 0
        for entry in os.scandir(self.shm_dir):
            if slot_owner(entry.name) == (os.getuid(), pid):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def _drop(self, slot: MappedSlot) -> None:
        with self._lock:
            if self._maps.get(slot.name) is slot:
                del self._maps[slot.name]
            if slot.users == 0:
                slot.close()

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._maps.values())

    def close(self) -> None:
        with self._lock:
            for slot in list(self._maps.values()):
                self._drop(slot)


def reclaim_orphaned_slots(shm_dir: Path | None = None) -> list[str]:
    """Unlink this user's ckptd slots whose owning process is gone (the start-up sweep)."""
    removed = []
    for entry in os.scandir(shm_dir if shm_dir is not None else default_shm_dir()):
        owner = slot_owner(entry.name)
        if owner is None or owner[0] != os.getuid() or pid_alive(owner[1]):
            continue
        try:
            os.unlink(entry.path)
            removed.append(entry.name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("event=slots_reclaimed count=%d", len(removed))
    return removed
