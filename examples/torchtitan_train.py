"""torchtitan's checkpoint manager switched to ckptd with one line, trained on CPU ranks (gloo, FSDP2).

torchtitan's ``Trainer`` needs CUDA; its checkpoint manager does not. This
runs the Trainer's checkpoint calls on CPU: an FSDP2 model with torchtitan's
own optimizer and LR-scheduler containers, a ``Stateful`` dataloader and the
train state, in the Trainer's order (``load`` once; per step: forward and
backward, ``maybe_wait_for_staging``, ``optimizer.step``, ``save``).
The switch is the checkpoint config, in a torchtitan ``Trainer.Config`` too::

    from ckptd.integrations.torchtitan import CheckpointManager   # instead of torchtitan's
    checkpoint = CheckpointManager.Config(enable=True, interval=3, async_mode="async", keep_latest_k=2)

Run it twice with the same ``--steps``, the first stopped early as a
preempted job would be; the second resumes from the newest checkpoint on
another number of ranks and finishes::

    torchrun --nproc-per-node 2 examples/torchtitan_train.py --ckpt-dir /ckpts/titan --steps 9 --stop-at 6
    torchrun --nproc-per-node 3 examples/torchtitan_train.py --ckpt-dir /ckpts/titan --steps 9

The config keeps torchtitan's defaults, ``last_save_model_only=True`` among
them: the last step (``--steps``) saves the model alone, an export that no
run resumes from (a resume from it is refused, naming the step). To go on
training a run that reached its last step, set ``last_save_model_only=False``
in the run you mean to continue, or resume an earlier step with
``load_step``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from ckptd.integrations.torchtitan import CheckpointManager

WIDTH = 16


class Batches(BaseDataLoader):
    """Synthetic batches that resume where the run stopped, on any number of ranks.

    The state is the number of batches the whole job consumed, the same on
    every rank, so a run on another world size picks up the next ones.
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.consumed = rank, world, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            gen = torch.Generator().manual_seed(self.consumed + self.rank)
            self.consumed += self.world
            x = torch.randn(8, WIDTH, generator=gen)
            yield {"input": x}, x.sum(dim=1, keepdim=True)

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = state_dict["consumed"]


class TrainState(Stateful):
    """What torchtitan's ``Trainer`` saves of itself (``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


@dataclass
class Run:
    """What torchtitan's ``Trainer.__init__`` builds, with an FSDP2 model sharded over every rank."""

    manager: CheckpointManager
    model: nn.Module
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: Batches
    state: TrainState

    @classmethod
    def build(cls, config: CheckpointManager.Config, steps: int, sd_adapter: Any = None) -> Run:
        """``sd_adapter``: the model's Hugging Face key mapping (a torchtitan ``BaseStateDictAdapter``), which
        ``last_save_in_hf`` needs."""
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        optimizers = OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        ).build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                           training_steps=steps)
        dataloader, state = Batches(rank, world), TrainState()
        manager = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                               lr_schedulers=lr_schedulers, states={"train_state": state}, sd_adapter=sd_adapter)
        return cls(manager, model, optimizers, lr_schedulers, dataloader, state)

    def forward_backward(self, batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> None:
        inputs, labels = batch
        (self.model(inputs["input"]) - labels).pow(2).mean().backward()
        self.state.ntokens_seen += inputs["input"].numel()

    def step(self, batches: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """One of the Trainer's steps, up to its ``checkpointer.save``."""
        self.state.step += 1
        self.forward_backward(next(batches))
        self.manager.maybe_wait_for_staging()  # before the tensors being saved change
        self.optimizers.step()
        self.optimizers.zero_grad()
        self.lr_schedulers.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=9, help="the run's last step (torchtitan's training.steps)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop after this step, before the last, as a preempted job would (no last-step save)")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--async-mode", default="async", choices=["disabled", "async", "async_with_pinned_mem"])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    config = CheckpointManager.Config(enable=True, folder=os.path.abspath(args.ckpt_dir), interval=args.save_every,
                                      async_mode=args.async_mode, keep_latest_k=2)
    run = Run.build(config, args.steps)
    if run.manager.load():
        print(f"rank {dist.get_rank()}: resumed at step {run.state.step} on {dist.get_world_size()} ranks, "
              f"{run.dataloader.consumed} batches consumed", flush=True)
    batches = iter(run.dataloader)
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    while run.state.step < stop:
        run.step(batches)
        run.manager.save(run.state.step, last_step=run.state.step == args.steps)
    run.manager.close()  # waits for the saves in flight
    done = "trained to" if run.state.step == args.steps else "stopped at"
    print(f"rank {dist.get_rank()}: {done} step {run.state.step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
