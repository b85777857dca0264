"""The on-disk shape of a committed checkpoint and its index file.

A checkpoint ``p`` is a directory holding one safetensors shard per rank and
``ckptd.json``. It is written as ``p.incomplete`` and renamed to ``p`` only
after every shard and the index are durable, so a directory under its final
name with a valid index is committed, and nothing else is. Readers use
``read_index`` and trust nothing it refuses.

Format version 2 adds ``tensors``: every *global* tensor (a DTensor, or a
tensor under a key saved with ``replicated=``) with its global shape, dtype
and every saved chunk: the file holding it, the chunk's offsets and sizes in
the global tensor, and its byte range ``[begin, end)`` counted from the start
of that file. Each chunk is stored exactly once, so the chunks of a tensor
tile it without overlap. Per-rank (plain) tensors are not listed; they are
found in their rank's shard header as in version 1. Version-1 indexes (no
``tensors``) still load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from . import checksums, objects
from .errors import InvalidCheckpoint
from .reading import CheckpointFiles, files_for
from .layout import DTYPE_SIZES
from .names import INCOMPLETE_SUFFIX, INDEX_NAME, incomplete_path, shard_name  # noqa: F401 (also named from here)

FORMAT_NAME = "ckptd"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Index versions this code reads; it always writes ``FORMAT_VERSION``."""
CHECKSUM_ALGORITHM = checksums.DEFAULT
MAX_INDEX_BYTES = 256 * 1024 * 1024
"""An index larger than this is not one ckptd wrote (refused, not read into memory)."""
"""What new checkpoints name; older ones name ``crc32`` and still verify (``protocol.checksums``)."""


@dataclass(frozen=True)
class ShardRecord:
    """One rank's file as the daemon wrote it."""

    file: str
    rank: int
    size: int
    checksum: int
    tensors: int


