"""Admission control: refuse a save up front when it cannot fit.

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

import os
import re
from pathlib import Path

from ckptd.protocol.errors import NoSpace, PathNotAllowed
from ckptd.protocol.shm import shm_dir as default_shm_dir

MOUNTINFO = Path("/proc/self/mountinfo")


def _human(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def filesystem_of(path: Path) -> int:
    """Device id of the filesystem that will hold ``path``."""
    return os.stat(existing_ancestor(path)).st_dev


def check_room(target: Path, nbytes: int, reserved: int, *, margin_fraction: float, margin_min: int,
               shm_min_free: int, shm_dir: Path | None = None) -> None:
    """Raise ``NoSpace`` unless ``nbytes`` more fit beside ``reserved`` bytes already promised."""
    st = os.statvfs(existing_ancestor(target))
    if st.f_blocks == 0:
        raise PathNotAllowed(
            f"cannot save to {target}: it lies on a {filesystem_type(target)} filesystem, which has no storage "
            "(a kernel pseudo-filesystem such as /proc or /sys); choose a directory on a disk or a shared filesystem"
        )
    free = st.f_bavail * st.f_frsize
    margin = max(margin_min, int(st.f_blocks * st.f_frsize * margin_fraction))
    if nbytes + reserved + margin > free:
        raise NoSpace(
            f"not enough space for {target}: the shard needs {_human(nbytes)}, saves in flight to the same "
            f"filesystem need {_human(reserved)}, and {_human(margin)} is kept free, but only {_human(free)} is free"
        )
    shm_dir = shm_dir if shm_dir is not None else default_shm_dir()
    shm = os.statvfs(shm_dir)
    shm_free = shm.f_bavail * shm.f_frsize
    if shm_free < shm_min_free:
        raise NoSpace(f"{shm_dir} is nearly full ({_human(shm_free)} free, {_human(shm_min_free)} needed as headroom)")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem mounted at the deepest mount point above ``path`` (for messages)."""
    best, kind = "", "unknown"
    target = os.path.realpath(existing_ancestor(path))
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # space is \040
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, tail.split()[0]
    return kind
