"""The daemon's event loop: one thread owns the ROUTER socket, and nothing else.

Each turn polls the socket and the workers' wake-up fd with a timeout,
decodes and dispatches requests, replies, applies finished work, and does
housekeeping (dead clients, overdue checkpoints, slots clients unlinked,
metrics, idle exit). What the node is doing lives in ``NodeState``; saves
move through ``Saves``; all file I/O runs on ``Workers``' pools. Requests are served as the peer
protocol's are (``core/dispatch.py``): whatever one raises is answered with ``replies.error_reply``, so no
request, however malformed, can take the daemon down.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from ckptd.protocol import __version__
from ckptd.protocol.errors import BadMessage, Conflict, InvalidCheckpoint
from ckptd.protocol.messages import (
    MAX_MESSAGE_BYTES, Abort, Bye, Delete, Finalize, Granted, Hello, Lease, ListPeerSnapshots, ListSnapshots,
    Message, Ok, PeerIdentity, PeerIdentityReply, Persist, Pin, Ping, Pong, Release, Restore, Ring, Snapshot, Staged,
    StagedShard, Status, StatusReply, Stop, Unpin, Welcome, WriteShard,
)
from ckptd.protocol.objects import display

from ckptd.core.config import DaemonConfig
from ckptd.core.dispatch import Dispatch, Handler, Sender
from ckptd.core.events import (
    Committed, Deleted, Events, Failed, ReplicaEnded, SnapshotDropped, SnapshotFailed, SnapshotHeld,
)
from ckptd.core.keys import KeyPair, PeerKeys, Trust
from ckptd.core.leases import Grant
from ckptd.core.replies import error_reply, logged
from ckptd.core.stats import add_filesystems
from ckptd.core.workers import Workers
from ckptd.lifecycle.holding import Holding
from ckptd.lifecycle.registry import DeadRank
from ckptd.lifecycle.saves import Saves
from ckptd.lifecycle.slot_maps import reclaim_orphaned_slots
from ckptd.lifecycle.state import MAX_PID, NodeState
from ckptd.peers.endpoint import PeerEndpoint
from ckptd.peers.replicas import ReplicaBook
from ckptd.peers.replication import Replication
from ckptd.storage.backends import Backends
from ckptd.upkeep.mirror import Mirrors
from ckptd.upkeep.retention import Retainer
from ckptd.upkeep.sweep import KnownDirs, sweep_incomplete

log = logging.getLogger("ckptd")
POLL_MS = 200
ABANDON_GRACE_S = 5.0
"""Seconds past the drain's deadline that maintenance still gets before the exit abandons it: a local removal
ends well within it, a request to a stalled store is not waited for longer."""


class Server:
    """Serve one node until stopped; ``serve_forever`` returns when drained."""

    def __init__(self, config: DaemonConfig, storage: Backends) -> None:
        self.config, self.storage = config, storage
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.router.setsockopt(zmq.LINGER, 1000)
        self.router.bind(config.endpoint)
        self.workers = Workers(config.max_concurrent_writes)
        self.state = NodeState(config, storage)
        self.known_dirs = KnownDirs(storage.local, config.run_dir)
        self.events = Events(defect=logged(self.state.stats))
        self.mirrors = Mirrors(storage, config.mirrors, config.mirror_keep) if config.mirrors else None
        self.saves = Saves(self.state, self.workers, storage, config, self._send, self.known_dirs, self.events)
        self.holding = Holding(self.state, self.workers, storage, config, self._send, self.saves, self.events)
        self.attempts = self.state.attempts
        self.attempts.keep((self.saves, self.holding), send=self._send)
        self.replicas: ReplicaBook | None = None
        self.peer_endpoint: PeerEndpoint | None = None
        self.replication: Replication | None = None
        if config.peer_keys is not None or config.peer_listen is not None:
            self._start_peers(Trust(None if config.peer_keys is None else PeerKeys(config.peer_keys)))
        mirrors = self.mirrors
        self.retainer = Retainer(storage, self.workers, config, self.state.stats, self.events,
                                 self.state.commits.publishing,
                                 lambda: self.state.commits.pending,
                                 None if mirrors is None else lambda victim: bool(mirrors.unmirrored([victim])))
        self._subscribe()
        if self.mirrors is not None:
            self.mirrors.after_upload = self.retainer.after_upload
            self.mirrors.start()
        self.metrics = None
        if config.metrics_port is not None or config.metrics_textfile is not None:
            from ckptd.core.metrics import Metrics

            self.metrics = Metrics(port=config.metrics_port, addr=config.metrics_addr,
                                   textfile=config.metrics_textfile)
        self._drain_deadline: float | None = None
        self._idle_since = time.monotonic()
        self._kept_for_replicas = False
        """Whether it stayed past its idle limit because it holds replicas (logged once, ``event=idle_kept``)."""
        handlers: dict[type[Message], Callable[[bytes, Any], Message | None]] = {
            Hello: self._on_hello,
            WriteShard: self.saves.write_shard,
            Snapshot: self.holding.snapshot,
            Persist: self.holding.persist,
            ListSnapshots: self.holding.listing,
            ListPeerSnapshots: self.holding.listing if self.replication is None else self.replication.listing,
            Restore: self._no_peers if self.replication is None else self.replication.restore,
            PeerIdentity: self._on_peer_identity,
            Ring: self._on_ring,
            Pin: self.holding.pin,
            Unpin: self.holding.unpin,
            Staged: lambda ident, m: self.saves.staged(ident, m.upto, m.error, m.id),
            Finalize: self.saves.finalize,
            Abort: self.holding.abort,
            Status: self._on_status,
            Ping: lambda ident, m: Pong(m.id),
            Lease: self._on_lease,
            Release: self._on_release,
            Delete: self._on_delete,
            Bye: self._on_bye,
            Stop: self._on_stop,
        }
        self.dispatch = Dispatch(self.router, self.state.stats, {
            kind: self._local(handler) for kind, handler in handlers.items()})
        directories = list(dict.fromkeys([*config.roots, *self.known_dirs.dirs]))
        # Slots under this daemon's own pid are a dead predecessor's (in a container a restarted daemon often gets
        # its pid), which the sweep of dead pids cannot tell: unlinked now, before this daemon takes any over.
        if reclaimed := self.state.slots.reclaim(os.getpid()):
            log.info("event=slots_reclaimed count=%d owner=predecessor_with_this_pid", reclaimed)
        self.workers.background("maintenance", reclaim_orphaned_slots)
        self.workers.background("maintenance", lambda: sweep_incomplete(storage, directories, config.sweep))

    def _start_peers(self, keys: Trust) -> None:
        """The replicas held for other nodes, the peer endpoint (``--peer-listen``) and replication to the buddy."""
        config, slots, stats = self.config, self.state.slots, self.state.stats
        book = self.replicas = ReplicaBook(self.attempts, self.workers, stats, self.events, slots.shm_dir,
                                           slots.own_name, self.state.memory,
                                           lambda raw: self.storage.resolve(raw, config.roots),
                                           encrypt=config.peer_encrypt)
        self.attempts.keep((*self.attempts.pipelines, book))  # its replicas end through the registry too
        book.endpoint_of = lambda origin: next((ep for ep, key in keys.endpoints.items() if key.decode() == origin),
                                               None)
        if config.peer_listen is not None:
            self.peer_endpoint = PeerEndpoint(self.ctx, config.peer_listen, KeyPair.of(config.run_dir), keys, book,
                                              stats, config.peer_timeout)
        self.replication = Replication(self.ctx, config, keys, self.holding, self.workers, stats, self._send)

    def _no_peers(self, ident: bytes, msg: Restore) -> Message:
        raise InvalidCheckpoint(f"snapshot {msg.path} cannot be restored: this daemon has no peers (start it with "
                                f"--peer-listen, or --peer and --peer-keys)")

    def _on_peer_identity(self, ident: bytes, msg: PeerIdentity) -> Message:
        key, endpoint = ("", "") if self.replication is None else self.replication.placement.identity()
        return PeerIdentityReply(msg.id, key, endpoint)

    def _on_ring(self, ident: bytes, msg: Ring) -> Message:
        """The ring a node's first rank sends (``ckptd/peers/placement.py``); ignored without ``--peer-listen``."""
        client = self.state.client(ident)
        if self.replication is None or self.config.peer_listen is None:
            log.info("event=ring_ignored job=%s reason=no_peer_listen", msg.job)
            return Ok(msg.id)
        self.replication.placement.take(msg, client.job, client.world_size)
        return Ok(msg.id)

    def _subscribe(self) -> None:
        """Who reacts to what the lifecycle publishes, in this order: the books first, then the memory tier
        (a snapshot persisted or shadowed by a disk save), the upload, and retention last (it asks the mirror)."""
        events, stats = self.events, self.state.stats
        events.subscribe(Committed, stats.committed)
        events.subscribe(Failed, stats.failed)
        events.subscribe(SnapshotHeld, stats.held)
        events.subscribe(SnapshotDropped, stats.dropped)
        events.subscribe(SnapshotFailed, stats.snapshot_failed)
        events.subscribe(ReplicaEnded, stats.replica_ended)
        events.subscribe(Committed, self.holding.committed)
        events.subscribe(Deleted, self.holding.deleted)
        if self.mirrors is not None:
            mirrors = self.mirrors
            events.subscribe(Committed, lambda e: mirrors.submit(e.path))
        events.subscribe(Committed, self.retainer.committed)
        if self.replication is not None:
            events.subscribe(SnapshotHeld, self.replication.held)
            events.subscribe(SnapshotDropped, self.replication.dropped)

    # -- loop ---------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.workers.wake_fd, zmq.POLLIN)
        peers = None if self.peer_endpoint is None else self.peer_endpoint.socket
        if peers is not None:
            poller.register(peers, zmq.POLLIN)
        next_housekeeping = time.monotonic()
        log.info("event=start pid=%d endpoint=%s roots=%s", os.getpid(), self.config.endpoint,
                 ",".join(map(display, self.config.roots)))
        while True:
            events = dict(poller.poll(POLL_MS))
            if self.router in events:
                self.dispatch.drain()
            if peers is not None and peers in events:
                self.peer_endpoint.drain()
            if self.workers.wake_fd in events:
                self.workers.woken()
            self.workers.apply_finished()
            if time.monotonic() >= next_housekeeping:
                next_housekeeping = time.monotonic() + self.config.housekeeping_interval
                self._housekeeping()
            if self._should_exit():
                break
        for failure in self.holding.drain_failures:
            log.error("event=drain_persist_failed snapshot=%s", failure)
        log.info("event=exit pid=%d", os.getpid())

    def request_stop(self) -> None:
        """Begin draining (safe to call from a signal handler)."""
        self.state.draining = True

    def close(self) -> None:
        if self.mirrors is not None:
            self.mirrors.close()  # what is left is logged, and queued again at the next start
        if self.replication is not None:
            self.replication.close()
        if self.peer_endpoint is not None:
            self.peer_endpoint.close()
        self.workers.close()
        self.attempts.close()  # after the workers: what they finished may have taken over or released slots; each
        # pipeline releases what it still holds (``Pipeline.exited``)
        self.router.close()
        self.ctx.term()
        self.state.slots.close()

    def _local(self, handler: Callable[[bytes, Any], Message | None]) -> Handler:
        """A local request's handler, as ``Dispatch`` calls it: a shard's layout resolved first (a ``WriteShard``
        or ``Snapshot`` may name the layout its client sent before instead of repeating it)."""
        def handle(sender: Sender, msg: Any) -> Message | None:
            if isinstance(msg, StagedShard):
                msg = self.state.resolve_layout(sender.ident, msg)
            return handler(sender.ident, msg)
        return handle

    def _send(self, ident: bytes, msg: Message) -> None:
        self.dispatch.send(ident, msg)

    def _send_grants(self, grants: list[Grant]) -> None:
        for g in grants:
            self._send(g.client, Granted(g.request_id, g.waited))

    # -- small requests -----------------------------------------------------

    def _on_hello(self, ident: bytes, msg: Hello) -> Message:
        if msg.uid != os.getuid():
            raise BadMessage(f"client uid {msg.uid} is not this daemon's uid {os.getuid()}")
        if not 0 < msg.pid <= MAX_PID:
            raise BadMessage(f"client pid {msg.pid} is not a process id (1..{MAX_PID})")
        self.state.hello(ident, msg.pid, rank=msg.rank, world_size=msg.world_size, job=msg.job)
        log.info("event=hello pid=%d version=%s", msg.pid, msg.client_version)
        return Welcome(msg.id, os.getpid(), __version__, tuple(str(r) for r in self.config.roots))

    def _status_info(self) -> dict:
        info = self.state.stats.status(self.state)
        if self.mirrors is not None:
            info["mirror"] = self.mirrors.status()
        if self.replication is not None and self.replicas is not None:
            info["peers"] = {**self.replication.status(),
                             "replicas_held": {**self.replicas.summary(), **self.state.stats.replica_totals()}}
        return info

    def _on_status(self, ident: bytes, msg: Status) -> None:
        info = self._status_info()
        self.workers.submit("status", lambda: add_filesystems(info, self.storage),
                            lambda fut: self._send(ident, StatusReply(msg.id, fut.result())),
                            failed=lambda exc: self._send(ident, error_reply(self.state.stats, msg.id, exc)))
        return None  # the reply follows once the filesystems' numbers are in

    def _on_lease(self, ident: bytes, msg: Lease) -> None:
        client = self.state.client(ident)
        self._send_grants(self.state.leases.request(ident, msg.id, client.pid, msg.limit))
        return None  # Granted follows when a lease is free

    def _on_delete(self, ident: bytes, msg: Delete) -> None:
        """Delete a committed checkpoint for a trainer (``Client.delete``): Ok, or the Error saying why not."""

        def delete(final: Path) -> None:
            snapshot = self.holding.in_the_way_of_delete(final)
            if snapshot is not None:
                self._send(ident, error_reply(self.state.stats, msg.id, Conflict(
                    f"{display(final)} is not deleted: {snapshot}; delete it once that is done")))
                return

            def answer(exc: BaseException | None) -> None:
                if exc is None:
                    self.holding.deleted_on_request(final)
                self._send(ident, Ok(msg.id) if exc is None else error_reply(self.state.stats, msg.id, exc))

            self.retainer.delete(final, answer)

        self.saves.resolve_then(ident, msg.id, msg.path, delete)

    def _on_release(self, ident: bytes, msg: Release) -> Message:
        self._send_grants(self.state.leases.release(ident))
        return Ok(msg.id)

    def _on_bye(self, ident: bytes, msg: Bye) -> None:
        """A client closes: Ok once what the daemon owed it is settled (the slots of its snapshots dropped since
        its last ``HeldInMemory`` unlinked), so nothing of a closed client is left in /dev/shm when its close
        returns."""
        self._teardown(ident, "the client closed before it finished staging", lambda: self._send(ident, Ok(msg.id)))

    def _on_stop(self, ident: bytes, msg: Stop) -> Message:
        log.info("event=stop_requested")
        self.request_stop()
        return Ok(msg.id)

    # -- housekeeping -------------------------------------------------------

    def _teardown(self, ident: bytes, reason: str, then: Callable[[], None] = lambda: None) -> None:
        client, grants = self.state.teardown(ident, reason)
        self._send_grants(grants)
        self.holding.reader_gone(ident)
        if client is not None:
            log.info("event=client_gone pid=%d", client.pid)
            if not self.state.pid_connected(client.pid):
                self.holding.client_gone(client.pid, then)
                return
        then()

    def _housekeeping(self) -> None:
        if self.metrics is not None:
            metrics, info = self.metrics, self._status_info()
            self.workers.background("status", lambda: metrics.update(add_filesystems(info, self.storage)))
        if self.state.slots.mapped_bytes:  # slots clients replaced; nothing to do (nor to keep busy) when none
            self.workers.background("maintenance", self.state.slots.drop_unlinked)
        died = []
        for ident in self.state.dead_clients():
            client = self.state.clients[ident]
            pid = client.pid
            self._teardown(ident, f"the client (pid {pid}) died before it finished staging")
            if client.job:  # a rank of a named run: its run's saves still waiting for it never complete
                died.append(DeadRank(client.job, client.world_size, client.rank, pid))
            if not self.state.pid_connected(pid):
                self.workers.background("maintenance", lambda pid=pid: self.state.slots.reclaim(pid))
        self.attempts.housekeep(time.monotonic(), died)  # the replicas held for peers too
        if self.replication is not None and not self.state.draining:
            self.replication.check(time.monotonic())

    def _busy(self) -> bool:
        return self.state.busy or self.workers.in_flight > 0

    def _should_exit(self) -> bool:
        if self.state.draining:
            return self._drained()
        idle_limit = self.config.exit_when_idle
        if idle_limit is None:
            return False
        now = time.monotonic()
        if not self.state.idle or self._busy():
            self._idle_since = now
            return False
        if self.replicas is not None and self.replicas.holds_any:  # a peer's node may be lost and need them: kept,
            # as its own snapshots keep it, and idle afresh from when the last one goes
            if now - self._idle_since >= idle_limit and not self._kept_for_replicas:
                log.info("event=idle_kept reason=holds_replicas idle_s=%g", idle_limit)
                self._kept_for_replicas = True
            return False
        if self._kept_for_replicas:
            self._idle_since, self._kept_for_replicas = now, False
        if now - self._idle_since >= idle_limit:
            log.info("event=idle_exit idle_s=%.0f", idle_limit)
            return True
        return False

    def _drained(self) -> bool:
        """Whether a drain is over: every write and commit done, every checkpoint ended.

        A checkpoint still missing ranks is waited for up to ``drain_timeout``
        (its ranks may still commit); then it fails with ``ShuttingDown``, its
        ranks are told so and its ``.incomplete`` directory is removed.
        """
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + self.config.drain_timeout
            log.info("event=drain checkpoints=%d writes=%d", len(self.state.commits.pending), len(self.state.writes))
            self.holding.drain()
            if self.replication is not None and self.replicas is not None:  # replicas whose origin is gone
                self.replication.drain(self.replicas)
        if now >= self._drain_deadline:
            self.saves.fail_waiting_for_ranks()
            self.state.abandon_staging(None, "the daemon was stopped before the client finished staging")
        if now >= self._drain_deadline:  # uploads and maintenance (store requests that may stall) are abandoned,
            # after a grace for what the deadline itself started (removing the directories of the attempts it failed)
            busy = self.state.busy or self.workers.in_flight > self.workers.abandonable_in_flight
            graced = self.workers.abandonable_in_flight and now < self._drain_deadline + ABANDON_GRACE_S
            return not busy and not self.state.commits.in_progress and not graced
        uploads_done = self.mirrors is None or self.mirrors.idle()
        return uploads_done and not self._busy() and not self.state.commits.in_progress
