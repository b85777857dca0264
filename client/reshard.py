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
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptd.protocol.chunks import Box, overlap
from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ChunkRecord, ShardRecord, TensorRecord
from ckptd.protocol.inspect import read_shard_header
from ckptd.protocol.layout import TensorEntry
from ckptd.protocol.objects import display
from ckptd.protocol.reading import files_for, shard_reader
from ckptd.protocol.shard_reads import ShardReader

from .dtypes import TORCH_DTYPES
from .verified import is_verified, remember


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
    """The checkpoint's files, each opened (and checksummed) at most once, on first use.

    Each file is a ``ShardReader`` (``protocol/shard_reads.py``): a local
    file mapped copy-on-write, or an object fetched by ranged GETs into
    anonymous memory; both are read the same way here. With ``defer`` the
    checksum of a file not yet verified in this process is left for
    ``copy``, which computes it in the same pass as the copies
    (``load_into``): the file's bytes are brought in once and checksummed
    right behind the read that brought them.
    """

    def __init__(self, path: Path, index: CheckpointIndex, *, verify: bool, defer: bool = False) -> None:
        self.path, self.index, self.verify, self.defer = path, index, verify, defer
        self.reading = files_for(path)
        """Where the checkpoint's files are read from: local files or objects (``protocol/reading.py``)."""
        self._maps: dict[str, torch.Tensor] = {}
        self._shards: dict[str, ShardReader] = {}
        self._unchecked: set[str] = set()
        """Files whose checksum ``copy`` computes (deferred, and not verified before)."""

    remembers_verified = True
    """Whether a file verified once is remembered as verified while unchanged (``verified.py``)."""

    def close(self) -> None:
        """Done reading (a snapshot's reader lease ends); the tensors handed out stay valid."""

    def header(self, record: ShardRecord) -> tuple[list[TensorEntry], dict[str, str], int]:
        """Shard ``record``'s tensor entries, metadata and where its data starts (read from the file)."""
        return read_shard_header(self.path / record.file, record.size)

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
        if file not in self._maps:
            record = self._record(file)
            shard = self.reading.reader(self.path / file, record, self.index.checksum_algorithm)
            if self.defer:
                shard.header()
                self._opened(file, shard, record, check=self.verify and not self._known(shard, record))
            else:
                read_verified(shard, record, verify=self.verify)
                self._opened(file, shard, record, check=False)
        return self._maps[file]

    def _known(self, shard: ShardReader, record: ShardRecord) -> bool:
        """Whether this process verified the very same unchanged file before (``verified.py``)."""
        return self.remembers_verified and is_verified(shard.identity, record, self.index.checksum_algorithm)

    def _opened(self, file: str, shard: ShardReader, record: ShardRecord, *, check: bool) -> None:
        """Read ``file`` through ``shard`` from now on; with ``check``, ``copy`` computes its checksum."""
        self._shards[file] = shard
        if check:
            self._unchecked.add(file)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only mapping (a held slot) is only copied from
            self._maps[file] = torch.frombuffer(shard.mapping, dtype=torch.uint8)

    def copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]], *, through_mapping: bool = False) -> None:
        """``dst.copy_(src)`` for each pair; checksums deferred files in the same pass.

        The copies are done per file, in file order, by the file's reader: a
        contiguous host target of a contiguous source range is read straight
        into its memory (``preadv`` of a local file: no page faults on the
        mapping, one pass over the bytes; ranged GETs of an object); any
        other copy goes through the mapping. With ``through_mapping`` only
        what is not in the mapping yet (an object's bytes) is read, and a
        local file is copied out of its mapping. A deferred file's checksum
        follows the reads on a thread of its own, the bytes no copy reads
        included. ``InvalidCheckpoint`` when a checksum is wrong (the targets
        then hold what was copied) or when the file changed since it was
        opened.
        """
        by_file: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {
            f: [] for f in self._unchecked if not self._shards[f].verified}
        spans = {f: (t.data_ptr(), t.numel()) for f, t in self._maps.items()}
        for dst, src in copies:
            start = src.data_ptr()
            owner = next((f for f, (base, n) in spans.items() if base <= start < base + n), None)
            if owner is None or src.numel() == 0 or not self._reads(owner, through_mapping):
                dst.copy_(src)  # not a file's mapping (node memory), or bytes in this process's memory
                continue
            last = sum((n - 1) * st for n, st in zip(src.shape, src.stride())) * src.element_size()
            begin = start - spans[owner][0]
            by_file.setdefault(owner, []).append((begin, begin + last + src.element_size(), dst, src))
        for file, pairs in by_file.items():
            self._read(file, sorted(pairs, key=lambda p: p[0]))

    def _reads(self, file: str, through_mapping: bool) -> bool:
        """Whether ``copy`` reads what it copies of ``file`` rather than copying out of its mapping: bytes not
        fetched yet, or a file's pages (a read into the target does not fault them in; unless ``through_mapping``)."""
        shard = self._shards[file]
        return shard.fetches or (shard.maps_file and not through_mapping)

    def fetch_whole(self, file: str) -> None:
        """Bring all of ``file`` into its mapping, checked (its tensors are handed out): an object is fetched, a
        local file's mapping holds it already."""
        self.mapped(file)
        read_verified(self._shards[file], self._record(file), verify=self.verify)

    def holds_chunks(self, file: str) -> bool:
        """Whether ``file`` holds chunks of global tensors (``load`` assembles them out of the whole file)."""
        return any(c.file == file for t in self.index.tensors.values() for c in t.chunks)

    def read_into(self, file: str, spans: list[tuple[int, int, memoryview]]) -> None:
        """Read ``file``'s bytes ``[begin, end)`` into each span's memory, with ``verify`` checking the checksum of
        every byte of it in the same pass; nothing is kept of the file afterwards."""
        record = self._record(file)
        self.reading.reader(self.path / file, record, self.index.checksum_algorithm).read(spans, verify=self.verify)

    def _record(self, file: str) -> ShardRecord:
        return next(f for f in self.index.files if f.file == file)

    def _read(self, file: str, pairs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        """Read what the copies take of ``file`` straight into each contiguous host target, the rest into the
        mapping (where a local file's bytes are already) and copied from there; ``file``'s deferred checksum is
        computed in the same pass."""
        shard, spans, later = self._shards[file], [], []
        for begin, end, dst, src in pairs:
            if _readable(dst, src, end - begin):
                spans.append((begin, end, bytes_of(dst)))
                torch.autograd.graph.increment_version(dst)  # as copy_ would: autograd sees the change
            else:
                spans.append((begin, end, None))
                later.append((dst, src))
        check = file in self._unchecked and not shard.verified
        shard.read(spans, verify=check)
        self._unchecked.discard(file)
        for dst, src in later:
            dst.copy_(src)
        if check and self.remembers_verified:
            remember(shard.identity, self._record(file), self.index.checksum_algorithm)


def _readable(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> bool:
    """Whether the file's bytes can be read straight into ``dst``: both contiguous, same bytes, host memory."""
    return (dst.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
            and dst.numel() * dst.element_size() == nbytes and not dst.is_conj() and not dst.is_neg())


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def read_verified(shard: ShardReader, record: ShardRecord, *, verify: bool) -> None:
    """Bring all of ``shard`` into its mapping and, with ``verify``, check its checksum unless this process
    verified the very same unchanged file before (``verified.py``); remembered once checked."""
    algorithm = shard.algorithm
    check = verify and not is_verified(shard.identity, record, algorithm)
    shard.read_whole(verify=check)
    if check:
        remember(shard.identity, record, algorithm)


def map_shard(shard: Path, record: ShardRecord, *, verify: bool, algorithm: str) -> ShardReader:
    """The shard, all of it in its reader's ``mapping`` (a local file mapped copy-on-write, an object fetched by
    parallel ranged reads into anonymous memory), and with ``verify`` checked (``read_verified``)."""
    reader = shard_reader(shard, record, algorithm)
    read_verified(reader, record, verify=verify)
    return reader


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
    files.copy(copies, through_mapping=True)  # fetches what the copies read that is not in memory yet
    return out
