"""Lightning with FSDP2 (``ModelParallelStrategy``) under torchrun, sharded checkpoints saved by ckptd.

    torchrun --nproc-per-node 2 examples/lightning_fsdp.py --ckpt-dir /ckpts/lit --epochs 3
    torchrun --nproc-per-node 3 examples/lightning_fsdp.py --ckpt-dir /ckpts/lit --epochs 4 --resume

The one line that differs from Lightning's own sharded training is
``strategy=CkptdModelParallelStrategy(...)``: each rank copies only its
shards of the weights and AdamW moments into shared memory and trains on,
and the node's daemon writes and commits ``epoch=E-step=S.ckpt/``.
``ModelCheckpoint`` keeps the best two by a score and ``last.ckpt``;
``--resume`` continues from ``last.ckpt`` on any number of ranks (the
checkpoint is resharded on load). Each run prints a digest of the full
weights and moments when training starts, so a resume can be checked
against the checkpoint (``ckptd.load(path)`` in one plain process gives the
whole Lightning checkpoint).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from ckptd.integrations.lightning_sharded import CkptdModelParallelStrategy

def score(epoch: int) -> float:
    """The validation score of ``epoch`` (lower is better): falls every epoch, so the best two are the newest two
    and the kept checkpoints are known for any ``--epochs``."""
    return 1.0 / (epoch + 1)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]  # FSDP2 over every rank
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("score", score(self.current_epoch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_start(self) -> None:
        weights = sum(p.full_tensor().double().sum().item() for p in self.parameters())
        moments = sum(s["exp_avg"].full_tensor().double().sum().item()
                      for s in self.trainer.optimizers[0].state.values() if "exp_avg" in s)
        if self.global_rank == 0:
            print(f"start at step {self.global_step} on {self.trainer.world_size} ranks: "
                  f"weights {weights!r} moments {moments!r}", flush=True)


def loader() -> DataLoader:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt")
    parser.add_argument("--data-parallel", type=int, help="ranks FSDP2 shards over (default: every rank)")
    args = parser.parse_args()
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_epochs=args.epochs,
        # the line that switches sharded checkpoints to ckptd (else ModelParallelStrategy(...))
        strategy=CkptdModelParallelStrategy(data_parallel_size=args.data_parallel or world,
                                            tensor_parallel_size=world // (args.data_parallel or world)),
        callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, monitor="score", save_top_k=2, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Regressor(), loader(), loader(), ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        kept = sorted(p.name for p in args.ckpt_dir.iterdir())
        print(f"trained to step {trainer.global_step}; checkpoints {kept}", flush=True)


if __name__ == "__main__":
    main()
