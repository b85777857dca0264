"""The daemon's storage backends, and the one choice between them: ``s3://`` names to the object store, every other
name to the local filesystem.

An attempt is bound to the backend that holds it once, where the lifecycle
makes it (``Backends.bind``), and speaks to that backend's checkpoint
operations (``LocalCheckpoints`` or ``ObjectCheckpoints``) for the rest of its
life. Everything else (retention, the mirror, the sweep, listing, status, a
buddy's drain) calls the same operations on ``Backends`` itself, and reads
through its ``files``: each call goes to the backend its name is on, beneath
the checkpoint operations the local ``Storage`` (which ``--storage
module:Class`` may replace) or ``ObjectStorage``. This module is the one place
that asks which backend a name is on.
"""

from __future__ import annotations

import importlib
import logging
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Mapping

from ckptd.protocol.errors import PathNotAllowed
from ckptd.protocol.objects import check_bucket, display, is_object_path

from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import CheckpointReads, Entry, Files, LocalStorage, ShardWriter, Space, Stat, Storage
from ckptd.storage.local import LocalCheckpoints
from ckptd.storage.store import ObjectCheckpoints, ObjectStorage

log = logging.getLogger("ckptd")
STORE_CHECK_S = 5.0
"""How long a start waits for an object store to say whether a root's or a mirror's bucket exists."""


class Backends:
    """The local filesystem (``local``: the daemon's ``Storage``) and the object store, each with its checkpoint
    operations: ``bind`` gives an attempt the one its name is on; the operations below, and ``files``, go to it
    call by call."""

    def __init__(self, local: Storage, store: Files | None = None) -> None:
        self.local = local
        self._local = LocalCheckpoints(local)
        self._store = ObjectCheckpoints(store if store is not None else ObjectStorage())
        self.files: Files = RoutedFiles(self)
        """File operations by name on whichever backend each name is on (reads, listing, space)."""

    def bind(self, path: Path | str) -> Checkpoints:
        """The backend holding the checkpoint, attempt or snapshot named ``path``: asked once, where the lifecycle
        makes the attempt, which keeps it (``Attempt.backend``)."""
        return self._store if is_object_path(path) else self._local

    def resolve(self, raw: str, roots: tuple[Path, ...]) -> Path:
        """The final checkpoint path for a user's ``raw`` path, strictly under one of ``roots`` (I/O)."""
        try:
            backend = self.bind(raw)
        except ValueError as exc:
            raise PathNotAllowed(f"checkpoint path: {exc}") from None
        if backend is self._local and not Path(raw).is_absolute():
            raise PathNotAllowed(f"checkpoint path {raw!r} must be absolute (or an s3:// URL)")
        return backend.resolve(raw, roots)

    # -- ``Checkpoints``' operations that upkeep calls, each on the backend its name is on ------------------------

    def index_bytes(self, checkpoint: Path) -> bytes | None:
        return self.bind(checkpoint).index_bytes(checkpoint)

    def delete(self, checkpoint: Path, *, judged: bytes | None, publishing: AbstractContextManager[Any]) -> bool | None:
        return self.bind(checkpoint).delete(checkpoint, judged=judged, publishing=publishing)

    def listed(self, directory: Path) -> tuple[list[Path], list[Path]]:
        return self.bind(directory).listed(directory)

    def sweep(self, attempt: Path, *, move_to: Path | None) -> None:
        self.bind(attempt).sweep(attempt, move_to=move_to)

    def set_aside(self, checkpoint: Path, *, marker: str | None) -> Path | None:
        return self.bind(checkpoint).set_aside(checkpoint, marker=marker)

    def open_shard(self, path: Path, *, direct: bool) -> ShardWriter:
        return self.bind(path).open_shard(path, direct=direct)

    def publish(self, attempt: Path, final: Path, index: bytes, *, overwrite: bool,
                publishing: AbstractContextManager[Any]) -> None:
        self.bind(final).publish(attempt, final, index, overwrite=overwrite, publishing=publishing)


