"""The node state: clients, shard writes, checkpoints in progress and load leases.

Everything here is bookkeeping in memory, used only on the loop thread: no
socket, no file, no thread. The loop (``server.py``) and the save pipeline
(``saves.py``) decide what to do; this object remembers what is going on,
so that there is one place to ask "who is connected", "what is being
written", "what is promised on this filesystem", and one way for a client to
go (``teardown``), whether it said ``Bye`` or died. Status and metrics read
it through the narrow ``stats.NodeView``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ckptd.protocol.errors import BadMessage, UnknownClient
from ckptd.protocol.layout import CheckedTable
from ckptd.protocol.messages import StagedShard
from ckptd.protocol.processes import pid_alive

from ckptd.core.config import DaemonConfig
from ckptd.core.leases import Grant, LoadLeases
from ckptd.core.replies import as_error
from ckptd.core.stats import Stats
from ckptd.lifecycle.budget import MemoryBudget
from ckptd.lifecycle.commit import Commits, PendingCheckpoint
from ckptd.lifecycle.registry import Registry
from ckptd.lifecycle.slot_maps import SlotMaps
from ckptd.lifecycle.snapshots import SnapshotBook
from ckptd.lifecycle.writer import Progress, ShardWrite
from ckptd.storage.backends import Backends

MAX_PID = 1 << 22
"""The kernel's largest possible pid_max."""
LAYOUTS_PER_CLIENT = 8
"""Checked tensor tables kept per client (most recently used): a client refers to the last one it sent."""


@dataclass
class ClientRecord:
    pid: int
    rank: int = 0
    world_size: int = 1
    job: str = ""
    """The run this client is a rank of (``Hello.job``; empty: unnamed, or it saves nothing)."""
    since: float = field(default_factory=time.time)
    saves: int = 0
    waited_s: float = 0.0
    """Total seconds this client blocked on backpressure before its saves."""
    last_waited_s: float = 0.0
    layouts: OrderedDict[str, CheckedTable] = field(default_factory=OrderedDict)
    """Tensor tables this connection sent, as checked at decode, by digest (``resolve_layout``)."""


