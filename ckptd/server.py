"""The daemon's event loop: one thread owns the ROUTER socket.

Each turn polls the socket and a wake-up fd with a timeout, decodes and
dispatches requests, applies finished writes, and does housekeeping (dead
clients, idle exit). File I/O never happens on this thread: shard writes run
on a bounded pool (the node's write slots, FIFO), commits on one commit
thread, and both report back through a queue plus an eventfd. ``_handle`` is
the one place where an exception becomes an ``Error`` reply, so no request,
however malformed, can take the daemon down.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import zmq

from ckptd.protocol import __version__
from ckptd.protocol.errors import (
    BadMessage,
    BadSlot,
    CkptdError,
    ErrorCode,
    InternalError,
    RanksMissing,
    ShuttingDown,
    UnknownClient,
)
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.layout import parse_header
from ckptd.protocol.messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    Accepted,
    Bye,
    Commit,
    Done,
    Durable,
    Error,
    Finalize,
    Granted,
    Hello,
    Lease,
    Message,
    Ok,
    Ping,
    Pong,
    Release,
    Staged,
    Status,
    Stop,
    Welcome,
    decode,
    request_id,
)

from .admission import check_room, filesystem_of
from .commit import Commits, PendingCheckpoint, resolve_path
from .config import DaemonConfig
from .leases import Grant, LoadLeases
from .retention import apply_retention
from .slots import SlotMaps, pid_alive
from .sweep import KnownDirs, reclaim_orphaned_slots, sweep_incomplete
from .stats import Stats
from .storage import Storage
from .writer import Progress, WriteJob, round_up, write_shard

log = logging.getLogger("ckptd")
POLL_MS = 200
MAX_PID = 1 << 22
"""The kernel's largest possible pid_max."""




@dataclass
class ClientRecord:
    pid: int
    since: float = field(default_factory=time.time)
    saves: int = 0
    waited_s: float = 0.0
    """Total seconds this client blocked on backpressure before its saves."""
    last_waited_s: float = 0.0


