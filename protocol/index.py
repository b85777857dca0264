"""The on-disk shape of a committed checkpoint and its index file.

A checkpoint ``p`` is a directory holding one safetensors shard per rank and
``ckptd.json``. It is written as ``p.incomplete`` and renamed to ``p`` only
after every shard and the index are durable, so a directory under its final
name with a valid index is committed, and nothing else is. Readers use
``read_index`` and trust nothing it refuses.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import InvalidCheckpoint
from .files import read_regular

INDEX_NAME = "ckptd.json"
INCOMPLETE_SUFFIX = ".incomplete"
FORMAT_NAME = "ckptd"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "crc32"
STRUCTURE_KEY = "ckptd.structure"
"""safetensors ``__metadata__`` key holding the base64 msgpack structure."""


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def incomplete_path(path: Path) -> Path:
    return path.with_name(path.name + INCOMPLETE_SUFFIX)


@dataclass(frozen=True)
class ShardRecord:
    """One rank's file as the daemon wrote it."""

    file: str
    rank: int
    size: int
    checksum: int
    tensors: int


@dataclass(frozen=True)
class CheckpointIndex:
    """Contents of ``ckptd.json``; written last, it is the commit marker."""

    world_size: int
    step: int | None
    created: float
    """Unix time at which the checkpoint was committed."""
    files: tuple[ShardRecord, ...]
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def shard(self, rank: int) -> ShardRecord:
        for f in self.files:
            if f.rank == rank:
                return f
        raise InvalidCheckpoint(f"checkpoint has no rank {rank}; it holds ranks 0..{self.world_size - 1}")

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["files"] = [asdict(f) for f in self.files]
        return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "CheckpointIndex":
        """Parse and check an index; anything odd is ``InvalidCheckpoint``."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if doc.get("format") != FORMAT_NAME:
                raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT_NAME!r}")
            if not _is_int(doc.get("version")) or doc["version"] != FORMAT_VERSION:
                raise ValueError(f"format version {doc.get('version')!r} is not {FORMAT_VERSION}")
            files = tuple(_shard_record(f) for f in doc["files"])
            world_size, step, created = doc["world_size"], doc["step"], doc["created"]
            if not _is_int(world_size) or world_size < 1:
                raise ValueError(f"world_size {world_size!r} is not a positive integer")
            if step is not None and not _is_int(step):
                raise ValueError(f"step {step!r} is not an integer")
            if type(created) not in (int, float) or not math.isfinite(created):
                raise ValueError(f"created {created!r} is not a time")
            if not isinstance(doc["checksum_algorithm"], str):
                raise ValueError("checksum_algorithm is not a string")
            index = cls(world_size=world_size, step=step, created=float(created), files=files,
                        checksum_algorithm=doc["checksum_algorithm"])
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise InvalidCheckpoint(f"{where}: index is not a valid ckptd index ({exc})") from None
        ranks = sorted(f.rank for f in files)
        if ranks != list(range(index.world_size)):
            raise InvalidCheckpoint(f"{where}: index lists ranks {ranks} for world size {index.world_size}")
        return index


def _is_int(value: object) -> bool:
    return type(value) is int


def _shard_record(doc: object) -> ShardRecord:
    if not isinstance(doc, dict) or set(doc) != {"file", "rank", "size", "checksum", "tensors"}:
        raise ValueError(f"file entry {doc!r:.80} must hold file, rank, size, checksum and tensors")
    if not isinstance(doc["file"], str) or "/" in doc["file"] or doc["file"] in ("", ".", ".."):
        raise ValueError(f"file name {doc['file']!r} is not a plain file name")
    for key in ("rank", "size", "checksum", "tensors"):
        if not _is_int(doc[key]) or doc[key] < 0:
            raise ValueError(f"{key} {doc[key]!r} of {doc['file']} is not a non-negative integer")
    return ShardRecord(**doc)


def read_index(path: Path | str) -> CheckpointIndex:
    """The index of the committed checkpoint at ``path``, or ``InvalidCheckpoint``."""
    path = Path(path)
    if path.name.endswith(INCOMPLETE_SUFFIX):
        raise InvalidCheckpoint(f"{path} is an unfinished checkpoint (.incomplete) and is never loaded")
    index_file = path / INDEX_NAME
    try:
        data = read_regular(index_file, "index")
    except FileNotFoundError:
        if path.is_dir():
            raise InvalidCheckpoint(f"{path} has no {INDEX_NAME}: it is not a committed ckptd checkpoint") from None
        raise InvalidCheckpoint(f"no checkpoint at {path}") from None
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read {index_file}: {exc.strerror}") from None
    return CheckpointIndex.from_json(data, str(index_file))


def committed_in(directory: Path | str) -> list[tuple[tuple[int, float], Path]]:
    """Committed checkpoints directly under ``directory``, oldest first, keyed by (step, created).

    A missing step sorts first. ``.incomplete`` directories, symlinks and
    directories without a valid index are not checkpoints and are left out.
    """
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    found = []
    for entry in entries:
        if entry.name.endswith(INCOMPLETE_SUFFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            index = read_index(entry.path)
        except InvalidCheckpoint:
            continue
        found.append(((index.step if index.step is not None else -1, index.created), Path(entry.path)))
    return sorted(found)


def latest(root: Path | str) -> Path | None:
    """The committed checkpoint under ``root`` with the highest step (then the newest), or None."""
    found = committed_in(root)
    return found[-1][1] if found else None
