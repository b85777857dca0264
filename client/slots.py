"""The client's shared-memory slots: created once, pre-faulted, reused.

Copying into memory that was touched before runs ~10x faster than into
fresh shared memory (page faults dominate the latter), so a client keeps a
small pool of slots and reuses them for every save. A slot is a file in
``/dev/shm`` named ``ckptd-<uid>-<pid>-<n>``; the daemon maps the same file
read-only and writes it to disk. Space is reserved with ``posix_fallocate``
so a full ``/dev/shm`` is an error at creation, never a SIGBUS mid-copy.

Slots are unlinked on ``close()`` and at interpreter exit, by the process
that created them only: a forked child inherits the parent's slot objects
(and the exit hook), but the slots stay the parent's. If the process is
killed, the daemon reclaims them when it sees the pid is gone. The directory
is ``$CKPTD_SHM_DIR`` or ``/dev/shm`` (``ckptd.protocol.shm``).

A slot holding a memory snapshot is lent to the daemon: the pool never
hands it out, and this process never unlinks it (the daemon does, or gives it
back when it drops the snapshot: ``reclaim``).

A fresh slot's first save pays for its pages (tmpfs allocates every 4 KiB
page as it is written: about 4x the copy into reused pages here). Lending the
only slot of its size to the daemon (a snapshot) therefore makes and
prepares the next one at once, on a helper thread (``SlotPool.lend``): a
snapshot's next save (every step, say) finds its slot ready instead of
paying for a fresh one on the caller's thread.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import itertools
import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING, Callable

import torch

from ckptd.protocol.errors import NoSpace
from ckptd.protocol.layout import PAGE_SIZE
from ckptd.protocol.shm import shm_dir, shm_shortage_message, slot_name

if TYPE_CHECKING:
    from ckptd.protocol.layout import ShardLayout

    from .flatten import Flat

from .fill import fill
from .prefault import MADV_POPULATE_READ, populate

GROWTH_QUANTUM = 1 << 20
"""Slots are sized in whole MiB so that small growth reuses the slot."""

_counter = itertools.count()
_live: "weakref.WeakSet[Slot]" = weakref.WeakSet()


class Slot:
    """One shared-memory segment and a uint8 tensor over it."""

    def __init__(self, size: int, *, prepared: bool = True) -> None:
        """``prepared``: reserve and fault in every page now (``reserve_bytes``); else the slot starts empty and
        ``fresh``, for its first save to ``fill`` (``client/fill.py``) or ``prepare`` it."""
        self.size = max(PAGE_SIZE, -(-size // GROWTH_QUANTUM) * GROWTH_QUANTUM)
        self.owner_pid = os.getpid()
        """Only this process unlinks the slot (not a forked child)."""
        self.name = slot_name(os.getuid(), self.owner_pid, next(_counter))
        self.directory = shm_dir()
        self.path = self.directory / self.name
        self._fd: int | None = None
        """Open while the slot is fresh: no page of it is reserved or mapped yet."""
        self._warming: threading.Thread | None = None
        """Populating the mapping after a ``fill``; the next copy through the mapping waits for it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:  # Ctrl-C included: never leave a half-made slot behind
            if prepared:
                os.posix_fallocate(fd, 0, self.size)
            else:
                os.ftruncate(fd, self.size)  # its pages come with its first save's writes
            self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if prepared:
                self._populate(fd)
            self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        except BaseException as exc:
            os.close(fd)
            os.unlink(self.path)
            self._raise_no_space(exc)
            raise
        if prepared:
            os.close(fd)
        else:
            self._fd = fd
        self.pinned: bool | None = None
        """Registered with CUDA as pinned memory (None: not tried yet)."""
        self.lent = False
        """The daemon holds a snapshot in it: this process must not unlink it."""
        _live.add(self)

    def _populate(self, fd: int) -> None:
        # Every page is faulted in now, not during a save, in the kernel: no
        # parallel torch op, which can hang in a forked child.
        if not _populate_for_writing(self.map):
            self.map.close()
            self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)

    def _raise_no_space(self, exc: BaseException) -> None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise NoSpace(shm_shortage_message(self.size, self.directory, exc.strerror)) from None

    def _out_of_room(self, exc: OSError) -> None:
        """A fresh slot's write found ``/dev/shm`` full: unlink the slot (its memory is given back) and say so."""
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            self.close()
            self._raise_no_space(exc)

    @property
    def fresh(self) -> bool:
        """Nothing was written into the slot yet: its first save writes it with ``fill`` (host tensors) or
        ``prepare``s it (a save with CUDA tensors copies through the pinned mapping). Either reserves every page."""
        return self._fd is not None

    def prepare(self) -> None:
        """Reserve and fault in every page of a fresh slot (as ``prepared=True`` does at creation)."""
        fd = self._fd
        assert fd is not None, "prepare() of a slot that is not fresh"
        try:
            os.posix_fallocate(fd, 0, self.size)
            del self.tensor
            self._populate(fd)
            self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        except BaseException as exc:
            self.close()
            self._raise_no_space(exc)
            raise
        self._fd = None
        os.close(fd)

    def prepare_ahead(self) -> None:
        """``prepare`` a fresh slot on a helper thread; ``ready`` waits for it. A failure (``/dev/shm`` full)
        closes the slot, which its next taker sees (``usable``) and replaces: the error is then that save's."""
        assert self._fd is not None and self._warming is None, "prepare_ahead() of a slot that is not fresh"

        def run() -> None:
            try:
                self.prepare()
            except BaseException:  # closed by prepare(): never taken
                pass
        self._warming = threading.Thread(target=run, name="ckptd-slot-prepare", daemon=True)
        self._warming.start()

    @property
    def usable(self) -> bool:
        """Mapped (not closed by a failed ``prepare_ahead``)."""
        return not self.map.closed

    def write(self, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of a fresh slot, with ``pwrite`` (its mapping stays untouched)."""
        assert self._fd is not None, "write() of a slot that is not fresh"
        try:
            view = memoryview(data)
            while len(view):
                view = view[os.pwrite(self._fd, view, offset + len(data) - len(view)):]
        except OSError as exc:
            self._out_of_room(exc)
            raise

    def fill(self, flat: "Flat", layout: "ShardLayout", progress: Callable[[int], None] | None = None) -> None:
        """Write a fresh slot's first shard with ``pwritev`` (``client/fill.py``), reserve the rest of the slot, and
        populate the mapping for the next save on a helper thread. Out of room: the slot is unlinked, ``NoSpace``; any
        other failure leaves it fresh (whatever its next save does not write again is never read)."""
        fd = self._fd
        assert fd is not None, "fill() of a slot that is not fresh"
        try:
            fill(fd, flat, layout, progress)
            tail = min(layout.nbytes // PAGE_SIZE * PAGE_SIZE, self.size - PAGE_SIZE)
            os.posix_fallocate(fd, tail, self.size - tail)  # no later copy can meet a missing page
        except OSError as exc:
            self._out_of_room(exc)
            raise  # another failure (a tensor that cannot be read): the slot stays fresh, for the next save
        self._fd = None
        os.close(fd)
        self._warming = threading.Thread(target=self._warm, name="ckptd-slot-warm", daemon=True)
        self._warming.start()

    def _warm(self) -> None:
        """Map every page of the filled slot: they are in the page cache now, so ``MADV_POPULATE_READ`` maps 16 a
        fault (fault-around), writable in a shared tmpfs mapping; measured on 256 MiB: 0.016 s, against 0.04 s
        populating for writing (a fault a page). Where refused, the next copy faults the pages in itself."""
        start = self.tensor.data_ptr()
        populate(start, start + self.size, MADV_POPULATE_READ)

    def ready(self) -> None:
        """Wait for the mapping's population after a ``fill``, or for ``prepare_ahead`` (the next copy through the
        mapping runs at full speed, with no page faults)."""
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
            self._warming = None

    def pin(self) -> bool:
        """Register the slot as CUDA pinned memory, once; False if CUDA refuses."""
        if self.pinned is None:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0))
                self.pinned = True
            except Exception:  # no CUDA, or registration refused: copies still work, unpinned
                self.pinned = False
        return self.pinned

    def close(self) -> None:
        """Unlink (in the creating process only) and unmap; safe to call twice."""
        if self.map.closed:
            return
        self.ready()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if os.getpid() == self.owner_pid and not self.lent:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self.pinned and os.getpid() == self.owner_pid:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view: leave it to GC
            pass


def _populate_for_writing(m: mmap.mmap) -> bool:
    """Fault every page of ``m`` in, writable (False where the kernel cannot: then ``MAP_POPULATE`` does).

    Measured on 1 GiB here (fallocate included): 0.53 CPU-s against 0.65 for
    ``MAP_POPULATE``, which faults a shared mapping in for reading. Through
    ctypes, so other threads (a training step, with background staging) run
    meanwhile: ``mmap.madvise`` holds the GIL.
    """
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    try:
        return populate(ctypes.addressof(buf), ctypes.addressof(buf) + len(m))
    finally:
        del buf  # the export would keep the mapping from closing


class SlotPool:
    """At most ``capacity`` slots; a save takes a free one big enough."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[Slot] = []
        self._busy: set[Slot] = set()
        self._lent: dict[str, Slot] = {}
        self._closed = False
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Slot:
        """A free slot of at least ``nbytes``, or a new one if none fits.

        When the state has grown past every free slot, those slots are too
        small from now on: their memory is given back before the new one is
        made. The caller bounds in-flight saves, so the pool never exceeds
        its capacity.
        """
        with self._lock:
            assert len(self._busy) < self.capacity, "more saves in flight than slots"
            fits = [s for s in self._free if s.size >= nbytes]
            slot = min(fits, key=lambda s: s.size) if fits else None
            if slot is not None:
                self._free.remove(slot)
            stale, self._free = (self._free, []) if slot is None else ([], self._free)
        for s in stale:
            s.close()
        if slot is not None:
            slot.ready()
            if not slot.usable:  # its preparation ahead failed: this save makes its own, and meets the error
                slot = None
        if slot is None:
            slot = Slot(nbytes, prepared=False)  # fresh: its first save writes it (``Slot.fill``)
        with self._lock:
            self._busy.add(slot)
        return slot

    def reserve(self, nbytes: int) -> None:
        """Make a free slot of at least ``nbytes`` now, before any save needs it."""
        slot = Slot(nbytes)
        with self._lock:
            self._free.append(slot)

    def give_back(self, slot: Slot) -> None:
        """A save is done with ``slot``: free for the next, or unlinked when the pool closed meanwhile (a save
        that ``close`` left running, after a Ctrl-C in it, ends after the pool)."""
        with self._lock:
            self._busy.discard(slot)
            keep = not slot.map.closed and not self._closed
            if keep:
                self._free.append(slot)
        if not keep:
            slot.close()

    def lend(self, slot: Slot) -> None:
        """The daemon took ``slot`` over (it holds a snapshot): out of the pool until ``reclaim``.

        If no free slot could take a save of its size now, the next one is
        made and prepared at once, on a helper thread: the next save (a
        snapshot every step, say) would make it anyway, on its own thread,
        at about 4x the copy's time. Only within the pool's capacity.
        """
        with self._lock:
            self._busy.discard(slot)
            slot.lent = True
            self._lent[slot.name] = slot
            ahead = (not self._closed and len(self._free) + len(self._busy) < self.capacity
                     and not any(s.size >= slot.size for s in self._free))
        if not ahead:
            return
        try:
            spare = Slot(slot.size, prepared=False)
        except Exception:  # no room now: the next save makes its slot (and meets the error) itself
            return
        spare.prepare_ahead()
        with self._lock:
            keep = not self._closed
            if keep:
                self._free.append(spare)
        if not keep:
            spare.close()

    def reclaim(self, names: tuple[str, ...]) -> None:
        """The daemon dropped the snapshots in these slots: they are free again."""
        with self._lock:
            for name in names:
                slot = self._lent.pop(name, None)
                if slot is not None:
                    slot.lent = False
                    self._free.append(slot)

    @property
    def names(self) -> list[str]:
        with self._lock:
            return [s.name for s in (*self._free, *self._busy, *self._lent.values())]

    @property
    def lent_names(self) -> list[str]:
        with self._lock:
            return list(self._lent)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            slots, self._free, self._busy = [*self._free, *self._busy, *self._lent.values()], [], set()
            self._lent = {}
        for s in slots:
            s.close()


@atexit.register
def _unlink_all() -> None:
    for slot in list(_live):
        if slot.owner_pid == os.getpid():  # a forked child leaves its parent's slots alone
            slot.close()
