"""``ckptd.dcp.StorageWriter``: torch.distributed.checkpoint saves through the node's ckptd daemon.

``dcp.save(state, storage_writer=StorageWriter(path))`` and ``dcp.async_save``
(THREAD or PROCESS) plan with DCP's own planner, de-duplication of
replicated items included; the writer maps DCP's two phases onto ckptd's:

* ``write_data`` (every rank): the items DCP planned for this rank become one
  shard, tensors and chunks exactly as planned (a DTensor's chunk at its
  offsets, a plain tensor as the one chunk of a global tensor on the rank DCP
  picked), copied once into the rank's reused shared-memory slot and
  committed to the node's daemon as a coordinated commit; it returns once the
  shard is durable (``Durable``), with the shard's record as its result.
* ``finish`` (DCP's coordinator only, after every rank's ``write_data``
  succeeded): ``Finalize`` with every rank's record; the daemon writes the
  index and renames ``path.incomplete`` to ``path``. So the checkpoint becomes
  visible only once every rank is durable, as with ``Client.save_async``.

If a rank's ``write_data`` fails, DCP never calls ``finish``, and the other
ranks' durable shards must not wait for the commit timeout (nor keep a retry
of the path waiting). So at the end of ``write_data`` the ranks agree, on a
gloo group of the writers' own, whether every shard is durable; if not, rank
0 sends ``Abort`` (every commit has been answered by then, so no shard can
join the attempt after it) and every rank raises.

With ``persist=False`` the save is a memory snapshot (the memory tier,
``docs/memory.md``): the shard is held in node memory by the daemon, not
written, and ``write_data`` returns once every rank's shard is held (on
several nodes, the client's own agreement); ``finish`` has nothing to
publish. ``ckptd.latest`` finds it, ``ckptd.dcp.StorageReader`` reads it
from memory, ``client.persist(path)`` (or the daemon, when the trainer
dies) writes it to disk as an ordinary ckptd checkpoint. Snapshot every few
steps, save with ``persist=True`` every few hundred.

Non-tensor items (what DCP would ``torch.save`` into bytes) are kept in the
shard's structure, msgpack-encoded as ``Client.save_async`` keeps them, from
the rank's own state dict: nothing is pickled, and a value msgpack cannot hold
is refused naming its key. The result is an ordinary ckptd checkpoint:
``ckptd.load``, ``ckptd.load_into``, ``dcp.load`` with
``ckptd.dcp.StorageReader`` and DCP's ``HuggingFaceStorageReader`` read it.

Given no ``client=``, a writer saves through its process's shared client
(``dcp_shared.py``): made by the first such writer and reused by every later
one, so a writer per save (the way DCP code is written) reuses the slots too.
The writer pickles without its client (DCP's PROCESS executor sends it to a
process of its own), and there uses that process's shared client.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptd.protocol.chunks import Box
from ckptd.protocol.errors import RanksMissing
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.messages import Abort, Durable, Finalize

from ckptd.protocol.layout import ShardLayout

from .api import Ahead, Client, checkpoint_target
from .checks import check_bool, check_keep_last, check_path, check_seconds, check_step
from .coordinate import all_gather_msgpack
from .dcp_shared import agreement_group, release_shared_client, shared_client
from .flatten import Flat, check_tensor, flatten
from .sharding import dtensor_chunk, global_rank, is_dtensor
from .slots import Slot

__all__ = ["StorageWriter"]


SHARD_RESULT = "ckptd.shard"
"""The fqn of the one extra ``WriteResult`` per rank that carries its shard's record to ``finish``."""



