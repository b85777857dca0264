"""The storage seam's checkpoint operations, on real files (no daemon).

Both implementations run here on local files: ``LocalCheckpoints`` as the
daemon runs it, ``ObjectCheckpoints`` (index written last, nothing renamed)
over the same files, since all it needs of a store besides uploads is the
file operations.
"""

from __future__ import annotations

import errno
import os
from contextlib import nullcontext
from pathlib import Path

import pytest

from ckptd.storage.local import LocalCheckpoints
from ckptd.storage.ownership import owner_marker
from ckptd.storage.store import ObjectCheckpoints, ObjectStorage
from ckptd.protocol.errors import CheckpointExists
from ckptd.protocol.index import CheckpointIndex, ShardRecord, read_index
from ckptd.protocol.names import (
    DISCARDED_INFIX,
    INCOMPLETE_SUFFIX,
    INDEX_NAME,
    deleting_path,
    incomplete_path,
    shard_name,
)
from ckptd.storage.backends import Backends
from ckptd.storage.checkpoints import Checkpoints
from ckptd.storage.contract import LocalStorage


def attempt_of(final: Path, step: int, fill: bytes) -> tuple[Path, bytes]:
    """``final``'s attempt holding one 16-byte shard of ``fill``, and the index that publishes it."""
    attempt = incomplete_path(final)
    attempt.mkdir(parents=True)
    (attempt / shard_name(0, 1)).write_bytes(fill * 16)
    index = CheckpointIndex(world_size=1, step=step, created=float(step),
                            files=(ShardRecord(file=shard_name(0, 1), rank=0, size=16, checksum=0, tensors=1),))
    return attempt, index.to_json()


class DirectRefusedOnWrite(LocalStorage):
    """A filesystem that takes O_DIRECT at open and refuses its writes with EINVAL (some FUSE and NFS setups)."""

    def __init__(self) -> None:
        self.refused: list[int] = []
        self._direct: set[int] = set()

    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]:
        fd, _ = super().open_new(path, direct=False)
        if direct:
            self._direct.add(fd)
        return fd, direct

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if fd in self._direct:
            self.refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().pwrite(fd, data, offset)

    def close(self, fd: int) -> None:
        self._direct.discard(fd)
        super().close(fd)


def test_the_daemons_storage_chooses_each_names_backend_once(tmp_path: Path) -> None:
    backends = Backends(LocalStorage())
    local, store = backends.bind(tmp_path / "a"), backends.bind(Path("s3://bucket/a"))
    assert isinstance(local, LocalCheckpoints) and isinstance(local, Checkpoints) and local.files is backends.local
    assert isinstance(store, ObjectCheckpoints) and isinstance(store.files, ObjectStorage)
    assert backends.bind("s3://bucket/b") is store and backends.bind(tmp_path / "b") is local


class StoreNamesSeen(LocalStorage):
    """The store's file operations for this test: every name asked of it recorded, none answered."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def stat(self, path: Path, *, follow: bool = False) -> None:
        self.asked.append(str(path))
        return None

    def scandir(self, path: Path) -> list:
        self.asked.append(str(path))
        return []


def test_calls_on_the_backends_go_to_the_backend_each_name_is_on(tmp_path: Path) -> None:
    """What upkeep, listing and status call on ``Backends`` itself (``files``, ``listed``, ``index_bytes``) reaches
    the filesystem for a local name and the store for an ``s3://`` one, call by call."""
    store = StoreNamesSeen()
    backends = Backends(LocalStorage(), store)
    final, index = tmp_path / "step-1", b'{"format": 1}'
    attempt = incomplete_path(final)
    attempt.mkdir()
    (attempt / INDEX_NAME).write_bytes(index)
    os.rename(attempt, final)
    assert backends.files.stat(final / INDEX_NAME).size == len(index) and backends.index_bytes(final) == index
    assert backends.listed(tmp_path) == ([final], []) and store.asked == []
    run = Path("s3://bucket/run")
    assert backends.files.stat(run / "step-1") is None and backends.listed(run) == ([], [])
    assert backends.index_bytes(run / "step-2") is None
    assert store.asked == [str(run / "step-1"), str(run), str(run / "step-2" / INDEX_NAME)]


