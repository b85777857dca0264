"""Reading memory snapshots: what the node's daemon holds, the newest checkpoint, and its bytes.

The daemon keeps each snapshot's shards in the slots its clients staged them
in (``Snapshots`` lists them: path, step, ranks, slot names, checksums). A
reader maps a held slot copy-on-write (read-only towards the daemon) and
reads tensors straight out of it: no disk, memcpy speed, checked against the
checksum the daemon computed when it took the slot over. A snapshot the
daemon drops while it is being read fails that check, and the reader falls
back to disk when the checkpoint is there too.

``latest`` merges disk and memory: the newest committed checkpoint or complete
snapshot. With torch.distributed initialized every rank asks its own daemon,
and the ranks agree (msgpack over a gloo group, ``coordinate``): a snapshot
that any rank's daemon lacks is never chosen.
"""

from __future__ import annotations

import mmap as _mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ckptd.protocol import checksums
from ckptd.protocol.chunks import tensor_table
from ckptd.protocol.endpoint import endpoint_for
from ckptd.protocol.errors import BadMessage, DaemonUnavailable, InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ShardRecord, read_index
from ckptd.protocol.index import latest as latest_on_disk
from ckptd.protocol.objects import user_path
from ckptd.protocol.inspect import check_checksum
from ckptd.protocol.layout import TensorEntry, parse_header
from ckptd.protocol.messages import SnapshotList, Snapshots
from ckptd.protocol.request import request
from ckptd.protocol.shm import shm_dir

from .reshard import ChunkFiles

ASK_TIMEOUT = 5.0
"""Seconds to wait for the daemon's list of snapshots (it answers from memory)."""


