"""Ranks (gloo, CPU) that train like torchtitan's ``Trainer`` with a checkpoint manager, for tests/torchtitan/.

The model, optimizer and LR-scheduler containers, dataloader and train state
are ``examples/torchtitan_train.py``'s, so the tests check the example's set-up
too. Each rank writes what it saw as ``out/<name>-<rank>.json`` (``run_rank``).
"""

from __future__ import annotations

import json
import itertools
import os
import signal
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import DATALOADER
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from ckptd.protocol.names import INDEX_NAME
from helpers import REPO
from sharded_ranks import full, run_rank

sys.path.insert(0, str(REPO / "examples"))
import torchtitan_train as example  # noqa: E402

SAVED = 4
"""The newest checkpoint the first run commits (every 2 steps) before rank 1 dies."""


def config(manager: type, folder: str, run_dir: str, **overrides: Any) -> Any:
    """``manager.Config`` for the tests: every 2 steps, the whole state at the last step too."""
    fields = dict(enable=True, folder=folder, interval=2, keep_latest_k=2, initial_load_model_only=False,
                  last_save_model_only=False)
    if "run_dir" in manager.Config.__dataclass_fields__:
        fields.update(run_dir=run_dir, commit_timeout=120.0)
    return manager.Config(**(fields | overrides))


def snapshot(run: Any) -> dict[str, Any]:
    """Everything a checkpoint restores, gathered: full tensors of the model and optimizer (a collective)."""
    return {"model": full(run.model.state_dict()), "optimizer": full(run.optimizers.state_dict()),
            "lr_scheduler": run.lr_schedulers.state_dict(), "dataloader": run.dataloader.state_dict(),
            "train_state": run.state.state_dict()}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def train(run: Any, steps: int) -> list[dict]:
    """The Trainer's loop up to ``steps``; what each save left behind, as torchtitan's async modes expect."""
    saves, batches = [], iter(run.dataloader)
    while run.state.step < steps:
        run.step(batches)
        if run.manager.save(run.state.step):
            path = Path(run.manager.folder) / f"step-{run.state.step}"
            saves.append({"step": run.state.step, "committed_on_return": (path / INDEX_NAME).exists(),
                          "save_future": run.manager.save_future is not None,
                          "staging_future": run.manager.staging_future is not None})
    return saves


def train_until_killed(rank: int, world: int, init: str, run_dir: str, folder: str, mode: str, out: str) -> None:
    """Train to step ``SAVED`` with ckptd's manager, then rank 1 kills itself halfway through the next step.

    Rank 0 saves the gathered state as the reference; every rank logs its
    saves (``train-<rank>.json``); rank 0 then waits for rank 1 in a
    collective until the test kills it too.
    """
    from ckptd.integrations.torchtitan import CheckpointManager

    _train_then_die(rank, world, init, config(CheckpointManager, folder, run_dir, async_mode=mode), SAVED, out)


def _train_then_die(rank: int, world: int, init: str, manager_config: Any, until: int, out: str) -> None:
    """Train to step ``until`` with ``manager_config`` (its last save awaited: what the resume must find), save the
    gathered state as the reference (rank 0) and each rank's log, then rank 1 kills itself halfway through the next
    step while rank 0 waits for it in a collective."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    run = example.Run.build(manager_config, steps=100)
    loaded = run.manager.load()
    saves = train(run, until)
    run.manager.maybe_wait_for_saving()
    reference = snapshot(run)
    if rank == 0:
        torch.save(reference, Path(out) / "reference.pt")
    Path(out, f"train-{rank}.json").write_text(json.dumps({"loaded": loaded, "saves": saves}))
    dist.barrier()
    run.forward_backward(next(iter(run.dataloader)))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # waits for a peer that is gone


def managers() -> dict[str, type]:
    """The checkpoint managers by name: torchtitan's own (DCP) and ckptd's."""
    from torchtitan.components.checkpointer import CheckpointManager as OwnManager

    from ckptd.integrations.torchtitan import CheckpointManager

    return {"torchtitan": OwnManager, "ckptd": CheckpointManager}


def train_to_saved(rank: int, world: int, init: str, run_dir: str, folder: str, manager: str, out: str) -> None:
    """Train to step ``SAVED`` with the ``manager`` named (``managers``), saving synchronously; rank 0 saves the
    gathered state as the reference."""

    def body() -> dict:
        run = example.Run.build(config(managers()[manager], folder, run_dir), steps=100)
        saves = train(run, SAVED)
        run.manager.maybe_wait_for_saving()
        reference = snapshot(run)
        run.manager.close()
        if rank == 0:
            torch.save(reference, Path(out) / "reference.pt")
        return {"saves": saves}

    run_rank(rank, world, init, out, "train", body)


def resume(rank: int, world: int, init: str, run_dir: str, folder: str, mode: str, out: str) -> None:
    """Resume with ckptd's manager on ``world`` ranks, compare with the reference, train on and save."""
    from ckptd.integrations.torchtitan import CheckpointManager

    def body() -> dict:
        run = example.Run.build(config(CheckpointManager, folder, run_dir, async_mode=mode), steps=SAVED + 2)
        loaded = run.manager.load()
        restored = snapshot(run)
        reference = torch.load(Path(out) / "reference.pt")
        differ = sorted(k for k in reference if not same(restored[k], reference[k]))
        log = {"loaded": loaded, "step": run.state.step, "differ": differ,
               "purge_thread": run.manager.purge_thread is not None}
        if loaded and not differ:  # else training on would save over the checkpoints this run should resume
            log["saves"] = train(run, SAVED + 2)
        run.manager.close()
        return log

    run_rank(rank, world, init, out, "resume", body)


