"""The daemon's storage: ``s3://`` names to the object store, every other name to the local filesystem.

``Routed`` is both seams at once, each call sent by the name it is about:
the checkpoint operations (``LocalCheckpoints`` or ``ObjectCheckpoints``) and
the file operations beneath them (the local ``Storage``, which
``--storage module:Class`` may replace, or ``ObjectFiles``). This is the
one place that asks which backend a name is on.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ckptd.protocol.objects import is_object_path

from ckptd.storage.contract import (
    CheckpointReads, Checkpoints, Entry, Files, LocalStorage, ShardWriter, Space, Stat, Storage,
)
from ckptd.storage.local import LocalCheckpoints
from ckptd.storage.store import ObjectCheckpoints, ObjectFiles


class Routed(CheckpointReads):
    """``s3://`` names to the object store, every other name to ``local`` (the daemon's storage)."""

    def __init__(self, local: Storage) -> None:
        self.local = local
        self.objects = ObjectFiles()
        self.local_checkpoints: Checkpoints = LocalCheckpoints(local)
        self.object_checkpoints: Checkpoints = ObjectCheckpoints(self.objects)

    def _by_path(self, path: Path) -> Files:
        return self.objects if is_object_path(path) else self.local

    def checkpoints(self, path: Path) -> Checkpoints:
        """The checkpoint operations for the checkpoint (or attempt, or shard) named ``path``."""
        return self.object_checkpoints if is_object_path(path) else self.local_checkpoints

    # -- checkpoint operations --------------------------------------------------

    def open_shard(self, path: Path, *, direct: bool) -> ShardWriter:
        return self.checkpoints(path).open_shard(path, direct=direct)

    def publish(self, attempt: Path, final: Path, index: bytes, *, overwrite: bool,
                publishing: AbstractContextManager[Any]) -> None:
        self.checkpoints(final).publish(attempt, final, index, overwrite=overwrite, publishing=publishing)

    def discard(self, attempt: Path, final: Path) -> Path | None:
        return self.checkpoints(final).discard(attempt, final)

    def set_aside(self, checkpoint: Path, *, marker: str | None) -> Path | None:
        return self.checkpoints(checkpoint).set_aside(checkpoint, marker=marker)

    def delete_guard(self, checkpoint: Path, publishing: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
        return self.checkpoints(checkpoint).delete_guard(checkpoint, publishing)

    def replace_refusal(self, final: Path) -> str | None:
        return self.checkpoints(final).replace_refusal(final)

    def exists_early(self, final: Path) -> bool:
        return self.checkpoints(final).exists_early(final)

    def not_a_directory(self, path: Path) -> Path | None:
        return self.checkpoints(path).not_a_directory(path)

    def attempt_at(self, listed: Path) -> Path | None:
        return self.checkpoints(listed).attempt_at(listed)

    def sweep(self, attempt: Path, *, move_to: Path | None) -> None:
        self.checkpoints(attempt).sweep(attempt, move_to=move_to)

    # -- file operations -------------------------------------------------------------------------------------

    def write_file(self, path: Path, data: bytes) -> None:
        self._by_path(path).write_file(path, data)

    def read(self, path: Path, offset: int, size: int) -> bytes:
        return self._by_path(path).read(path, offset, size)

    def mkdir(self, path: Path, *, parents: bool = False, exist_ok: bool = False) -> None:
        self._by_path(path).mkdir(path, parents=parents, exist_ok=exist_ok)

    def touch(self, path: Path) -> None:
        self._by_path(path).touch(path)

    def rename(self, src: Path, dst: Path) -> None:
        self._by_path(src).rename(src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        self._by_path(a).exchange(a, b)

    def fsync_dir(self, path: Path) -> None:
        self._by_path(path).fsync_dir(path)

    def unlink(self, path: Path) -> None:
        self._by_path(path).unlink(path)

    def remove_tree(self, path: Path) -> None:
        self._by_path(path).remove_tree(path)

    def scandir(self, path: Path) -> list[Entry]:
        return self._by_path(path).scandir(path)

    def stat(self, path: Path, *, follow: bool = False) -> Stat | None:
        return self._by_path(path).stat(path, follow=follow)

    def resolve(self, path: Path) -> Path:
        return self._by_path(path).resolve(path)

    def space(self, path: Path) -> Space:
        return self._by_path(path).space(path)


def load_storage(spec: str | None) -> Routed:
    """The storage for ``s3://`` names and, for all others, the one named ``module:Class`` (None: the local filesystem).

    A class that needs settings reads them itself (``tests/faults.py`` reads
    ``CKPTD_FAULTS``), so the daemon's options stay free of them.
    """
    return Routed(_local_storage(spec))


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