class NodeState:
    """What one node's daemon is doing (loop thread only)."""

    def __init__(self, config: DaemonConfig, storage: Backends, slots: SlotMaps | None = None,
                 attempts: Registry | None = None) -> None:
        self.config = config
        self.attempts = attempts if attempts is not None else Registry(defect=lambda exc: as_error(self.stats, exc))
        """The attempts' books and their one mover (the lifecycle's ``Registry``): the pipelines keep theirs there."""
        self.clients: dict[bytes, ClientRecord] = {}
        self.staging: dict[tuple[bytes, int], Progress] = {}
        """Staging progress of every shard from its WriteShard or Snapshot until its write ends (``Staged`` finds
        it here)."""
        self.writes: list[ShardWrite] = []
        """Admitted shard writes, queued or running, until they end (their bytes reserved on their device)."""
        self.commits = Commits(storage, self.attempts)
        self.leases = LoadLeases(config.max_concurrent_loads)
        self.slots = slots if slots is not None else SlotMaps()
        self.stats = Stats(config)
        self.memory = MemoryBudget(config.memory_budget)
        """The node's memory budget, which the snapshots and the replicas held for peers share."""
        self.snapshots = SnapshotBook(self.memory, config.keep_snapshots, self.attempts)
        self.draining = False

    # -- the view status reads (stats.NodeView) ---------------------------------

    @property
    def client_records(self) -> Iterable[ClientRecord]:
        return self.clients.values()

    @property
    def checkpoints(self) -> Iterable[PendingCheckpoint]:
        return self.commits.pending.values()

    @property
    def shm_mapped_bytes(self) -> int:
        return self.slots.mapped_bytes

    @property
    def shm_dir(self) -> Path:
        return self.slots.shm_dir

    def lease_status(self) -> Mapping[str, Any]:
        return self.leases.status()

    def memory_status(self) -> Mapping[str, Any]:
        return self.snapshots.summary()

    # -- clients ------------------------------------------------------------------

    def hello(self, ident: bytes, pid: int, *, rank: int = 0, world_size: int = 1, job: str = "") -> ClientRecord:
        self.clients[ident] = record = ClientRecord(pid=pid, rank=rank, world_size=world_size, job=job)
        return record

    def client(self, ident: bytes) -> ClientRecord:
        client = self.clients.get(ident)
        if client is None:
            raise UnknownClient("this client has not said hello (or the daemon restarted); send hello first")
        return client

    def resolve_layout(self, ident: bytes, msg: StagedShard) -> StagedShard:
        """``msg`` with its tensor table: a table it carries is kept under its digest, a digest is replaced by
        the table this connection sent under it (checked then, by this daemon: never taken on the client's word).

        A training loop saves one structure again and again; a thousand small
        tensors cost milliseconds to decode and check, and a digest costs none.
        """
        client = self.client(ident)
        layouts = client.layouts
        if msg.tensors or not msg.layout:
            if msg.layout:
                assert isinstance(msg.tensors, CheckedTable)  # StagedShard.__post_init__ checked it against the digest
                layouts[msg.layout] = msg.tensors
                layouts.move_to_end(msg.layout)
                while len(layouts) > LAYOUTS_PER_CLIENT:
                    layouts.popitem(last=False)
            return msg
        table = layouts.get(msg.layout)
        if table is None:
            raise BadMessage(f"commit names layout {msg.layout!r}, which this connection did not send (or it is "
                             f"older than the last {LAYOUTS_PER_CLIENT}): send the tensor table")
        if table.data_len != msg.nbytes - msg.header_len:
            raise BadMessage(f"layout {msg.layout!r} covers {table.data_len} bytes of data, but the commit's shard "
                             f"holds {msg.nbytes - msg.header_len}")
        layouts.move_to_end(msg.layout)
        return dataclasses.replace(msg, tensors=table)

    def teardown(self, ident: bytes, reason: str) -> tuple[ClientRecord | None, list[Grant]]:
        """The one way a client goes, whether it said Bye or died.

        Its saves still staging fail with ``reason``, its leases and lease
        requests go (returning the grants that frees), its slot mappings are
        dropped once idle. Writes it committed in full still complete.
        """
        client = self.clients.pop(ident, None)
        self.abandon_staging(ident, reason)
        grants = self.leases.drop_client(ident)
        if client is not None:
            self.slots.forget_pid(client.pid)
        return client, grants

    def dead_clients(self) -> list[bytes]:
        return [ident for ident, c in self.clients.items() if not pid_alive(c.pid)]

    def pid_connected(self, pid: int) -> bool:
        return any(c.pid == pid for c in self.clients.values())

    # -- saves and writes ---------------------------------------------------------

    def begin_save(self, ident: bytes, client: ClientRecord, msg: StagedShard, *, deadline: float) -> Progress:
        """A shard arrived: count it and track its staging until its write ends."""
        client.saves += 1
        client.waited_s += msg.waited
        client.last_waited_s = msg.waited
        progress = Progress(msg.staged, msg.nbytes, deadline=deadline)
        self.staging[(ident, msg.id)] = progress
        return progress

    def end_save(self, ident: bytes, request_id: int) -> None:
        self.staging.pop((ident, request_id), None)

    def abandon_staging(self, ident: bytes | None, reason: str) -> None:
        """Fail the saves still waiting for ``ident``'s staging (None: every client's)."""
        for (client, _), progress in self.staging.items():
            if ident in (None, client) and not progress.complete:
                progress.fail(reason)

    def reserved_on(self, device: int) -> int:
        """Bytes admitted to ``device`` and not yet written (admission's promise)."""
        return sum(j.msg.nbytes - j.written for j in self.writes if j.device == device)

    def finish_write(self, write: ShardWrite) -> None:
        self.writes.remove(write)
        self.slots.release(write.slot)
        self.end_save(write.client, write.msg.id)
        write.finished_at = time.monotonic()

    @property
    def busy(self) -> bool:
        return bool(self.staging or self.writes or self.attempts.still_releasing(PendingCheckpoint))

    @property
    def idle(self) -> bool:
        """Nothing to do, and no snapshot held only in memory (a spawned daemon must not take one with it)."""
        unpersisted = any(not s.persisted for s in self.snapshots.all())
        return not (self.clients or self.busy or self.commits.in_progress or unpersisted)
