"""Start-up cleaning: leftovers of saves whose writer died, and orphaned slots.

``p.incomplete`` directories are never loaded, but they hold disk space. On
start the daemon removes (or moves aside) the ones it can prove are dead: every
owner marker inside names this host and a process that no longer runs.
Directories written from another host, or without a marker, are left alone,
because a daemon on another node may be writing them right now.

Shared-memory slots whose owning client process is gone are unlinked too.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ckptd.protocol.index import INCOMPLETE_SUFFIX, INDEX_NAME
from ckptd.protocol.shm import shm_dir as default_shm_dir

from .ownership import dead_here, marker_owners, remove_markers
from .slots import pid_alive, slot_owner
from .storage import Storage

log = logging.getLogger("ckptd")
SWEPT_DIR = ".ckptd-swept"
KNOWN_DIRS_NAME = "ckptd.dirs"
MAX_KNOWN_DIRS = 1000


class KnownDirs:
    """Directories this daemon committed into, kept in the run dir so the next start sweeps them too.

    Roots can be as wide as ``/``; scanning them whole is not an option, so the
    sweep looks at each root's own entries and at the directories saves went to.
    """

    def __init__(self, run_dir: Path) -> None:
        self.file = run_dir / KNOWN_DIRS_NAME
        try:
            lines = self.file.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        self.dirs = [Path(line) for line in lines if line.startswith("/")][-MAX_KNOWN_DIRS:]

    def remember(self, directory: Path) -> None:
        if directory in self.dirs:
            return
        self.dirs = [*self.dirs, directory][-MAX_KNOWN_DIRS:]
        tmp = self.file.with_name(self.file.name + ".tmp")
        tmp.write_text("".join(f"{d}\n" for d in self.dirs))
        os.replace(tmp, self.file)


def is_orphaned(incomplete: Path) -> bool:
    """Whether every writer named in ``incomplete``'s markers is a dead process on this host."""
    try:
        owners = marker_owners(incomplete)
    except OSError:
        return False
    return bool(owners) and all(dead_here(owner) for owner in owners)


def sweep_incomplete(storage: Storage, directories: list[Path], mode: str) -> list[Path]:
    """Remove (``remove``) or move into ``.ckptd-swept/`` (``move``) orphaned ``.incomplete`` dirs.

    That includes a checkpoint that retention or an overwrite had renamed
    aside when its daemon died. Dead daemons' owner markers left in committed
    checkpoints (a crash between marking and renaming, or a failed removal)
    are removed as well.
    """
    if mode == "off":
        return []
    swept = []
    for directory in directories:
        try:
            entries = [e for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            if not entry.name.endswith(INCOMPLETE_SUFFIX):
                if os.path.isfile(path / INDEX_NAME):
                    remove_markers(storage, path, dead_only=True)
                continue
            if not is_orphaned(path):
                continue
            if mode == "move":
                aside = directory / SWEPT_DIR
                aside.mkdir(exist_ok=True)
                storage.rename(path, aside / f"{entry.name}-{int(time.time())}")
            else:
                storage.remove_tree(path)
            swept.append(path)
            log.info("event=swept path=%s mode=%s", path, mode)
    return swept


def reclaim_orphaned_slots(shm_dir: Path | None = None) -> list[str]:
    """Unlink this user's ckptd slots whose owning process is gone."""
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
