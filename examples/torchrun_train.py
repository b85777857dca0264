"""Data-parallel training under torchrun, checkpointed by ckptd, resumable.

    torchrun --nproc-per-node 2 examples/torchrun_train.py --ckpt-dir /ckpts/run1 --steps 200 --save-every 50

Every rank trains a DistributedDataParallel replica on CPU (gloo) and saves
each checkpoint with ``save_async``. The model and optimizer are the same on
every rank, so they are declared ``replicated``: rank 0 writes them once, not
one copy per rank. What is each rank's alone, its data stream's random state,
goes in every rank's own shard. The node's daemon commits ``step-NNNNNN/``
once every shard is durable. Run it again with the same ``--ckpt-dir`` and a
larger ``--steps``: it resumes from ``ckptd.latest()``, each rank loading the
shared model and optimizer and its own random state.

``ckptd.Client()`` takes rank and world size from torch.distributed, and finds
the node's daemon through ``$CKPTD_RUN_DIR`` (or the default run dir),
spawning one if none runs; the daemon may write only below its roots
(``$CKPTD_ROOTS`` for a spawned one), so put ``--ckpt-dir`` under them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ckptd

BATCH = 32
FEATURES = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=50, help="save a checkpoint every N steps")
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="checkpoint root (under the daemon's roots)")
    return parser.parse_args()


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP expects
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))


def batch(data_rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's next batch: each rank draws from its own stream, so its state is per-rank."""
    x = torch.randn(BATCH, FEATURES, generator=data_rng)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment
    rank = dist.get_rank()
    root = args.ckpt_dir.absolute()

    model = make_model()
    data_rng = torch.Generator().manual_seed(1000 + rank)
    opt_state = None
    start = 0
    resume = ckptd.latest(root)  # every rank calls it, and the ranks agree on one checkpoint
    if resume is not None:
        state = ckptd.load(resume)  # this rank's state (its shard, plus the replicated keys from rank 0's)
        assert state["rank"] == rank, f"rank {rank} loaded rank {state['rank']}'s shard"
        model.load_state_dict(state["model"])
        data_rng.set_state(state["data_rng"].clone())
        opt_state, start = state["optimizer"], state["step"]
        print(f"rank {rank}: resumed from step {start} ({resume})", flush=True)
    else:
        print(f"rank {rank}: no checkpoint under {root}; starting from step 0", flush=True)

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    if opt_state is not None:
        opt.load_state_dict(opt_state)

    client = ckptd.Client()  # collective: every rank creates its client
    saves: list[ckptd.SaveFuture] = []
    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        x, y = batch(data_rng)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        if saves:
            saves[-1].wait_staged()  # the previous save's tensors are copied out: safe to step
        opt.step()
        if (step + 1) % args.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                     "rank": rank, "data_rng": data_rng.get_state()}
            saves.append(client.save_async(state, root / f"step-{step + 1:06d}", step=step + 1,
                                           replicated=("model", "optimizer")))
    client.close()  # waits until every save is committed (or failed)
    failed = [f.exception() for f in saves if f.exception() is not None]
    for exc in failed:
        print(f"rank {rank}: save failed: {exc!r}", flush=True)
    committed = [f.result().step for f in saves if f.exception() is None]
    print(f"rank {rank}: trained to step {max(start, args.steps)}, loss {loss.item():.4f}, "
          f"committed steps {committed}", flush=True)
    dist.destroy_process_group()
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
