"""``ckptd.Client``: what a training process holds to save asynchronously."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.protocol.endpoint import default_run_dir, endpoint_for
from ckptd.protocol.errors import Busy, CkptdError, InternalError, InvalidCheckpoint, NoSpace
from ckptd.protocol.layout import ShardLayout
from ckptd.protocol.messages import (
    DEFAULT_COMMIT_TIMEOUT, Bye, Delete, Done, Durable, HeldInMemory, Ok, Persist, Ping, Snapshot, Staged, WriteShard,
)
from ckptd.protocol.objects import absolute, user_path

from .checks import check_bool, check_client_args, check_int, check_keep_last, check_path, check_seconds, check_step
from .connection import Connection
from .coordinate import Coordinator, SaveSpec, agree_on_places, agree_on_ring
from .fill import host_only
from .incarnation import drawn, from_launcher, from_master
from .flatten import Flat, flatten
from .future import SaveFuture, SaveResult
from .memory import passed_over, wait_replicated
from .ranks import detect_ranks
from .slots import Slot, SlotPool
from .spawn import ensure_daemon
from .staging import DeviceCopies, LayoutCache, overlap_pays, stage, streamable, write_header


MAX_RESERVE = 1 << 50
"""``reserve_bytes`` above this (1 PiB) is a mistake, not a slot size."""
HEADER_ROOM = 1 << 20
"""Added to ``reserve_bytes`` for the shard's header, so a state of exactly that many tensor bytes fits."""
REFUSALS_KEPT = 64
"""Paths whose last snapshot failed that ``persist`` can still say why for."""