def switch_back(rank: int, world: int, init: str, run_dir: str, folder: str, out: str) -> None:
    """torchtitan's own manager resumes in ``folder`` after ckptd's saved there and trains to ``SAVED + 2``;
    ckptd's manager then tries to resume (the newest step) and to load step ``SAVED + 2`` by number."""
    own_manager, manager = managers()["torchtitan"], managers()["ckptd"]

    def body() -> dict:
        own = example.Run.build(config(own_manager, folder, run_dir), steps=SAVED + 2)
        own.manager.load()
        log: dict[str, Any] = {"own_resumed_at": own.state.step}
        train(own, SAVED + 2)
        own.manager.close()
        for name, step in (("resume", -1), ("load_step", SAVED + 2)):
            run = example.Run.build(config(manager, folder, run_dir), steps=SAVED + 4)
            try:
                run.manager.load(step)
            except ValueError as exc:
                log[name] = str(exc)
            log[f"{name}_step"] = run.state.step
            run.manager.close()
        return log

    run_rank(rank, world, init, out, "back", body)


def carry_over(rank: int, world: int, init: str, run_dir: str, folder: str, new_folder: str, out: str) -> None:
    """Back to torchtitan's own manager in ``new_folder``, as docs/integrations.md says: ``dcp.load`` with
    ``ckptd.dcp.StorageReader`` reads ckptd's step ``SAVED`` into the trainer's state, ``dcp.save`` writes it into
    ``new_folder``; torchtitan's own manager then resumes from it. Logs what differs from the reference."""
    import torch.distributed.checkpoint as dcp

    from ckptd.dcp import StorageReader

    own_manager = managers()["torchtitan"]

    def body() -> dict:
        run = example.Run.build(config(own_manager, new_folder, run_dir), steps=SAVED + 2)
        state = {k: v for k, v in run.manager.states.items() if k != "model"} | run.model.state_dict()
        dcp.load(state, storage_reader=StorageReader(f"{folder}/step-{SAVED}"))
        dcp.save(state, checkpoint_id=f"{new_folder}/step-{SAVED}")
        run.manager.close()
        again = example.Run.build(config(own_manager, new_folder, run_dir), steps=SAVED + 2)
        loaded = again.manager.load()
        reference = torch.load(Path(out) / "reference.pt")
        restored = snapshot(again)
        again.manager.close()
        return {"loaded": loaded, "step": again.state.step,
                "differ": sorted(k for k in reference if not same(restored[k], reference[k]))}

    run_rank(rank, world, init, out, "carry", body)


