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


def read_regular(path: Path | str, what: str, *, max_bytes: int) -> bytes:
    """The whole content of a regular file (the index) of at most ``max_bytes``, refusing anything else.

    The bound keeps a stray multi-GiB file under the index's name from being
    read into memory by every ``latest`` that walks past it.
    """
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise InvalidCheckpoint(f"{what} {path} is {size} bytes, more than any {what} ckptd writes "
                                    f"({max_bytes}); it is not one of ckptd's")
        return f.read()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
