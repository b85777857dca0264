"""What a trainer uses without ckptd: ``torch.save`` + ``fsync``, and PyTorch DCP.

``torch.save`` alone returns once the bytes are in the page cache, which is
not a checkpoint a crash leaves behind; the fair comparison with ckptd's
"durable" is ``torch.save`` + ``flush`` + ``fsync``. The trainer is blocked
for all of it, so its blocking time and its time to durable are the same
number.

PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) is
measured in four ways on the same state dict, through a one-process gloo
group on 127.0.0.1:

* ``dcp.save``: blocking; the trainer waits for everything.
* ``dcp.async_save`` with ``AsyncCheckpointerType.THREAD``: the call copies
  the state into fresh CPU memory (its default stager), a thread writes.
* ``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS``: the same copy,
  then a background thread hands it to DCP's checkpoint process (spawned on
  the first save), which moves the copy into shared memory while pickling
  it over a pipe, and writes.
* the same with a reused ``DefaultStager`` (``async_stager=``), as the
  ``async_save`` and ``DefaultStager`` docs recommend: its staging copies
  live in shared memory, are allocated once and reused, and are made on the
  stager's thread (``use_async_staging``), so the call returns at once and
  ``AsyncSaveResponse.staging_completion`` says when the tensors may change.
  Pinned memory and non-blocking copies need CUDA and are off on a CPU-only
  machine.

DCP's ``FileSystemWriter`` has ``sync_files=True`` by default: it fsyncs
each data file and the ``.metadata`` file, which it writes to a temporary
name and renames. It does not fsync the checkpoint directory, and the data
files are written under their final names, so "durable" here means DCP's
future resolved with its own fsyncs done.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .limits import drop_cached
from .measure import Series


@dataclass
class TorchSaveResult:
    durable: Series = field(default_factory=Series)
    """``torch.save`` + ``fsync``: the caller is blocked for all of it."""
    serialize: Series = field(default_factory=Series)
    """``torch.save`` returning (bytes in the page cache, not yet durable)."""
    file_bytes: int = 0


def torch_save(state: Any, scratch: Path, repeat: int, on_steady: Callable[[], None] | None = None,
               keep: Path | None = None) -> TorchSaveResult:
    """One warm-up and ``repeat`` timed ``torch.save`` + ``fsync`` to a new file each."""
    result = TorchSaveResult()
    for i in range(1 + repeat):
        if i == 1 and on_steady is not None:
            on_steady()
        path = scratch / f"torch-save-{i}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            t1 = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        result.file_bytes = path.stat().st_size
        drop_cached(path)
        if i >= 1:
            result.serialize.add(t1 - t0)
            result.durable.add(t2 - t0)
    return result


# --- DCP ---------------------------------------------------------------------

DCP_MODES = {
    "save": "DCP save",
    "thread": "DCP async_save THREAD",
    "process": "DCP async_save PROCESS",
    "process_stager": "DCP async_save PROCESS + reused DefaultStager",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo() -> None:
    """A one-process gloo group on 127.0.0.1, as DCP needs one."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def dcp_writer_pid() -> int | None:
    """Pid of DCP's checkpoint process (PROCESS checkpointer), if one runs (private torch API)."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        return proc._save_process.pid if proc is not None else None
    except Exception:
        return None


def stop_dcp_writer() -> None:
    """End DCP's checkpoint process now rather than at interpreter exit."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        if proc is not None:
            ape._CHECKPOINT_PROCESS = None
            proc.__del__()
    except Exception:
        pass


@dataclass
class DcpResult:
    mode: str
    returned: Series = field(default_factory=Series)
    staged: Series = field(default_factory=Series)
    durable: Series = field(default_factory=Series)
    files_bytes: int = 0

    def to_json(self) -> dict:
        return {"mode": self.mode, "returned": self.returned.values, "staged": self.staged.values,
                "durable": self.durable.values, "files_bytes": self.files_bytes}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def dcp_saves(state: Any, scratch: Path, mode: str, repeat: int, *, on_steady: Callable[[], None] | None = None,
              on_writer: Callable[[int], None] | None = None, on_end: Callable[[], None] | None = None) -> DcpResult:
    """One warm-up and ``repeat`` timed DCP saves of ``state`` in ``mode`` (a key of ``DCP_MODES``).

    ``on_end`` runs after the last timed save, while DCP's checkpoint process still runs.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    init_gloo()
    stager = None
    if mode == "process_stager":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                              use_async_staging=True, use_non_blocking_copy=cuda))
    kind = AsyncCheckpointerType.PROCESS if mode.startswith("process") else AsyncCheckpointerType.THREAD
    result = DcpResult(mode)
    previous: Path | None = None
    try:
        for i in range(1 + repeat):
            if i == 1 and on_steady is not None:
                on_steady()
            path = scratch / f"dcp-{mode}-{i}"
            t0 = time.perf_counter()
            if mode == "save":
                dcp.save(state, checkpoint_id=path)
                t_ret = t_staged = time.perf_counter()
            else:
                response = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=kind,
                                          async_stager=stager)
                t_ret = time.perf_counter()
                if isinstance(response, AsyncSaveResponse):
                    response.staging_completion.result()
                    t_staged = time.perf_counter()
                    response.upload_completion.result()
                else:
                    t_staged = t_ret  # the default stager copies inside the call
                    response.result()
            t_dur = time.perf_counter()
            if i == 0 and on_writer is not None and (pid := dcp_writer_pid()) is not None:
                on_writer(pid)
            result.files_bytes = dir_bytes(path)
            if previous is not None:
                shutil.rmtree(previous, ignore_errors=True)
            previous = path
            if i >= 1:
                result.returned.add(t_ret - t0)
                result.staged.add(t_staged - t0)
                result.durable.add(t_dur - t0)
        if on_end is not None:
            on_end()
    finally:
        if stager is not None:
            stager.close()
        stop_dcp_writer()
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
    return result


def dcp_save_once(state: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    init_gloo()
    dcp.save(state, checkpoint_id=path)


def dcp_load(state: Any, path: Path) -> None:
    """DCP's load: in place, into the tensors of ``state``."""
    import torch.distributed.checkpoint as dcp

    init_gloo()
    dcp.load(state, checkpoint_id=path)