def resume_after_model_only_last_step(rank: int, world: int, init: str, run_dir: str, folder: str, out: str) -> None:
    """Train to ``SAVED`` with torchtitan's default last step (the model only), then try to resume from it."""
    from ckptd.integrations.torchtitan import CheckpointManager

    def body() -> dict:
        cfg = config(CheckpointManager, folder, run_dir, last_save_model_only=True)
        run = example.Run.build(cfg, steps=SAVED)
        batches = iter(run.dataloader)
        while run.state.step < SAVED:
            run.step(batches)
            run.manager.save(run.state.step, last_step=run.state.step == SAVED)
        run.manager.close()
        again = example.Run.build(cfg, steps=SAVED + 2)
        try:
            again.manager.load()
        except ValueError as exc:
            return {"error": str(exc), "step": again.state.step}
        return {"step": again.state.step}

    run_rank(rank, world, init, out, "model-only", body)


class HFKeys(BaseStateDictAdapter):
    """The example model's Hugging Face names: ``model.`` before each key, all in one file."""

    def __init__(self) -> None:
        self.fqn_to_index_mapping, self.hf_assets_path = None, None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> HuggingFaceStorageReader:
        return HuggingFaceStorageReader(path)


def export_last_step_in_hf(rank: int, world: int, init: str, run_dir: str, folder: str, out: str) -> None:
    """Train to step ``SAVED`` with ``last_save_in_hf`` (rank 0 saves the gathered model as the reference), then
    resume."""
    from ckptd.integrations.torchtitan import CheckpointManager

    def body() -> dict:
        cfg = config(CheckpointManager, folder, run_dir, last_save_model_only=True, last_save_in_hf=True,
                     export_dtype="bfloat16")
        run = example.Run.build(cfg, steps=SAVED, sd_adapter=HFKeys())
        batches = iter(run.dataloader)
        while run.state.step < SAVED:
            run.step(batches)
            run.manager.save(run.state.step, last_step=run.state.step == SAVED)
        run.manager.close()
        reference = full(run.model.state_dict())
        if rank == 0:
            torch.save(reference, Path(out) / "reference.pt")
        again = example.Run.build(cfg, steps=SAVED, sd_adapter=HFKeys())
        again.manager.load()
        again.manager.close()
        return {"resumed_at": again.state.step}

    run_rank(rank, world, init, out, "export", body)


class Numbers(IterableDataset):
    """Endless samples in the example's shape, different on each data-parallel rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for i in itertools.count():
            x = torch.randn(example.WIDTH, generator=torch.Generator().manual_seed(1000 * self.rank + i))
            yield {"input": x}, x.sum(dim=0, keepdim=True)


def with_torchtitans_dataloader(run: Any) -> None:
    """torchtitan's own ``ParallelAwareDataloader`` in place of the example's: its state is per data-parallel rank
    (``dp_rank_N``), as a real torchtitan job's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    run.dataloader = ParallelAwareDataloader(Numbers(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    run.manager.states[DATALOADER] = run.dataloader


def parallel_aware(rank: int, world: int, init: str, run_dir: str, folder: str, phase: str, out: str) -> None:
    """``phase`` "save": train to ``SAVED`` and save the gathered state; "resume": load it on as many ranks;
    "grow": load it on more ranks without the dataloader (``exclude_from_loading``). Logs what differs.

    The dataloader's part of the state is the next batch it gives (its state dict is only read back once
    it iterates again).
    """
    from ckptd.integrations.torchtitan import CheckpointManager

    def state(run: Any, batches: Iterator) -> dict[str, Any]:
        return {k: v for k, v in snapshot(run).items() if k != DATALOADER} | {"next_batch": next(batches)[1]}

    def body() -> dict:
        exclude = [DATALOADER] if phase == "grow" else []
        run = example.Run.build(config(CheckpointManager, folder, run_dir, exclude_from_loading=exclude), steps=100)
        with_torchtitans_dataloader(run)
        if phase == "grow-all":  # more ranks, the dataloader not excluded
            try:
                run.manager.load()
            except Exception as exc:
                return {"error": f"{type(exc).__name__}: {exc}", "step": run.state.step}
            finally:
                run.manager.close()
            return {"step": run.state.step}
        if phase == "save":
            batches = iter(run.dataloader)
            while run.state.step < SAVED:
                run.step(batches)
                run.manager.save(run.state.step)
            run.manager.close()
            torch.save(state(run, batches), Path(out) / f"reference-{rank}.pt")
            return {}
        loaded = run.manager.load()
        reference = torch.load(Path(out) / f"reference-{min(rank, 1)}.pt")
        restored = state(run, iter(run.dataloader))
        run.manager.close()
        return {"loaded": loaded, "differ": sorted(k for k in reference if not same(restored[k], reference[k]))}

    run_rank(rank, world, init, out, phase, body)