@dataclass(frozen=True)
class ChunkRecord:
    """One stored piece of a global tensor."""

    file: str
    offsets: tuple[int, ...]
    """Where the chunk starts in the global tensor, per dimension."""
    sizes: tuple[int, ...]
    begin: int
    """Byte offset of the chunk's first element from the start of ``file``."""
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorRecord:
    """A global tensor: its full shape and dtype, and where its chunks are."""

    dtype: str
    """safetensors dtype name (``F32``, ``BF16``...)."""
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class CheckpointIndex:
    """Contents of ``ckptd.json``; written last, it is the commit marker."""

    world_size: int
    step: int | None
    created: float
    """Unix time at which the checkpoint was acknowledged: committed, or, for a persisted memory snapshot, held."""
    files: tuple[ShardRecord, ...]
    tensors: Mapping[str, TensorRecord] = field(default_factory=dict)
    """Global tensors by name (format version 2); empty when the state holds none."""
    keep_last: int | None = None
    """The retention its save asked for (``save_async(keep_last=)``; None: none, not written). The daemon
    applies it after the commit, and again once the mirror holds what it had to keep: recorded here, that
    request outlives the daemon that took it (``ckptd/upkeep/mirror.py``)."""
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
        doc["tensors"] = {name: asdict(t) for name, t in self.tensors.items()}
        if self.keep_last is None:
            del doc["keep_last"]
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
            version = doc.get("version")
            if not _is_int(version) or version not in READABLE_VERSIONS:
                raise ValueError(f"format version {version!r} is not one of {list(READABLE_VERSIONS)}")
            files = tuple(_shard_record(f) for f in doc["files"])
            raw_tensors = doc.get("tensors", {}) if version >= 2 else {}
            if not isinstance(raw_tensors, dict):
                raise ValueError("tensors is not a JSON object")
            sizes = {f.file: f.size for f in files}
            tensors = {name: _tensor_record(name, t, sizes) for name, t in raw_tensors.items()}
            world_size, step, created = doc["world_size"], doc["step"], doc["created"]
            if not _is_int(world_size) or world_size < 1:
                raise ValueError(f"world_size {world_size!r} is not a positive integer")
            if step is not None and not _is_int(step):
                raise ValueError(f"step {step!r} is not an integer")
            if type(created) not in (int, float) or not math.isfinite(created):
                raise ValueError(f"created {created!r} is not a time")
            keep_last = doc.get("keep_last")
            if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
                raise ValueError(f"keep_last {keep_last!r} is not a positive integer")
            checksums.updater(doc["checksum_algorithm"])  # never checked as something else
            index = cls(world_size=world_size, step=step, created=float(created), files=files, tensors=tensors,
                        keep_last=keep_last, version=version,
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


def _int_list(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise ValueError(f"{what} {value!r:.80} is not a list of non-negative integers")
    return tuple(value)


def _tensor_record(name: str, doc: object, file_sizes: Mapping[str, int]) -> TensorRecord:
    """Parse one global tensor; its chunks must lie inside it, in listed files, and tile it once."""
    if not isinstance(doc, dict) or set(doc) != {"dtype", "shape", "chunks"}:
        raise ValueError(f"tensor {name!r} must hold dtype, shape and chunks")
    dtype, shape = doc["dtype"], _int_list(doc["shape"], f"shape of {name!r}")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if not isinstance(doc["chunks"], list):
        raise ValueError(f"chunks of {name!r} is not a list")
    chunks = []
    for c in doc["chunks"]:
        if not isinstance(c, dict) or set(c) != {"file", "offsets", "sizes", "begin", "end"}:
            raise ValueError(f"a chunk of {name!r} must hold file, offsets, sizes, begin and end")
        chunk = ChunkRecord(c["file"], _int_list(c["offsets"], f"offsets of {name!r}"),
                            _int_list(c["sizes"], f"sizes of {name!r}"), c["begin"], c["end"])
        check_chunk(name, dtype, shape, chunk, file_sizes)
        chunks.append(chunk)
    check_tiling(name, shape, chunks)
    return TensorRecord(dtype, shape, tuple(chunks))


def check_chunk(name: str, dtype: str, shape: tuple[int, ...], chunk: ChunkRecord,
                file_sizes: Mapping[str, int]) -> None:
    """One chunk lies inside its tensor and its file, and its bytes match its sizes (else ``ValueError``)."""
    if chunk.file not in file_sizes:
        raise ValueError(f"a chunk of {name!r} is in {chunk.file!r}, which the index does not list")
    if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
        raise ValueError(f"a chunk of {name!r} has {len(chunk.offsets)}-d offsets for a {len(shape)}-d tensor")
    if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, shape)):
        raise ValueError(f"chunk at {list(chunk.offsets)} size {list(chunk.sizes)} lies outside "
                         f"{name!r} of shape {list(shape)}")
    if not (_is_int(chunk.begin) and _is_int(chunk.end) and 0 <= chunk.begin <= chunk.end <= file_sizes[chunk.file]):
        raise ValueError(f"a chunk of {name!r} has bytes [{chunk.begin!r}, {chunk.end!r}) outside {chunk.file}")
    if chunk.end - chunk.begin != chunk.numel * DTYPE_SIZES[dtype]:
        raise ValueError(f"a chunk of {name!r} spans {chunk.end - chunk.begin} bytes for {chunk.numel} "
                         f"{dtype} elements")


def check_tiling(name: str, shape: tuple[int, ...], chunks: list[ChunkRecord]) -> None:
    """The chunks hold every element of the tensor once (counted; no two start at the same place)."""
    starts = [c.offsets for c in chunks if c.numel]
    if len(set(starts)) != len(starts):
        raise ValueError(f"tensor {name!r} holds two chunks at the same offsets")
    stored, want = sum(c.numel for c in chunks), math.prod(shape)
    if stored != want:
        raise ValueError(f"the chunks of {name!r} hold {stored} elements; its shape {list(shape)} has {want}")


