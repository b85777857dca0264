"""Saving: ckptd through a daemon of the case's own, and the peers a trainer would use instead.

One warm-up save, then ``repeat`` timed ones back to back, each to a new
path: *blocking* (the call returned), *staged* (the tensors may change),
*durable* (``torch.save`` + fsync returned, DCP's future, ckptd's future).
The daemon's own accepted-to-committed time comes from ``ckptd status
--json`` after each save. DCP fsyncs its files (``sync_files=True``), not
the directory, and writes under the final names.
"""

from __future__ import annotations

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

import torch
import torch.distributed as dist

from .probe import Sampler, cpu_seconds, peak_rss, reset_peak_rss

START_TIMEOUT_S = 60.0


class BenchDaemon:
    """``ckptd start --foreground`` on a private run directory, for one case (a context manager)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # Short and under /tmp: a socket path must fit in 107 bytes.
        self.run_dir = Path(tempfile.mkdtemp(prefix="ckbench-", dir="/tmp"))
        self.proc: subprocess.Popen | None = None
        self.pid = 0

    def _cmd(self, command: str, *args: str) -> list[str]:
        return [sys.executable, "-m", "ckptd", command, "--run-dir", str(self.run_dir), *args]

    def status(self) -> dict:
        """The daemon's ``ckptd status --json`` snapshot."""
        out = subprocess.run(self._cmd("status", "--json"), capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if out.returncode:
            raise RuntimeError(f"ckptd status failed: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def __enter__(self) -> "BenchDaemon":
        self.proc = subprocess.Popen(self._cmd("start", "--foreground", "--quiet", "--root", str(self.root)),
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.pid:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the ckptd daemon did not start (exit code {self.proc.returncode})")
            if (self.run_dir / "ckptd.sock").exists():
                try:
                    self.pid = self.status()["daemon"]["pid"]
                except RuntimeError:
                    pass
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        """SIGTERM (the daemon drains, then exits); SIGKILL only if it hangs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def measure_saves(save: Callable[[int], dict], repeat: int, rss_built: int,
                  writer: Callable[[], int | None] = lambda: None) -> dict:
    """One warm-up ``save(0)``, then ``repeat`` timed ones; memory and CPU of the trainer and of the writer.

    ``writer`` names the writing process once the warm-up has run (DCP
    starts its checkpoint process on the first save). The trainer's extra
    memory is its peak RSS during the timed saves over its RSS with the
    state built: for ckptd, the slot.
    """
    first = slowest(save(0))
    writer_pid = writer()
    reset_peak_rss()
    cpu0, wcpu0 = cpu_seconds(), cpu_seconds(writer_pid) if writer_pid else 0.0
    reps: dict[str, list] = defaultdict(list)
    with Sampler({"writer": [writer_pid] if writer_pid else []}) as sampler:
        for i in range(1, 1 + repeat):
            for key, value in slowest(save(i)).items():
                reps[key].append(value)
    out = {"first": first, "reps": dict(reps), "trainer_extra": peak_rss() - rss_built,
           "trainer_cpu": (cpu_seconds() - cpu0) / repeat}
    if writer_pid:
        out["writer"] = {**sampler.peaks["writer"], "cpu": (cpu_seconds(writer_pid) - wcpu0) / repeat}
    return out


def _rotate(scratch: Path, prefix: str) -> Callable[[int], Path]:
    """A new path per save; the one before is removed (untimed, after its save was measured); ranks start at once."""
    def path(i: int) -> Path:
        shutil.rmtree(scratch / f"{prefix}-{i - 1}", ignore_errors=True)
        Path(scratch / f"{prefix}-{i - 1}.pt").unlink(missing_ok=True)
        if dist.is_initialized():
            dist.barrier()
        return scratch / f"{prefix}-{i}"
    return path


def ckptd_saves(state: Any, scratch: Path, repeat: int, rss_built: int, daemon: BenchDaemon | None = None,
                **options: Any) -> dict:
    """``ckptd.Client.save_async`` in steady state (slot made and mapped by the warm-up); ``options`` go to Client.

    Without ``daemon``, through one of its own; ranks (``torch.distributed``) share the caller's.
    """
    import ckptd

    if daemon is None:
        with BenchDaemon(scratch) as daemon:
            return ckptd_saves(state, scratch, repeat, rss_built, daemon, **options)
    path = _rotate(scratch, "ckptd")
    client = ckptd.Client(run_dir=daemon.run_dir, spawn=False, max_inflight=1, **options)

    def save(i: int) -> dict:
        target = path(i)
        t0 = time.perf_counter()
        fut = client.save_async(state, target, step=i)
        t1 = time.perf_counter()
        fut.wait_staged()
        t2 = time.perf_counter()
        saved = fut.result()
        t3 = time.perf_counter()
        last = daemon.status()["completed"]["last"]
        return {"blocking": t1 - t0, "staged": t2 - t0, "durable": t3 - t0, "daemon_s": last["seconds"],
                "bytes_written": saved.bytes_written}

    try:
        return measure_saves(save, repeat, rss_built, writer=lambda: daemon.pid)
    finally:
        client.close()
        path(repeat + 1)


def torch_saves(state: Any, scratch: Path, repeat: int, rss_built: int) -> dict:
    """``torch.save`` + flush + fsync: the caller is blocked for all of it."""
    path = _rotate(scratch, "torch")

    def save(i: int) -> dict:
        target = path(i).with_suffix(".pt")
        t0 = time.perf_counter()
        with open(target, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        t = time.perf_counter() - t0
        return {"blocking": t, "staged": t, "durable": t, "bytes_written": target.stat().st_size}

    try:
        return measure_saves(save, repeat, rss_built)
    finally:
        path(repeat + 1)


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


def slowest(values: Any) -> Any:
    """A dict (or list) of figures, each the highest over the ranks: a sharded save is as fast as its slowest rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    keys = list(values) if isinstance(values, dict) else range(len(values))
    highest = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    return dict(zip(keys, highest.tolist())) if isinstance(values, dict) else highest.tolist()


def _dcp_process_pid() -> int | None:
    """Pid of DCP's checkpoint process (PROCESS checkpointer), if one runs (a private torch name)."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    return proc._save_process.pid if proc is not None else None


def dcp_saves(state: Any, scratch: Path, repeat: int, rss_built: int, *, mode: str) -> dict:
    """DCP ``save`` or ``async_save`` with the THREAD or PROCESS checkpointer (``process_stager``: a reused stager)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    init_gloo()
    stager = None
    if mode == "process_stager":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                              use_non_blocking_copy=cuda))
    kind = AsyncCheckpointerType.PROCESS if mode.startswith("process") else AsyncCheckpointerType.THREAD
    path = _rotate(scratch, f"dcp-{mode}")

    def save(i: int) -> dict:
        target = path(i)
        t0 = time.perf_counter()
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
        t3 = time.perf_counter()
        return {"blocking": t1 - t0, "staged": t2 - t0, "durable": t3 - t0,
                "bytes_written": sum(p.stat().st_size for p in target.rglob("*") if p.is_file())}

    try:
        return measure_saves(save, repeat, rss_built, writer=_dcp_process_pid if mode.startswith("process")
                             else lambda: None)
    finally:
        if stager is not None:
            stager.close()
        path(repeat + 1)