ROLLED_BACK_TO = 2
"""The step the rollback run loads (``checkpoint.load_step``): two saves before the first run's newest, ``SAVED + 2``."""


def roll_back(rank: int, world: int, init: str, run_dir: str, folder: str, manager: str, phase: str,
              out: str) -> None:
    """``phase`` "train": train to ``SAVED + 2`` with the ``manager`` named (saves at 2, 4, 6), rank 0 saving the
    gathered state of each save as ``out/<phase>-step-N.pt``. "rollback": a new run loads step ``ROLLED_BACK_TO``
    (``checkpoint.load_step``, the usual answer to a loss spike), skips the batches the first run took next (so its
    steps differ from the first run's) and trains on to ``SAVED + 2``, saving over steps 4 and 6. Logs the steps
    loaded and saved, or the save's error."""

    def body() -> dict:
        run = example.Run.build(config(managers()[manager], folder, run_dir, keep_latest_k=0), steps=SAVED + 2)
        log: dict[str, Any] = {}
        batches = iter(run.dataloader)
        if phase == "rollback":
            log["loaded"] = run.manager.load(step=ROLLED_BACK_TO)
            log["step"] = run.state.step
            run.dataloader.consumed += world  # the batches behind the spike are skipped
            batches = iter(run.dataloader)
        saves = []
        try:
            while run.state.step < SAVED + 2:
                run.step(batches)
                if run.manager.save(run.state.step):
                    run.manager.maybe_wait_for_saving()
                    saves.append(run.state.step)
                    reference = snapshot(run)
                    if rank == 0:
                        torch.save(reference, Path(out) / f"{phase}-step-{run.state.step}.pt")
        except Exception as exc:  # what the trainer would die of
            log["error"] = f"{type(exc).__name__}: {exc}"
        log["saves"] = saves
        run.manager.close()
        return log

    run_rank(rank, world, init, out, phase, body)


def resume_at(rank: int, world: int, init: str, run_dir: str, folder: str, manager: str, steps: list[int],
              out: str) -> None:
    """Load each of ``steps`` with the ``manager`` named; log what differs from ``out/rollback-step-<step>.pt``."""

    def body() -> dict:
        differ = {}
        for step in steps:
            run = example.Run.build(config(managers()[manager], folder, run_dir), steps=SAVED + 2)
            run.manager.load(step=step)
            restored = snapshot(run)
            run.manager.close()
            reference = torch.load(Path(out) / f"rollback-step-{step}.pt")
            differ[str(step)] = sorted(k for k in reference if not same(restored[k], reference[k]))
        return {"differ": differ}

    run_rank(rank, world, init, out, "load", body)


SNAPSHOTTED = 6
"""The newest memory snapshot of the snapshotting run (every step), past its last persisted checkpoint (every 4)."""
PERSISTED = 4


def train_with_snapshots_until_killed(rank: int, world: int, init: str, run_dir: str, folder: str, out: str) -> None:
    """Persist every ``PERSISTED`` steps and snapshot every step, to step ``SNAPSHOTTED`` (held: what the resume must
    find); then as ``train_until_killed``."""
    from ckptd.integrations.torchtitan import CheckpointManager

    manager_config = config(CheckpointManager, folder, run_dir, interval=PERSISTED, memory_interval=1)
    _train_then_die(rank, world, init, manager_config, SNAPSHOTTED, out)


def resume_from_snapshot(rank: int, world: int, init: str, run_dir: str, folder: str, out: str) -> None:
    """Resume with the snapshotting configuration, compare with the reference, train on to the next persist."""
    from ckptd.integrations.torchtitan import CheckpointManager

    def body() -> dict:
        run = example.Run.build(config(CheckpointManager, folder, run_dir, interval=PERSISTED, memory_interval=1),
                                steps=2 * PERSISTED)
        loaded = run.manager.load()
        restored = snapshot(run)
        reference = torch.load(Path(out) / "reference.pt")
        differ = sorted(k for k in reference if not same(restored[k], reference[k]))
        log = {"loaded": loaded, "step": run.state.step, "differ": differ}
        if loaded and not differ:
            log["saves"] = train(run, 2 * PERSISTED)
        run.manager.close()
        return log

    run_rank(rank, world, init, out, "resume", body)
