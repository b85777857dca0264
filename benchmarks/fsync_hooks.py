"""The fsyncs torch-checkpointing leaves out, as its own write hooks: what a user adds to make its saves durable.

torch-checkpointing 0.1.1 writes each rank's files into ``tmp_<name>``, meets the other ranks on a store barrier, and
rank 0 renames the directory to ``<name>``; nothing is fsynced. These hooks run in its writer subprocess, so the time
they take lands inside the save's future, where a user's would: before the barrier each rank fsyncs the files it wrote
(``pre_finalize_callback``: a rename must not publish unflushed files); after the rename rank 0 fsyncs the checkpoint
directory (every rank's entries are in it by then) and its parent (the rename). Pickled by reference into the
subprocess, so this module imports nothing heavy.
"""
from __future__ import annotations
import os
from typing import Any

def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

def fsync_rank_files(rank: int, args: Any) -> None:
    """Every file under ``args.path`` (the temporary directory) that rank ``rank`` wrote: the default layout names
    them ``<item>_<rank>.<ext>``."""
    suffix = f"_{rank}"
    for parent, _, names in os.walk(args.path):
        for name in names:
            if os.path.splitext(name)[0].endswith(suffix):
                _fsync(os.path.join(parent, name))

def fsync_published(rank: int, args: Any) -> None:
    """Rank 0, after its rename: the checkpoint directory ``args.path`` and the directory holding it."""
    if rank == 0:
        _fsync(args.path)
        _fsync(os.path.dirname(os.path.abspath(args.path)))