class StorageWriter(_DCPStorageWriter):
    """Writes a ckptd checkpoint for ``torch.distributed.checkpoint.save`` and ``async_save``."""

    def __new__(cls, *args: Any, stage_in_slot: bool = False, **kwargs: Any) -> "StorageWriter":
        check_bool("stage_in_slot", stage_in_slot)
        return super().__new__(_SlotStagingWriter if stage_in_slot and cls is StorageWriter else cls)

    def __init__(self, path: str | os.PathLike, *, step: int | None = None, overwrite: bool = True,
                 keep_last: int | None = None, client: Client | None = None,
                 run_dir: str | os.PathLike | None = None, commit_timeout: float = 600.0,
                 stage_in_slot: bool = False, persist: bool = True) -> None:
        """
        Args:
            path: the checkpoint (a directory; ``checkpoint_id`` replaces it).
            step, keep_last: as for ``Client.save_async``.
            overwrite: replace a checkpoint at ``path`` (DCP's ``FileSystemWriter``
                default), atomically as ``Client.save_async(overwrite=True)``:
                the old one stays until the new one is renamed in its place.
                ``False``: fail with ``CheckpointExists``, the old one kept.
            client: the ``ckptd.Client`` to save through (default: this
                process's shared client for ``run_dir``, made by the first
                writer, collectively under torch.distributed, and reused).
            run_dir, commit_timeout: the shared client's (one per pair).
            stage_in_slot: be ``async_save``'s stager (DCP's ``AsyncStager``):
                staging is the copy of this rank's tensors into the slot,
                before DCP plans, so every byte is copied once and
                ``async_save`` returns once that copy is done, while DCP
                plans and the daemon writes. For the THREAD executor only:
                the PROCESS executor runs the save, and so the copy, in
                another process, and needs a staged copy of its own (without
                this, DCP's default stager makes one).
            persist: ``False``: a memory snapshot, held by the node's daemon
                instead of written (``Client.save_async(persist=False)``).
        """
        super().__init__()
        self.path = checkpoint_target(path)
        self.step = check_step(step)
        check_bool("overwrite", overwrite)
        self.overwrite = overwrite
        self.keep_last = check_keep_last(keep_last)
        check_bool("persist", persist)
        self.persist = persist
        if client is not None and not isinstance(client, Client):
            raise TypeError(f"client must be a ckptd.Client, got {type(client).__name__}")
        if client is not None:  # a copy in another process reaches the same daemon the same way
            run_dir, commit_timeout = client.run_dir, client.commit_timeout
        self.run_dir = None if run_dir is None else os.path.abspath(check_path("run_dir", run_dir))
        self.commit_timeout = check_seconds("commit_timeout", commit_timeout)
        self._client: Client | None = client
        """The client given (None: the process's shared one, looked up at each use)."""
        if client is None:
            shared_client(self.run_dir, self.commit_timeout)  # made now: collective, as every rank makes its writer
        self._is_coordinator = False
        self._group = agreement_group(self.commit_timeout)  # collective: every rank makes its writer

    # -- pickling for DCP's PROCESS executor ------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # a client belongs to its process (its slots, its socket), and so does a group
        state["_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._group = agreement_group(self.commit_timeout)  # DCP's process: every rank unpickles its copy

    @property
    def client(self) -> Client:
        """The client given, else (unpickled in another process too) this process's shared one."""
        if self._client is not None:
            return self._client
        return shared_client(self.run_dir, self.commit_timeout)

    def close(self) -> None:
        """Close the shared client, waiting for its saves, to free its slots now (a given client is left alone).

        Never needed: the shared client is closed at exit. The next writer
        makes a new one, collectively: call it on every rank or on none.
        """
        if self._client is None:
            release_shared_client(self.run_dir, self.commit_timeout)

    # -- DCP's StorageWriter contract -------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._save_begins()
        if checkpoint_id is not None:
            self.path = checkpoint_target(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            checkpoint_target(checkpoint_id)
        except (TypeError, ValueError):
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is not None and rank != self.client.rank:
            raise ValueError(f"DCP saves as rank {rank} but the ckptd client is rank {self.client.rank} of "
                             f"{self.client.world_size}: save with the process group the client's ranks come from")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) != self.client.world_size:
            raise ValueError(f"DCP planned {len(plans)} ranks but the ckptd client's world size is "
                             f"{self.client.world_size}: save with the process group the client's ranks come from")
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Stage this rank's planned items as one shard and commit it; resolves once it is durable."""
        client, failure = self.client, None
        try:
            started = time.monotonic()
            ahead = self._taken_ahead()
            try:
                flat = _planned_shard(plan, planner)
            except BaseException:
                if ahead is not None:
                    client.release_ahead(ahead)
                raise
            # A disk save is committed by ``finish`` (coordinated: each rank's shard answers Durable); a snapshot
            # is complete once every rank is held, which the daemon (or the client's agreement) judges itself.
            saved, reply = client._save_flat(flat, self.path, step=self.step, overwrite=self.overwrite,
                                            keep_last=self.keep_last, block=True, persist=self.persist,
                                            started=started, coordinated=self.persist, ahead=ahead)
            saved.staged.add_done_callback(lambda f: self._staging_over(f.exception()))
            if self.persist:
                saved.result()
                durable = reply.result()
                assert isinstance(durable, Durable)
            else:  # held once every rank is: waited for after the agreement, so a rank that failed is not waited on
                saved.staged.result()
                durable = None
        except Exception as exc:
            failure = exc
            self._staging_over(exc)
        # Every rank's commit has its answer now: if one failed, DCP will never call finish, so the attempt is
        # aborted here, after the last shard joined it (an earlier Abort would leave a later shard pending).
        outcome = ["ok"] if failure is None else ["error", f"rank {client.rank}: {failure!r}"]
        everyone = all_gather_msgpack(outcome, self._group) if self._group is not None else [outcome]
        failures = [entry[1] for entry in everyone if entry[0] != "ok"]
        if failures:
            if client.rank == 0:  # a snapshot too: the daemon fails the ranks it holds of it, at once
                self._abort("; ".join(failures))
            if failure is not None:
                raise failure
            if not self.persist:
                with contextlib.suppress(Exception):  # failed by the Abort: the rank's slot is its own again
                    saved.result(timeout=self.commit_timeout)
            what = "checkpoint {} was not committed" if self.persist else "snapshot {} was not held"
            raise RanksMissing(f"{what.format(self.path)}: {'; '.join(failures)}")
        if not self.persist:
            saved.result()  # every rank's shard is in: the snapshot is held, or fails on every rank
        results = [WriteResult(item.index, _item_bytes(item), None) for item in plan.items]
        if durable is not None:  # finish publishes with every rank's record
            record = (durable.file, durable.rank, durable.size, durable.checksum, durable.tensors)
            results.append(WriteResult(MetadataIndex(SHARD_RESULT), durable.size, record))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Every rank is durable: commit (index, rename, fsync) through this node's daemon (a snapshot is held
        already: nothing to publish)."""
        if not self.persist:
            return
        records = [r.storage_data for rank_results in results for r in rank_results if r.index.fqn == SHARD_RESULT]
        files = tuple(sorted((ShardRecord(*record) for record in records), key=lambda f: f.rank))
        client = self.client
        conn = client._conn
        conn.call(Finalize(conn.next_id(), self.path, client.world_size, self.step, self.overwrite, self.keep_last,
                           files, client.job), timeout=self.commit_timeout)

    def storage_meta(self) -> None:
        self._save_begins()  # the first call of a save's planning, on the thread that runs the save
        return None

    def _save_begins(self) -> None:
        """A save of this writer runs on the calling thread (``stage_in_slot`` watches it)."""

    def _taken_ahead(self) -> Ahead | None:
        """The slot this save's state was staged into ahead (``stage_in_slot``), now the save's."""
        return None

    def _staging_over(self, error: BaseException | None) -> None:
        """This rank's items are in the slot (or never will be): the caller may change its tensors."""

    def _abort(self, reason: str) -> None:
        """Fail this attempt on this node's daemon (best effort: the save's own error is what is raised).

        It names this run: a rank refused because another run is saving the
        path must not end that run's attempt. Other nodes' daemons let their
        shards go once the attempt's directory is gone, as with
        ``Client.save_async``'s own agreement across nodes.
        """
        try:
            client = self.client
            conn = client._conn
            conn.call(Abort(conn.next_id(), self.path, reason, client.job))
        except Exception:
            pass


