"""Agreeing on a checkpoint across nodes, on a thread the client owns.

With ranks on several nodes, no single daemon sees every shard. Each rank's
daemon writes its shard and answers ``Durable``; then the ranks agree,
through a dedicated gloo group (never the training group, whose collectives
the training loop is issuing at the same time), on whether every shard made
it. Global rank 0 then asks its own daemon to ``Finalize`` (index, rename,
fsync) or ``Abort``, and broadcasts the outcome, so every rank's future
resolves the same way.

Collectives must run in the same order on every rank: saves are queued here
in the order ``save_async`` was called and handled one at a time.

Placement (``agree_on_ring``): once every rank is connected, the ranks agree
on the node map (which ranks share a daemon) and exchange each daemon's peer
key and endpoint over the same group; each node's first rank tells its own
daemon the ring (``Ring``), so node i's snapshots are replicated on node i+1.

What ranks tell each other is msgpack, sent as uint8 tensors (a length
all-gather, then one padded all-gather or broadcast): never pickle, which
would run whatever another process sent, and needs numpy to be installed.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import msgpack
import torch
import torch.distributed as dist

from ckptd.protocol.errors import CkptdError, Conflict, RanksMissing, error_for_code
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.messages import Abort, Done, Durable, Finalize, HeldInMemory, PeerIdentity, PeerIdentityReply, Ring

from .connection import Connection

log = logging.getLogger("ckptd.client")


@dataclass(frozen=True)
class SaveSpec:
    """What every rank agrees to commit."""

    path: str
    world_size: int
    step: int | None
    overwrite: bool
    keep_last: int | None
    timeout: float
    snapshot: bool = False
    """A memory snapshot: the ranks agree that every one is held; nothing is finalized."""
    replicated: tuple[tuple[str, str], ...] = ()
    """This rank's digest per ``replicated=`` key (``Flat.replicated``): every rank must hold the same."""


@dataclass
class _Save:
    shard: Future
    """This rank's reply: ``Durable``, or an exception."""
    spec: SaveSpec
    resolve: Callable[[Done | BaseException], None]


def agree_on_places(endpoint: str, timeout: float, job: str) -> tuple[dist.ProcessGroup | None, str]:
    """A gloo group for coordination if the ranks talk to more than one daemon (else None), and rank 0's ``job``.

    Collective: every rank must call it (``Client()`` does, on every rank).
    The ranks take rank 0's job incarnation, so a name one rank drew at
    random is every rank's (``incarnation.py``).
    """
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    places = all_gather_msgpack([socket.gethostname(), endpoint, job], group)
    if len({tuple(p[:2]) for p in places}) == 1:
        dist.destroy_process_group(group)
        return None, places[0][2]
    return group, places[0][2]


def agree_on_ring(group: dist.ProcessGroup, conn: Connection, endpoint: str, job: str) -> dict[str, object]:
    """Tell each node's daemon its place in the ring of the job's nodes; what was agreed, the same on every rank.

    Collective over ``group`` (``agree_on_places``'s, never the training
    group): every rank asks its daemon for its peer identity, the ranks gather
    them, and the ranks sharing a daemon (same host and socket) are one node,
    ordered by their lowest global rank. The nodes whose daemon has a peer
    endpoint (``--peer-listen``) form the ring; each one's first rank sends its
    daemon ``Ring``, and a last gather waits until every daemon answered, so
    every daemon knows its buddy and trusts the others' keys before any rank
    goes on (a replacement node's first ``latest()`` reads from its buddy).
    A daemon that refuses, or predates, the ring is logged, never fatal: the
    job trains on, that node without replicas.
    """
    try:
        reply = conn.call(PeerIdentity(conn.next_id()))
        key, listen = (reply.key, reply.endpoint) if isinstance(reply, PeerIdentityReply) else ("", "")
    except Exception as exc:  # one that predates rings answers an unknown message type: no peer endpoint
        log.info("ckptd: the daemon at %s names no peer identity (%s): this node is in no ring", endpoint, exc)
        key, listen = "", ""
    everyone = all_gather_msgpack([socket.gethostname(), endpoint, key, listen], group)
    nodes: dict[tuple[str, str], int] = {}  # node -> its first rank, in rank order
    for rank, (host, ep, _, _) in enumerate(everyone):
        nodes.setdefault((host, ep), rank)
    members = [first for first in nodes.values() if everyone[first][3]]
    me = dist.get_rank(group)
    outcome = None
    if nodes[(socket.gethostname(), endpoint)] == me and me in members and len(members) >= 2:
        try:
            ring = Ring(conn.next_id(), job, members.index(me), tuple(everyone[r][3] for r in members),
                        tuple(everyone[r][2] for r in members))
            conn.call(ring)
            outcome = "ok"
        except Exception as exc:  # every rank must reach the gather below, whatever this daemon answered
            outcome = f"node of rank {me} ({listen}): {exc.message if isinstance(exc, CkptdError) else repr(exc)}"
    outcomes = all_gather_msgpack(outcome, group)
    refused = [o for o in outcomes if o not in (None, "ok")]
    agreed = {"nodes": len(nodes), "ring": [everyone[r][3] for r in members] if len(members) >= 2 else [],
              "refused": refused}
    if me == 0 and refused:
        log.warning("ckptd: the ring of %d nodes was refused by some daemons (their snapshots are not "
                    "replicated): %s", len(members), "; ".join(refused))
    elif me == 0 and len(nodes) > 1 and len(members) < 2:
        log.info("ckptd: %d of %d nodes have a peer endpoint (--peer-listen): no ring, snapshots are not "
                 "replicated", len(members), len(nodes))
    return agreed


