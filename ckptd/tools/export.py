"""``ckptd export``: a checkpoint's full tensors in the Hugging Face safetensors layout.

Inference tools want whole tensors in ``model.safetensors`` (or
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``
with ``metadata.total_size`` and ``weight_map``). A ckptd checkpoint holds
the chunks of each global tensor in the files of the ranks that owned them,
at known byte ranges (the index), so exporting only moves bytes: each output
file is created at its final size, mapped, and every chunk is copied into its
place row-major, one contiguous run at a time. No torch, no tensor objects;
memory is the page cache of one output file at a time.

What is exported: every global tensor (DTensors, ``replicated=`` keys), and
the per-rank tensors of a one-rank checkpoint. Per-rank tensors of a larger
world differ between ranks and have no single value; they are left out and
counted. ``prefix`` keeps only names starting with it and strips it, so
``--prefix model.`` turns ``model.fc.weight`` into ``fc.weight``, the key
``model.load_state_dict`` expects.

The export is written into a hidden ``.NAME.*.incomplete`` sibling of
``OUTDIR``, fsync'd, and renamed into place, so ``OUTDIR`` is either absent
(or empty) or complete. Each source file's checksum is verified once, before
its bytes are used. A checkpoint on an object store (``s3://``) is read the
same way, each shard fetched into memory by parallel ranged GETs when first
used (so up to the whole checkpoint is held in memory at once).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ckptd.protocol.chunks import GLOBAL_KEY
from ckptd.protocol.index import CheckpointIndex, ChunkRecord, TensorRecord, read_index
from ckptd.protocol.inspect import read_shard_header
from ckptd.protocol.layout import DTYPE_SIZES, plan_layout
from ckptd.protocol.reading import shard_reader
from ckptd.protocol.shard_reads import ShardReader

from ckptd.storage.contract import LocalStorage

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class ExportResult:
    outdir: Path
    files: tuple[str, ...]
    tensors: int
    total_size: int
    """Tensor bytes written (``metadata.total_size`` of the index)."""
    skipped_per_rank: int
    """Per-rank tensors under the prefix in a multi-rank checkpoint: they have no single value."""

    @property
    def tensor_files(self) -> int:
        return sum(1 for f in self.files if f != INDEX_FILE)


def parse_size(text: str) -> int:
    """``5GB`` (10**9), ``2GiB`` (2**30), ``500MB``, ``1000``: bytes, as Hugging Face reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]) if match else 0
    if size < 1:
        raise ValueError(f"max shard size {text!r} is not a positive size (examples: 5GB, 500MB, 2GiB, 1000000)")
    return size


def export_checkpoint(checkpoint: Path | str, outdir: Path | str, *, prefix: str = "",
                      max_shard_size: int | str = DEFAULT_MAX_SHARD) -> ExportResult:
    """Write the full tensors of ``checkpoint`` to ``outdir`` as Hugging Face safetensors files."""
    checkpoint, outdir = Path(checkpoint), Path(outdir)
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if type(limit) is not int or limit < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if outdir.exists() and (not outdir.is_dir() or any(outdir.iterdir())):
        raise ValueError(f"output directory {outdir} already exists and is not empty; choose a new one")
    index = read_index(checkpoint)
    tensors, skipped = _exported_tensors(checkpoint, index)
    chosen = {name[len(prefix):]: rec for name, rec in sorted(tensors.items()) if name.startswith(prefix)}
    if not chosen or "" in chosen:
        own = sorted(name for name in skipped if name.startswith(prefix))
        why = f"it holds {_sample(tensors)}" if not own or "" in chosen else (
            f"only per-rank tensors ({len(own)}, such as {own[0]}), which each rank saved its own of: no single "
            f"value to export; load them per rank with ckptd.load(path, rank=R), or export a DeepSpeed tag with "
            f"python -m ckptd.integrations.deepspeed export")
        raise ValueError(f"prefix {prefix!r} selects no tensor of {checkpoint} ({why})")
    groups = _group(chosen, limit)
    names = [SINGLE_FILE] if len(groups) == 1 else [
        f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)]
    outdir.parent.mkdir(parents=True, exist_ok=True)
    files = LocalStorage()  # the output is local files, written durably as the daemon writes a checkpoint's
    tmp = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.", suffix=".incomplete", dir=outdir.parent))
    try:
        with _Sources(checkpoint, index) as sources:
            for file, group in zip(names, groups):
                _write_file(tmp / file, group, sources)
        total = sum(_nbytes(rec) for rec in chosen.values())
        if len(groups) > 1:
            weight_map = {name: file for file, group in zip(names, groups) for name in group}
            doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            files.write_file(tmp / INDEX_FILE, json.dumps(doc, indent=2).encode() + b"\n")
            names.append(INDEX_FILE)
        os.chmod(tmp, 0o777 & ~_umask())
        files.fsync_dir(tmp)
        files.rename(tmp, outdir)  # replaces an empty outdir atomically
        files.fsync_dir(outdir.parent)
    except BaseException:
        files.remove_tree(tmp)
        raise
    return ExportResult(outdir, tuple(names), len(chosen), total, sum(1 for n in skipped if n.startswith(prefix)))


