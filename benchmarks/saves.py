"""Saving: ckptd through a daemon of the case's own, and the peers a trainer would use instead.

The daemon's own accepted-to-committed time comes from ``ckptd status --json`` after each save. DCP fsyncs its files
(``sync_files=True``), not the directory, and writes under the final names.
"""
from __future__ import annotations
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable
import ckptd
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from .limits import Sampler, cpu_seconds, peak_rss, reset_peak_rss

START_TIMEOUT_S = 60.0

class BenchDaemon:
    """A daemon of the case's own (``ckptd start``, ``ckptd stop``: it drains) on a private run directory;
    ``options``: more ``ckptd start`` options."""
    def __init__(self, root: Path, *options: str) -> None:
        self.root, self.options = root, options
        self.run_dir = Path(tempfile.mkdtemp(prefix="ckbench-", dir="/tmp"))  # a socket path fits in 107 bytes
        self.pid = 0
    def _ckptd(self, command: str, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "ckptd", command, "--run-dir", str(self.run_dir), *args],
                             capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if out.returncode:
            raise RuntimeError(f"ckptd {command} failed: {out.stderr.strip()}")
        return out.stdout
    def status(self) -> dict:
        """The daemon's ``ckptd status --json`` snapshot."""
        return json.loads(self._ckptd("status", "--json"))
    def __enter__(self) -> "BenchDaemon":
        self._ckptd("start", "--root", str(self.root), *self.options)  # returns once the daemon answers
        self.pid = self.status()["daemon"]["pid"]
        return self
    def __exit__(self, *exc: object) -> None:
        try:
            self._ckptd("stop", "--timeout", str(START_TIMEOUT_S))
        except (RuntimeError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # it hangs
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)

def measure_saves(save: Callable[[Path, int], dict], prefix: Path, repeat: int, rss_built: int,
                  writer: Callable[[], int | None] = lambda: None) -> dict:
    """One warm-up ``save(target, 0)``, then ``repeat`` timed ones, each to a new path (the last one removed).
    ``save`` returns the ``perf_counter()`` times its call returned (``blocking``), the tensors could change
    (``staged``), the save was durable (``durable``), and other figures; ranks start each save at once and report
    their slowest. ``writer``: the writing process, after the warm-up (DCP starts its own then). Trainer extra memory:
    peak RSS over the RSS with the state built (for ckptd, the slot)."""
    def remove(i: int) -> None:
        shutil.rmtree(f"{prefix}-{i}", ignore_errors=True)
        Path(f"{prefix}-{i}.pt").unlink(missing_ok=True)
    def one(i: int) -> dict:
        remove(i - 1)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        out = save(Path(f"{prefix}-{i}"), i)
        return dict(zip(out, across_ranks([v - t0 if k in ("blocking", "staged", "durable") else v
                                           for k, v in out.items()])))
    try:
        first, writer_pid = one(0), writer()
        reset_peak_rss()
        cpu0, wcpu0 = cpu_seconds(), cpu_seconds(writer_pid) if writer_pid else 0.0
        reps: dict[str, list] = defaultdict(list)
        with Sampler({"writer": [writer_pid] if writer_pid else []}) as sampler:
            for i in range(1, 1 + repeat):
                for key, value in one(i).items():
                    reps[key].append(value)
    finally:
        remove(repeat)
    out = {"first": first, "reps": dict(reps), "trainer_extra": peak_rss() - rss_built,
           "trainer_cpu": (cpu_seconds() - cpu0) / repeat}
    if writer_pid:
        out["writer"] = {**sampler.peaks["writer"], "cpu": (cpu_seconds(writer_pid) - wcpu0) / repeat}
    return out

