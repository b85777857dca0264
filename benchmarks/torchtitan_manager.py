"""torchtitan's checkpoint manager against ckptd's, one rank's view: how long ``save()`` blocks, how long until durable.

Not part of ``make bench`` (it needs torchtitan): run it in ``.venv-torchtitan``
(``make .venv-torchtitan/.installed``), once per manager and async mode::

    CKPTD_ROOTS=/ckpts torchrun --nproc-per-node 2 benchmarks/torchtitan_manager.py ckptd async /ckpts/bench

Two gloo ranks hold an FSDP2 model of 8 2048x2048 layers (134 MB) with its
AdamW state (403 MB in all, half per rank), torchtitan's containers and the
example's dataloader and train state (``examples/torchtitan_train.py``), and
save every step; rank 0 prints the medians of steps 2 to 5 as one JSON line:
``blocking`` (``save()`` returned), ``staged`` (``maybe_wait_for_staging()``
returned: the tensors may change) and ``durable`` (``maybe_wait_for_saving()``
returned). Measured on the two-core development machine at load average 6-10
(other work running), seconds:

| manager, async_mode | blocking | staged | durable |
| --- | --- | --- | --- |
| torchtitan (DCP), disabled | 0.68-1.31 | = | = |
| ckptd, disabled | 0.21-0.23 | = | = |
| torchtitan (DCP), async | 0.06-0.13 | = | 0.80-1.35 |
| ckptd, async | 0.05-0.08 | = | 0.22-0.26 |
| torchtitan (DCP), async_with_pinned_mem | fails without CUDA (1) | | |
| ckptd, async_with_pinned_mem | 0.003 | 0.04 | 0.19 |

(1) DCP's pinned stager: "Non-blocking copy requires that the current accelerator is available".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from torchtitan_train import Batches, TrainState  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manager", choices=["torchtitan", "ckptd"])
    parser.add_argument("async_mode", choices=["disabled", "async", "async_with_pinned_mem"])
    parser.add_argument("folder")
    args = parser.parse_args()
    if args.manager == "ckptd":
        from ckptd.integrations.torchtitan import CheckpointManager
    else:
        from torchtitan.components.checkpointer import CheckpointManager
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]
    optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=groups).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=100)
    config = CheckpointManager.Config(enable=True, folder=args.folder, interval=1, async_mode=args.async_mode,
                                      keep_latest_k=0)
    manager = config.build(dataloader=Batches(rank, world), model_parts=[model], optimizers=optimizers,
                           lr_schedulers=lr_schedulers, states={"train_state": TrainState()}, sd_adapter=None)
    model(torch.ones(4, 2048)).sum().backward()
    optimizers.step()
    times = []
    for step in range(1, 6):
        dist.barrier()
        start = time.perf_counter()
        manager.save(step)
        blocking = time.perf_counter() - start
        manager.maybe_wait_for_staging()
        staged = time.perf_counter() - start
        manager.maybe_wait_for_saving()
        times.append((blocking, staged, time.perf_counter() - start))
    manager.close()
    if rank == 0:
        print(json.dumps({"manager": args.manager, "async_mode": args.async_mode} | {
            name: round(statistics.median(t[i] for t in times[1:]), 4)
            for i, name in enumerate(("blocking", "staged", "durable"))}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