def _exported_tensors(checkpoint: Path, index: CheckpointIndex) -> tuple[dict[str, TensorRecord], set[str]]:
    """Global tensors from the index; per-rank tensors as one-chunk records when the world is one rank."""
    tensors = dict(index.tensors)
    per_rank: set[str] = set()
    for record in index.files:
        entries, metadata, data_start = read_shard_header(checkpoint / record.file, record.size)
        chunk_names = set(json.loads(metadata.get(GLOBAL_KEY, "{}")))
        for e in entries:
            if e.name in chunk_names:
                continue
            if index.world_size > 1:
                per_rank.add(e.name)
                continue
            zeros = (0,) * len(e.shape)
            chunk = ChunkRecord(record.file, zeros, e.shape, data_start + e.begin, data_start + e.end)
            tensors[e.name] = TensorRecord(e.dtype, e.shape, (chunk,))
    return tensors, per_rank


def _sample(tensors: dict[str, TensorRecord]) -> str:
    names = sorted(tensors)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") if names else "no tensors"


def _nbytes(rec: TensorRecord) -> int:
    return math.prod(rec.shape) * DTYPE_SIZES[rec.dtype]


def _group(tensors: dict[str, TensorRecord], limit: int) -> list[dict[str, TensorRecord]]:
    """Tensors in name order, cut into files of at most ``limit`` tensor bytes (a larger tensor gets a file alone)."""
    groups: list[dict[str, TensorRecord]] = [{}]
    used = 0
    for name, rec in tensors.items():
        size = _nbytes(rec)
        if groups[-1] and used + size > limit:
            groups.append({})
            used = 0
        groups[-1][name] = rec
        used += size
    return groups


class _Sources:
    """The checkpoint's files, each read whole (a local file mapped, an object fetched) and checksummed once, on
    first use."""

    def __init__(self, checkpoint: Path, index: CheckpointIndex) -> None:
        self.checkpoint, self.index = checkpoint, index
        self.shards: dict[str, ShardReader] = {}
        self.views: dict[str, memoryview] = {}

    def view(self, file: str) -> memoryview:
        if file not in self.shards:
            record = next(f for f in self.index.files if f.file == file)
            shard = shard_reader(self.checkpoint / file, record, self.index.checksum_algorithm)
            shard.read_whole(verify=True)
            self.shards[file], self.views[file] = shard, memoryview(shard.mapping)
        return self.views[file]

    def __enter__(self) -> "_Sources":
        return self

    def __exit__(self, *exc: object) -> None:
        for view in self.views.values():
            view.release()  # a mapping cannot close while a view of it lives
        for shard in self.shards.values():
            shard.mapping.close()


def _write_file(path: Path, group: dict[str, TensorRecord], sources: _Sources) -> None:
    """One output file: created at its final size, filled through a mapping, fsync'd."""
    layout = plan_layout(((name, rec.dtype, rec.shape) for name, rec in group.items()), {"format": "pt"})
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        os.ftruncate(fd, layout.nbytes)
        with mmap.mmap(fd, layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as out:
            with memoryview(out) as dst:
                dst[: layout.data_start] = layout.header
                for entry in layout.entries:
                    rec = group[entry.name]
                    for chunk in rec.chunks:
                        _copy_chunk(dst, layout.data_start + entry.begin, rec, chunk, sources.view(chunk.file))
            out.flush()
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_chunk(dst: memoryview, base: int, rec: TensorRecord, chunk: ChunkRecord, src: memoryview) -> None:
    """Copy ``chunk`` into the row-major tensor starting at ``dst[base]``, one contiguous run at a time.

    A run spans the chunk's trailing dimensions that are whole in the tensor,
    plus the one before them: for a row-sharded tensor the chunk is one run.
    """
    shape, item = rec.shape, DTYPE_SIZES[rec.dtype]
    if chunk.numel == 0:
        return
    k = len(shape)
    while k > 0 and chunk.sizes[k - 1] == shape[k - 1]:
        k -= 1
    lead = max(k - 1, 0)  # dimensions walked one index at a time; the rest form a run
    run = math.prod(chunk.sizes[lead:]) * item
    strides = [math.prod(shape[d + 1:]) * item for d in range(len(shape))]
    chunk_strides = [math.prod(chunk.sizes[d + 1:]) * item for d in range(len(shape))]
    start = base + sum(o * s for o, s in zip(chunk.offsets, strides))
    for idx in itertools.product(*(range(n) for n in chunk.sizes[:lead])):
        out = start + sum(i * s for i, s in zip(idx, strides))
        inp = chunk.begin + sum(i * s for i, s in zip(idx, chunk_strides))
        dst[out : out + run] = src[inp : inp + run]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