def read_index(path: Path | str, files: CheckpointFiles | None = None) -> CheckpointIndex:
    """The index of the committed checkpoint at ``path``, or ``InvalidCheckpoint``.

    ``files``: where to read it (``files_for(path)`` when None; the daemon passes its storage seam).
    """
    objects.check_url(path)
    path = Path(path)
    files = files if files is not None else files_for(path)
    if path.name.endswith(INCOMPLETE_SUFFIX):
        raise InvalidCheckpoint(f"{objects.display(path)} is an unfinished checkpoint (.incomplete) and is never loaded")
    index_file = path / INDEX_NAME
    try:
        data = files.read_index_file(index_file, max_bytes=MAX_INDEX_BYTES)
    except FileNotFoundError as exc:
        if isinstance(exc, objects.NoSuchBucket):
            raise InvalidCheckpoint(f"no checkpoint at {objects.display(path)}: {exc.strerror}") from None
        raise InvalidCheckpoint(files.no_index(path)) from None
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read {objects.display(index_file)}: {exc.strerror or exc}") from None
    return CheckpointIndex.from_json(data, objects.display(index_file))


def _store_failed(files: CheckpointFiles, exc: InvalidCheckpoint) -> bool:
    """Whether reading failed because a store did not answer (``unanswered_is_error``) (not because the checkpoint is gone)."""
    return files.unanswered_is_error and exc.message.startswith("cannot read")


def committed_in(directory: Path | str, files: CheckpointFiles | None = None) -> list[tuple[tuple[int, float], Path]]:
    """Committed checkpoints directly under ``directory``, oldest first, keyed by (step, created).

    A missing step sorts first. ``.incomplete`` directories, symlinks and
    directories without a valid index are not checkpoints and are left out.
    """
    objects.check_url(directory)
    files = files if files is not None else files_for(directory)
    try:
        paths = files.subdirs(Path(directory))
    except OSError as exc:
        if files.unanswered_is_error:  # a typo, no credentials or no endpoint must not read as "none yet"
            raise InvalidCheckpoint(f"cannot list {objects.display(directory)}: {exc.strerror}") from None
        return []
    found = []
    for path in paths:
        if path.name.endswith(INCOMPLETE_SUFFIX):
            continue
        try:
            index = read_index(path, files)
        except InvalidCheckpoint as exc:
            if _store_failed(files, exc):
                raise  # a store that failed to answer says nothing of this checkpoint: skipping it could skip the newest
            continue
        found.append(((index.step if index.step is not None else -1, index.created), path))
    return sorted(found)


def missing_or_truncated(path: Path | str, index: CheckpointIndex,
                         files: CheckpointFiles | None = None) -> str | None:
    """What is wrong with the shard files of ``path`` at a glance, or None.

    Cheap (one ``stat`` per shard, no data read): each file the index lists
    must be a regular file (after links, as load opens it) of the size the
    index records. A checksum or header problem needs ``verify_checkpoint``.
    """
    files = files if files is not None else files_for(path)
    for record in index.files:
        shard = Path(path) / record.file
        try:
            regular, size = files.file_stat(shard)
        except FileNotFoundError:
            return f"shard {objects.display(shard)} is missing"
        except OSError as exc:
            if files.unanswered_is_error:  # the store failed to answer: that says nothing of the shard
                raise InvalidCheckpoint(f"cannot read {objects.display(shard)}: {exc.strerror}") from None
            return f"shard {shard} is missing or unreadable: {exc.strerror}"
        if not regular:
            return f"shard {objects.display(shard)} is not a regular file"
        if size != record.size:
            return f"shard {objects.display(shard)} holds {size} bytes; the index says {record.size} (truncated?)"
    return None


def latest(root: Path | str) -> Path | None:
    """The committed checkpoint under ``root`` with the highest step (then the newest), or None.

    A checkpoint whose shard files are missing, not regular or of the wrong
    size is skipped, so a resume falls back to the newest one that can load.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")
    objects.check_url(root)
    files = files_for(root)
    for _, path in reversed(committed_in(root, files)):
        try:
            if missing_or_truncated(path, read_index(path, files), files) is None:
                return path
        except InvalidCheckpoint as exc:  # removed or replaced since the scan
            if _store_failed(files, exc):
                raise  # a store that stopped answering is no reason to fall back to an older checkpoint
            continue
    return None
