"""Lightning Fabric with ckptd: one process, DDP, or FSDP2 under torchrun; resumes from the newest checkpoint.

    python examples/fabric_train.py --ckpt-dir /ckpts/fab --steps 6
    torchrun --nproc-per-node 2 examples/fabric_train.py --ckpt-dir /ckpts/ddp --strategy ddp --steps 6
    torchrun --nproc-per-node 2 examples/fabric_train.py --ckpt-dir /ckpts/fsdp --strategy fsdp --steps 6

The lines that switch Fabric's checkpoints to ckptd are
``plugins=[CkptdCheckpointIO()]`` (one process, DDP: rank 0 saves the whole
state) and ``strategy=CkptdFabricModelParallelStrategy(...)`` (FSDP2: each
rank saves only its shards). ``fabric.save`` returns once the state is in
shared memory; the node's daemon writes and commits ``step-NNNN/``. A second
run with the same ``--ckpt-dir`` resumes from ``ckptd.latest()`` (FSDP2 on
any number of ranks) and prints a digest of the weights it resumed from.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckptd
from ckptd.integrations.fabric import CkptdCheckpointIO, CkptdFabricModelParallelStrategy


def shard(model: nn.Module, mesh) -> nn.Module:
    """FSDP2 over the data-parallel ranks (all of them here): Fabric calls this when it sets the model up."""
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def make_fabric(strategy: str, world: int, data_parallel: int) -> Fabric:
    if strategy == "fsdp":
        sharded = CkptdFabricModelParallelStrategy(shard, data_parallel_size=data_parallel,
                                                   tensor_parallel_size=world // data_parallel)
        return Fabric(accelerator="cpu", devices=world, strategy=sharded)
    return Fabric(accelerator="cpu", devices=world, strategy=strategy, plugins=[CkptdCheckpointIO()])


def digest(model: nn.Module) -> float:
    """Sum of every full parameter (with FSDP2 a collective: every rank calls it)."""
    return sum((p.full_tensor() if isinstance(p, DTensor) else p).double().sum().item() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--strategy", choices=["auto", "ddp", "fsdp"], default="auto")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--data-parallel", type=int, help="ranks FSDP2 shards over (default: every rank)")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = make_fabric(args.strategy, world, args.data_parallel or world)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "global_step": 0}  # global_step: the checkpoint's step

    resume = ckptd.latest(args.ckpt_dir.absolute())
    if resume is not None:
        fabric.load(resume, state)  # restores model and optimizer in place, and global_step
        resumed = digest(model)
        fabric.print(f"resumed from step {state['global_step']} on {world} ranks ({resume}), weights {resumed!r}")

    for step in range(state["global_step"] + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + fabric.global_rank)
        x = torch.randn(8, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["global_step"] = step
        if step % args.save_every == 0:
            fabric.save(args.ckpt_dir / f"step-{step:04d}", state)  # returns once staged

    fabric.strategy.checkpoint_io.teardown()  # waits for the saves in flight; raises one that failed
    fabric.print(f"trained to step {args.steps} on {world} ranks")


if __name__ == "__main__":
    main()
