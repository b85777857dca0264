"""``ckptd.dcp.StorageReader``: torch.distributed.checkpoint loads ckptd checkpoints.

``dcp.load(state_dict, storage_reader=ckptd.dcp.StorageReader(path))`` plans
with DCP's own planner and reshards with DCP's own logic: the reader only
describes what the checkpoint holds and serves byte ranges.

What DCP sees (its ``Metadata``), keyed by DCP's flattened names (DCP's own
``flatten_state_dict`` over the saved structure, so the names are the ones
DCP derives from the target):

* a global tensor (DTensor, ``replicated=`` key): its dtype, global shape and
  every saved chunk (offsets, sizes), straight from the index;
* a per-rank tensor: one chunk, the whole tensor;
* anything else (ints, strings, lists of plain values...): ``BytesStorageMetadata``,
  served as DCP's planner expects (``torch.save`` bytes of the value).

Every rank's shard is described, so a key only some ranks saved (torchtitan's
``dataloader.dp_rank_N``) loads on the rank that asks for it. A per-rank
name that several ranks saved (DCP treats a plain tensor or value as one
item) is read as this process's rank saved it when that rank is in the
saved world, else as the lowest rank that saved it.

A memory snapshot the node's daemon holds (``StorageWriter(persist=False)``,
``Client.save_async(persist=False)``) is read from its slots, as
``ckptd.load`` reads it (``memory.open_checkpoint``: pinned while read,
every byte checked against the checksum the daemon took); a path the
daemon does not hold is read from disk. Each rank opens it from its own
daemon (DCP sends the coordinator's metadata to every rank), and the
coordinator describes what its own daemon holds: on several nodes, where
each daemon holds only its own ranks' shards, a snapshot is not read
through DCP (restore there from a save with ``persist=True``).

Reads view chunks in place in the mapped shard files (``ChunkFiles``): each
file is mapped and its checksum verified once, on first use, and a read
copies only the pages of the requested region.

The metadata's ``planner_data`` maps each name to its key path in the saved
state, as DCP's own writer records its planner's flattening: a planner that
builds the state from the metadata alone (``_EmptyStateDictLoadPlanner``, as
``dcp_to_torch_save`` and offline inspection use) nests it as saved.

Saving through DCP is ``ckptd.dcp.StorageWriter`` (``dcp_writer.py``).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import StorageReader as _DCPStorageReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ChunkRecord, ShardRecord, TensorRecord, read_index
from ckptd.protocol.inspect import check_shard_structure

from .checks import check_bool, check_path
from .flatten import unflatten
from .ranks import detect_rank
from .memory import find_held, open_checkpoint
from .reshard import ChunkFiles, GlobalRef, read_full, region

__all__ = ["StorageReader"]


class StorageReader(_DCPStorageReader):
    """Reads a committed ckptd checkpoint, or a memory snapshot, for ``torch.distributed.checkpoint.load``."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True,
                 run_dir: str | os.PathLike | None = None) -> None:
        """``run_dir``: the daemon whose memory snapshots are read (default: this node's, as ``ckptd.Client``)."""
        super().__init__()
        self.path = Path(check_path("path", path))
        check_bool("verify", verify)
        self.verify = verify
        self.run_dir = None if run_dir is None else os.path.abspath(check_path("run_dir", run_dir))
        self._files: ChunkFiles | None = None
        self._items: dict[str, Any] = {}
        """DCP name -> GlobalRef (a tensor) or the plain value."""
        self._value_files: dict[str, str] = {}
        """DCP name of a plain value -> the shard file whose header holds it."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(check_path("checkpoint_id", checkpoint_id))
        self._files, self._items, self._value_files = None, {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            read_index(checkpoint_id)
        except (InvalidCheckpoint, TypeError, ValueError):
            try:
                return find_held(Path(checkpoint_id)) is not None
            except (TypeError, ValueError):
                return False
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        files = open_checkpoint(self.path, verify=self.verify, run_dir=self.run_dir)
        index = files.index
        try:
            refs: dict[int, GlobalRef] = {}
            keep: list[torch.Tensor] = []  # placeholders stay alive so their ids stay unique

            def placeholder(ref: GlobalRef) -> torch.Tensor:
                t = torch.empty(ref.record.shape, dtype=ref.dtype, device="meta")
                refs[id(t)] = ref
                keep.append(t)
                return t

            described: dict[str, Any] = {}
            paths: dict[str, tuple[str | int, ...]] = {}
            items: dict[str, Any] = {}
            value_files: dict[str, str] = {}
            for rank in _reading_order(index.world_size):
                record = index.shard(rank)
                flat, rank_paths = self._rank_state(index, record, files, placeholder)
                for name, value in flat.items():
                    if name in described:
                        continue  # a name several ranks saved: the first in the reading order describes it
                    paths[name] = rank_paths[name]
                    ref = refs.get(id(value)) if isinstance(value, torch.Tensor) else None
                    if ref is not None:
                        chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                                  for c in ref.record.chunks]
                        described[name] = TensorStorageMetadata(TensorProperties(dtype=ref.dtype),
                                                                torch.Size(ref.record.shape), chunks)
                        items[name] = ref
                    else:
                        described[name] = BytesStorageMetadata()
                        items[name] = _materialize(value, refs, files)
                        value_files[name] = record.file
        except BaseException:
            files.close()  # a snapshot's lease ends with the failed read
            raise
        self._files, self._items, self._value_files = files, items, value_files
        # DCP's own writer keeps its planner's flattening (DCP name -> key path) as planner_data; a planner that
        # builds the state from the metadata (``_EmptyStateDictLoadPlanner``: ``dcp_to_torch_save``) nests by it.
        return Metadata(state_dict_metadata=described, planner_data=paths, storage_data=(files, items, value_files))

    def _rank_state(self, index: CheckpointIndex, record: ShardRecord, files: ChunkFiles,
                    placeholder: Callable[[GlobalRef], torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
        """One rank's saved state flattened by DCP's names, tensors as placeholders (no tensor data read), and
        each name's key path in the saved state."""
        entries, metadata, data_start = files.header(record)
        structure = check_shard_structure([e.name for e in entries], metadata, record, index, self.path / record.file)
        per_rank = {e.name: e for e in entries}

        def tensor_for(name: str) -> torch.Tensor:
            e = per_rank.get(name)
            if e is None:
                raise InvalidCheckpoint(f"shard {self.path / record.file}: structure names tensor {name!r}, "
                                        "which the header lacks")
            chunk = ChunkRecord(record.file, (0,) * len(e.shape), e.shape, data_start + e.begin, data_start + e.end)
            return placeholder(GlobalRef(name, TensorRecord(e.dtype, e.shape, (chunk,))))

        try:
            state = unflatten(structure, tensor_for, lambda name: placeholder(files.ref(name)))
        except (ValueError, TypeError) as exc:
            raise InvalidCheckpoint(f"shard {self.path / record.file} has a structure that cannot be read: {exc}") from None
        if not isinstance(state, dict):
            raise InvalidCheckpoint(f"checkpoint {self.path} holds a {type(state).__name__}; DCP loads dict states only")
        return flatten_state_dict(state)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata.storage_data, tuple) and len(metadata.storage_data) == 3:
            self._files, self._items, self._value_files = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._files is None:
            raise RuntimeError("read_data before read_metadata: DCP calls read_metadata first")
        try:
            for item in plan.items:
                fqn = item.storage_index.fqn
                value = self._items[fqn]
                if item.type == LoadItemType.BYTE_IO:
                    self._files.mapped(self._value_files[fqn])  # the value came from this file's header: verify it
                    buffer = io.BytesIO()
                    torch.save(value, buffer)
                    buffer.seek(0)
                    planner.load_bytes(item, buffer)
                    continue
                offsets = tuple(item.storage_index.offset)
                chunk = next((c for c in value.record.chunks if c.offsets == offsets), None)
                if chunk is None:
                    raise InvalidCheckpoint(f"checkpoint {self.path}: DCP asked for a chunk of {fqn!r} at "
                                            f"{list(offsets)}, which the index does not list")
                source = self._files.chunk(value, chunk)
                box = (tuple(o + s for o, s in zip(chunk.offsets, item.storage_offsets)), tuple(item.lengths))
                target = planner.resolve_tensor(item).detach()
                target.copy_(region(source, box, chunk.offsets))
                planner.commit_tensor(item, target)
        finally:
            self._files.close()  # a snapshot's lease: this rank has read what it needed
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _reading_order(world_size: int) -> list[int]:
    """The saved ranks in the order they describe a name: this process's rank first (a rank of the same
    world reads back what it saved), then from rank 0 up (a rank beyond the saved world reads rank 0's)."""
    own = detect_rank()[0]
    return sorted(range(world_size), key=lambda r: (r != own, r))


def _materialize(value: Any, refs: dict[int, GlobalRef], files: ChunkFiles) -> Any:
    """A plain value with any tensor placeholders inside (DCP treats tuples as plain values) read whole."""
    if isinstance(value, torch.Tensor) and id(value) in refs:
        return read_full(files, refs[id(value)])
    if isinstance(value, dict):
        return type(value)((k, _materialize(v, refs, files)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v, refs, files) for v in value)
    return value
