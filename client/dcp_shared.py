"""What every ``ckptd.dcp.StorageWriter`` of one process shares: its client and its agreement group.

DCP code makes a writer per save (``dcp.save(state,
storage_writer=StorageWriter(f"/ckpts/step-{n}"))``). A client per writer
would pay, at every save, what a client pays once: on several ranks a gloo
group and a collective to learn where the ranks are, a connection to the
daemon, and a fresh shared-memory slot that the copy must fault in (about ten
times slower than copying into a slot used before); and nothing would close
those clients, so each save would also leave its slot behind until the
process exits. So a writer given no ``client=`` saves through the process's
shared client for its daemon (``run_dir``) and ``commit_timeout``:

* made on first use, by the first writer (collectively under
  torch.distributed: every rank makes its writers in the same order), and
  reused for every later save, to any path, with either executor (a writer
  unpickled in DCP's PROCESS executor's process uses that process's own);
* made again when it was closed (``StorageWriter.close()``) or when the
  process group it was made under is no longer the process's (another
  ``init_process_group``: other ranks, another world);
* a daemon that died or stopped is the client's own concern: its next save
  reconnects (``Client._reconnect_if_lost``), keeping its slots;
* never inherited: a forked child starts with none (its parent's client,
  slots and socket stay the parent's) and makes its own;
* closed at interpreter exit, after DCP's executor threads have finished, so
  a save still in flight completes and the daemon hears goodbye.
"""

from __future__ import annotations

import atexit
import os
import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from .api import Client
from .ranks import detect_ranks

__all__ = ["agreement_group", "release_shared_client", "shared_client"]

_clients: dict[tuple[str | None, float], tuple[tuple, Client]] = {}
"""(run_dir, commit_timeout) -> (the process group it was made under, the client): this process's shared clients."""
_groups: dict[tuple[int, int], "dist.ProcessGroup"] = {}
"""Each process's agreement group (``agreement_group``)."""
_lock = threading.Lock()


def _world() -> tuple:
    """The process group a client is made under, as far as a client depends on it: its rank, size and identity."""
    ranks = detect_ranks()
    default = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return ranks.rank, ranks.world_size, None if default is None else id(default)


def shared_client(run_dir: Path | str | None, commit_timeout: float) -> Client:
    """This process's shared client for the daemon at ``run_dir`` (see the module docstring)."""
    key, world = (None if run_dir is None else str(run_dir), commit_timeout), _world()
    with _lock:
        entry = _clients.get(key)
        if entry is not None and entry[0] == world and not entry[1]._closed and entry[1]._pid == os.getpid():
            return entry[1]
        stale = entry[1] if entry is not None else None
        client = Client(run_dir=run_dir, commit_timeout=commit_timeout)
        _clients[key] = (world, client)
    if stale is not None:
        stale.close()  # another process group's (or already closed): nothing saves through it any more
    return client


def release_shared_client(run_dir: Path | str | None, commit_timeout: float) -> None:
    """Close the shared client for ``run_dir`` if there is one (waiting for its saves); the next writer makes another."""
    with _lock:
        entry = _clients.pop((None if run_dir is None else str(run_dir), commit_timeout), None)
    if entry is not None:
        entry[1].close()


def agreement_group(timeout: float) -> "dist.ProcessGroup | None":
    """This process's gloo group on which writers agree whether every rank's shard is durable (None: one rank).

    Made once per process (collectively, on the first writer) and kept: a
    group per save would cost a rendezvous each time. Never the training
    group, which may not be gloo.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    key = (os.getpid(), id(dist.group.WORLD))
    with _lock:
        if key not in _groups:
            _groups[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        return _groups[key]


def _forget_in_child() -> None:
    """A forked child: its parent's clients and groups are not its own (a fresh lock: the parent's may be held)."""
    global _lock
    _lock = threading.Lock()
    _clients.clear()
    _groups.clear()


@atexit.register
def _close_at_exit() -> None:
    """Close this process's shared clients: their pending saves finish, the daemon is told goodbye."""
    with _lock:
        clients = [client for _, client in _clients.values()]
        _clients.clear()
    for client in clients:
        try:
            client.close()  # a forked child's inherited ones close nothing (``Client.close``)
        except Exception:
            pass  # the interpreter is exiting: a daemon gone is no reason to fail the exit


os.register_at_fork(after_in_child=_forget_in_child)
