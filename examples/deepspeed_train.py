"""A DeepSpeed engine whose checkpoints go through ckptd (``make test-deepspeed`` runs it).

A small MLP learns a fixed regression on CPU under ZeRO stage 1 or 2 (gloo,
DeepSpeed's CPU accelerator). ``install(engine)`` after
``deepspeed.initialize`` is the only change from plain DeepSpeed: every
``--save-every`` steps ``engine.save_checkpoint`` hands the state to the
node's ckptd daemon and training goes on; the daemon commits
``SAVE_DIR/global_stepN``, and ``SAVE_DIR/latest`` names it once it is
whole. A second run with the same arguments resumes from it::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed_train.py --save-dir /ckpts/ds --steps 4
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed_train.py --save-dir /ckpts/ds --steps 8

(the second resumes at step 4). Each rank prints its loss at every step.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import deepspeed
import deepspeed.ops
import torch
from deepspeed.accelerator import get_accelerator

from ckptd.integrations.deepspeed import install

BATCH, FEATURES = 4, 16


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--steps", type=int, default=8, help="train to this step (resumed runs included)")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--stage", type=int, default=1, choices=(0, 1, 2), help="ZeRO stage")
    parser.add_argument("--blocking", action="store_true", help="save_checkpoint returns once the tag is committed")
    parser.add_argument("--local_rank", type=int, default=-1, help="(set by the deepspeed launcher)")
    return parser.parse_args(argv)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: the same in every run, so a resumed run sees what the first would have."""
    x = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x.sum(dim=1, keepdim=True)


def say(line: str) -> None:
    """``line`` in one write: the launcher runs ranks unbuffered (``python -u``) on one terminal, where ``print``'s
    two writes (the text, then the newline) of two ranks interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def engine_for(args: argparse.Namespace) -> Any:
    if get_accelerator().device_name() == "cpu":
        # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (minutes, once) that only its inference
        # all-reduce uses; training on gloo does without it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
              "zero_optimization": {"stage": args.stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def main(argv: list[str] | None = None, at_end: Callable[[Any], None] | None = None) -> Any:
    """Train to ``--steps``; ``at_end(engine)`` (the tests': the final state) runs before ``engine.destroy()``."""
    args = parse(argv)
    engine = engine_for(args)
    install(engine, blocking=args.blocking)
    engine.load_checkpoint(args.save_dir)  # the tag `latest` names, if any (it is always a whole one)
    rank = engine.global_rank
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        say(f"rank {rank} step {step} loss {loss.item()!r}")
        if step % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)  # training goes on while the daemon writes global_step{step}
    if at_end is not None:
        at_end(engine)
    engine.destroy()  # waits for the last save: committed, and `latest` names it
    say(f"rank {rank}: trained to step {engine.global_steps}")
    return engine


if __name__ == "__main__":
    main()
