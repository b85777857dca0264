"""Opening a checkpoint's files for reading: regular files only.

A FIFO (or a device, or a socket) planted under a shard's or the index's
name would make a plain ``open`` block forever, or read bytes that never
end. Every reader (``load``, ``load_into``, ``read_index``, inspect and
verify) opens through ``open_regular``: ``O_NONBLOCK`` so the open itself
cannot hang, then ``fstat`` refuses anything that is not a regular file
with an ``InvalidCheckpoint`` naming it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import InvalidCheckpoint


def open_regular(path: Path | str, what: str = "shard") -> BinaryIO:
    """``path`` opened unbuffered for reading; ``InvalidCheckpoint`` unless it is a regular file.

    ``FileNotFoundError`` passes through untouched, so callers can tell a
    missing file from a bad one.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InvalidCheckpoint(f"{what} {path} is not a regular file ({_kind(mode)}); refusing to read it")
        os.set_blocking(fd, True)
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path | str, what: str) -> bytes:
    """The whole content of a regular file (the index), refusing anything else."""
    with open_regular(path, what) as f:
        return f.read()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
