"""Reading global tensors back: whole, or only the region a target holds.

A global tensor's chunks are listed in the index with their byte ranges. A
loader maps each file it needs once (copy-on-write, verified once per
process while the file is unchanged: ``client/verified.py``) and views
the chunks in place; copying the part of a chunk that overlaps a target
region touches only the pages holding those bytes, so a rank loading its
shard of a resharded tensor reads its share of the checkpoint, not all of it,
and never builds the full tensor. ``load`` of a sharded checkpoint in one
process assembles full tensors chunk by chunk.
"""

from __future__ import annotations

import ctypes
import math
import mmap as _mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptd.protocol.checksums import Behind, checksum
from ckptd.protocol.chunks import Box, overlap
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ChunkRecord, ShardRecord, TensorRecord
from ckptd.protocol.inspect import check_checksum, check_shard_size, open_shard
from ckptd.protocol.objects import display, is_object_path
from ckptd.protocol.ranged import ObjectShard

from .dtypes import TORCH_DTYPES
from .verified import Identity, identity, is_verified, remember

MAX_READ = 1 << 30
"""Bytes asked of one read(2); Linux returns at most ~2 GiB per call anyway."""
GAP_READ = 16 << 20
"""Bytes per read of a range only the checksum needs."""
FOLD_READ = 8 << 20
"""Bytes per read straight into a target whose checksum follows: the checksum thread reads each piece while the next
is read, from the cache rather than from memory."""


@dataclass(frozen=True)
class GlobalRef:
    """A global tensor of a checkpoint, not read yet."""

    name: str
    record: TensorRecord

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.record.dtype]

    def describe(self) -> str:
        return f"{self.dtype}{list(self.record.shape)}"


