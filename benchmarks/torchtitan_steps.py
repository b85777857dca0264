"""The torchtitan step-time case's measurements, run in ``.venv-torchtitan`` (``integration_steps.torchtitan_steps``).

``python -m benchmarks.torchtitan_steps SCRATCH SIZE_GIB EVERY SAVES`` with ``CKPTD_RUN_DIR`` naming a running
daemon: one gloo rank trains ``steps.Trainee`` through torchtitan's containers and calls ``manager.save(step)``
after each step, as torchtitan's trainer does, for each mode (``integration_steps.MODES``): ckptd's
``CheckpointManager`` with ``memory_interval=EVERY`` (``interval`` beyond the run), with ``interval=EVERY``, and
torchtitan's own with ``interval=EVERY``, all ``async_mode="async"`` (each save waits for the previous one, as
torchtitan's does). Prints the case's JSON on its last line.
"""
from __future__ import annotations
import json
import os
import sys
from pathlib import Path
from typing import Any
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from .steps import MODES, QUIET, Trainee, record, train

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from torchtitan_train import Batches, TrainState  # noqa: E402

def main(scratch: Path, size_gib: float, every: int, saves: int) -> dict:
    from ckptd.integrations.torchtitan import CheckpointManager as Ckptd
    from torchtitan.components.checkpointer import CheckpointManager as Own
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    reps: dict[str, list[float]] = {}
    far = 10 * every * (1 + saves)  # an interval beyond the run: no persist among the snapshots
    for mode in MODES:
        t = Trainee(size_gib)
        groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})]
        optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=groups).build(
            model_parts=[t.model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10**6)
        fields: dict[str, Any] = dict(enable=True, folder=str(scratch / f"torchtitan-{mode}"), async_mode="async",
                                      keep_latest_k=0, interval=every)
        if mode == "snapshot":
            fields.update(interval=far, memory_interval=every)
        if mode in ("snapshot", "persisted"):
            fields.update(run_dir=os.environ["CKPTD_RUN_DIR"])
        manager = (Own if mode == "own" else Ckptd).Config(**fields).build(
            dataloader=Batches(0, 1), model_parts=[t.model], optimizers=optimizers, lr_schedulers=schedulers,
            states={"train_state": TrainState()}, sd_adapter=None)
        def step(t: Trainee = t, optimizers: Any = optimizers, schedulers: Any = schedulers,
                 manager: Any = manager) -> None:
            optimizers.zero_grad()
            t.loss().backward()
            manager.maybe_wait_for_staging()
            optimizers.step()
            schedulers.step()
        record(reps, mode, train(step, None if mode in QUIET else manager.save, every=every, saves=saves))
        manager.maybe_wait_for_saving()  # the last save (each one waited for the one before)
        manager.close()
        nbytes = sum(p.numel() * p.element_size() for p in t.model.parameters()) * 3
    dist.destroy_process_group()
    return {"nbytes": nbytes, "every": every, "reps": reps}

if __name__ == "__main__":
    root, gib, n, k = sys.argv[1:5]
    print(json.dumps(main(Path(root), float(gib), int(n), int(k))))
