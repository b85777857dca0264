"""A snapshot every step (issue #40, item 5): what each way of capturing the state at every step adds to a step.

One process trains ``steps.Trainee`` (an MLP with AdamW, on the CPU) and captures its state after every optimizer
step, each way in turn, all set up once and kept for the whole run:

- ``none``: no capture (the plain step);
- ``memcpy``: one copy of every parameter and optimizer tensor into buffers of the same shapes, touched before
  (``torch._foreach_copy_``, the call ckptd's staging makes): the floor of any capture that keeps its own copy;
- ``ckptd_sync``: ``client.save_async(state, path, step=i, persist=False)`` after ``optimizer.step()``, sync
  staging (a new path each step; the daemon keeps the newest, ``--keep-snapshots 1``);
- ``ckptd_bg``: the same with ``Client(background_staging=True)``, ``future.wait_staged()`` before the next
  ``optimizer.step()`` (README's loop): the copy runs beside the next step's forward and backward;
- ``ckptd_niced``: ``ckptd_sync`` against a daemon of its own whose every thread runs at nice 19, a measurement
  (not an option of ckptd): whether the daemon's work (the snapshot's checksum) costs the step less when it only
  takes what the step leaves of the cores;
- ``dcp_stager``: ``dcp.async_save`` (THREAD) of ``get_state_dict(model, optimizer)`` with one ``DefaultStager``
  (async staging) reused, its staging awaited before the next ``optimizer.step()``, the previous save awaited
  before the next; written to ``/dev/shm`` (memory, as ckptd's snapshot is; DCP has no memory tier);
- ``torchckpt``: torch-checkpointing's ``CheckpointManager.save`` (async, its writer subprocess ``torch.save``-ing
  to ``/dev/shm``), ``optimizer.step()`` under ``manager.lock()``, the previous save awaited before the next;
- ``gemini``: lm-resiliency's ``InMemoryCheckpointManager.save(state, step)`` (``interval=1``, disk tier off; one
  rank, so no peer exchange; on the CPU its copy is a ``copy_`` per tensor in the call), where it is installed
  (``LMRES``; never a ckptd requirement).

The run is ``1 + repeat`` rounds (the first a warm-up, not recorded); in each round every mode trains ``STEPS``
steps right after ``PLAIN`` plain ones, the modes in an order rotated from round to round, and whatever a mode left
in flight is awaited (untimed) before the next plain steps. A step is timed from before its forward to after its
capture call; the first step of each mode's segment is left out (it waits for no previous capture). A round's
overhead of a mode is the median of its steps less the median of the plain steps right before them, so a change of
load on the machine meets both alike (the report takes the median over the rounds). CPU: this process's (all its
threads) plus the helper process's (ckptd's daemon, torch-checkpointing's writer), per step, over each segment and
its drain, the daemon's checksum threads apart; faults: minor page faults per step, of this process and of the
helper. On a loaded machine the steps' wall times spread by more than a capture costs; the CPU figures do not.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .cases import Case
from .limits import cpu_seconds
from .steps import Trainee

PLAIN = 4
"""Plain steps right before each mode's steps: its reference in that round."""
STEPS = 6
"""Steps per mode per round; the first of each segment is not recorded (it awaits no previous capture)."""
LMRES = Path(__file__).resolve().parent.parent / ".venv-lmres"
"""``pip install --no-deps --target .venv-lmres lm-resiliency==0.2.0`` (its requirements, torch and numpy, are in
``.venv``); put on ``sys.path`` for the ``gemini`` mode only."""
SHM = Path("/dev/shm")
LABELS = {
    "none": "no capture (plain step)",
    "memcpy": "one memcpy of the state into reused buffers (floor)",
    "ckptd_sync": "ckptd save_async(persist=False), sync staging",
    "ckptd_bg": "ckptd save_async(persist=False), background staging, wait_staged() before optimizer.step()",
    "ckptd_niced": "ckptd save_async(persist=False), sync staging, daemon at nice 19 (measurement only)",
    "dcp_stager": "DCP async_save THREAD + reused DefaultStager, to /dev/shm",
    "torchckpt": "torch-checkpointing CheckpointManager.save (async), to /dev/shm",
    "gemini": "lm-resiliency InMemoryCheckpointManager.save (GEMINI), one rank",
}
CKPTD = ("ckptd_sync", "ckptd_bg")
PEERS = ("dcp_stager", "torchckpt", "gemini")


