"""Looking into a committed checkpoint without torch: describe it, verify it.

``inspect_checkpoint`` reads only the index and each shard's header, never
tensor data, so it is instant on any size. ``verify_checkpoint`` reads every
byte once and reports every problem it finds (not just the first), naming
the file and, for header problems, the tensor. Both back the CLI (``ckptd
list``/``verify``) and ``ckptd.inspect``; the daemon side imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Collection

from . import objects
from .objects import user_path
from .checksums import stream_checksum
from .errors import BadMessage, InvalidCheckpoint
from .index import CheckpointIndex, ShardRecord, read_index
from .layout import HEADER_GUESS, MAX_HEADER_BYTES, TensorEntry, parse_header
from .reading import CheckpointFiles, files_for
from .shard_reads import check_checksum, check_shard_size
from .structure import check_structure, structure_bytes


@dataclass(frozen=True)
class ShardInfo:
    file: str
    rank: int
    size: int
    tensors: tuple[TensorEntry, ...]


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds, from its index and shard headers."""

    path: Path | str
    """As ckptd hands a name back (``user_path``): the ``s3://`` URL, a str, for an object."""
    index: CheckpointIndex
    shards: tuple[ShardInfo, ...]

    @property
    def tensor_count(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "step": self.index.step,
            "world_size": self.index.world_size,
            "created": self.index.created,
            "bytes": self.index.total_bytes,
            "shards": [
                {"file": s.file, "rank": s.rank, "size": s.size,
                 "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
                             for t in s.tensors]}
                for s in self.shards
            ],
        }


def read_shard_header(path: Path, size: int,
                      files: CheckpointFiles | None = None) -> tuple[list[TensorEntry], dict[str, str], int]:
    """Parse a shard file's header; ``InvalidCheckpoint`` naming the file if it is wrong.

    One read (an object store's request) for most headers, a second for a longer one.
    """
    files = files if files is not None else files_for(path)
    try:
        prefix = files.read(path, 0, min(size, HEADER_GUESS))
        if len(prefix) >= 8:
            want = 8 + min(int.from_bytes(prefix[:8], "little"), MAX_HEADER_BYTES, max(size - 8, 0))
            if want > len(prefix):
                prefix += files.read(path, len(prefix), want - len(prefix))
    except FileNotFoundError:
        raise InvalidCheckpoint(f"shard {objects.display(path)} is missing") from None
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read shard {objects.display(path)}: {exc.strerror or exc}") from None
    return _parse(prefix, size, path)


def _parse(prefix: bytes, size: int, path: Path) -> tuple[list[TensorEntry], dict[str, str], int]:
    try:
        return parse_header(prefix, size)
    except BadMessage as exc:
        raise InvalidCheckpoint(f"shard {objects.display(path)} has a bad header: {exc.message}") from None


def read_header_from(f: BinaryIO, size: int, path: Path) -> tuple[list[TensorEntry], dict[str, str], int]:
    """Parse the header of shard ``path`` from ``f``, which is positioned at its start.

    Leaves ``f`` wherever the header's last byte was read (the data start
    for a well-formed shard).
    """
    prefix = f.read(8)
    if len(prefix) == 8:
        hlen = int.from_bytes(prefix, "little")
        prefix += _read_exactly(f, min(hlen, MAX_HEADER_BYTES, max(size - 8, 0)))
    return _parse(prefix, size, path)


def check_shard_structure(tensor_names: Collection[str], metadata: dict[str, str], record: ShardRecord,
                          index: CheckpointIndex, shard: Path) -> bytes:
    """What load relies on beyond the tensor table (``parse_header``); the one check load and verify share.

    The header must hold as many tensors as the index says, and its
    ``ckptd.structure`` must decode and reference exactly those tensors (and
    only global tensors the index lists). Returns the packed structure;
    ``InvalidCheckpoint`` naming the file and the problem otherwise.
    """
    try:
        if len(tensor_names) != record.tensors:
            raise BadMessage(f"it holds {len(tensor_names)} tensors; the index says {record.tensors}")
        structure = structure_bytes(metadata)
        check_structure(structure, tensor_names, index.tensors)
    except BadMessage as exc:
        raise InvalidCheckpoint(f"shard {objects.display(shard)} has a bad header: {exc.message}") from None
    return structure


def open_shard(path: Path) -> BinaryIO:
    """A shard opened for reading: a missing file or one that is not a regular file is ``InvalidCheckpoint``."""
    try:
        return files_for(path).open(path)
    except FileNotFoundError:
        raise InvalidCheckpoint(f"shard {objects.display(path)} is missing") from None


def _read_exactly(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes: unbuffered reads may return short, so loop until EOF."""
    chunks, left = [], n
    while left > 0:
        chunk = f.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def inspect_checkpoint(path: Path | str) -> CheckpointInfo:
    """Describe a committed checkpoint without reading tensor data."""
    path = Path(path)
    index = read_index(path)
    shards = []
    for record in index.files:
        shard = path / record.file
        entries, _, _ = read_shard_header(shard, _size_of(shard))
        shards.append(ShardInfo(record.file, record.rank, record.size, tuple(sorted(entries, key=lambda e: e.name))))
    return CheckpointInfo(user_path(path), index, tuple(shards))


@dataclass
class VerifyReport:
    path: Path | str
    """As ckptd hands a name back (``user_path``): the ``s3://`` URL, a str, for an object."""
    problems: list[str] = field(default_factory=list)
    checked_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: Path | str) -> VerifyReport:
    """Check everything load relies on (index, each shard's size, header, structure, checksum); every problem."""
    report = VerifyReport(user_path(path))
    try:
        index = read_index(path)
    except InvalidCheckpoint as exc:
        report.problems.append(exc.message)
        return report
    for record in index.files:
        shard = Path(path) / record.file
        try:
            size = _size_of(shard)
            check_shard_size(shard, size, record)
            entries, metadata, _ = read_shard_header(shard, size)
            check_shard_structure([e.name for e in entries], metadata, record, index, shard)
            with open_shard(shard) as f:
                crc = stream_checksum(f, index.checksum_algorithm)[0]
            report.checked_bytes += size
            check_checksum(shard, crc, record, index.checksum_algorithm)
        except InvalidCheckpoint as exc:
            report.problems.append(exc.message)
    return report


def _size_of(path: Path) -> int:
    with open_shard(path) as f:
        return files_for(path).size(f)
