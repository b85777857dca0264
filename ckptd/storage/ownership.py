"""What on disk is ckptd's to replace or remove, and the markers that say who writes it.

Overwrite and retention delete a directory, and a start-up sweep or a new save
removes a leftover ``.incomplete`` one. The user's files must never go that
way: ``save_async(sd, "/ckpts/exp1", overwrite=True)`` with ``exp1`` a run
folder full of checkpoints and notes must refuse, not empty the folder. So a
directory is only ever replaced when it is a committed checkpoint that ckptd
wrote: a real directory (not a symlink) with a valid index, holding nothing
but ``ckptd.json``, the shards that index lists and owner markers. A leftover
``p.incomplete`` is only removed when it holds nothing but ckptd's files and
no live ckptd process on this host is writing it. Everything else is left
untouched, and the save is refused with an error that says why.

Owner markers (``.ckptd-owner-<host>-<pid>``) name the daemon writing a
directory; the start-up sweep removes a ``.incomplete`` directory only when
every marker in it names a dead process on this host. Readers ignore them.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Callable

from ckptd.protocol.errors import CheckpointExists, InvalidCheckpoint
from ckptd.protocol.index import read_index
from ckptd.protocol.names import INDEX_NAME, owner_marker_name, parse_owner_marker, parse_shard_name, shard_name

from ckptd.protocol.processes import pid_alive
from ckptd.storage.contract import Files, Kind

log = logging.getLogger("ckptd")
MAX_NAMED = 5
"""Foreign entries named in an error; the rest are counted."""


def owner_marker() -> str:
    """This daemon's marker name."""
    return owner_marker_name(socket.gethostname(), os.getpid())


def is_owner_marker(name: str) -> bool:
    return parse_owner_marker(name) is not None


def _owner(name: str) -> tuple[str, int | None]:
    owner = parse_owner_marker(name)
    assert owner is not None, name
    return owner


def marker_owners(storage: Files, directory: Path) -> list[tuple[str, int | None]]:
    """(host, pid) of every owner marker in ``directory`` (pid None: unreadable marker)."""
    return [_owner(e.name) for e in storage.scandir(directory) if is_owner_marker(e.name)]


def dead_here(owner: tuple[str, int | None]) -> bool:
    """Whether a marker's owner is a process of this host that no longer runs."""
    host, pid = owner
    return host == socket.gethostname() and pid is not None and not pid_alive(pid)


def remove_markers(storage: Files, directory: Path, *, dead_only: bool = False) -> None:
    """Remove owner markers from ``directory`` (only dead processes' with ``dead_only``).

    A marker left in a committed checkpoint harms no reader, so a failure is
    logged, never raised: it must not turn a committed save into a failed one.
    """
    try:
        for entry in storage.scandir(directory):
            if is_owner_marker(entry.name) and (not dead_only or dead_here(_owner(entry.name))):
                storage.unlink(entry.path)
    except OSError as exc:
        log.warning("event=marker_left path=%s error=%s", directory, exc.strerror or exc)


def release(storage: Files, directory: Path) -> bool:
    """Remove this daemon's marker from ``directory``; True if nobody else may still write or publish it (I/O).

    A coordinated attempt's ``p.incomplete`` is shared by the daemons of
    every node of its run, each with its own marker. A daemon whose ranks all
    died lets go of its part; the last to let go (no marker left but dead
    processes' of this host) removes the directory. A marker of another host
    keeps it: that node's daemon may be publishing it now, and lets go of it
    itself; a start-up sweep removes what a killed daemon held.
    """
    try:
        storage.unlink(directory / owner_marker())
    except FileNotFoundError:
        pass
    return all(dead_here(owner) for owner in marker_owners(storage, directory))


def _is_shard_name(name: str) -> bool:
    parsed = parse_shard_name(name)
    return parsed is not None and shard_name(*parsed) == name


def _foreign(storage: Files, directory: Path, ours: Callable[[str], bool]) -> list[str]:
    """Entries of ``directory`` that are not regular files ckptd writes (``ours`` decides by name)."""
    return sorted(e.name for e in storage.scandir(directory)
                  if not (e.kind is Kind.FILE and (ours(e.name) or is_owner_marker(e.name))))


def _describe(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def _not_a_directory(storage: Files, path: Path) -> str | None:
    st = storage.stat(path)
    if st is None:
        raise FileNotFoundError(2, "No such file or directory", str(path))
    if st.kind is Kind.LINK:
        return "it is a symbolic link"
    if st.kind is not Kind.DIR:
        return "it is a file, not a checkpoint directory"
    return None


UNEXAMINED = "it cannot be examined"
"""How ``why_not_replaceable`` begins where asking failed (an outage), not where the answer was no."""


def why_not_replaceable(storage: Files, path: Path) -> str | None:
    """Why the existing ``path`` is not a committed ckptd checkpoint ckptd may delete; None if it is."""
    try:
        reason = _not_a_directory(storage, path)
        if reason is not None:
            return reason
        if storage.stat(path / INDEX_NAME) is None:
            return f"it is not a committed ckptd checkpoint: it has no {INDEX_NAME}"
        try:
            index = read_index(path, storage)
        except InvalidCheckpoint:
            return f"it is not a committed ckptd checkpoint: its {INDEX_NAME} is not a valid ckptd index"
        listed = {INDEX_NAME, *(f.file for f in index.files)}
        foreign = _foreign(storage, path, listed.__contains__)
    except OSError as exc:
        return f"{UNEXAMINED} ({exc.strerror or exc})"
    if foreign:
        return f"it holds entries ckptd did not write: {_describe(foreign)}"
    return None


def check_replaceable(storage: Files, path: Path) -> None:
    """Refuse to delete ``path`` unless it is a committed checkpoint holding only ckptd's files."""
    reason = why_not_replaceable(storage, path)
    if reason is not None:
        raise CheckpointExists(
            f"refusing to replace {path}: {reason}. overwrite=True only ever replaces a committed ckptd "
            f"checkpoint; move {path.name!r} away or save under another path")


def why_not_leftover(storage: Files, incomplete: Path) -> str | None:
    """Why ``incomplete`` is not a dead save's leftover that a new save may remove; None if it is."""
    try:
        reason = _not_a_directory(storage, incomplete)
        if reason is not None:
            return reason
        foreign = _foreign(storage, incomplete, lambda name: name == INDEX_NAME or _is_shard_name(name))
        if foreign:
            return f"it holds entries ckptd did not write: {_describe(foreign)}"
        host = socket.gethostname()
        live = [pid for h, pid in marker_owners(storage, incomplete)
                if h == host and pid is not None and pid != os.getpid() and pid_alive(pid)]
    except OSError as exc:
        return f"{UNEXAMINED} ({exc.strerror or exc})"
    if live:
        return f"ckptd (pid {live[0]}) is writing it now"
    return None