def gemini_available() -> bool:
    """Whether lm-resiliency can be imported (from ``LMRES`` where it is there)."""
    if LMRES.is_dir() and str(LMRES) not in sys.path:
        sys.path.append(str(LMRES))
    return importlib.util.find_spec("lm_resiliency") is not None


def torchckpt_available() -> bool:
    return importlib.util.find_spec("torch_checkpointing") is not None


class Mode:
    """One way of capturing: ``capture(i)`` after step ``i``'s ``optimizer.step()``; ``guard()`` around the next
    ``optimizer.step()`` (until then the tensors must not change); ``drain()`` awaits what is in flight."""
    helper: int | None = None
    """A process whose CPU and faults count as this mode's (ckptd's daemon, a writer subprocess)."""
    def __init__(self, trainee: Trainee) -> None:
        self.t = trainee
    def state(self) -> dict:
        return {"model": self.t.model.state_dict(), "optimizer": self.t.optimizer.state_dict()}
    def capture(self, i: int) -> None:
        pass
    def guard(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
    def drain(self) -> None:
        pass
    def close(self) -> None:
        self.drain()


class Memcpy(Mode):
    def __init__(self, trainee: Trainee) -> None:
        super().__init__(trainee)
        self.src = _tensors(trainee)
        self.dst = [torch.empty_like(t) for t in self.src]
        torch._foreach_copy_(self.dst, self.src)  # touched: the floor copies into mapped pages
        self.copies: list[float] = []
    def capture(self, i: int) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            torch._foreach_copy_(self.dst, self.src)
        self.copies.append(time.perf_counter() - t0)


class Ckptd(Mode):
    def __init__(self, trainee: Trainee, daemon: Any, root: Path, *, background: bool) -> None:
        import ckptd
        super().__init__(trainee)
        self.client = ckptd.Client(run_dir=daemon.run_dir, spawn=False, background_staging=background)
        self.root, self.background, self.helper = root, background, daemon.pid
        self.pending: Any = None
        self.newest: Path | None = None
    def capture(self, i: int) -> None:
        self.newest = self.root / f"step-{i}"
        self.pending = self.client.save_async(self.state(), self.newest, step=i, persist=False)
    def guard(self) -> contextlib.AbstractContextManager:
        if self.background and self.pending is not None:
            self.pending.wait_staged()
        return contextlib.nullcontext()
    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
    def close(self) -> None:
        self.drain()
        if self.newest is not None:  # nothing for the daemon's stop to persist
            self.client.delete(self.newest)
        self.client.close()


class Dcp(Mode):
    def __init__(self, trainee: Trainee, root: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from .saves import init_gloo
        init_gloo()
        super().__init__(trainee)
        self.dcp, self.root = dcp, root
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))
        self.pending: Any = None
        self.paths: list[Path] = []
    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model, optim = get_state_dict(self.t.model, self.t.optimizer)
        return {"model": model, "optim": optim}
    def capture(self, i: int) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        self.drain()  # the previous save, as DCP asks
        self.paths.append(self.root / f"step-{i}")
        self.pending = self.dcp.async_save(self.state(), checkpoint_id=self.paths[-1], async_stager=self.stager,
                                           async_checkpointer_type=AsyncCheckpointerType.THREAD)
    def guard(self) -> contextlib.AbstractContextManager:
        if self.pending is not None:
            self.pending.staging_completion.result()
        return contextlib.nullcontext()
    def drain(self) -> None:
        if self.pending is not None:
            self.pending.upload_completion.result()
            self.pending = None
        while len(self.paths) > 1:  # the newest is kept, as a memory snapshot's is
            shutil.rmtree(self.paths.pop(0), ignore_errors=True)
    def close(self) -> None:
        self.drain()
        self.stager.close()