class Coordinator:
    """One thread per client that turns durable shards into a committed checkpoint."""

    def __init__(self, group: dist.ProcessGroup, connection: Callable[[], Connection], rank: int, job: str) -> None:
        self.group = group
        self.connection = connection
        self.rank = rank
        self.job = job
        """The run (``Client.job``) that Finalize and Abort name: a daemon acts only on that run's attempt."""
        self._queue: queue.SimpleQueue[_Save | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ckptd-coordinate", daemon=True)
        self._thread.start()

    def submit(self, shard: Future, spec: SaveSpec, resolve: Callable[[Done | BaseException], None]) -> None:
        """Queue a save (in call order); ``resolve`` gets rank 0's outcome once all ranks agree."""
        self._queue.put(_Save(shard, spec, resolve))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (save := self._queue.get()) is not None:
            try:
                outcome = self._agree(save)
            except BaseException as exc:  # collective failed: a rank died or timed out
                outcome = RanksMissing(f"checkpoint {save.spec.path}: ranks did not agree: {exc}")
            save.resolve(outcome)

    def _agree(self, save: _Save) -> Done | BaseException:
        try:
            reply = save.shard.result()
            if isinstance(reply, HeldInMemory):
                mine: tuple = ("ok", (reply.path, self.rank, reply.bytes_held, 0, 0))
            else:
                assert isinstance(reply, Durable)
                mine = ("ok", (reply.file, reply.rank, reply.size, reply.checksum, reply.tensors))
        except CkptdError as exc:
            mine = ("error", f"rank {self.rank}: {exc.message}", int(exc.code))
        except BaseException as exc:
            mine = ("error", f"rank {self.rank}: {exc!r}", 0)
        everyone = all_gather_msgpack([*mine, list(save.spec.replicated)], self.group)
        outcome = self._commit_or_abort(save.spec, everyone) if self.rank == 0 else None
        kind, *data = broadcast_msgpack(outcome, self.group)
        if kind == "done":
            path, seconds = data
            size = mine[1][2] if mine[0] == "ok" else 0
            return Done(0, path, size, seconds)
        message, code = data
        return error_for_code(code, message) if code else RanksMissing(message)

    def _commit_or_abort(self, spec: SaveSpec, everyone: list) -> tuple:
        """Global rank 0 only: Finalize if every shard is durable, else Abort."""
        failures = [entry[1] for entry in everyone if entry[0] != "ok"]
        disagreement = _replicated_disagreement(spec.path, [dict(map(tuple, entry[-1])) for entry in everyone])
        if disagreement is not None and not failures:
            failures, everyone = [disagreement.message], [("error", disagreement.message, int(disagreement.code))]
        if spec.snapshot:  # held on every rank, or not: nothing to write, nothing to remove
            if failures:
                code = next((e[2] for e in everyone if e[0] != "ok"), 0)
                return ("error", f"snapshot {spec.path} is not held by every rank: {'; '.join(failures)}", code)
            return ("done", spec.path, 0.0)
        conn = self.connection()
        if failures:
            reason = "; ".join(failures)
            try:
                conn.call(Abort(conn.next_id(), spec.path, reason, self.job))
            except Exception:
                pass  # rank 0's daemon is gone too; the sweep will clean up
            code = next((e[2] for e in everyone if e[0] != "ok"), 0)
            return ("error", f"checkpoint {spec.path} was not committed: {reason}", code)
        files = tuple(ShardRecord(*entry[1]) for entry in everyone)
        try:
            done = conn.call(Finalize(conn.next_id(), spec.path, spec.world_size, spec.step,
                                      spec.overwrite, spec.keep_last, files, self.job), timeout=spec.timeout)
        except CkptdError as exc:
            return ("error", exc.message, int(exc.code))
        return ("done", done.path, done.seconds)


def _replicated_disagreement(path: str, digests: list[dict[str, str]]) -> Conflict | None:
    """A ``Conflict`` naming the keys and ranks if the ranks' replicated keys differ (each daemon checks only
    its own node's ranks; across nodes, global rank 0 does before it finalizes)."""
    for rank, theirs in enumerate(digests):
        if theirs != digests[0]:
            keys = sorted(k for k in digests[0].keys() | theirs.keys() if digests[0].get(k) != theirs.get(k))
            return Conflict(f"checkpoint {path}: ranks 0 and {rank} disagree on replicated key(s) "
                            f"{', '.join(map(repr, keys))} (tensor names, shapes or dtypes differ, or one rank does "
                            f"not save the key as replicated). Rank 0 writes replicated keys once for every rank, so "
                            f"every rank must hold the same tensors there; nothing was saved")
    return None


def _to_tensor(data: bytes, length: int) -> torch.Tensor:
    buf = torch.zeros(length, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _from_tensor(buf: torch.Tensor, length: int) -> object:
    return msgpack.unpackb(bytes(buf[:length].tolist()), raw=False)


def all_gather_msgpack(value: object, group: dist.ProcessGroup) -> list:
    """Every rank's ``value`` (msgpack-able), in rank order."""
    data = msgpack.packb(value, use_bin_type=True)
    n = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(t.item()) for t in lengths)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(bufs, _to_tensor(data, longest), group=group)
    return [_from_tensor(b, int(t.item())) for b, t in zip(bufs, lengths)]


def broadcast_msgpack(value: object, group: dist.ProcessGroup, src: int = 0) -> object:
    """Global rank ``src``'s ``value`` on every rank (the others pass None)."""
    data = msgpack.packb(value, use_bin_type=True) if dist.get_rank() == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    buf = _to_tensor(data, int(length.item()))
    dist.broadcast(buf, src=src, group=group)
    return _from_tensor(buf, int(length.item()))