class Server:
    """Serve one node until stopped; ``serve_forever`` returns when drained."""

    def __init__(self, config: DaemonConfig, storage: Storage) -> None:
        self.config = config
        self.storage = storage
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.router.setsockopt(zmq.LINGER, 1000)
        self.router.bind(config.endpoint)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.finished: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.writers = ThreadPoolExecutor(config.max_concurrent_writes, thread_name_prefix="ckptd-write")
        self.checksums = ThreadPoolExecutor(config.max_concurrent_writes, thread_name_prefix="ckptd-crc")
        self.committer = ThreadPoolExecutor(1, thread_name_prefix="ckptd-commit")
        self.commits = Commits(storage, config.roots)
        self.slots = SlotMaps()
        self.clients: dict[bytes, ClientRecord] = {}
        self.jobs: list[WriteJob] = []
        self.background_jobs = 0
        """Commits, discards and the start-up sweep running on the commit thread."""
        self.stats = Stats(config)
        self.leases = LoadLeases(config.max_concurrent_loads)
        self.draining = False
        self._drain_deadline: float | None = None
        self._idle_since = time.monotonic()
        self._handlers: dict[type[Message], Callable[[bytes, Message], Message | None]] = {
            Hello: self._on_hello,
            Commit: self._on_commit,
            Staged: self._on_staged,
            Status: self._on_status,
            Ping: lambda ident, msg: Pong(msg.id),
            Finalize: self._on_finalize,
            Abort: self._on_abort,
            Lease: self._on_lease,
            Release: self._on_release,
            Bye: self._on_bye,
            Stop: self._on_stop,
        }
        self.metrics = None
        if config.metrics_port is not None or config.metrics_textfile is not None:
            from .metrics import Metrics

            self.metrics = Metrics(port=config.metrics_port, addr=config.metrics_addr,
                                   textfile=config.metrics_textfile)
        self.known_dirs = KnownDirs(config.run_dir)
        self._start_sweep()

    # -- loop ---------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.wake_fd, zmq.POLLIN)
        next_housekeeping = time.monotonic()
        log.info("event=start pid=%d endpoint=%s roots=%s", os.getpid(), self.config.endpoint,
                 ",".join(map(str, self.config.roots)))
        while True:
            events = dict(poller.poll(POLL_MS))
            if self.router in events:
                self._drain_socket()
            if self.wake_fd in events:
                os.eventfd_read(self.wake_fd)
            self._apply_finished()
            if time.monotonic() >= next_housekeeping:
                next_housekeeping = time.monotonic() + self.config.housekeeping_interval
                self._housekeeping()
            if self._should_exit():
                break
        log.info("event=exit pid=%d", os.getpid())

    def request_stop(self) -> None:
        """Begin draining (safe to call from a signal handler)."""
        self.draining = True

    def close(self) -> None:
        for pool in (self.writers, self.committer, self.checksums):
            pool.shutdown(wait=True)
        self._apply_finished()
        self.router.close()
        self.ctx.term()
        os.close(self.wake_fd)
        self.slots.close()

    def _busy(self) -> bool:
        return bool(self.jobs or self.background_jobs)

    def _should_exit(self) -> bool:
        if self.draining:
            return self._drained()
        idle_limit = self.config.exit_when_idle
        if idle_limit is None:
            return False
        if self.clients or self._busy():
            self._idle_since = time.monotonic()
            return False
        if time.monotonic() - self._idle_since >= idle_limit:
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
            log.info("event=drain checkpoints=%d writes=%d", len(self.commits.pending), len(self.jobs))
        if now >= self._drain_deadline:
            waiting = [p for p in self.commits.pending.values() if p.state == "writing" and not p.coordinated]
            for pending in [p for p in waiting if p.missing]:
                self._fail(pending, ShuttingDown(
                    f"the daemon was stopped while checkpoint {pending.path} waited for ranks {pending.missing} "
                    f"of {pending.world_size}; it waited {self.config.drain_timeout:g} s for them and "
                    f"committed nothing"))
            self._abandon_staging(None, "the daemon was stopped before the client finished staging")
        return not self._busy() and not self.commits.pending

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            ident, payloads = frames[0], frames[1:]
            if len(payloads) != 1:
                self._send(ident, Error(0, ErrorCode.BAD_MESSAGE, f"expected one frame, got {len(payloads)}"))
                continue
            reply = self._handle(ident, payloads[0])
            if reply is not None:
                self._send(ident, reply)

    def _handle(self, ident: bytes, payload: bytes) -> Message | None:
        """Decode, dispatch, and turn any exception into an Error reply."""
        rid = 0
        try:
            msg = decode(payload)
            rid = msg.id
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise BadMessage(f"{msg.type!r} is a reply; the daemon does not accept it as a request")
            return handler(ident, msg)
        except CkptdError as exc:
            rid = rid or request_id(payload)
            self.stats.error(exc.message)
            return Error(rid, exc.code, exc.message)
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("event=internal_error")
            self.stats.error(f"internal error: {exc!r}")
            return Error(rid, ErrorCode.INTERNAL, f"internal error in ckptd: {exc!r}")

    def _send(self, ident: bytes, msg: Message) -> None:
        try:
            self.router.send_multipart([ident, msg.to_wire()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out
            log.warning("event=reply_dropped type=%s error=%s", msg.type, exc)

    # -- requests -----------------------------------------------------------

    def _on_hello(self, ident: bytes, msg: Hello) -> Message:
        if msg.uid != os.getuid():
            raise BadMessage(f"client uid {msg.uid} is not this daemon's uid {os.getuid()}")
        if not 0 < msg.pid <= MAX_PID:
            raise BadMessage(f"client pid {msg.pid} is not a process id (1..{MAX_PID})")
        self.clients[ident] = ClientRecord(pid=msg.pid)
        log.info("event=hello pid=%d version=%s", msg.pid, msg.client_version)
        return Welcome(msg.id, os.getpid(), __version__, tuple(str(r) for r in self.config.roots))

    def _client(self, ident: bytes) -> ClientRecord:
        client = self.clients.get(ident)
        if client is None:
            raise UnknownClient("this client has not said hello (or the daemon restarted); send hello first")
        return client

    def _on_commit(self, ident: bytes, msg: Commit) -> Message:
        client = self._client(ident)
        if self.draining and resolve_path(msg.path, self.config.roots) not in self.commits.pending:
            raise ShuttingDown("the daemon is draining and accepts no new saves (only missing ranks of "
                               "checkpoints already in progress)")
        slot = self.slots.acquire(msg.slot, pid=client.pid, nbytes=round_up(msg.nbytes))
        try:
            entries, _, data_start = parse_header(slot.map[: msg.header_len], msg.nbytes)
            by_offset = lambda e: (e.begin, e.end)  # noqa: E731
            if data_start != msg.header_len or sorted(entries, key=by_offset) != sorted(msg.tensors, key=by_offset):
                raise BadSlot(f"slot {msg.slot!r} holds a header that does not match the commit's tensor table")
            self._check_room(resolve_path(msg.path, self.config.roots), msg.nbytes)
            pending, dest = self.commits.admit(msg, ident)
        except BadMessage as exc:
            self.slots.release(slot)
            raise BadSlot(f"slot {msg.slot!r}: {exc.message}") from None
        except BaseException:
            self.slots.release(slot)
            raise
        progress = Progress(msg.staged, msg.nbytes, deadline=time.monotonic() + msg.timeout)
        job = WriteJob(ident, msg, slot, dest, pending.path, progress, device=filesystem_of(dest))
        self.jobs.append(job)
        client.saves += 1
        client.waited_s += msg.waited
        client.last_waited_s = msg.waited
        run = lambda: write_shard(  # noqa: E731
            job, self.storage, self.checksums, direct=self.config.direct_io, chunk=self.config.chunk_bytes
        )
        self._submit(self.writers, run, lambda fut: self._write_finished(job, pending, fut))
        log.info("event=accepted path=%s rank=%d bytes=%d", pending.path, msg.rank, msg.nbytes)
        return Accepted(msg.id)

    def _check_room(self, target: Path, nbytes: int) -> None:
        device = filesystem_of(target)
        reserved = sum(j.commit.nbytes - j.written for j in self.jobs if j.device == device)
        check_room(target, nbytes, reserved, margin_fraction=self.config.space_margin_fraction,
                   margin_min=self.config.space_margin_bytes, shm_min_free=self.config.shm_min_free)

    def _on_finalize(self, ident: bytes, msg: Finalize) -> None:
        self._client(ident)
        pending = self.commits.from_finalize(msg, ident)
        self._finalize(pending)
        return None  # Done or Error follows once the commit is durable

    def _on_abort(self, ident: bytes, msg: Abort) -> Message:
        self._client(ident)
        final = resolve_path(msg.path, self.config.roots)
        pending = self.commits.pending.get(final) or PendingCheckpoint(final, 1, None, False, coordinated=True)
        self._fail(pending, RanksMissing(f"checkpoint {final} was aborted: {msg.reason}"))
        return Ok(msg.id)

    def _on_lease(self, ident: bytes, msg: Lease) -> None:
        client = self._client(ident)
        self._send_grants(self.leases.request(ident, msg.id, client.pid, msg.limit))
        return None  # Granted follows when a lease is free

    def _on_release(self, ident: bytes, msg: Release) -> Message:
        self._send_grants(self.leases.release(ident))
        return Ok(msg.id)

    def _send_grants(self, grants: list[Grant]) -> None:
        for g in grants:
            self._send(g.client, Granted(g.request_id, g.waited))

    def _on_staged(self, ident: bytes, msg: Staged) -> None:
        job = next((j for j in self.jobs if j.client == ident and j.commit.id == msg.id), None)
        if job is None:
            return None  # that save already ended (refused or failed): the notice is moot
        if msg.error:
            job.progress.fail(f"the client reported: {msg.error}")
        else:
            job.progress.advance(msg.upto)
        return None

    def _on_status(self, ident: bytes, msg: Status) -> Message:
        return self.stats.reply(msg.id, self)

    def _on_bye(self, ident: bytes, msg: Bye) -> Message:
        client = self.clients.pop(ident, None)
        if client is not None:
            self.slots.forget_pid(client.pid)
        self._abandon_staging(ident, "the client closed before it finished staging")
        self._send_grants(self.leases.release(ident))
        return Ok(msg.id)

    def _on_stop(self, ident: bytes, msg: Stop) -> Message:
        log.info("event=stop_requested")
        self.request_stop()
        return Ok(msg.id)

    # -- completions (run on the socket thread) ----------------------------

    def _submit(self, pool: ThreadPoolExecutor, work: Callable[[], object], then: Callable[[Future], None]) -> None:
        """Run ``work`` on ``pool``; ``then(future)`` runs back on this thread."""

        def report(fut: Future) -> None:
            self.finished.put(lambda: then(fut))
            os.eventfd_write(self.wake_fd, 1)

        pool.submit(work).add_done_callback(report)

    def _apply_finished(self) -> None:
        while True:
            try:
                self.finished.get_nowait()()
            except queue.Empty:
                return

    def _write_finished(self, job: WriteJob, pending: PendingCheckpoint, fut: Future) -> None:
        self.jobs.remove(job)
        self.slots.release(job.slot)
        job.finished_at = time.monotonic()
        exc = fut.exception()
        record: ShardRecord | None = None if exc is not None else fut.result()
        if exc is not None:
            job.state = "failed"
            if pending.state != "failed":
                self._fail(pending, exc)
        ready = self.commits.shard_done(pending, record)
        if pending.state == "failed":
            if pending.writing == 0:
                self._discard(pending)
            return
        if pending.coordinated and record is not None:
            self._send(job.client, Durable(job.commit.id, record.file, record.rank, record.size,
                                           record.checksum, record.tensors))
        if ready:
            self._finalize(pending)

    def _finalize(self, pending: PendingCheckpoint) -> None:
        self.background_jobs += 1
        self._submit(self.committer, lambda: self.commits.finalize(pending), lambda f: self._finalized(pending, f))

    def _finalized(self, pending: PendingCheckpoint, fut: Future) -> None:
        self.background_jobs -= 1
        exc = fut.exception()
        if exc is not None:
            self._fail(pending, exc)
            return
        self.commits.forget(pending)
        pending.state = "committed"
        seconds = time.monotonic() - pending.started_at
        self.stats.committed(pending, seconds)
        log.info("event=committed path=%s bytes=%d seconds=%.3f", pending.path, pending.index().total_bytes, seconds)
        for ident, rid, rank in pending.waiting:
            self._send(ident, Done(rid, str(pending.path), pending.shards[rank].size, seconds))
        self.known_dirs.remember(pending.path.parent)
        keep = pending.keep_last or self.config.retention_for(pending.path)
        if keep is not None:
            in_flight = set(self.commits.pending)
            self._submit(self.committer, lambda: apply_retention(self.storage, pending.path, keep, in_flight),
                         lambda f: self._retention_done(pending, f))

    def _retention_done(self, pending: PendingCheckpoint, fut: Future) -> None:
        if fut.exception() is not None:
            log.error("event=retention_failed path=%s error=%r", pending.path, fut.exception())
            self.stats.error(f"retention after {pending.path} failed: {fut.exception()!r}")

    def _fail(self, pending: PendingCheckpoint, exc: BaseException) -> None:
        if not isinstance(exc, CkptdError):
            log.error("event=internal_error path=%s error=%r", pending.path, exc)
            exc = InternalError(f"internal error while saving {pending.path}: {exc!r}")
        self.commits.fail(pending, exc)
        self.stats.error(exc.message)
        log.warning("event=failed path=%s error=%s", pending.path, exc.message)
        for ident, rid, _ in pending.waiting:
            self._send(ident, Error(rid, exc.code, exc.message))
        if pending.writing == 0:  # else the last shard to finish discards (_write_finished)
            self._discard(pending)

    def _discard(self, pending: PendingCheckpoint) -> None:
        self.background_jobs += 1
        self._submit(self.committer, lambda: self.commits.discard(pending), lambda f: self._background_done())

    def _background_done(self) -> None:
        self.background_jobs -= 1

    # -- housekeeping ------------------------------------------------------

    def _abandon_staging(self, ident: bytes | None, reason: str) -> None:
        """Fail the writes still waiting for ``ident``'s staging (None: every client's)."""
        for job in self.jobs:
            if ident in (None, job.client) and not job.progress.complete:
                job.progress.fail(reason)

    def _start_sweep(self) -> None:
        """Clean leftovers of dead writers, off the socket thread."""
        directories = list(dict.fromkeys([*self.config.roots, *self.known_dirs.dirs]))

        def sweep() -> None:
            reclaim_orphaned_slots()
            sweep_incomplete(self.storage, directories, self.config.sweep)

        self.background_jobs += 1
        self._submit(self.committer, sweep, lambda f: self._background_done())

    def _housekeeping(self) -> None:
        if self.metrics is not None:
            self.metrics.update(self.stats.reply(0, self).info)
        for pending, error in self.commits.overdue(time.monotonic()):
            self._fail(pending, error)
        for ident, client in list(self.clients.items()):
            if not pid_alive(client.pid):
                del self.clients[ident]
                self._abandon_staging(ident, f"the client (pid {client.pid}) died before it finished staging")
                self._send_grants(self.leases.drop_pid(client.pid))
                removed = self.slots.reclaim(client.pid)
                log.info("event=client_gone pid=%d slots_reclaimed=%d", client.pid, removed)
