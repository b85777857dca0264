"""A Hugging Face accelerate training loop whose ``save_state`` / ``load_state`` go through ckptd (``make test-hf``).

A small network with dropout learns a fixed regression on CPU, shuffled by
accelerate's seedable sampler. ``CkptdAccelerator`` is the only change from
``accelerate.Accelerator``: every ``--save-every`` steps ``save_state()``
stages the state into shared memory and training goes on, while the node's
ckptd daemon commits ``PROJECT/checkpoints/checkpoint_<n>`` (accelerate's
automatic names, ``--total-limit`` kept); a second run with the same
arguments resumes from the newest with ``load_state()``::

    python examples/accelerate_train.py --project-dir /ckpts/acc --steps 6
    python examples/accelerate_train.py --project-dir /ckpts/acc --steps 12     # resumes at step 6
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --project-dir /ckpts/acc2

(``--multi_gpu`` on a machine without GPUs starts two CPU processes, gloo.)
The position in the data is the step count of a ``Progress`` object
registered with ``register_for_checkpointing``; a resumed run skips the
batches its epoch had already used (``skip_first_batches``), as accelerate's
own examples do.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch
from accelerate import DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed

import ckptd
from ckptd.integrations.accelerate import CkptdAccelerator

SAMPLES, FEATURES, BATCH = 96, 8, 8


class Regression(torch.utils.data.Dataset):
    """``SAMPLES`` fixed inputs and their targets, the same in every process and run."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = self.x @ torch.randn(FEATURES, 1, generator=generator) + 0.1 * torch.randn(SAMPLES, 1,
                                                                                             generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Progress:
    """The steps taken: saved and loaded with the accelerator's state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--total-limit", type=int, default=2)
    parser.add_argument("--resume-from", default=None,
                        help="a checkpoint to load (default: the newest under PROJECT/checkpoints, if any)")
    return parser.parse_args(argv)


def main(accelerator_class: type = CkptdAccelerator, argv: list[str] | None = None,
         on_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> tuple[Any, torch.nn.Module, Any]:
    """Train to ``--steps``; ``on_step(step, batch inputs, loss)`` is called after each step. Returns the
    accelerator, the (prepared) model and optimizer."""
    args = parse(argv)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    # its own generator: each pass over the data draws a seed from it, not from torch's global generator, so a
    # resumed run's global generator (the dropout masks) goes on from where the checkpoint left it
    loader = torch.utils.data.DataLoader(Regression(), batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    accelerator = accelerator_class(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True,
                                            total_limit=args.total_limit))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = os.path.join(args.project_dir, "checkpoints")
    if args.resume_from is not None:
        accelerator.load_state(args.resume_from)
    elif os.path.isdir(checkpoints) and ckptd.latest(checkpoints) is not None:  # every process asks: collective
        accelerator.load_state()  # the newest complete checkpoint, on disk or held in node memory

    per_epoch = len(loader)
    while progress.step < args.steps:
        epoch, done = divmod(progress.step, per_epoch)
        loader.set_epoch(epoch)
        for x, y in accelerator.skip_first_batches(loader, done) if done else loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            if on_step is not None:
                on_step(progress.step, x, loss)
            if progress.step % args.save_every == 0:
                accelerator.save_state()  # returns once staged; the daemon commits checkpoint_<n>
            if progress.step == args.steps:
                break
    accelerator.end_training()  # waits for the last save (its failure would raise here)
    print(f"rank {accelerator.process_index}: trained to step {progress.step}", flush=True)
    return accelerator, model, optimizer


if __name__ == "__main__":
    main()