class TorchCkpt(Mode):
    def __init__(self, trainee: Trainee, root: Path) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        super().__init__(trainee)
        saver = AsyncCheckpointSaverConfig(process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600))
        self.manager = CheckpointManager(CheckpointManager.Config(
            save=saver, storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.root = root
        self.pending: Any = None
        self.paths: list[Path] = []
    def capture(self, i: int) -> None:
        self.drain()
        self.paths.append(self.root / f"step-{i}")
        self.pending = self.manager.save(str(self.paths[-1]), self.state())
        if self.helper is None:
            self.helper = self.manager._saver._checkpoint_process.process.processes[0].pid  # private names of 0.1.1
    def guard(self) -> contextlib.AbstractContextManager:
        return self.manager.lock()  # taken once its staging is done
    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        while len(self.paths) > 1:
            shutil.rmtree(self.paths.pop(0), ignore_errors=True)
    def close(self) -> None:
        self.drain()
        self.manager.close()


class Gemini(Mode):
    def __init__(self, trainee: Trainee, scratch: Path) -> None:
        from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig
        super().__init__(trainee)
        self.manager = InMemoryCheckpointManager(InMemoryCkptConfig(
            interval=1, disk_flush_interval=0, disk_folder=str(scratch), run_id=f"everystep{os.getpid()}",
            pin_memory=False))
    def capture(self, i: int) -> None:
        self.manager.save(self.state(), i)
    def guard(self) -> contextlib.AbstractContextManager:
        self.manager.maybe_wait()
        return contextlib.nullcontext()
    def close(self) -> None:
        self.manager.close()


def _tensors(t: Trainee) -> list[torch.Tensor]:
    return [*(p.detach() for p in t.model.parameters()),
            *(v for s in t.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]


def _faults(pid: int | None = None) -> int:
    """Minor page faults so far of this process (all its threads) or of ``pid`` (0 if it is gone)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def _checksum_cpu(pid: int | None) -> float:
    """CPU seconds so far of ``pid``'s threads named ``checksum_*`` (the daemon's CRC pool names its threads)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").glob("*") if pid else ():
        try:
            if (task / "comm").read_text().startswith("checksum"):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue  # the thread ended
    return total


@contextlib.contextmanager
def _modes(names: list[str], t: Trainee, scratch: Path) -> Iterator[dict[str, Mode]]:
    """Every mode of ``names`` set up (one daemon for ckptd's), closed after."""
    from .saves import BenchDaemon
    peers = SHM / f"ckbench-everystep-{os.getpid()}"
    peers.mkdir()
    out: dict[str, Mode] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, peers, ignore_errors=True)
        daemon = stack.enter_context(BenchDaemon(scratch, "--persist-on-exit", "never")) if set(names) & set(CKPTD) \
            else None
        niced = None
        if "ckptd_niced" in names:  # a daemon of its own, every thread at nice 19 (threads it starts inherit it)
            niced = stack.enter_context(BenchDaemon(scratch, "--persist-on-exit", "never"))
            for task in os.listdir(f"/proc/{niced.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(task), 19)
        for name in names:
            mode: Mode = {"none": lambda: Mode(t), "memcpy": lambda: Memcpy(t),
                          "ckptd_sync": lambda: Ckptd(t, daemon, scratch / "everystep-sync", background=False),
                          "ckptd_bg": lambda: Ckptd(t, daemon, scratch / "everystep-bg", background=True),
                          "ckptd_niced": lambda: Ckptd(t, niced, scratch / "everystep-niced", background=False),
                          "dcp_stager": lambda: Dcp(t, peers / "dcp"), "torchckpt": lambda: TorchCkpt(t, peers / "tc"),
                          "gemini": lambda: Gemini(t, scratch / "gemini")}[name]()
            stack.callback(mode.close)
            out[name] = mode
        yield out


def _segment(t: Trainee, mode: Mode, first: int, steps: int) -> tuple[list[float], dict[str, float]]:
    """``steps`` timed steps of ``mode`` numbered from ``first``, then its drain; each step's time, and: the median
    time a step spent in the mode's calls (``blocking``: its guard's wait and its capture, the first step left out),
    and per step the CPU seconds and minor faults of this process and of the mode's helper over the segment and its
    drain, and the CPU seconds of the helper's checksum threads (ckptd's daemon)."""
    helper = mode.helper
    cpu0, faults0 = cpu_seconds(), _faults()
    hcpu0, hfaults0 = (cpu_seconds(helper), _faults(helper)) if helper else (0.0, 0)
    crc0 = _checksum_cpu(helper)
    times, blocked = [], []
    for i in range(first, first + steps):
        t0 = time.perf_counter()
        t.optimizer.zero_grad(set_to_none=True)
        t.loss().backward()
        t1 = time.perf_counter()
        with mode.guard():
            t2 = time.perf_counter()
            t.optimizer.step()
        t3 = time.perf_counter()
        mode.capture(i)
        times.append(time.perf_counter() - t0)
        blocked.append(t2 - t1 + time.perf_counter() - t3)
    mode.drain()
    known = helper is not None  # torch-checkpointing's writer is known after its first save
    return times, {"blocking": statistics.median(blocked[1:]), "cpu": (cpu_seconds() - cpu0) / steps, "faults": (_faults() - faults0) / steps,
                   "helper_cpu": (cpu_seconds(helper) - hcpu0) / steps if known else 0.0,
                   "helper_crc_cpu": (_checksum_cpu(helper) - crc0) / steps if known else 0.0,
                   "helper_faults": (_faults(helper) - hfaults0) / steps if known else 0.0}


def every_step(case: Case, scratch: Path) -> dict:
    """The case: ``case.repeat`` recorded rounds after a warm-up one; in each, every mode's ``STEPS`` steps right
    after ``PLAIN`` plain ones. Per mode and round: ``<mode>_round`` and ``<mode>_plain``, the medians of its steps
    and of those plain steps (the report's overhead is the median of their differences: ``report.overhead``)."""
    names = ["memcpy", *CKPTD, "ckptd_niced", "dcp_stager", *(["torchckpt"] if torchckpt_available() else []),
             *(["gemini"] if gemini_available() else [])]
    names = [n for n in names if n in case.params.get("modes", names)]
    t = Trainee(case.size_gib)
    t.step()  # AdamW's state exists from here on
    reps: dict[str, list[float]] = {}
    load, i = [], 0
    with _modes(["none", *names], t, scratch) as modes:
        for rnd in range(1 + case.repeat):
            load.append(os.getloadavg()[0])
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                plain, quiet = _segment(t, modes["none"], i, PLAIN)
                times, figures = _segment(t, modes[name], i + PLAIN, STEPS)
                i += PLAIN + STEPS
                if not rnd:
                    continue
                reps.setdefault("none_step", []).extend(plain)
                reps.setdefault(f"{name}_step", []).extend(times[1:])
                reps.setdefault(f"{name}_round", []).append(statistics.median(times[1:]))
                reps.setdefault(f"{name}_plain", []).append(statistics.median(plain))
                for key, value in figures.items():
                    reps.setdefault(f"{name}_{key}", []).append(value)
                    reps.setdefault(f"none_{key}", []).append(quiet[key])
        if "memcpy" in modes:
            reps["copy"] = modes["memcpy"].copies[STEPS:]  # type: ignore[attr-defined]
    return {"nbytes": t.nbytes, "modes": {n: LABELS[n] for n in ["none", *names]}, "steps": [PLAIN, STEPS],
            "load": load, "reps": reps}