def ckptd_saves(state: Any, scratch: Path, repeat: int, rss_built: int, daemon: BenchDaemon | None = None,
                **options: Any) -> dict:
    """``Client.save_async`` in steady state (the warm-up made the slot); ranks share the caller's ``daemon``."""
    if daemon is None:
        with BenchDaemon(scratch) as daemon:
            return ckptd_saves(state, scratch, repeat, rss_built, daemon, **options)
    def save(target: Path, i: int) -> dict:
        fut = client.save_async(state, target, step=i)
        t1 = time.perf_counter()
        fut.wait_staged()
        t2 = time.perf_counter()
        saved = fut.result()
        return {"blocking": t1, "staged": t2, "durable": time.perf_counter(), "bytes_written": saved.bytes_written,
                "daemon_s": daemon.status()["completed"]["last"]["seconds"]}
    with ckptd.Client(run_dir=daemon.run_dir, spawn=False, max_inflight=1, **options) as client:
        return measure_saves(save, scratch / "ckptd", repeat, rss_built, writer=lambda: daemon.pid)

def ckptd_dcp_saves(state: Any, scratch: Path, repeat: int, rss_built: int, daemon: BenchDaemon) -> dict:
    """``dcp.async_save`` (THREAD) through ``ckptd.dcp.StorageWriter(stage_in_slot=True)``: it returns once the
    rank's planned items are in its slot (blocking = staged); DCP plans on a gloo group of its own, as a training
    loop must give it (its collectives run on a thread beside the training's)."""
    from ckptd.dcp import StorageWriter

    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    def save(target: Path, i: int) -> dict:
        writer = StorageWriter(target, client=client, step=i, stage_in_slot=True)
        upload = dcp.async_save(state, storage_writer=writer, process_group=group)
        t1 = time.perf_counter()
        upload.result()
        return {"blocking": t1, "staged": t1, "durable": time.perf_counter(),
                "bytes_written": sum(p.stat().st_size for p in target.rglob("*") if p.is_file()),
                "daemon_s": daemon.status()["completed"]["last"]["seconds"]}
    with ckptd.Client(run_dir=daemon.run_dir, spawn=False, max_inflight=1) as client:
        return measure_saves(save, scratch / "ckptd-dcp", repeat, rss_built, writer=lambda: daemon.pid)

def torchckpt_saves(state: Any, scratch: Path, repeat: int, rss_built: int, *, fsync: bool) -> dict:
    """torch-checkpointing 0.1.1's ``CheckpointManager`` with its default async saver: ``save`` starts staging on a
    thread (into shared memory) and returns; its writer subprocess (one per rank, spawned when the manager is built;
    the first save waits for it) ``torch.save``s each top-level item to ``<item>_<rank>.pt`` under ``tmp_<name>``,
    meets the other ranks on the process group's store, and rank 0 renames the directory. Staged: ``manager.lock()``
    (its guard for an optimizer step) can be taken. Buffered writes (``use_direct_io=False``): its O_DIRECT default
    fails on this ext4 (EINVAL: torch.save's records are unaligned) and leaves ``tmp_<name>`` behind. It never
    fsyncs: ``fsync=False`` is durable as it reports it (written, not on disk); ``fsync=True`` adds the fsyncs a
    user needs, as its own write hooks (``fsync_hooks``), inside the save's future. DTensors (FSDP2) are saved as
    the rank's shards with the default ``ItemSpec``: its resharding save (``ItemSpec(resharder=DefaultResharder())``)
    gathers its metadata in CUDA tensors and fails without CUDA. A test-only requirement (requirements-dev.txt),
    imported here alone: where it is absent ``cases.missing_peers`` leaves these cases out."""
    import functools
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    from . import fsync_hooks

    rank = dist.get_rank() if dist.is_initialized() else 0
    hooks = dict(pre_finalize_callback=functools.partial(fsync_hooks.fsync_rank_files, rank),
                 finalize_callback=functools.partial(fsync_hooks.fsync_published, rank)) if fsync else {}
    # Its writer subprocess must answer within 30 s by default; on two busy cores (the smoke run inside the test
    # suite) importing torch there can take longer, and the case failed. The limit is raised; the time is measured.
    saver = AsyncCheckpointSaverConfig(process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600))
    manager = CheckpointManager(CheckpointManager.Config(
        save=saver, storage_config=LocalFileSystemStorageConfig(use_direct_io=False), **hooks))
    def save(target: Path, i: int) -> dict:
        written = manager.save(str(target), state)
        t1 = time.perf_counter()
        with manager.lock():  # taken once staging is done: the tensors may change
            t2 = time.perf_counter()
        written.result()
        t3 = time.perf_counter()
        # Rank 0 renames after the barrier, so another rank's future may resolve before the directory has its name:
        # rank 0 counts the checkpoint's bytes (the largest over the ranks is taken).
        whole = sum(p.stat().st_size for p in target.rglob("*") if p.is_file()) if rank == 0 else 0
        return {"blocking": t1, "staged": t2, "durable": t3, "bytes_written": whole}
    def writer() -> int:
        return manager._saver._checkpoint_process.process.processes[0].pid  # private names of 0.1.1
    try:
        return measure_saves(save, scratch / ("torchckpt-fsync" if fsync else "torchckpt"), repeat, rss_built,
                             writer=writer)
    finally:
        manager.close()