def held_snapshots(run_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The complete snapshots this node's daemon holds (none if no daemon runs)."""
    endpoint = endpoint_for(Path(run_dir).absolute()) if run_dir is not None else endpoint_for()
    try:
        reply = request(endpoint, Snapshots(1), timeout=ASK_TIMEOUT)
    except DaemonUnavailable:
        return []
    if not isinstance(reply, SnapshotList):
        return []  # a daemon that predates snapshots answers with an error: it holds none
    return [s for s in reply.snapshots if s.get("complete")]


def _resolved(path: Path) -> str:
    """The path as the daemon names it (its parent's symlinks and ``..`` resolved)."""
    return os.path.join(os.path.realpath(path.parent), path.name)


def find_held(path: Path, run_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    want = _resolved(path)
    return next((s for s in held_snapshots(run_dir) if s["path"] == want), None)


class HeldFiles(ChunkFiles):
    """A held snapshot's shards, read from the daemon's slots instead of files.

    The index is built from the daemon's list and the slots' own headers,
    so everything that reads a committed checkpoint (``load``, ``load_into``,
    resharding) reads a snapshot the same way.
    """

    def __init__(self, path: Path, held: dict[str, Any], *, verify: bool) -> None:
        self.path = path
        self.slots = {name: (rank, size, checksum) for rank, name, size, checksum, _ in held["shards"]}
        self._raw: dict[str, _mmap.mmap] = {}
        files = tuple(ShardRecord(name, rank, size, checksum, tensors)
                      for rank, name, size, checksum, tensors in held["shards"])
        headers = []
        for f in files:
            entries, metadata, data_start = self._header(f)
            headers.append((f.file, f.size, entries, metadata, data_start))
        try:
            tensors = tensor_table(headers)
        except ValueError as exc:
            raise InvalidCheckpoint(f"snapshot {path} cannot be read from memory: {exc}") from None
        index = CheckpointIndex(world_size=held["world_size"], step=held["step"], created=held["created"],
                                files=files, tensors=tensors, checksum_algorithm=held["checksum_algorithm"])
        super().__init__(path, index, verify=verify)

    def _map(self, name: str, size: int) -> _mmap.mmap:
        if name not in self._raw:
            try:
                with open(shm_dir() / name, "rb") as f:
                    self._raw[name] = _mmap.mmap(f.fileno(), size, _mmap.MAP_PRIVATE,
                                                 _mmap.PROT_READ | _mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:
                raise InvalidCheckpoint(f"snapshot {self.path}: its slot {name} is gone ({exc})") from None
        return self._raw[name]

    def _header(self, f: ShardRecord) -> tuple[list[TensorEntry], dict[str, str], int]:
        try:
            return parse_header(memoryview(self._map(f.file, f.size)), f.size)
        except BadMessage as exc:
            raise InvalidCheckpoint(f"snapshot {self.path}, rank {f.rank}: bad header in memory: {exc}") from None

    def mapped(self, file: str) -> torch.Tensor:
        """The held shard as bytes, checksummed once (a view of this process's copy-on-write mapping)."""
        if file not in self._maps:
            rank, size, checksum = self.slots[file]
            mapping = self._map(file, size)
            if self.verify:
                record = self.index.shard(rank)
                algorithm = self.index.checksum_algorithm
                check_checksum(self.path / f"rank {rank} in memory",
                               checksums.checksum(memoryview(mapping)[:size], algorithm),
                               record, algorithm)
            self._maps[file] = torch.frombuffer(mapping, dtype=torch.uint8)[:size]
        return self._maps[file]

    def read(self, record: ShardRecord, *, copy: bool) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        """One rank's tensors: owned copies, checksummed as copied (``copy``), else views of the verified mapping."""
        from .load import _typed  # load imports this module

        entries, metadata, data_start = self._header(record)
        if not copy:
            data = self.mapped(record.file)
            return metadata, {e.name: _typed(data[data_start + e.begin : data_start + e.end], e) for e in entries}
        # Shared and read-only, pre-faulted in one pass (a private writable one would copy every page), and
        # checksummed on a second thread while this one copies: the two passes overlap.
        with self._shared(record) as shared, ThreadPoolExecutor(1) as pool:
            crc = (pool.submit(checksums.checksum, memoryview(shared)[: record.size], self.index.checksum_algorithm)
                   if self.verify else None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only: only ever copied from
                raw = torch.frombuffer(shared, dtype=torch.uint8)
            tensors = {e.name: _typed(raw[data_start + e.begin : data_start + e.end].clone(), e) for e in entries}
            del raw
            if crc is not None:
                check_checksum(self.path / f"rank {record.rank} in memory", crc.result(), record,
                               self.index.checksum_algorithm)
        return metadata, tensors

    def _shared(self, record: ShardRecord) -> _mmap.mmap:
        try:
            with open(shm_dir() / record.file, "rb") as f:
                return _mmap.mmap(f.fileno(), record.size, _mmap.MAP_SHARED | getattr(_mmap, "MAP_POPULATE", 0),
                                  _mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise InvalidCheckpoint(f"snapshot {self.path}: its slot {record.file} is gone ({exc})") from None


def open_checkpoint(path: Path, *, verify: bool, run_dir: str | os.PathLike | None = None,
                    defer: bool = False) -> ChunkFiles:
    """The checkpoint's files: from the daemon's memory when it holds ``path``, else from disk."""
    held = find_held(path, run_dir)
    if held is not None:
        try:
            return HeldFiles(path, held, verify=verify)
        except InvalidCheckpoint:
            if not path.exists():
                raise
    return ChunkFiles(path, read_index(path), verify=verify, defer=defer)


def latest(root: str | os.PathLike, *, run_dir: str | os.PathLike | None = None) -> Path | str | None:
    """The newest checkpoint under ``root``: committed on disk, or a complete snapshot in node memory.

    Newest means the highest step, then the most recent. With
    torch.distributed initialized (several ranks) every rank must call it:
    the ranks agree, and a snapshot that some rank's daemon does not hold is
    never chosen (that rank could not restore it), nor a disk checkpoint some
    rank cannot see.
    """
    on_disk = latest_on_disk(root)  # checks root, too
    root, candidates = Path(root), {}
    if on_disk is not None:
        try:
            index = read_index(on_disk)
            candidates[str(on_disk)] = (index.step if index.step is not None else -1, index.created)
        except InvalidCheckpoint:  # removed since
            pass
    real_root = os.path.realpath(root)
    for s in held_snapshots(run_dir):
        parent, name = os.path.split(s["path"])
        if parent == real_root:
            key = (s["step"] if s["step"] is not None else -1, s["created"])
            candidates[str(root / name)] = max(key, candidates.get(str(root / name), key))
    candidates = _agreed(candidates)
    if not candidates:
        return None
    return user_path(max(candidates, key=lambda p: (candidates[p], p)))  # an object: its s3:// URL


def _agreed(candidates: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    """What every rank can restore, ordered by rank 0's keys so every rank picks the same (one process: all)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return candidates
    from .coordinate import all_gather_msgpack

    group = dist.new_group(backend="gloo")
    try:
        everyone = all_gather_msgpack([[p, *k] for p, k in sorted(candidates.items())], group)
    finally:
        dist.destroy_process_group(group)
    common = set.intersection(*({p for p, *_ in rank} for rank in everyone))
    return {p: (step, created) for p, step, created in everyone[0] if p in common}
