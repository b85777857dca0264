"""Start-up cleaning: leftovers of saves whose writer died (orphaned slots: ``slot_maps.py``).

``p.incomplete`` directories are never loaded, but they hold disk space. On
start the daemon removes (or moves aside) the ones it can prove are dead: every
owner marker inside names this host and a process that no longer runs.
Directories written from another host, or without a marker, are left alone,
because a daemon on another node may be writing them right now.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ckptd.protocol.names import KNOWN_DIRS_NAME, SWEPT_DIR
from ckptd.protocol.objects import SCHEME

from ckptd.storage.backends import Backends
from ckptd.storage.contract import Files
from ckptd.storage.ownership import dead_here, marker_owners, remove_markers

log = logging.getLogger("ckptd")
MAX_KNOWN_DIRS = 1000


class KnownDirs:
    """Directories this daemon saved into, kept in the run dir so the next start sweeps them too.

    A directory is remembered when a save into it is admitted, before its
    ``.incomplete`` is created, so a crash mid-save leaves nothing unswept.

    Roots can be as wide as ``/``; scanning them whole is not an option, so the
    sweep looks at each root's own entries and at the directories saves went to.
    ``remember`` writes a file: call it off the loop thread.
    """

    def __init__(self, storage: Files, run_dir: Path) -> None:
        self.storage = storage
        self.file = run_dir / KNOWN_DIRS_NAME
        try:
            st = storage.stat(self.file)
            lines = storage.read(self.file, 0, st.size).decode(errors="replace").splitlines() if st else []
        except OSError:
            lines = []
        self.dirs = [Path(line) for line in lines if line.startswith(("/", SCHEME))][-MAX_KNOWN_DIRS:]

    def remember(self, directory: Path) -> None:
        if directory in self.dirs:
            return
        self.dirs = [*self.dirs, directory][-MAX_KNOWN_DIRS:]
        tmp = self.file.with_name(self.file.name + ".tmp")
        self.storage.write_file(tmp, "".join(f"{d}\n" for d in self.dirs).encode())
        self.storage.rename(tmp, self.file)


def is_orphaned(storage: Files, incomplete: Path) -> bool:
    """Whether every writer named in ``incomplete``'s markers is a dead process on this host."""
    try:
        owners = marker_owners(storage, incomplete)
    except OSError:
        return False
    return bool(owners) and all(dead_here(owner) for owner in owners)


def sweep_incomplete(storage: Backends, directories: list[Path], mode: str) -> list[Path]:
    """Remove (``remove``) or move into ``.ckptd-swept/`` (``move``) orphaned ``.incomplete`` dirs.

    That includes a checkpoint that retention or an overwrite had renamed
    aside when its daemon died. Dead daemons' owner markers left in committed
    checkpoints (a crash between marking and renaming, or a failed removal)
    are removed as well. On an object store (no rename), ``p.incomplete``
    is ``p``'s prefix: one without an index whose owners are all dead is
    removed (``move`` cannot move it), so a daemon killed mid-save leaves
    nothing in the bucket after the next start.
    """
    if mode == "off":
        return []
    swept = []
    for directory in directories:
        try:
            committed, attempts = storage.listed(directory)
        except OSError:
            continue
        for path in committed:
            remove_markers(storage.files, path, dead_only=True)
        for path in attempts:
            if not is_orphaned(storage.files, path):
                continue
            storage.sweep(path, move_to=directory / SWEPT_DIR if mode == "move" else None)
            swept.append(path)
            log.info("event=swept path=%s mode=%s", path, mode)
    return swept
