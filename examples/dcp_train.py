"""FSDP2 training under torchrun, checkpointed with DCP's own async_save through ckptd's daemon.

    torchrun --nproc-per-node 2 examples/dcp_train.py --ckpt-dir /ckpts/dcp --steps 100 --save-every 20
    torchrun --nproc-per-node 3 examples/dcp_train.py --ckpt-dir /ckpts/dcp --steps 200 --save-every 20
    torchrun --nproc-per-node 2 examples/dcp_train.py --ckpt-dir /ckpts/dcp --steps 300 --save-every 100 \
        --snapshot-every 5

A training loop that already saves with ``torch.distributed.checkpoint``
switches to ckptd by one argument: ``storage_writer=ckptd.dcp.StorageWriter(path)``.
DCP plans the save as usual; each rank's planned items go into its reused
shared-memory slot (``stage_in_slot=True``: that copy is the only staging, and
``async_save`` returns once it is done), and the node's daemon writes, fsyncs
and renames ``step-NNNNNN/`` once every rank is durable, while training goes
on. DCP plans on its own gloo group (its collectives run on a thread while
training runs FSDP's), and the previous save is waited for before the next.

With ``--snapshot-every N`` the steps between two saves are memory snapshots
every N steps (``StorageWriter(persist=False)``): held in the daemon's node
memory, not written. A trainer killed between two saves resumes from the
newest snapshot, read from memory.

A second run with the same ``--ckpt-dir`` resumes from ``ckptd.latest()``
with DCP's ``dcp.load`` and ``ckptd.dcp.StorageReader``, on any number of
ranks (DCP reshards). The run prints a digest of the full weights it resumed
from, so a resume can be checked against the checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptd
from ckptd.dcp import StorageReader, StorageWriter

BATCH = 32
FEATURES = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=20, help="save a checkpoint to disk every M steps")
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="between saves, a memory snapshot every N steps (0: none)")
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
    resume = ckptd.latest(root)  # collective: the ranks agree on one checkpoint
    if resume is not None:
        msd, osd = get_state_dict(model, optim)  # DTensors on this run's mesh (optimizer state initialized)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, storage_reader=StorageReader(resume))  # DCP plans and reshards
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
        resumed_digest = digest(model)
        if rank == 0:
            print(f"resumed from step {start} on {world} ranks ({resume}), weights digest {resumed_digest!r}")
    elif rank == 0:
        print(f"no checkpoint under {root}; starting from step 0 on {world} ranks")

    client = ckptd.Client()  # one per process, shared by every save's writer (its slots are reused)
    # async_save plans on a thread while training runs FSDP's collectives: give DCP a group of its own, or the
    # two interleave differently on each rank and hang.
    checkpoint_group = dist.new_group(backend="gloo")
    pending, pending_step, pending_persists = None, 0, False
    committed = []
    loss = torch.zeros(())
    for step in range(start + 1, args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # this rank's batch of this step
        x = torch.randn(BATCH, FEATURES, generator=gen)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        optim.step()
        optim.zero_grad()
        persist = step % args.save_every == 0
        if persist or (args.snapshot_every and step % args.snapshot_every == 0):
            if pending is not None:
                pending.result()  # one async save in flight at a time
                if pending_persists:
                    committed.append(pending_step)
            msd, osd = get_state_dict(model, optim)
            writer = StorageWriter(root / f"step-{step:06d}", client=client, step=step, stage_in_slot=True,
                                   persist=persist)
            # Returns once this rank's planned items are in its slot; the daemon writes (or holds) them while
            # training goes on.
            pending = dcp.async_save({"model": msd, "optim": osd, "step": step}, storage_writer=writer,
                                     process_group=checkpoint_group)
            pending_step, pending_persists = step, persist
            if not persist:
                pending.add_done_callback(lambda f, s=step: f.exception() or print(
                    f"rank {rank}: step {s} held in memory", flush=True))
    if pending is not None:
        pending.result()
        if pending_persists:
            committed.append(pending_step)
    client.close()
    print(f"rank {rank}: trained to step {args.steps}, loss {loss.item():.6f}")
    if rank == 0:
        print(f"committed steps {committed}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
