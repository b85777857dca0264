"""Admission: what a commit is checked against before its write is queued.

``examine`` is the admission work that touches files (resolving the path,
mapping the slot, reading the header back, measuring free space); it runs on
the admission worker, never on the loop thread. ``check_room`` is the
arithmetic the loop then does with what is already promised.

Refusing a save up front when it cannot fit:

A save that fails halfway for lack of space wastes the write and, on a shared
filesystem, squeezes everyone else. So before accepting a shard the daemon
checks the target filesystem has room for it, plus everything already
queued or writing to the same filesystem, plus a margin; and that the node's
``/dev/shm`` still has headroom (slots live there, and so does everything
else that uses shared memory on the node). A target on a filesystem that
holds no storage at all (``/proc``, ``/sys``) is refused as such, not as
"no space".
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass

from ckptd.protocol.errors import BadMessage, BadSlot, NoSpace, PathNotAllowed
from ckptd.protocol.layout import TensorEntry, parse_header
from ckptd.protocol.messages import StagedShard
from ckptd.protocol.shm import SHM_REMEDIES, shm_usage

from ckptd.core.render import human_bytes
from ckptd.lifecycle.slot_maps import MappedSlot, SlotMaps
from ckptd.lifecycle.writer import round_up
from ckptd.storage.backends import Backends
from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import Space


@dataclass
class Examined:
    """What admission found out about one commit, off the loop thread."""

    final: Path
    backend: Checkpoints
    """The storage ``final`` lies on: the attempt the shard joins or opens keeps it (``Attempt.backend``)."""
    slot: MappedSlot
    space: Space
    shm_free: int | None
    """Free bytes in the slot directory counting this save's own slot as free (it exists already)."""


def examine(storage: Backends, slots: SlotMaps, msg: StagedShard, *, pid: int, roots: tuple[Path, ...]) -> Examined:
    """Resolve the path, map and check the slot, measure free space (I/O; the admission worker).

    The slot is released again if anything is wrong, so a refused commit holds no mapping.
    """
    slot = slots.acquire(msg.slot, pid=pid, nbytes=round_up(msg.nbytes))
    try:
        if not _header_matches(slot, msg):
            raise BadSlot(f"slot {msg.slot!r} holds a header that does not match the commit's tensor table")
        final = storage.resolve(msg.path, roots)
        backend = storage.bind(final)
        backend.admit(final, msg.overwrite)  # before the room check: "exists" is the answer that helps
        shm_free = shm_free_bytes()
        return Examined(final, backend, slot, backend.space(final.parent),
                        None if shm_free is None else shm_free + slot.size)
    except BadMessage as exc:
        slots.release(slot)
        raise BadSlot(f"slot {msg.slot!r}: {exc.message}") from None
    except BaseException:
        slots.release(slot)
        raise


def _by_offset(e: TensorEntry) -> tuple[int, int]:
    return e.begin, e.end


def _header_matches(slot: MappedSlot, msg: StagedShard) -> bool:
    """Whether the slot's header holds the commit's tensor table (``msg.tensors``: checked, by offset).

    A training loop saves the same structure every time, so the header in a
    reused slot is the one parsed last time (same bytes), and usually matched
    against the very same checked table (``NodeState.resolve_layout``):
    comparing bytes costs microseconds, parsing and comparing a thousand
    entries milliseconds.
    """
    raw = slot.map[: msg.header_len]
    if slot.header is None or slot.header[:2] != (raw, msg.nbytes):
        entries, _, data_start = parse_header(raw, msg.nbytes)
        slot.header = (raw, msg.nbytes, tuple(sorted(entries, key=_by_offset)), data_start, None)
    _, _, ordered, data_start, matched = slot.header
    if matched is msg.tensors:
        return True
    if data_start != msg.header_len or ordered != msg.tensors:
        return False
    slot.header = (*slot.header[:4], msg.tensors)
    return True


def check_room(target: Path, space: Space, nbytes: int, reserved: int, *, margin_fraction: float, margin_min: int,
               shm_min_free: int, shm_free: int | None) -> None:
    """Raise ``NoSpace`` unless ``nbytes`` more fit beside ``reserved`` bytes already promised.

    Pure arithmetic over what the storage (``space``) and the slot directory
    (``shm_free``) reported, so it runs on the loop thread where the promises are known.
    """
    if not space.bounded:  # an object store: no free space to run out of
        return check_shm(shm_free, shm_min_free)
    if space.total == 0:
        raise PathNotAllowed(
            f"cannot save to {target}: it lies on a {space.kind} filesystem, which has no storage "
            "(a kernel pseudo-filesystem such as /proc or /sys); choose a directory on a disk or a shared filesystem"
        )
    margin = max(margin_min, int(space.total * margin_fraction))
    if nbytes + reserved + margin > space.free:
        raise NoSpace(
            f"not enough space for {target}: the shard needs {human_bytes(nbytes)}, saves in flight to the same "
            f"filesystem need {human_bytes(reserved)}, and {human_bytes(margin)} is kept free, but only "
            f"{human_bytes(space.free)} is free"
        )
    check_shm(shm_free, shm_min_free)


def check_shm(shm_free: int | None, shm_min_free: int) -> None:
    """Raise ``NoSpace`` if the slot directory has less than ``shm_min_free`` bytes free (None: not known)."""
    if shm_free is not None and shm_free < shm_min_free:
        raise NoSpace(f"{shm_usage()['dir']} is nearly full: {human_bytes(shm_free)} free counting this save's "
                      f"own slot, but the daemon keeps {human_bytes(shm_min_free)} free as headroom for everything "
                      f"else on the node that uses shared memory. {SHM_REMEDIES}")


def shm_free_bytes() -> int | None:
    """Free bytes in the slot directory (None: it cannot be measured)."""
    free = shm_usage().get("free_bytes")
    return free if isinstance(free, int) else None