class ChunkFiles:
    """The checkpoint's files, each mapped (and checksummed) at most once, on first use.

    With ``defer`` the checksum of a file not yet verified in this process is
    left for ``copy``, which computes it in the same pass as the copies out
    of the mapping (``load_into``): the file's bytes are brought in once and
    checksummed right behind the copy that touched them.
    """

    def __init__(self, path: Path, index: CheckpointIndex, *, verify: bool, defer: bool = False) -> None:
        self.path, self.index, self.verify, self.defer = path, index, verify, defer
        self._maps: dict[str, torch.Tensor] = {}
        self._raw: dict[str, _mmap.mmap] = {}
        self._idents: dict[str, Identity] = {}
        self._objects: dict[str, ObjectShard] = {}
        self._pending: dict[str, tuple[_mmap.mmap, ShardRecord, Identity]] = {}

    remembers_verified = True
    """Whether a file verified once is remembered as verified while unchanged (``verified.py``)."""

    def source(self, file: str) -> Path:
        """Where ``file``'s bytes are read from."""
        return self.path / file

    def close(self) -> None:
        """Done reading (a snapshot's reader lease ends); the tensors handed out stay valid."""

    def ref(self, name: str) -> GlobalRef:
        record = self.index.tensors.get(name)
        if record is None:
            raise InvalidCheckpoint(f"checkpoint {display(self.path)}: structure names global tensor {name!r}, "
                                    "which the index does not list")
        return GlobalRef(name, record)

    def chunk(self, ref: GlobalRef, chunk: ChunkRecord) -> torch.Tensor:
        """The chunk's elements, viewed in the mapped file (no read until touched)."""
        data = self.mapped(chunk.file)
        return data[chunk.begin : chunk.end].view(ref.dtype).view(chunk.sizes)

    def mapped(self, file: str) -> torch.Tensor:
        """The whole file as bytes, mapped and (with ``verify``, unless deferred) checksummed on the first call.

        An object is fetched whole into anonymous memory, unless ``defer``:
        then only its header is, and ``copy`` fetches the ranges its copies
        read (``protocol/ranged.py``); ``fetch_whole`` the rest.
        """
        if file in self._maps:
            return self._maps[file]
        record = next(f for f in self.index.files if f.file == file)
        algorithm = self.index.checksum_algorithm
        if is_object_path(self.path):
            shard = ObjectShard(self.path / file, record, algorithm)
            if self.defer:
                shard.header()
            else:
                shard.read_whole(verify=self.verify)
            self._objects[file] = shard
            self._maps[file] = torch.frombuffer(shard.mapping, dtype=torch.uint8)
        else:
            mapping, ident = map_shard(self.path / file, record, verify=self.verify and not self.defer,
                                       algorithm=algorithm)
            if self.verify and self.defer and not is_verified(ident, record, algorithm):
                self._pending[file] = (mapping, record, ident)
            self._raw[file], self._idents[file] = mapping, ident
            self._maps[file] = torch.frombuffer(mapping, dtype=torch.uint8)
        return self._maps[file]

    def copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for each pair; checksums deferred files in the same pass.

        The copies are done per file, in file order. A contiguous host
        target of a contiguous source range is read straight into its memory
        with ``preadv`` (no page faults on the mapping, one pass over the
        bytes); any other copy goes through the mapping. A deferred file's
        checksum follows the copies on a thread of its own: each range right
        after the copy that brought it in, while the next one is read, and
        the bytes no copy read. ``InvalidCheckpoint`` when a checksum is
        wrong (the targets then hold what was copied) or when the file
        changed since it was mapped.
        """
        unchecked = [f for f, o in self._objects.items() if self.verify and not o.verified]
        by_file: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {f: [] for f in [*self._pending, *unchecked]}
        spans = {f: (t.data_ptr(), t.numel()) for f, t in self._maps.items()}
        for dst, src in copies:
            start = src.data_ptr()
            owner = next((f for f, (base, n) in spans.items() if base <= start < base + n), None)
            if owner is None or src.numel() == 0 or not (owner in self._idents or self._fetches(owner)):
                dst.copy_(src)  # not a file's mapping (node memory), or an object already in memory
                continue
            last = sum((n - 1) * st for n, st in zip(src.shape, src.stride())) * src.element_size()
            begin = start - spans[owner][0]
            by_file.setdefault(owner, []).append((begin, begin + last + src.element_size(), dst, src))
        for file, pairs in by_file.items():
            if file in self._objects:
                self._copy_object(file, pairs)
            else:
                self._copy_file(file, sorted(pairs, key=lambda p: p[0]))

    def _fetches(self, file: str) -> bool:
        """Whether ``copy`` fetches what it reads of ``file``: an object not (yet) all in memory."""
        return file in self._objects and not self._objects[file].whole

    def fetch_whole(self, file: str) -> None:
        """Bring all of an object ``file`` into memory (its tensors are handed out); nothing for a local file."""
        self.mapped(file)
        if file in self._objects:
            self._objects[file].read_whole(verify=self.verify)

    def _copy_object(self, file: str, pairs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        """Ranged GETs of what the copies read: straight into a contiguous host target, else into the mapping
        and copied from there."""
        shard, landed, later = self._objects[file], [], []
        for begin, end, dst, src in pairs:
            if _readable(dst, src, end - begin):
                landed.append((begin, end, bytes_of(dst)))
                torch.autograd.graph.increment_version(dst)  # as copy_ would: autograd sees the change
            else:
                landed.append((begin, end, memoryview(shard.mapping)[begin:end]))
                later.append((dst, src))
        shard.read(landed, verify=self.verify)
        for dst, src in later:
            dst.copy_(src)

    def _copy_file(self, file: str, pairs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        pending = self._pending.pop(file, None)
        record = next(f for f in self.index.files if f.file == file)
        algorithm, path, done = self.index.checksum_algorithm, self.source(file), 0
        with open_shard(path) as f, memoryview(self._raw[file]) as mapped, Behind(algorithm) as crc:
            if identity(f.fileno())[:5] != self._idents[file][:5]:
                raise InvalidCheckpoint(f"shard {path} changed while it was being loaded")
            for begin, end, dst, src in pairs:
                if pending is not None and begin > done:  # bytes no copy reads: the header, skipped tensors
                    _read_for(crc, f.fileno(), done, begin, path)
                    done = begin
                if _readable(dst, src, end - begin):
                    into = bytes_of(dst)
                    for lo in range(0, len(into), FOLD_READ):  # each piece checksummed while in cache
                        piece = into[lo : lo + FOLD_READ]
                        _pread_into(f.fileno(), piece, begin + lo, path)
                        if pending is not None and begin + lo + len(piece) > done:
                            crc.add(piece[max(done, begin + lo) - begin - lo :])
                            done = begin + lo + len(piece)
                    torch.autograd.graph.increment_version(dst)  # as copy_ would: autograd sees the change
                else:
                    dst.copy_(src)
                    into = mapped[begin:end]
                if pending is not None and end > done:
                    crc.add(into[max(done, begin) - begin :])
                done = max(done, end)
            if pending is not None:
                _read_for(crc, f.fileno(), done, record.size, path)
                check_checksum(path, crc.value(), record, algorithm)
                if self.remembers_verified:
                    remember(pending[2], record, algorithm)


def _readable(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> bool:
    """Whether the file's bytes can be read straight into ``dst``: both contiguous, same bytes, host memory."""
    return (dst.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
            and dst.numel() * dst.element_size() == nbytes and not dst.is_conj() and not dst.is_neg())


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _read_for(crc: Behind, fd: int, begin: int, end: int, path: Path) -> None:
    """Bytes ``[begin, end)`` read in large pieces (no page faults on the mapping) for the checksum alone."""
    for offset in range(begin, end, GAP_READ):
        piece = memoryview(bytearray(min(GAP_READ, end - offset)))  # a fresh buffer: the checksum may lag behind
        _pread_into(fd, piece, offset, path)
        crc.add(piece)


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + MAX_READ]], offset + done)
        if n <= 0:
            raise InvalidCheckpoint(f"shard {path} ended early while being read (changed under the reader?)")
        done += n