def _item_bytes(item: Any) -> int:
    if item.tensor_data is None:
        return 0
    props, sizes = item.tensor_data.properties, item.tensor_data.chunk.sizes
    return torch.Size(sizes).numel() * torch.empty((), dtype=props.dtype).element_size()


def _planned_shard(plan: SavePlan, planner: SavePlanner) -> Flat:
    """This rank's shard: the tensor items DCP planned for it, and the structure of its whole state.

    Every tensor is a global tensor named by its DCP fqn; this rank writes
    the chunks its plan holds, and the structure names all of them, so any
    rank's structure describes the whole state. Plain values are encoded in
    the structure, from this rank's own state dict.
    """
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, dict):
        raise ValueError(f"ckptd.dcp.StorageWriter needs a planner that keeps the state it plans "
                         f"(DefaultSavePlanner or a subclass), got {type(planner).__name__}")
    mappings = getattr(planner, "mappings", None) if getattr(planner, "flatten_state_dict", False) else None
    structure = _structure(state, mappings)
    tensors: list[tuple[str, torch.Tensor]] = []
    chunks: dict[str, Box] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue  # in the structure already
        fqn = item.index.fqn
        if fqn in chunks:
            raise ValueError(f"state_dict key {fqn!r}: this rank holds several chunks of it; ckptd stores one chunk "
                             "of a tensor per rank (DTensor), not ShardedTensor's several")
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor), f"DCP resolved tensor item {fqn!r} to {type(data).__name__}"
        chunk = item.tensor_data.chunk
        box = (tuple(chunk.offsets), tuple(chunk.sizes))
        if tuple(data.shape) != box[1]:
            raise ValueError(f"state_dict key {fqn!r}: DCP planned a chunk of {list(box[1])} but resolved "
                             f"{list(data.shape)}")
        check_tensor(data, [fqn])
        tensors.append((fqn, data.detach()))
        chunks[fqn] = box
        shapes[fqn] = tuple(item.tensor_data.size)
    return Flat(tensors, structure, chunks, shapes)


