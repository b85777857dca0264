"""The daemon's storage backends, and the one choice between them: ``s3://`` names to the object store, every other
name to the local filesystem.

A caller names the checkpoint (or attempt, or shard) it is about once
(``Backends.at``) and speaks to the backend that holds it: its checkpoint
operations (``LocalCheckpoints`` or ``ObjectCheckpoints``) and, beneath them,
its file operations (``.files``: the local ``Storage``, which
``--storage module:Class`` may replace, or ``ObjectStorage``). This is the one
place that asks which backend a name is on.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ckptd.protocol.errors import PathNotAllowed
from ckptd.protocol.objects import is_object_path

from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import Files, LocalStorage, Storage
from ckptd.storage.local import LocalCheckpoints
from ckptd.storage.store import ObjectCheckpoints, ObjectStorage


class Backends:
    """The local filesystem (``local``: the daemon's ``Storage``) and the object store, each with its checkpoint
    operations; ``at`` picks the one a name is on."""

    def __init__(self, local: Storage, store: Files | None = None) -> None:
        self.local = local
        self._local = LocalCheckpoints(local)
        self._store = ObjectCheckpoints(store if store is not None else ObjectStorage())

    def at(self, path: Path | str) -> Checkpoints:
        """The backend holding the checkpoint, attempt, shard or directory named ``path``."""
        return self._store if is_object_path(path) else self._local

    def resolve(self, raw: str, roots: tuple[Path, ...]) -> Path:
        """The final checkpoint path for a user's ``raw`` path, strictly under one of ``roots`` (I/O)."""
        try:
            backend = self.at(raw)
        except ValueError as exc:
            raise PathNotAllowed(f"checkpoint path: {exc}") from None
        if backend is self._local and not Path(raw).is_absolute():
            raise PathNotAllowed(f"checkpoint path {raw!r} must be absolute (or an s3:// URL)")
        return backend.resolve(raw, roots)


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