def map_shard(shard: Path, record: ShardRecord, *, verify: bool,
              algorithm: str) -> tuple[_mmap.mmap, Identity | None]:
    """The shard mapped copy-on-write, after checking that it is a regular file of the index's size (and, unless
    this process verified the same unchanged file before, its checksum); with the file's identity.

    An object (``s3://``) is fetched instead, with parallel ranged reads, into
    anonymous memory of its size (which the tensors then view), and checked
    as it arrives, every time: it has no identity to remember.
    """
    if record.size < 8:
        raise InvalidCheckpoint(f"shard {shard} of {record.size} bytes is too short for a safetensors header")
    if is_object_path(shard):
        fetched = ObjectShard(shard, record, algorithm)
        fetched.read_whole(verify=verify)
        return fetched.mapping, None
    with open_shard(shard) as f:
        check_shard_size(shard, os.fstat(f.fileno()).st_size, record)
        ident = identity(f.fileno())
        mapping = _mmap.mmap(f.fileno(), record.size, _mmap.MAP_PRIVATE, _mmap.PROT_READ | _mmap.PROT_WRITE)
    if verify and not is_verified(ident, record, algorithm):
        try:
            check_checksum(shard, checksum(mapping, algorithm), record, algorithm)
        except BaseException:
            mapping.close()
            raise
        remember(ident, record, algorithm)
    return mapping, ident


def region(t: torch.Tensor, box: Box, origin: tuple[int, ...]) -> torch.Tensor:
    """The view of ``t`` (which starts at ``origin`` of the global tensor) covering ``box``."""
    for dim, (start, size, base) in enumerate(zip(box[0], box[1], origin)):
        t = t.narrow(dim, start - base, size)
    return t


def plan_region(files: ChunkFiles, ref: GlobalRef, box: Box, dst: torch.Tensor
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
    """Copies that fill ``dst`` (the region ``box`` of the tensor) from the chunks overlapping it.

    The second value says what is wrong when the chunks do not cover the
    region exactly once (a hole, or two chunks holding the same elements).
    """
    copies, pieces = [], []
    for chunk in ref.record.chunks:
        shared = overlap(box, (chunk.offsets, chunk.sizes))
        if shared is None:
            continue
        if any(overlap(shared, other) is not None for other in pieces):
            return [], f"saved chunks of {ref.name!r} overlap at {list(shared[0])}"
        pieces.append(shared)
        copies.append((region(dst, shared, box[0]), region(files.chunk(ref, chunk), shared, chunk.offsets)))
    covered, want = sum(math.prod(p[1]) for p in pieces), math.prod(box[1])
    if covered != want:
        return [], (f"region at {list(box[0])} of size {list(box[1])} of {ref.name!r}: saved chunks hold "
                    f"{covered} of its {want} elements")
    return copies, None


def read_full(files: ChunkFiles, ref: GlobalRef, device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor, assembled from its chunks."""
    shape = ref.record.shape
    out = torch.empty(shape, dtype=ref.dtype, device=device or "cpu")
    copies, problem = plan_region(files, ref, ((0,) * len(shape), shape), out)
    if problem is not None:
        raise InvalidCheckpoint(f"checkpoint {display(files.path)}: {problem}")
    if is_object_path(files.path):
        files.copy(copies)  # fetches what the copies read, unless the object is in memory already
    else:
        for dst, src in copies:
            dst.copy_(src)
    return out