def _structure(flat_state: dict[str, Any], mappings: Any) -> bytes:
    """The shard's structure: the whole state, its tensors named by their DCP fqn (``_planned_shard``)."""
    names = {id(v): fqn for fqn, v in flat_state.items() if isinstance(v, torch.Tensor)}
    nested = unflatten_state_dict(flat_state, mappings) if mappings else flat_state
    structure = flatten(nested, written_elsewhere=names)
    if structure.tensors:
        name = structure.tensors[0][0]
        raise ValueError(f"state_dict key {name!r} holds a tensor that DCP saves as bytes (inside a value it does "
                         "not traverse); ckptd stores tensors only where DCP plans them: keep it in a dict or list")
    return structure.structure


def _local_shard(flat_state: dict[str, Any], mappings: Any) -> Flat | None:
    """Every tensor this rank holds of a state DCP flattened: the shard it would write if DCP's plan gave it
    all of them; None where the state holds a tensor ckptd cannot place without the plan."""
    tensors: list[tuple[str, torch.Tensor]] = []
    chunks: dict[str, Box] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    rank = global_rank()
    for fqn, value in flat_state.items():
        if is_dtensor(value):
            chunk = dtensor_chunk(value, fqn, rank)
            local, offsets = chunk.local, chunk.offsets
        elif type(value) in (torch.Tensor, torch.nn.Parameter):
            local, offsets = value, (0,) * value.dim()
        elif isinstance(value, torch.Tensor):
            return None  # a ShardedTensor or another subclass: what DCP plans of it is DCP's to say
        else:
            continue
        check_tensor(local, [fqn])
        tensors.append((fqn, local.detach()))
        chunks[fqn] = (offsets, tuple(local.shape))
        shapes[fqn] = tuple(value.shape)
    return Flat(tensors, _structure(flat_state, mappings), chunks, shapes)


_wrappers: "weakref.WeakKeyDictionary[Slot, tuple[ShardLayout, dict[str, Any]]]" = weakref.WeakKeyDictionary()
"""Per slot: the DTensors over its views last handed to DCP, for the layout they were made for. A DTensor made per
tensor per save costs more than copying a small one; a loop saving the same state reuses them. Weakly keyed: a
closed client's slot (and the views that keep its memory mapped) goes with it."""


def _in_slot(flat_state: dict[str, Any], ahead: Ahead) -> dict[str, Any]:
    """``flat_state`` with each tensor replaced by its view of the slot (a DTensor by one over its local view,
    with its spec: same mesh, placements and global shape)."""
    slot, layout, views = ahead.slot, ahead.layout, ahead.views
    cached = _wrappers.get(slot)
    made = cached[1] if cached is not None and cached[0] is layout else {}
    out: dict[str, Any] = {}
    for fqn, value in flat_state.items():
        if is_dtensor(value):
            wrapper = made.get(fqn)
            if wrapper is None or (wrapper._spec is not value._spec and wrapper._spec != value._spec):
                wrapper = made[fqn] = DTensor(views[fqn], value._spec, requires_grad=False)
            out[fqn] = wrapper
        elif isinstance(value, torch.Tensor):
            out[fqn] = views[fqn]
        else:
            out[fqn] = value
    _wrappers.clear()  # one slot's: a client saving through several slots rebuilds them, nothing is kept stale
    _wrappers[slot] = (layout, made)
    return out


