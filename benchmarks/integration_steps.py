"""The step-time cases (``steps``): each integration's snapshot, persisted save and own async save in its own loop.

Modes, each one run of ``steps.train`` (or of the framework's own loop, timed by a callback) on a fresh trainee:
``none`` (never saves), ``snapshot`` (ckptd's memory tier through the integration), ``persisted`` (the same
integration writing to disk through ckptd) and ``own`` (the framework's own save, as shipped):

- dcp: ``dcp.async_save`` (THREAD) with ``ckptd.dcp.StorageWriter(path, persist=False)``, with
  ``StorageWriter(path)``, and with DCP's ``FileSystemWriter`` (``checkpoint_id=path``); the previous save's future
  is waited on before the next, as DCP asks.
- lightning: ``Trainer(plugins=[CkptdCheckpointIO()])`` with ``ModelCheckpoint(save_last=True)`` and
  ``CkptdSnapshots(every_n_train_steps=N)``; with ``ModelCheckpoint(every_n_train_steps=N)``; and with Lightning's
  ``AsyncCheckpointIO`` around ``TorchCheckpointIO`` (a clone on the caller, ``torch.save`` on a thread, no fsync).
- fabric: ``with io.in_memory(): fabric.save(...)``; ``fabric.save`` through ``CkptdCheckpointIO``; Fabric's default
  (``torch.save`` in the call, no fsync).
- torchtitan (``torchtitan_steps``, in ``.venv-torchtitan``): ckptd's ``CheckpointManager`` with ``memory_interval``,
  with ``interval``, and torchtitan's own manager with ``interval``, all ``async_mode="async"``.
"""
from __future__ import annotations
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
import torch
from .cases import TT_PY, Case
from .saves import BenchDaemon, init_gloo
from .steps import MODES, QUIET, Trainee, record, step_times, train


def dcp_steps(scratch: Path, size_gib: float, every: int, saves: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from ckptd.dcp import StorageWriter
    init_gloo()
    reps: dict[str, list[float]] = {}
    with BenchDaemon(scratch) as daemon:
        for mode in MODES:
            t = Trainee(size_gib)
            root = scratch / f"dcp-{mode}"
            def save(i: int, mode: str = mode, t: Trainee = t, root: Path = root) -> Any:
                model, optim = get_state_dict(t.model, t.optimizer)
                state = {"model": model, "optim": optim}
                if mode == "own":
                    return dcp.async_save(state, checkpoint_id=root / f"step-{i}")
                writer = StorageWriter(root / f"step-{i}", step=i, run_dir=daemon.run_dir,
                                       persist=mode == "persisted")
                return dcp.async_save(state, storage_writer=writer)
            record(reps, mode, train(t.step, None if mode in QUIET else save, every=every, saves=saves,
                                     wait=lambda fut: fut.result()))
        nbytes = t.nbytes
    return {"nbytes": nbytes, "every": every, "reps": reps}

def _module(t: Trainee) -> Any:
    import lightning.pytorch as pl
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = t.model
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return t.loss(self.net)
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return t.optimizer
    return Module()

def lightning_steps(scratch: Path, size_gib: float, every: int, saves: int) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from ckptd.integrations.lightning import CkptdCheckpointIO, CkptdSnapshots

    class Clock(pl.Callback):
        """The start of each training step (the time between two is a whole step, its checkpoint callbacks in it)."""
        def __init__(self) -> None:
            self.starts: list[float] = []
        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())
    reps: dict[str, list[float]] = {}
    steps = every * (1 + saves) + 1  # one more step: the last timed one ends where it starts
    with BenchDaemon(scratch) as daemon:
        for mode in MODES:
            t, clock, root = Trainee(size_gib), Clock(), scratch / f"lightning-{mode}"
            callbacks: list[Any] = [clock]
            plugins: list[Any] = []
            if mode == "snapshot":  # persists far apart (never in the timed steps): snapshots between them
                callbacks += [ModelCheckpoint(dirpath=root, every_n_train_steps=10 * steps, save_last=True),
                              CkptdSnapshots(every_n_train_steps=every)]
            elif mode not in QUIET:
                callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1))
            if mode in ("snapshot", "persisted"):
                plugins.append(CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False))
            elif mode == "own":
                plugins.append(AsyncCheckpointIO(TorchCheckpointIO()))
            trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, plugins=plugins,
                                 enable_checkpointing=mode not in QUIET, logger=False, enable_progress_bar=False,
                                 enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root)
            data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(steps, 1)), batch_size=1)
            trainer.fit(_module(t), data)
            between = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
            record(reps, mode, step_times(between, every=every, saves=saves, saving=mode not in QUIET))
    return {"nbytes": t.nbytes, "every": every, "reps": reps}

def fabric_steps(scratch: Path, size_gib: float, every: int, saves: int) -> dict:
    from lightning.fabric import Fabric
    from ckptd.integrations.fabric import CkptdCheckpointIO
    reps: dict[str, list[float]] = {}
    with BenchDaemon(scratch) as daemon:
        for mode in MODES:
            t, root = Trainee(size_gib), scratch / f"fabric-{mode}"
            io = CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False) if mode in ("snapshot", "persisted") else None
            fabric = Fabric(accelerator="cpu", devices=1, plugins=[io] if io else None)
            t.model, t.optimizer = fabric.setup(t.model, t.optimizer)
            def step(t: Trainee = t, fabric: Any = fabric) -> None:
                t.optimizer.zero_grad(set_to_none=True)
                fabric.backward(t.loss())
                t.optimizer.step()
            def save(i: int, t: Trainee = t, fabric: Any = fabric, io: Any = io, mode: str = mode,
                     root: Path = root) -> None:
                state = {"model": t.model, "optimizer": t.optimizer, "global_step": i}
                if mode == "snapshot":
                    with io.in_memory():
                        fabric.save(root / f"step-{i}", state)
                else:
                    fabric.save(root / f"step-{i}{'' if io else '.pt'}", state)
            try:
                record(reps, mode, train(step, None if mode in QUIET else save, every=every, saves=saves))
            finally:
                if io is not None:
                    io.teardown()  # every save committed before the daemon stops
    return {"nbytes": t.nbytes, "every": every, "reps": reps}

def torchtitan_steps(scratch: Path, size_gib: float, every: int, saves: int) -> dict:
    """``torchtitan_steps`` in ``.venv-torchtitan`` (torchtitan is not in ``.venv``), against a daemon of ours."""
    with BenchDaemon(scratch) as daemon:
        env = {**os.environ, "CKPTD_RUN_DIR": str(daemon.run_dir)}
        out = subprocess.run([str(TT_PY), "-m", "benchmarks.torchtitan_steps", str(scratch), str(size_gib),
                              str(every), str(saves)], cwd=TT_PY.parent.parent.parent, env=env, capture_output=True,
                             text=True, timeout=900)
    sys.stderr.write(out.stderr)  # into the case's log
    if out.returncode:
        raise RuntimeError(f"benchmarks.torchtitan_steps failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])

RUNS = {"dcp": dcp_steps, "lightning": lightning_steps, "fabric": fabric_steps, "torchtitan": torchtitan_steps}

def steps_case(case: Case, scratch: Path) -> dict:
    """The case's integration, ``case.repeat`` saves after the warm-up one, every ``params["every"]`` steps."""
    return RUNS[case.params["integration"]](scratch, case.size_gib, case.params["every"], case.repeat)
