"""FSDP2 training under torchrun, checkpointed by ckptd, resumable on any number of ranks.

    torchrun --nproc-per-node 4 examples/fsdp2_train.py --ckpt-dir /ckpts/fsdp --steps 100 --save-every 20
    torchrun --nproc-per-node 2 examples/fsdp2_train.py --ckpt-dir /ckpts/fsdp --steps 200 --save-every 20

The model is sharded with ``fully_shard`` (CPU, gloo). Each save takes the
sharded state from ``get_state_dict`` (DTensors for the parameters and the
AdamW moments) and hands it to ``save_async``: every rank stages only its own
shard, nothing is gathered, and the node's daemon writes and commits
``step-NNNNNN/``. Training continues while the daemon writes.

A second run with the same ``--ckpt-dir`` resumes from ``ckptd.latest()``,
with any ``--nproc-per-node``: ``ckptd.load_into`` reads into the new
run's DTensors only the byte ranges of each tensor that its shards hold, and
``set_state_dict`` puts them into the model and the optimizer. The run
prints a digest of the full weights it resumed from, so a resume can be
checked against the checkpoint (``ckptd.load(path)["model"]`` in one plain
process gives the full tensors). ``ckptd export CKPT OUT --prefix model.``
turns any of the checkpoints into ``model.safetensors`` for inference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptd

BATCH = 32
FEATURES = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=20, help="save a checkpoint every N steps")
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="checkpoint root (under the daemon's roots)")
    return parser.parse_args()


def make_model(world: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def digest(model: nn.Module) -> float:
    """Sum of every full parameter (a collective: every rank calls it)."""
    return sum(p.full_tensor().double().sum().item() for p in model.parameters())


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    root = args.ckpt_dir.absolute()
    model = make_model(world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    resume = ckptd.latest(root)  # no save is in flight yet, so every rank finds the same one
    if resume is not None:
        msd, osd = get_state_dict(model, optim)  # DTensors on this run's mesh (optimizer state initialized)
        state = {"model": msd, "optim": osd, "step": 0}
        ckptd.load_into(state, resume)  # each rank reads only its shards' byte ranges
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
        resumed_digest = digest(model)
        if rank == 0:
            print(f"resumed from step {start} on {world} ranks ({resume}), weights digest {resumed_digest!r}")
    elif rank == 0:
        print(f"no checkpoint under {root}; starting from step 0 on {world} ranks")

    client = ckptd.Client()  # rank and world size from torch.distributed
    futures = []
    loss = torch.zeros(())
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # this rank's batch of this step
        x = torch.randn(BATCH, FEATURES, generator=gen)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step % args.save_every == 0:
            msd, osd = get_state_dict(model, optim)
            # Returns once this rank's shard is staged; the daemon writes while training goes on.
            futures.append(client.save_async({"model": msd, "optim": osd, "step": step},
                                             root / f"step-{step:06d}", step=step))
    results = [f.result() for f in futures]
    client.close()
    print(f"rank {rank}: trained to step {args.steps}, loss {loss.item():.6f}")
    if rank == 0:
        print(f"committed steps {[r.step for r in results]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