class _SlotStagingWriter(StorageWriter, AsyncStager):
    """``StorageWriter(stage_in_slot=True)``: its own ``async_save`` stager (see ``StorageWriter.__init__``).

    ``stage`` copies every local tensor into the slot and hands DCP the
    state with views of the slot in their place (``_stage_ahead``); DCP's
    planning, whose collectives cost more than the copy, runs after
    ``async_save`` returned, and ``write_data`` keeps in the slot what the
    plan gives this rank. A state ckptd cannot place without the plan is
    handed to DCP live instead, and ``synchronize_staging``, which
    ``async_save`` calls before it returns, waits until ``write_data`` has
    copied this rank's planned items; if the save fails before it gets
    there, the wait ends with it (the save's thread ended). Either state
    refuses to be pickled, so the PROCESS executor fails at once, before any
    tensor is shared.
    """

    _synchronize_after_execute = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staged = threading.Event()
        self._staged.set()
        self._begun = threading.Event()
        """The save began on DCP's thread, or was refused to the PROCESS executor (``synchronize_staging``)."""
        self._staging_error: BaseException | None = None
        self._save_thread: threading.Thread | None = None
        self._ahead: Ahead | None = None
        """The slot ``stage`` copied the state into, until ``write_data`` takes it."""
        self._ticket: int | None = None
        """This save's turn (``_Turns``), from ``stage``."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in ("_staged", "_begun", "_staging_error", "_save_thread", "_ahead", "_ticket"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._staged, self._staging_error, self._save_thread, self._ahead = threading.Event(), None, None, None
        self._begun, self._ticket = threading.Event(), None
        self._staged.set()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not self._staged.is_set() or (self._ahead is not None and not self._ahead.taken):
            raise RuntimeError("this StorageWriter(stage_in_slot=True) is still staging an async_save; "
                               "use one writer per save in flight")
        self._staged.clear()
        self._begun.clear()
        self._staging_error, self._save_thread, self._ahead = None, None, None
        self._ticket = _TURNS.ticket()
        try:
            staged = self._stage_ahead(state_dict)
        except BaseException:
            _TURNS.done(self._ticket)
            self._staged.set()
            raise
        if staged is None:
            return _LiveState(state_dict, self)
        self._staged.set()  # every byte is in the slot: the caller may change its tensors
        return staged

    def _stage_ahead(self, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        """Copy every local tensor into the slot now, before DCP plans, and return the state with views of the
        slot in their place, for DCP to plan on; None where only DCP's plan can say what this rank stages.

        DCP plans after staging, with collectives across the ranks, and its
        plan may give a tensor several ranks hold to one of them. So the copy
        takes every local tensor (a DTensor's local chunk, a plain tensor
        whole), in the layout of a shard that keeps them all; ``write_data``
        then moves what the plan keeps into its place in the same slot
        (``Client._save_flat(ahead=)``). DCP reads the views, never the
        caller's tensors, so the plan, whatever it keeps, saves what was
        staged. States holding what ckptd cannot place without the plan (a
        ShardedTensor, a tensor subclass, a placement ckptd does not know)
        are staged by ``write_data`` as before, and ``synchronize_staging``
        waits for that.
        """
        flat_state, mappings = flatten_state_dict(state_dict)
        try:
            flat = _local_shard(flat_state, mappings)
        except (TypeError, ValueError):  # refused again, naming the key, when write_data stages it
            return None
        if flat is None:
            return None
        ahead = self.client._stage_ahead(flat)
        self._ahead = ahead
        try:
            staged = _LiveState(unflatten_state_dict(_in_slot(flat_state, ahead), mappings), self)
        except BaseException:
            self._release_ahead()
            raise
        return staged

    def _release_ahead(self) -> None:
        """The staged slot and in-flight place go back to the client if no save took them."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self.client.release_ahead(ahead)

    def synchronize_staging(self) -> None:
        # Staged ahead: wait only for the save to begin on DCP's thread, where the PROCESS executor pickles the
        # staged state instead, refused.
        if self._staged.is_set() and not self._begun.wait(self.commit_timeout):
            raise RuntimeError(f"async_save staged this rank's state, but DCP's executor did not begin the save "
                               f"in {self.commit_timeout:g} s (commit_timeout); nothing was saved")
        while not self._staged.wait(0.05):
            thread = self._save_thread
            if thread is not None and not thread.is_alive():
                break  # the save ended before its items were staged: it failed, and its future says why
        if isinstance(self._staging_error, _ProcessExecutor):
            raise self._staging_error

    def close(self) -> None:
        """Wait for this writer's save in flight to end (as closing the shared client waits for its saves), then
        close as ``StorageWriter.close`` does."""
        if self._ticket is not None:
            _TURNS.wait(self._ticket + 1, self.commit_timeout)
        self._release_ahead()  # a save that never began (its thread never ran) leaves its slot to no one
        StorageWriter.close(self)

    def _save_begins(self) -> None:
        """On DCP's save thread, before its first collective: wait for this save's turn (``_Turns``), and leave a
        guard in the thread that ends the turn, and gives back a slot staged ahead and never taken, when the
        thread ends (DCP's executor ends it after the save, whether it succeeded or failed)."""
        self._save_thread = threading.current_thread()
        self._begun.set()
        ticket = self._ticket
        if ticket is None:  # dcp.save, not async_save: it runs on the caller's thread, in the caller's order
            return
        guards = getattr(_save_guards, "guards", [])
        if all(guard.ticket != ticket for guard in guards):
            _save_guards.guards = guards + [_SaveGuard(self.client, self._ahead, ticket)]
        if not _TURNS.wait(ticket, self.commit_timeout):
            raise RuntimeError(f"an earlier async_save of this process through ckptd.dcp.StorageWriter"
                               f"(stage_in_slot=True) has not ended in {self.commit_timeout:g} s (commit_timeout); "
                               "this save waited for it, so that their collectives run in the same order on "
                               "every rank")

    def _taken_ahead(self) -> Ahead | None:
        ahead, self._ahead = self._ahead, None
        return ahead

    def _staging_over(self, error: BaseException | None) -> None:
        if not self._staged.is_set():
            self._staging_error = error
            self._staged.set()


