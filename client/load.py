"""Reading a committed checkpoint back into the structure that was saved.

By default every tensor owns its memory: the shard is read once, front to
back, straight into one fresh buffer per tensor (no temporary copy of the
file), and the checksum from the index is computed over the same bytes as
they arrive; a helper thread faults the new tensors' pages in ahead of the
read (``prefault.py``), so that work overlaps the disk instead of following
it. Nothing keeps the file open or mapped afterwards, so when retention
deletes the checkpoint its space comes back, and ``torch.save`` of one loaded
tensor writes that tensor, not the shard. With ``map_location`` each tensor
is moved to that device as soon as it is read.

``mmap=True`` (as in ``torch.load``) instead maps the shard copy-on-write and
returns views of the mapping: no read at all, the page cache serves the
bytes, and writing to a tensor changes only this process's copy. The
mapping then lives as long as any of those tensors.

Every failure is an ``InvalidCheckpoint`` that names the file and what is
wrong (``verify=False`` skips the checksum); nothing partial is returned.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Literal

import torch

from ckptd.protocol.checksums import Behind
from ckptd.protocol.errors import BadMessage, InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ShardRecord
from ckptd.protocol.inspect import check_shard_structure, open_shard, read_header_from
from ckptd.protocol.layout import parse_header
from ckptd.protocol.mapped import MAX_READ, identity
from ckptd.protocol.objects import display
from ckptd.protocol.shard_reads import check_checksum, check_shard_size

from .checks import check_bool, check_limit, check_load_rank, check_path
from .dtypes import typed_view
from .flatten import unflatten
from .lease import load_lease
from .ranks import detect_ranks
from .memory import HeldFiles, open_checkpoint
from .prefault import STEP as READ_STEP, Prefault
from .reshard import ChunkFiles, GlobalRef, bytes_of, read_full
from .verified import is_verified, remember

MapLocation = str | torch.device | None


def load(
    path: str | os.PathLike,
    *,
    rank: int | Literal["all"] | None = None,
    map_location: MapLocation = None,
    verify: bool = True,
    mmap: bool = False,
    max_concurrent_per_node: int | None = None,
    run_dir: str | os.PathLike | None = None,
    exclude: tuple[str, ...] = (),
) -> Any:
    """The state saved by ``rank`` at ``path`` (``rank="all"``: a list, one per rank).

    Global tensors of a sharded checkpoint (DTensors, ``replicated=`` keys)
    come back whole, assembled from their chunks, so one plain process can
    read what many ranks saved; with ``rank="all"`` the ranks' states share
    those tensors.

    Args:
        rank: default this process's rank (0 for a one-rank checkpoint).
        map_location: None keeps tensors on the CPU; a device (``"cpu"``,
            ``"cuda:0"``) moves each tensor there as it is read.
        verify: check the shard's checksum from the index (in the same pass
            as the read; with ``mmap=True``, one pass over the mapping first).
        mmap: return views of a copy-on-write mapping of the shard instead
            of tensors that own their memory (zero-copy; the file stays
            mapped while any of them lives).
        max_concurrent_per_node: hold a lease from this node's daemon so at
            most this many ranks load at once (None: the daemon's default,
            if a daemon runs and has one).
        run_dir: the daemon to ask for the lease.
        exclude: top-level keys of a saved dict to leave out. Their global
            tensors are never assembled: a rank that restores the sharded
            part with ``ckptd.load_into`` reads the rest this way without
            holding a whole copy of the model.
    """
    path = Path(check_path("path", path))
    rank = check_load_rank(rank, allow_all=True)
    if not isinstance(exclude, (tuple, list)) or not all(isinstance(k, str) for k in exclude):
        raise TypeError(f"exclude must be a tuple of top-level key names, got {exclude!r}")
    check_bool("verify", verify)
    check_bool("mmap", mmap)
    limit = check_limit(max_concurrent_per_node)
    if run_dir is not None:
        check_path("run_dir", run_dir)
    device = _device(map_location)
    files = open_checkpoint(path, verify=verify, run_dir=run_dir)  # the daemon's memory when it holds path
    try:
        index = files.index
        assembled: dict[str, torch.Tensor] = {}

        def full_tensor(name: str) -> torch.Tensor:  # a global tensor, assembled once however many ranks name it
            if name not in assembled:
                assembled[name] = read_full(files, files.ref(name), device)
            return assembled[name]

        def state_of(r: int) -> Any:
            if not exclude:
                return load_rank(files, r, device, full_tensor, mmap=mmap)
            state = load_rank(files, r, device, files.ref, mmap=mmap)  # global tensors as references for now
            if not isinstance(state, dict):
                raise TypeError(f"exclude names top-level keys, but rank {r} of {display(path)} saved a "
                                f"{type(state).__name__}, not a dict")
            return _assemble({k: v for k, v in state.items() if k not in exclude}, full_tensor)

        with load_lease(limit, run_dir=run_dir):
            if rank == "all":
                return [state_of(r) for r in range(index.world_size)]
            if rank is None:
                rank = _own_rank(path, index)
            return state_of(rank)
    finally:
        files.close()  # a held snapshot's reader lease ends


def _assemble(obj: Any, full_tensor: Callable[[str], torch.Tensor]) -> Any:
    """``obj`` with each global tensor reference replaced by the whole tensor."""
    if isinstance(obj, GlobalRef):
        return full_tensor(obj.name)
    if isinstance(obj, dict):
        return {k: _assemble(v, full_tensor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_assemble(v, full_tensor) for v in obj)
    return obj


def _own_rank(path: Path, index: CheckpointIndex) -> int:
    """This process's rank in the checkpoint: never silently another rank's state."""
    if index.world_size == 1:
        return 0  # one state for every reader, as with torch.load
    rank = detect_ranks().rank
    if rank >= index.world_size:
        raise InvalidCheckpoint(
            f"checkpoint {display(path)} was saved by ranks 0..{index.world_size - 1}; this process is rank {rank}, which "
            "has no state there. Pass rank= to read another rank's state on purpose" + (
                ", or use ckptd.load_into to reshard its global (DTensor) tensors into this rank's target"
                if index.tensors else " (it holds no global tensors that ckptd.load_into could reshard)")
        )
    return rank


def _device(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(f"map_location must be None, a str or a torch.device, got {type(map_location).__name__}")
    try:
        device = torch.device(map_location)
    except RuntimeError as exc:
        raise ValueError(f"map_location {map_location!r} is not a device: {exc}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"map_location {map_location!r} names a CUDA device, but this process sees "
                             f"{count} CUDA device(s)")
    return device


def load_rank(files: ChunkFiles, rank: int, device: torch.device | None,
               global_for: Callable[[str], Any] | None = None, *, mmap: bool) -> Any:
    """Rank ``rank``'s state: read into owned tensors, or (``mmap``) views of ``files``' mapping of its shard."""
    index = files.index
    record = index.shard(rank)
    shard = files.path / record.file
    if isinstance(files, HeldFiles):  # a snapshot in node memory
        metadata, tensors = files.read(record, copy=not mmap)
    elif mmap:  # the mapping's views (an object: fetched whole into this process's memory)
        metadata, tensors = _map_tensors(files, record)
    elif files.reading.fetched:
        metadata, tensors = _fetch_tensors(files, record)
    else:
        metadata, tensors = _read_tensors(shard, record, verify=files.verify, algorithm=index.checksum_algorithm)
    structure = check_shard_structure(tensors.keys(), metadata, record, index, shard)
    made: dict[str, torch.Tensor] = {}

    def tensor_for(name: str) -> torch.Tensor:
        if name in made:  # one tensor referenced twice (tied weights) loads as one object
            return made[name]
        t = tensors.get(name)
        if t is None:
            raise InvalidCheckpoint(f"shard {shard}: structure names tensor {name!r}, which the header lacks")
        made[name] = t if device is None else t.to(device, copy=mmap)  # a copy lets go of the mapping
        return made[name]

    try:
        return unflatten(structure, tensor_for, global_for)
    except (ValueError, TypeError) as exc:
        raise InvalidCheckpoint(f"shard {shard} has a structure that cannot be read: {exc}") from None


def _read_tensors(shard: Path, record: ShardRecord, *, verify: bool,
                  algorithm: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read the shard front to back into one owned buffer per tensor, checksumming as it goes.

    The checksum is skipped for a file this process verified before and that has not changed since.
    """
    with open_shard(shard) as f:
        check_shard_size(shard, os.fstat(f.fileno()).st_size, record)
        ident = identity(f.fileno())
        verify = verify and not is_verified(ident, record, algorithm)
        entries, metadata, data_start = read_header_from(f, record.size, shard)
        entries = sorted(entries, key=lambda e: e.begin)  # contiguous, no holes: checked by the header parse
        bufs = [torch.empty(e.nbytes, dtype=torch.uint8) for e in entries]
        # Each range's checksum runs while the next is read, and the fresh tensors' pages are faulted in ahead.
        with Behind(algorithm) as crc, Prefault(bufs) as ahead:
            if verify:
                crc.add(os.pread(f.fileno(), data_start, 0))
            f.seek(data_start)
            for e, buf in zip(entries, bufs):
                for lo in range(0, e.nbytes, READ_STEP):
                    piece = bytes_of(buf)[lo : lo + READ_STEP]
                    ahead.reading(e.begin + lo + len(piece))
                    _read_into(f, piece, shard)
                    if verify:
                        crc.add(piece)
            if verify:
                check_checksum(shard, crc.value(), record, algorithm)
                remember(ident, record, algorithm)
        tensors = {e.name: typed_view(buf, e) for e, buf in zip(entries, bufs)}
    return metadata, tensors