def torch_save_synced(state: Any, path: Path) -> int:
    """``torch.save`` + flush + fsync; the bytes written."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()

def torch_saves(state: Any, scratch: Path, repeat: int, rss_built: int) -> dict:
    """``torch.save`` + flush + fsync: the caller is blocked for all of it."""
    def save(target: Path, i: int) -> dict:
        written = torch_save_synced(state, target.with_suffix(".pt"))
        t = time.perf_counter()
        return {"blocking": t, "staged": t, "durable": t, "bytes_written": written}
    return measure_saves(save, scratch / "torch", repeat, rss_built)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def init_gloo(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """A gloo group on 127.0.0.1 (DCP needs one, even for one process); DCP's checkpoint processes meet there too."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank,
                                world_size=world_size)

def across_ranks(values: list[float], op: Any = dist.ReduceOp.MAX) -> list[float]:
    """Each value reduced over the ranks (float64); by default the highest: a sharded save is its slowest rank's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    out = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(out, op=op)
    return out.tolist()

def _dcp_process_pid() -> int | None:
    """Pid of DCP's checkpoint process (PROCESS checkpointer), if one runs (a private torch name)."""
    proc = getattr(_async_process_executor, "_CHECKPOINT_PROCESS", None)
    return proc._save_process.pid if proc is not None else None

def dcp_saves(state: Any, scratch: Path, repeat: int, rss_built: int, *, mode: str) -> dict:
    """DCP ``save`` or ``async_save`` with the THREAD or PROCESS checkpointer (``*_stager``: one ``DefaultStager``
    reused by every save, its staging copies kept). PROCESS stages into shared memory for its checkpoint process;
    THREAD's writer is a thread of this process, so its stager keeps the copies in private memory."""
    init_gloo()
    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=mode.startswith("process"),
                                          use_async_staging=True, use_non_blocking_copy=cuda)
                           ) if mode.endswith("_stager") else None
    kind = AsyncCheckpointerType.PROCESS if mode.startswith("process") else AsyncCheckpointerType.THREAD
    def save(target: Path, i: int) -> dict:
        if mode == "save":
            dcp.save(state, checkpoint_id=target)
            t1 = t2 = time.perf_counter()
        else:
            response = dcp.async_save(state, checkpoint_id=target, async_checkpointer_type=kind, async_stager=stager)
            t1 = time.perf_counter()
            if isinstance(response, AsyncSaveResponse):
                response.staging_completion.result()
                t2 = time.perf_counter()
                response.upload_completion.result()
            else:  # the default stager copies inside the call
                t2 = t1
                response.result()
        return {"blocking": t1, "staged": t2, "durable": time.perf_counter(),
                "bytes_written": sum(p.stat().st_size for p in target.rglob("*") if p.is_file())}
    try:
        return measure_saves(save, scratch / f"dcp-{mode}", repeat, rss_built,
                             writer=_dcp_process_pid if mode.startswith("process") else lambda: None)
    finally:
        if stager is not None:
            stager.close()