class _ProcessExecutor(ValueError):
    """``stage_in_slot`` under the PROCESS executor."""


class _LiveState(dict):
    """The state handed to DCP, only to plan and write in this process: the caller's own (copied into the slot by
    ``write_data``) or, staged ahead, views of this process's slot. The PROCESS executor, which pickles it, is
    refused (and a slot staged ahead given back)."""

    def __init__(self, state: dict[str, Any], writer: _SlotStagingWriter) -> None:
        super().__init__(state)
        self._writer = writer

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._writer._release_ahead()
        raise _refused_by_process(self._writer)


def _refused_by_process(writer: _SlotStagingWriter) -> _ProcessExecutor:
    """The error for a staged state that the PROCESS executor pickles; ``synchronize_staging`` raises it too."""
    error = _ProcessExecutor(
        "StorageWriter(stage_in_slot=True) stages by copying into this process's slot, so it works with "
        "async_save's THREAD executor only; for AsyncCheckpointerType.PROCESS drop stage_in_slot (DCP then "
        "stages a copy for the other process)")
    writer._staging_error = error
    writer._staging_over(error)
    writer._begun.set()
    if writer._ticket is not None:  # no thread of this process runs it
        _TURNS.done(writer._ticket)
        writer._ticket = None
    return error


class _Turns:
    """The order in which this process's ``async_save``s through the stage-in-slot writer run DCP's collectives.

    ``async_save`` returns once staged, before DCP plans, so a loop that
    saves again without waiting has two saves planning at once, each on a
    thread of its own, on one process group: their collectives would meet
    in a different order on different ranks and hang. Each save takes a
    ticket when it is staged (the caller's order, the same on every rank)
    and runs its collectives only once every earlier save's thread ended.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._serving = 0
        self._ended: set[int] = set()

    def ticket(self) -> int:
        with self._cond:
            self._issued += 1
            return self._issued - 1

    def wait(self, ticket: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._serving >= ticket, timeout)

    def done(self, ticket: int) -> None:
        with self._cond:
            if ticket >= self._serving:
                self._ended.add(ticket)
            while self._serving in self._ended:
                self._ended.remove(self._serving)
                self._serving += 1
            self._cond.notify_all()


_TURNS = _Turns()


class _SaveGuard:
    """Kept in DCP's save thread's local storage, and dropped when the thread ends: the save's turn ends then,
    and a slot staged ahead that ``write_data`` never took (the plan failed on some rank) goes back to the
    client with its in-flight place."""

    def __init__(self, client: Client, ahead: Ahead | None, ticket: int) -> None:
        self.client, self.ahead, self.ticket = client, ahead, ticket

    def __del__(self) -> None:
        _TURNS.done(self.ticket)
        if self.ahead is not None:
            try:
                self.client.release_ahead(self.ahead)
            except Exception:
                pass  # the interpreter is exiting, or the client closed: nothing is left to give back to


_save_guards = threading.local()
"""``guards``: the ``_SaveGuard`` of each save this thread runs (DCP's executor makes a thread per ``async_save``)."""


def _forget_turns_in_child() -> None:
    """A forked child runs saves of its own: none of its parent's is its to wait for."""
    global _TURNS
    _TURNS = _Turns()


os.register_at_fork(after_in_child=_forget_turns_in_child)