def _read_into(f: BinaryIO, view: memoryview, shard: Path) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done : done + MAX_READ])
        if not n:
            raise InvalidCheckpoint(f"shard {shard} ended early while being read (changed under the reader?)")
        done += n


def _fetch_tensors(files: ChunkFiles, record: ShardRecord) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """An object's tensors, each fetched straight into memory of its own (ranged reads, checksummed as they land),
    as a local shard's are read: views of the whole fetched object kept all of it alive. An object holding chunks
    of global tensors is fetched whole once (they are assembled from it) and its own tensors copied out."""
    if files.holds_chunks(record.file):
        files.fetch_whole(record.file)
        metadata, views = _map_tensors(files, record)
        return metadata, {name: t.clone() for name, t in views.items()}
    entries, metadata, data_start = files.header(record)
    bufs = {e.name: torch.empty(e.nbytes, dtype=torch.uint8) for e in entries}
    files.read_into(record.file, [(data_start + e.begin, data_start + e.end, bytes_of(bufs[e.name]))
                                  for e in entries if e.nbytes])
    return metadata, {e.name: typed_view(bufs[e.name], e) for e in entries}


def _map_tensors(files: ChunkFiles, record: ShardRecord) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Views of the copy-on-write mapping of the shard (``mmap=True``), shared with its global tensors' chunks."""
    buf = files.mapped(record.file)
    try:
        # A view of the mapping itself, through ctypes: never buf.numpy(), which fails where numpy is not installed.
        entries, metadata, data_start = parse_header(bytes_of(buf).toreadonly(), record.size)
    except BadMessage as exc:
        raise InvalidCheckpoint(f"shard {files.path / record.file} has a bad header: {exc.message}") from None
    return metadata, {e.name: typed_view(buf[data_start + e.begin : data_start + e.end], e) for e in entries}