class RoutedFiles(CheckpointReads):
    """``Files`` on whichever backend each call's name is on: what reads a directory, an index or a shard, or asks
    for space, needs no backend of its own (``Backends.files``)."""

    def __init__(self, backends: Backends) -> None:
        self._backends = backends

    def _on(self, path: Path) -> Files:
        return self._backends.bind(path).files

    def write_file(self, path: Path, data: bytes) -> None:
        self._on(path).write_file(path, data)

    def read(self, path: Path, offset: int, size: int) -> bytes:
        return self._on(path).read(path, offset, size)

    def mkdir(self, path: Path, *, parents: bool = False, exist_ok: bool = False) -> None:
        self._on(path).mkdir(path, parents=parents, exist_ok=exist_ok)

    def touch(self, path: Path) -> None:
        self._on(path).touch(path)

    def rename(self, src: Path, dst: Path) -> None:
        self._on(src).rename(src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        self._on(a).exchange(a, b)

    def fsync_dir(self, path: Path) -> None:
        self._on(path).fsync_dir(path)

    def unlink(self, path: Path) -> None:
        self._on(path).unlink(path)

    def remove_tree(self, path: Path) -> None:
        self._on(path).remove_tree(path)

    def scandir(self, path: Path) -> list[Entry]:
        return self._on(path).scandir(path)

    def stat(self, path: Path, *, follow: bool = False) -> Stat | None:
        return self._on(path).stat(path, follow=follow)

    def resolve(self, path: Path) -> Path:
        return self._on(path).resolve(path)

    def space(self, path: Path) -> Space:
        return self._on(path).space(path)


def load_storage(spec: str | None) -> Backends:
    """The storage for ``s3://`` names and, for all others, the one named ``module:Class`` (None: the local filesystem).

    A class that needs settings reads them itself (``tests/faults.py`` reads
    ``CKPTD_FAULTS``), so the daemon's options stay free of them.
    """
    return Backends(_local_storage(spec))


def _local_storage(spec: str | None) -> Storage:
    """The storage named ``module:Class`` (None: the local filesystem), created without arguments."""
    if not spec:
        return LocalStorage()
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"--storage must be module:Class, got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--storage {spec!r} cannot be loaded: {exc}") from None
    if not isinstance(cls, type):
        raise ValueError(f"--storage {spec!r} names a {type(cls).__name__}, not a class implementing "
                         "ckptd.storage.contract.Storage")
    try:
        storage = cls()
    except Exception as exc:
        raise ValueError(f"--storage {spec!r} could not be created without arguments: {exc!r}") from None
    if not isinstance(storage, Storage):
        raise ValueError(f"--storage {spec!r} does not implement ckptd.storage.contract.Storage")
    return storage


def check_stores(roots: tuple[Path, ...], mirrors: Mapping[Path, Path]) -> None:
    """Refuse (ValueError) an ``s3://`` root or mirror target whose bucket does not exist: every save or upload
    there would fail. An endpoint that does not answer now may come back: that is only logged."""
    targets = [(f"--root {display(r)}", r) for r in roots if is_object_path(r)]
    targets += [(f"--mirror {d}={display(r)}", r) for d, r in mirrors.items()]
    for shown, target in targets:
        outcome: list[BaseException | None] = []
        ask = threading.Thread(target=lambda: outcome.append(_bucket_error(target)), name="ckptd-check", daemon=True)
        ask.start()
        ask.join(STORE_CHECK_S)  # a stalled endpoint must not hold up the start
        error = outcome[0] if outcome else TimeoutError(f"no answer within {STORE_CHECK_S:g} s")
        if isinstance(error, FileNotFoundError):
            raise ValueError(f"{shown}: {error.strerror} (create it first, or name another)") from None
        if error is not None:
            log.warning("event=store_unchecked target=%s error=%s", display(target),
                        getattr(error, "strerror", None) or error)


def _bucket_error(target: Path) -> BaseException | None:
    try:
        check_bucket(target)
    except Exception as exc:  # noqa: BLE001 - the caller decides what stops the start
        return exc
    return None