class Client:
    """One training process's connection to its node's ckptd daemon.

    ``save_async`` copies the state into shared memory (the only part the
    training step waits for) and returns; the daemon writes, fsyncs and
    commits. Use one client per process for the whole run: its shared-memory
    slots are created on the first save and reused, which is what makes the
    copy fast.
    """

    def __init__(
        self,
        *,
        run_dir: str | os.PathLike | None = None,
        spawn: bool = True,
        max_inflight: int = 1,
        background_staging: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        commit_timeout: float = DEFAULT_COMMIT_TIMEOUT,
        keep_last: int | None = None,
        stream_commit: bool | None = None,
        heartbeat: float = 1.0,
        timeout: float = 30.0,
        reserve_bytes: int | None = None,
        job: str | None = None,
    ) -> None:
        """
        Args:
            run_dir: the daemon's run directory (default ``$CKPTD_RUN_DIR``,
                ``$XDG_RUNTIME_DIR/ckptd`` or ``/tmp/ckptd-<uid>``).
            spawn: start a daemon if none answers; ``False`` raises
                ``DaemonUnavailable`` instead.
            max_inflight: saves staged but not yet durable; a further
                ``save_async`` waits for one to finish (backpressure).
            background_staging: copy on a client thread so ``save_async``
                returns at once; wait on ``future.staged`` before changing
                the tensors.
            rank, world_size, local_rank: this process's shard; default from
                torch.distributed, else ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``,
                else 0 of 1.
            commit_timeout: seconds every rank has to commit its shard; after
                that the checkpoint fails on every rank, naming the missing ones.
            keep_last: default retention for ``save_async``: keep only this
                many newest checkpoints beside the one just saved.
            stream_commit: commit shards of 64 MiB or more right after their
                header, so the daemon writes while the copy runs: durable
                about one copy-time sooner. None (default): only where
                torch's copy leaves a core free (``torch.get_num_threads()``
                below this process's cores); where it runs on every core,
                the write beside it lengthens the copy (2 cores, 1 GiB:
                0.103 s instead of 0.088 s).
            heartbeat: seconds between liveness checks while saves are pending.
            timeout: seconds of daemon silence after which pending saves fail.
            reserve_bytes: create (and pre-fault) a slot this big now, so the
                first save of a state up to that size copies as fast as the
                later ones instead of also faulting in fresh shared memory
                (the state's tensor bytes: room for the shard's header is
                added).
            job: a name for this run of the job, the same on every rank and
                different after a restart (default: the launcher's where it
                names one launch, from torchrun's run id or Slurm's job step;
                else drawn by rank 0 when torch.distributed is initialized;
                see ``incarnation.py``). A checkpoint is only ever made of one
                run's shards: a restarted job saving the same path never joins
                the dead run's save, and a second live launch never joins the
                first's.
        """
        check_client_args(max_inflight=max_inflight, rank=rank, world_size=world_size, local_rank=local_rank,
                          commit_timeout=commit_timeout, keep_last=keep_last, heartbeat=heartbeat, timeout=timeout,
                          spawn=spawn, background_staging=background_staging, stream_commit=stream_commit, job=job)
        reserve = check_int("reserve_bytes", reserve_bytes, high=MAX_RESERVE, optional=True)
        self._pid = os.getpid()
        """The process that owns this client's slots, thread and socket."""
        detected = detect_ranks()
        self.rank = detected.rank if rank is None else rank
        self.world_size = detected.world_size if world_size is None else world_size
        self.local_rank = detected.local_rank if local_rank is None else local_rank
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not inside world size {self.world_size}")
        self.run_dir = Path(check_path("run_dir", run_dir)).absolute() if run_dir is not None else default_run_dir()
        self.endpoint = endpoint_for(self.run_dir) if run_dir is not None else endpoint_for()
        self.spawn = spawn
        self.max_inflight = max_inflight
        self.commit_timeout = commit_timeout
        self.keep_last = keep_last
        self.stream_commit = stream_commit
        self._heartbeat, self._timeout = heartbeat, timeout
        self._slots = SlotPool(max_inflight + 1)
        self._layouts = LayoutCache()
        self._saves: collections.Counter[str] = collections.Counter()
        """Saves this client made of each path: a save's count is the same on every rank of an SPMD job
        (``StagedShard.save``), which tells two saves of one path apart across nodes."""
        self._known_layout: tuple[Connection, int | None, str] | None = None
        """The last tensor table the daemon accepted on which connection (and daemon): a commit names it by digest."""
        self._inflight = threading.BoundedSemaphore(max_inflight)
        self._background_staging = background_staging
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptd-stage")
        """Background staging, and waiting for CUDA copies to land."""
        self._futures: set[SaveFuture] = set()
        self._snapshotting: dict[SaveFuture, str] = {}
        """Pending snapshots (``persist=False``) by path: ``persist`` of one waits for it to be held."""
        self._refused: dict[str, BaseException] = {}
        """Why this client's last snapshot of a path failed (the newest ``REFUSALS_KEPT`` paths): the daemon
        holds nothing there to say why, so ``persist`` of the path reports it."""
        self._lock = threading.Lock()
        self._closed = False
        self.job = job or from_launcher()
        """This run's incarnation, sent with every save (``incarnation.py``) and in the connection's hello."""
        group = None
        if detected.distributed and self.world_size > 1:
            group, self.job = agree_on_places(self.endpoint, commit_timeout, self.job or drawn())
        elif not self.job:
            self.job = from_master()
        self._conn = self._connect()
        self.ring: dict[str, Any] | None = None
        """What the ranks agreed on placement (``coordinate.agree_on_ring``); None on one node."""
        if group is not None:
            try:
                self.ring = agree_on_ring(group, self._conn, self.endpoint, self.job)
            except BaseException:
                self._conn.close()
                raise
        self._coordinator = Coordinator(group, lambda: self._conn, self.rank, self.job) if group is not None else None
        if reserve:
            try:
                self._slots.reserve(reserve + HEADER_ROOM)
            except NoSpace as exc:
                self.close()
                raise NoSpace(f"reserve_bytes={reserve}: {exc}") from None
            except BaseException:
                self.close()
                raise

    def _connect(self) -> Connection:
        ensure_daemon(self.run_dir, self.endpoint, spawn=self.spawn, timeout=self._timeout)
        conn = Connection(self.endpoint, heartbeat=self._heartbeat, timeout=self._timeout, rank=self.rank,
                          world_size=self.world_size, job=self.job)
        try:
            conn.introduce()
        except BaseException:
            conn.close()
            raise
        return conn

    def save_async(self, state_dict: Any, path: str | os.PathLike, *, step: int | None = None,
                   overwrite: bool = False, keep_last: int | None = None, block: bool = True,
                   replicated: tuple[str, ...] = (), persist: bool = True) -> SaveFuture:
        """Save ``state_dict`` as checkpoint ``path``; returns at once or after staging.

        DTensors anywhere in the state are saved as chunks of their global
        tensors: each rank stages only the chunk it owns, nothing is gathered.
        ``replicated`` names top-level keys whose state is identical on every
        rank (DDP's model and optimizer): written once, by rank 0, and served
        to every rank on load.

        Unsupported leaves raise ``TypeError`` here, naming their key path.
        With ``max_inflight`` saves pending, this waits for one to finish, or
        raises ``ckptd.Busy`` with ``block=False``. The future resolves with a
        ``SaveResult`` once every rank's shard is durable and the checkpoint
        is renamed to ``path``. ``keep_last`` overrides the client's retention.

        ``persist=False`` takes a memory snapshot: staged the same way, but
        the node's daemon keeps the shard in memory as checkpoint ``path``
        instead of writing it (no disk I/O), and the future resolves once
        every rank's shard is held. ``ckptd.latest`` and ``ckptd.load`` find
        it there; ``persist(path)`` writes it to disk, and the daemon does
        so itself for the newest one when this process exits or dies.
        """
        started = time.monotonic()
        self._check_process()
        if self._closed:
            raise RuntimeError("this ckptd client is closed")
        target = checkpoint_target(path)
        step, keep_last = check_step(step), check_keep_last(keep_last)
        check_bool("overwrite", overwrite)
        check_bool("block", block)
        check_bool("persist", persist)
        flat = flatten(state_dict, replicated=replicated, rank=self.rank)
        return self._save_flat(flat, target, step=step, overwrite=overwrite, keep_last=keep_last, block=block,
                               persist=persist, started=started)[0]

    def _save_flat(self, flat: Flat, target: str, *, step: int | None, overwrite: bool, keep_last: int | None,
                   block: bool, persist: bool, started: float, coordinated: bool = False,
                   ahead: "Ahead | None" = None) -> tuple[SaveFuture, Future]:
        """Stage an already flattened state and commit it; (the save's future, the daemon's reply to the commit).

        ``coordinated``: the commit is answered by ``Durable`` and the caller
        finalizes (``ckptd.dcp.StorageWriter``, whose coordinator sends
        ``Finalize`` from DCP's ``finish``); the save's future resolves at
        ``Durable``, not through this client's coordinator. ``ahead``: the
        slot ``_stage_ahead`` copied the state into, with its in-flight place;
        ``flat``'s tensors are views of it (its own or another copy's).
        """
        if ahead is not None:
            self._take(ahead)
            try:  # the daemon may have gone since the copy
                self._reconnect_if_lost()
            except BaseException:
                self._slots.give_back(ahead.slot)
                self._inflight.release()
                raise
        else:
            self._take_place(block)
        overwrite = passed_over(target) or overwrite  # a snapshot only some nodes hold, which latest passed over
        fut = SaveFuture()
        with self._lock:
            self._futures.add(fut)
            self._refused.pop(target, None)
            if not persist:
                self._snapshotting[fut] = target
        if not persist:
            endpoint = self.endpoint
            fut.replication = lambda timeout: wait_replicated(endpoint, target, timeout)
        fut.add_done_callback(self._forget)
        self._saves[target] += 1
        req = _Request(flat, target, step, overwrite, keep_last or self.keep_last, started,
                       waited=time.monotonic() - started, persist=persist, coordinated=coordinated,
                       save=self._saves[target], slot=ahead.slot if ahead is not None else None,
                       ahead=ahead is not None)
        # This rank's daemon reply (Done, or Durable on several nodes) lands in
        # ``shard``. The coordinator gets its place now, in call order, which is
        # the same on every rank whatever staging does later.
        shard: Future = Future()
        if self._coordinator is None or coordinated:
            shard.add_done_callback(lambda r: self._resolve(fut, req, r.exception() or r.result()))
        else:
            self._coordinator.submit(shard, self._spec(req), lambda outcome: self._resolve(fut, req, outcome))
        if self._background_staging:
            self._worker.submit(self._stage, req, fut, shard, True)
        else:
            self._stage(req, fut, shard, False)
        return fut, shard

    def _take_place(self, block: bool) -> None:
        """An in-flight place for a save, and a daemon to send it to."""
        acquired = self._inflight.acquire(timeout=self.commit_timeout) if block else self._inflight.acquire(False)
        if not acquired:  # never block a training loop forever, even on a hung filesystem
            waited = f" for {self.commit_timeout:g} s" if block else ""
            raise Busy(f"{self.max_inflight} save(s) still in flight{waited}; wait for one or raise max_inflight")
        try:  # after the wait for a place: the save that held it may have failed because the daemon was lost
            self._reconnect_if_lost()
        except BaseException:
            self._inflight.release()
            raise

    def _stage_ahead(self, flat: Flat) -> "Ahead":
        """Copy ``flat`` into a slot now, for a save that names what it keeps of it later (``_save_flat(ahead=)``).

        ``ckptd.dcp.StorageWriter(stage_in_slot=True)``'s staging: DCP plans
        (collectives across the ranks) after staging and before it writes, so
        the writer copies every local tensor first, hands DCP views of the
        slot to plan on, and its ``write_data`` lays out in place what the plan
        keeps (``LayoutCache.restage``). Holds an in-flight place and the slot
        until the save takes them, or ``release_ahead``.
        """
        self._check_process()
        self._take_place(block=True)
        slot = None
        try:
            layout = self._layouts.layout(flat)
            slot = self._slots.take(layout.nbytes)
            if slot.fresh and not host_only(flat):
                slot.prepare()
            if slot.fresh:
                write_header(layout, slot)
                copies = stage(flat, layout, slot)
            else:
                copies = None if self._layouts.copy(flat, layout, slot) else stage(
                    flat, layout, slot, views=self._layouts.views(layout, slot))
            if copies is not None:
                copies.wait()
            views = self._layouts.views(layout, slot)
        except BaseException:
            if slot is not None:
                self._slots.give_back(slot)
            self._inflight.release()
            raise
        return Ahead(slot, layout, {entry.name: view for entry, view in zip(layout.entries, views)})

    def _take(self, ahead: "Ahead") -> None:
        with self._lock:
            if ahead.taken:
                raise RuntimeError("this staged shard was released (its save gave up) before its save began")
            ahead.taken = True

    def release_ahead(self, ahead: "Ahead") -> None:
        """Give back the slot and in-flight place of a shard staged ahead whose save never took them."""
        with self._lock:
            if ahead.taken:
                return
            ahead.taken = True
        self._slots.give_back(ahead.slot)
        self._inflight.release()

    def _check_process(self) -> None:
        """A forked child has no I/O thread and must not touch its parent's slots: fail at once."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this ckptd.Client belongs to process {self._pid}; it cannot be used in a forked child "
                f"(pid {os.getpid()}). Create a new ckptd.Client in the child."
            )

    def _spec(self, req: "_Request") -> SaveSpec:
        return SaveSpec(req.path, self.world_size, req.step, req.overwrite, req.keep_last, self.commit_timeout,
                        snapshot=not req.persist, replicated=tuple(sorted(req.flat.replicated.items())))

    def _stage(self, req: "_Request", fut: SaveFuture, shard: Future, on_worker: bool) -> None:
        """Copy into a slot; CUDA copies still running are awaited on the worker thread.

        Streamed (``stream_commit``, by default ``overlap_pays``), a big
        host-only shard is committed right after its header, and the daemon
        writes each part as soon as ``Staged`` says it is final.
        """
        try:
            layout = self._layouts.layout(req.flat)
            if req.ahead:
                self._restage(req, layout)
                self._commit_when_copied(req, fut, shard, layout, None)
                return
            req.slot = self._slots.take(layout.nbytes)
            if req.slot.fresh and not host_only(req.flat):
                req.slot.prepare()  # CUDA copies land through the pinned mapping
            views = None
            if req.slot.fresh:
                write_header(layout, req.slot)  # into its file: its mapping stays untouched (``Slot.fill``)
            else:
                views = self._layouts.views(layout, req.slot)  # the header is in the slot from here on
            stream = overlap_pays() if self.stream_commit is None else self.stream_commit
            if stream and streamable(req.flat, layout):
                commit_id, accepted = self._send_commit(req, shard, layout, staged=layout.data_start)
                report = lambda upto: self._conn.notify(Staged(commit_id, upto, ""))  # noqa: E731
                try:
                    stage(req.flat, layout, req.slot, progress=report, views=views)
                except BaseException as exc:
                    self._conn.notify(Staged(commit_id, layout.data_start, f"staging failed: {exc!r}"))
                    raise
                self._conn.notify(Staged(commit_id, layout.nbytes, ""))
                fut.staged.set_result(None)
                if not on_worker:
                    self._until_delivered(accepted, notices=True)
                return
            copies = None if self._layouts.copy(req.flat, layout, req.slot) else stage(
                req.flat, layout, req.slot, views=views)
        except BaseException as exc:
            _fail(exc, fut.staged, shard)  # frees the slot and the in-flight place
            if not isinstance(exc, Exception):
                raise  # Ctrl-C and SystemExit reach the caller, after the clean-up
            return
        if copies is not None and not on_worker:
            self._worker.submit(self._commit_when_copied, req, fut, shard, layout, copies)
        else:
            self._commit_when_copied(req, fut, shard, layout, copies)

    def _restage(self, req: "_Request", layout: ShardLayout) -> None:
        """Lay out the save's tensors in the slot they were staged into ahead: in place where they can be; else
        (a planner that made copies, or moved tensors up) from copies of them, as any save is staged."""
        assert req.slot is not None
        if self._layouts.restage(req.flat, layout, req.slot):
            return
        flat = dataclasses.replace(req.flat, tensors=[(name, t.clone()) for name, t in req.flat.tensors])
        stage(flat, layout, req.slot, views=self._layouts.views(layout, req.slot))

    def _commit_when_copied(self, req: "_Request", fut: SaveFuture, shard: Future, layout: ShardLayout,
                            copies: DeviceCopies | None) -> None:
        """Once every byte is in the slot: off to the daemon, then staged.

        Staged follows the daemon's answer to the commit (on the staging
        thread when staging runs there), so a save reported staged is one
        the daemon holds: a ``ckptd stop`` that comes after it drains it
        instead of refusing it as new, and a trainer killed after it still
        gets its checkpoint.
        """
        try:
            if copies is not None:
                copies.wait()
            _, accepted = self._send_commit(req, shard, layout, staged=layout.nbytes)
        except BaseException as exc:
            _fail(exc, fut.staged, shard)
            if not isinstance(exc, Exception):
                raise
            return
        try:
            self._until_delivered(accepted, notices=False)
        finally:
            fut.staged.set_result(None)

    def _until_delivered(self, accepted: Future, *, notices: bool) -> None:
        """Return once the daemon holds the save (or refused it).

        A trainer may be killed the moment ``save_async`` returns; by then the
        daemon has the commit and (``notices``: after a second round trip)
        every progress notice, so the checkpoint is still written. Costs one
        round trip on this node's socket.
        """
        try:
            accepted.exception(timeout=self._timeout)
            if notices:
                self._conn.call(Ping(self._conn.next_id()))  # notices sent before it have arrived too
        except Exception:
            pass  # the save's own future reports what went wrong

    def _send_commit(self, req: "_Request", shard: Future, layout: ShardLayout, *, staged: int) -> tuple[int, Future]:
        kind, conn, table = WriteShard if req.persist else Snapshot, self._conn, self._layouts.table(layout)
        full = kind(conn.next_id(), req.slot.name, layout.nbytes, layout.data_start, table, req.path, self.rank,
                    self.world_size, req.step, req.overwrite, coordinated=self._coordinator is not None or req.coordinated,
                    keep_last=req.keep_last, timeout=self.commit_timeout, waited=req.waited, staged=staged,
                    layout=table.digest if table else "",  # no tensors: nothing to name
                    job=self.job, replicated=req.flat.replicated, save=req.save)
        known = (conn, conn.daemon_pid, full.layout)
        # The daemon keeps the last tables this connection sent: a save of the same structure names its table.
        commit = dataclasses.replace(full, tensors=()) if full.layout and self._known_layout == known else full
        accepted: Future = Future()
        accepted.add_done_callback(lambda f: f.exception() is None and setattr(self, "_known_layout", known))
        reply = conn.request(commit, accepted=accepted, resend=full)
        reply.add_done_callback(lambda r: self._lend_if_held(req, r))  # before the save resolves (and frees the slot)
        reply.add_done_callback(lambda r: _chain(r, shard))
        return commit.id, accepted

    def _lend_if_held(self, req: "_Request", reply: Future) -> None:
        """A held snapshot's slot is the daemon's now; the slots it names as released are ours again."""
        if reply.exception() is None and isinstance(reply.result(), HeldInMemory):
            self._slots.reclaim(reply.result().released)
            self._slots.lend(req.slot)
            req.slot = None

    def _resolve(self, fut: SaveFuture, req: "_Request", outcome: Any) -> None:
        """A save's end: free its slot and in-flight place, then settle its future."""
        if req.slot is not None:
            self._slots.give_back(req.slot)
        self._inflight.release()
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        elif isinstance(outcome, HeldInMemory):
            fut.set_result(SaveResult(user_path(outcome.path), outcome.bytes_held, time.monotonic() - req.started,
                                      req.step))
        elif isinstance(outcome, Durable):  # a coordinated commit its caller finalizes
            fut.set_result(SaveResult(user_path(req.path), outcome.size,
                                      time.monotonic() - req.started, req.step))
        elif not isinstance(outcome, Done):
            fut.set_exception(InternalError(f"daemon answered a commit with {outcome.type!r}"))
        else:
            fut.set_result(SaveResult(user_path(outcome.path), outcome.bytes_written, time.monotonic() - req.started,
                                      req.step))

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)
            path = self._snapshotting.pop(fut, None)
            if path is not None and fut.exception() is not None:
                self._refused.pop(path, None)  # re-inserted as the newest
                self._refused[path] = fut.exception()
                while len(self._refused) > REFUSALS_KEPT:
                    del self._refused[next(iter(self._refused))]

    def _reconnect_if_lost(self) -> None:
        """After the daemon died or stopped, reach (or respawn) a daemon before the next save.

        A client with nothing pending learns of it only here, by the daemon's
        pid: sending the save first would lose it to a daemon that is gone.
        """
        if self._conn.lost is None and self._conn.daemon_running():
            return
        self._conn.close()
        self._conn = self._connect()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has finished (successfully or not), or ``timeout`` seconds pass."""
        self._check_process()
        if timeout is not None:
            check_seconds("timeout", timeout)
        with self._lock:
            pending = list(self._futures)
        concurrent.futures.wait(pending, timeout)

    def persist(self, path: str | os.PathLike, *, timeout: float | None = None) -> Path | str:
        """Write the memory snapshot ``path`` (held by this node's daemon) to disk; returns once it is committed.

        The daemon writes it from the memory it holds, exactly like a save
        (``.incomplete``, fsync, rename), with the snapshot's own
        ``overwrite`` and ``keep_last``, and keeps holding it. Every rank may
        call it, right after ``save_async(..., persist=False)``: it waits for
        this client's snapshot of ``path`` to be held and for the snapshot to
        be complete, and a snapshot already persisted returns at once. Raises
        what this client's last snapshot of ``path`` failed with (a
        ``CheckpointExists`` on a restart, say), else ``InvalidCheckpoint``
        if the daemon holds no snapshot there. Returns the checkpoint's name
        as ``SaveResult.path`` does (an object: its URL).
        """
        self._check_process()
        if self._closed:
            raise RuntimeError("this ckptd client is closed")
        target = absolute(check_path("path", path))
        wait = self.commit_timeout if timeout is None else check_seconds("timeout", timeout)
        deadline = time.monotonic() + wait
        with self._lock:
            mine = [f for f, p in self._snapshotting.items() if p == target]
            refused = self._refused.get(target)
        _, late = concurrent.futures.wait(mine, wait)
        if late:
            raise TimeoutError(f"persist({target!r}): this client's snapshot of it was not held within {wait:g} s")
        if mine:  # the newest decides (its future may be done before ``_forget`` has run)
            refused = mine[-1].exception()
        if refused is not None:  # nothing of it is held: the daemon could only say it holds no snapshot there
            why = getattr(refused, "message", None) or str(refused) or type(refused).__name__
            kind = type(refused) if isinstance(refused, CkptdError) else InvalidCheckpoint
            raise kind(f"persist({target!r}): this client's snapshot of it failed, so nothing is held to "
                       f"persist: {why}") from refused
        self._reconnect_if_lost()
        try:
            done = self._conn.call(Persist(self._conn.next_id(), target), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(f"persist({target!r}) was not committed to disk within {wait:g} s") from None
        assert isinstance(done, Done)
        return user_path(done.path)

    def delete(self, path: str | os.PathLike, *, timeout: float | None = None) -> None:
        """Delete the committed checkpoint ``path`` through this node's daemon (nothing there is fine).

        The daemon deletes it as its retention does: only a committed ckptd
        checkpoint holding nothing but ckptd's files, under its publish lock
        (never a version saved again meanwhile), set aside first so no reader
        sees it half deleted, on disk or on an object store (``s3://``). A
        save to it in flight is refused (``Conflict``), and what is not a
        ckptd checkpoint is left where it is (``InvalidCheckpoint`` says why).
        """
        self._check_process()
        if self._closed:
            raise RuntimeError("this ckptd client is closed")
        target = absolute(check_path("path", path))
        wait = self.commit_timeout if timeout is None else check_seconds("timeout", timeout)
        self._reconnect_if_lost()
        try:
            ok = self._conn.call(Delete(self._conn.next_id(), target), timeout=wait)
        except TimeoutError:
            raise TimeoutError(f"delete({target!r}) got no answer from the daemon within {wait:g} s") from None
        assert isinstance(ok, Ok)

    @property
    def slot_names(self) -> list[str]:
        """Names of this client's shared-memory slots (for monitoring and tests)."""
        return self._slots.names

    def close(self) -> None:
        """Wait for pending saves, say goodbye, and unlink the slots.

        In a forked child this does nothing: the slots, the socket and the
        pending saves are the parent's.
        """
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            self._worker.shutdown(wait=True)
            self.wait()
            try:
                self._conn.call(Bye(self._conn.next_id()), timeout=min(self._timeout, 5.0))
            except Exception:
                pass  # the daemon is gone: nothing to say goodbye to
            self._conn.close()
        finally:
            if self._coordinator is not None:
                self._coordinator.close()
            self._layouts = LayoutCache()  # no view of a slot outlives its mapping
            self._slots.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Request:
    """One save_async call on its way through staging and commit."""

    flat: Flat
    path: str
    step: int | None
    overwrite: bool
    keep_last: int | None
    started: float
    waited: float
    persist: bool = True
    slot: Slot | None = None
    coordinated: bool = False
    """Answered by ``Durable``; the caller finalizes (see ``Client._save_flat``)."""
    save: int = 0
    """This client's count of its saves to ``path`` (``StagedShard.save``)."""
    ahead: bool = False
    """The tensors were staged ahead into ``slot`` (``Client._stage_ahead``)."""


@dataclass
class Ahead:
    """A shard copied into a slot ahead of its save (``Client._stage_ahead``), holding an in-flight place."""

    slot: Slot
    layout: ShardLayout
    views: dict[str, Any]
    """Each tensor's view of the slot, by name."""
    taken: bool = False
    """A save took the slot and place, or ``release_ahead`` gave them back."""


def checkpoint_target(path: str | os.PathLike) -> str:
    """The checkpoint name a save sends: an ``s3://`` URL as is, a local path made absolute."""
    return absolute(check_path("path", path))


def _fail(exc: BaseException, *futures: Future) -> None:
    for f in futures:
        if not f.done():
            f.set_exception(exc)


def _chain(source: Future, target: Future) -> None:
    if target.done():  # staging already failed it, with the more telling error
        return
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())