def test_a_shard_whose_o_direct_writes_are_refused_carries_on_buffered_and_is_cut_to_its_size(tmp_path) -> None:
    files, path = DirectRefusedOnWrite(), tmp_path / "shard"
    shard = LocalCheckpoints(files).open_shard(path, direct=True)
    try:
        assert shard.aligned and shard.finishing == "fsync"
        page = memoryview(b"x" * 5000 + b"\0" * (8192 - 5000))  # the slot's page padding is written too
        assert shard.write(page, 0) == 8192
        assert not shard.aligned  # from now on the writer writes the shard's own bytes only
        shard.finish(5000)
    finally:
        shard.close()
    assert files.refused == [0]
    assert path.read_bytes() == b"x" * 5000


def test_publish_takes_the_name_and_replaces_a_checkpoint_only_with_overwrite(tmp_path) -> None:
    local, final = LocalCheckpoints(LocalStorage()), tmp_path / "step"
    attempt, index = attempt_of(final, 1, b"a")
    local.publish(attempt, final, index, overwrite=False, publishing=nullcontext())
    assert not attempt.exists() and read_index(final).step == 1

    attempt, index = attempt_of(final, 2, b"b")
    with pytest.raises(CheckpointExists, match="appeared while this one was written"):
        local.publish(attempt, final, index, overwrite=False, publishing=nullcontext())
    assert read_index(final).step == 1 and (final / shard_name(0, 1)).read_bytes() == b"a" * 16

    local.publish(attempt, final, index, overwrite=True, publishing=nullcontext())
    assert read_index(final).step == 2 and (final / shard_name(0, 1)).read_bytes() == b"b" * 16
    assert sorted(os.listdir(tmp_path)) == ["step"]  # the old version, swapped to the attempt's name, is gone


def test_publishing_by_index_creates_the_index_once_and_never_replaces(tmp_path) -> None:
    store, final = ObjectCheckpoints(LocalStorage()), tmp_path / "step"
    attempt, index = attempt_of(final, 1, b"a")
    store.publish(attempt, final, index, overwrite=True, publishing=nullcontext())
    assert (attempt / INDEX_NAME).read_bytes() == index  # on a store the attempt's prefix is the checkpoint's
    store.admit(final, overwrite=True)  # nothing is asked of a store before Accepted: ``begin`` asks
    final.mkdir()
    with pytest.raises(CheckpointExists, match="does not replace a checkpoint"):
        store.begin(final, attempt, overwrite=True, coordinated=False)
    with pytest.raises(CheckpointExists, match="already exists"):
        LocalCheckpoints(LocalStorage()).admit(final, overwrite=False)


def test_a_discarded_attempt_frees_its_name_at_once(tmp_path) -> None:
    final = tmp_path / "step"
    attempt, _ = attempt_of(final, 1, b"a")
    aside = LocalCheckpoints(LocalStorage()).discard(attempt, final)
    assert aside is not None and aside.parent == tmp_path
    assert aside.name.startswith(f"step{DISCARDED_INFIX}") and aside.name.endswith(INCOMPLETE_SUFFIX)
    assert not attempt.exists() and aside.exists()

    attempt, _ = attempt_of(final, 2, b"b")
    assert ObjectCheckpoints(LocalStorage()).discard(attempt, final) is None  # nothing to rename: removed in place
    assert not attempt.exists()


def test_a_checkpoint_set_aside_vanishes_for_readers_and_carries_the_marker(tmp_path) -> None:
    final = tmp_path / "step"
    attempt, index = attempt_of(final, 1, b"a")
    LocalCheckpoints(LocalStorage()).publish(attempt, final, index, overwrite=False, publishing=nullcontext())
    doomed = LocalCheckpoints(LocalStorage()).set_aside(final, marker=owner_marker())
    assert doomed == deleting_path(final) and not final.exists() and (doomed / owner_marker()).exists()

    attempt, index = attempt_of(final, 2, b"b")
    (attempt / INDEX_NAME).write_bytes(index)
    store = ObjectCheckpoints(LocalStorage())
    assert store.set_aside(attempt, marker=owner_marker()) == attempt  # the index goes first, the shards stay
    assert sorted(os.listdir(attempt)) == sorted([shard_name(0, 1), owner_marker()])
    assert store.set_aside(attempt, marker=owner_marker()) is None  # already gone for readers
