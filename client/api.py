"""``ckptd.Client``: what a training process holds to save asynchronously."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptd.protocol import __version__
from ckptd.protocol.endpoint import default_run_dir, endpoint_for
from ckptd.protocol.errors import InternalError
from ckptd.protocol.messages import Bye, Commit, Done, Hello, Welcome

from .connection import Connection
from .flatten import Flat, flatten
from .future import SaveFuture, SaveResult
from .ranks import detect_rank
from .slots import SlotPool
from .spawn import ensure_daemon
from .staging import layout_for, stage


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
        heartbeat: float = 1.0,
        timeout: float = 30.0,
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
            rank, world_size: this process's shard; default from
                torch.distributed, else ``RANK``/``WORLD_SIZE``, else 0 of 1.
            heartbeat: seconds between liveness checks while saves are pending.
            timeout: seconds of daemon silence after which pending saves fail.
        """
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        detected = detect_rank() if rank is None or world_size is None else (rank, world_size)
        self.rank = detected[0] if rank is None else rank
        self.world_size = detected[1] if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not inside world size {self.world_size}")
        self.run_dir = Path(run_dir).absolute() if run_dir is not None else default_run_dir()
        self.endpoint = endpoint_for(self.run_dir) if run_dir is not None else endpoint_for()
        self.spawn = spawn
        self.max_inflight = max_inflight
        self._heartbeat, self._timeout = heartbeat, timeout
        self._slots = SlotPool(max_inflight + 1)
        self._inflight = threading.BoundedSemaphore(max_inflight)
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="ckptd-stage") if background_staging else None
        self._futures: set[SaveFuture] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._conn = self._connect()

    def _connect(self) -> Connection:
        ensure_daemon(self.run_dir, self.endpoint, spawn=self.spawn, timeout=self._timeout)
        hello = Hello(0, os.getpid(), os.getuid(), __version__)
        conn = Connection(self.endpoint, hello, heartbeat=self._heartbeat, timeout=self._timeout)
        try:
            welcome = conn.call(Hello(conn.next_id(), hello.pid, hello.uid, hello.client_version))
        except BaseException:
            conn.close()
            raise
        assert isinstance(welcome, Welcome)
        return conn

    def save_async(self, state_dict: Any, path: str | os.PathLike, *, step: int | None = None,
                   overwrite: bool = False) -> SaveFuture:
        """Save ``state_dict`` as checkpoint ``path``; returns at once or after staging.

        Unsupported leaves raise ``TypeError`` here, naming their key path.
        The future resolves with a ``SaveResult`` once every rank's shard is
        durable and the checkpoint is renamed to ``path``.
        """
        started = time.monotonic()
        if self._closed:
            raise RuntimeError("this ckptd client is closed")
        flat = flatten(state_dict)
        target = os.path.abspath(os.fspath(path))
        self._reconnect_if_lost()
        self._inflight.acquire()
        fut = SaveFuture()
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._forget)
        if self._stager is None:
            self._stage_and_commit(flat, target, step, overwrite, fut, started)
        else:
            self._stager.submit(self._stage_and_commit, flat, target, step, overwrite, fut, started)
        return fut

    def _stage_and_commit(self, flat: Flat, path: str, step: int | None, overwrite: bool,
                          fut: SaveFuture, started: float) -> None:
        slot = None
        try:
            layout = layout_for(flat)
            slot = self._slots.take(layout.nbytes)
            stage(flat, layout, slot)
            fut.staged.set_result(None)
            commit = Commit(self._conn.next_id(), slot.name, layout.nbytes, layout.data_start, layout.entries,
                            path, self.rank, self.world_size, step, overwrite)
        except BaseException as exc:
            if slot is not None:
                self._slots.give_back(slot)
            self._inflight.release()
            for f in (fut.staged, fut):
                if not f.done():
                    f.set_exception(exc)
            return
        reply = self._conn.request(commit)
        reply.add_done_callback(lambda r: self._finished(r, fut, slot, started, step))

    def _finished(self, reply: Future, fut: SaveFuture, slot: Any, started: float, step: int | None) -> None:
        self._slots.give_back(slot)
        self._inflight.release()
        exc = reply.exception()
        if exc is not None:
            fut.set_exception(exc)
            return
        done = reply.result()
        if not isinstance(done, Done):
            fut.set_exception(InternalError(f"daemon answered a commit with {done.type!r}"))
            return
        fut.set_result(SaveResult(Path(done.path), done.bytes_written, time.monotonic() - started, step))

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def _reconnect_if_lost(self) -> None:
        """After the daemon died, reach (or respawn) a daemon before the next save."""
        if self._conn.lost is None:
            return
        self._conn.close()
        self._conn = self._connect()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has finished (successfully or not)."""
        with self._lock:
            pending = list(self._futures)
        concurrent.futures.wait(pending, timeout)

    @property
    def slot_names(self) -> list[str]:
        """Names of this client's shared-memory slots (for monitoring and tests)."""
        return self._slots.names

    def close(self) -> None:
        """Wait for pending saves, say goodbye, and unlink the slots."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stager is not None:
                self._stager.shutdown(wait=True)
            self.wait()
            try:
                self._conn.call(Bye(self._conn.next_id()), timeout=min(self._timeout, 5.0))
            except Exception:
                pass  # the daemon is gone: nothing to say goodbye to
            self._conn.close()
        finally:
            self._slots.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
