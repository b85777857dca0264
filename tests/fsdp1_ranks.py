"""One rank of ``CkptdFSDPStrategy``'s save and load on real FSDP1-sharded modules (run under torchrun, gloo).

Lightning's Trainer refuses ``FSDPStrategy`` on CPU, so this drives the
strategy the way the Trainer does: the model wrapped by FSDP1 with the
strategy's mesh, ``lightning_module_state_dict`` and ``optimizer_state`` into
Lightning's checkpoint dict, ``save_checkpoint`` on every rank, then a fresh
model and optimizer restored by ``load_checkpoint``. Prints digests of the
full weights and first moments after the save and after the load.

    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp1_ranks.py RUN_DIR CKPT
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ckptd.integrations.lightning import CkptdCheckpointIO
from ckptd.integrations.lightning_sharded import CkptdFSDPStrategy


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """Sums of the full weights and first moments (collectives: every rank calls this)."""
    full = StateDictOptions(full_state_dict=True)
    weights = sum(t.double().sum().item() for t in get_model_state_dict(model, options=full).values())
    optim = get_optimizer_state_dict(model, optimizer, options=full)
    return weights, sum(s["exp_avg"].double().sum().item() for s in optim["state"].values())


def set_up(run_dir: str, seed: int) -> tuple[CkptdFSDPStrategy, nn.Module, torch.optim.Optimizer]:
    strategy = CkptdFSDPStrategy(checkpoint_io=CkptdCheckpointIO(run_dir=run_dir, spawn=False, timeout=30.0))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # what the strategy's setup_environment makes
    torch.manual_seed(seed)
    module = Net()
    model = FSDP(module, device_mesh=mesh, device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    strategy._lightning_module = module
    strategy.model = model
    strategy.optimizers = [optimizer]
    return strategy, model, optimizer


def main() -> None:
    run_dir, path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    strategy, model, optimizer = set_up(run_dir, 0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    optimizer.step()
    checkpoint = {"state_dict": strategy.lightning_module_state_dict(),
                  "optimizer_states": [strategy.optimizer_state(optimizer)], "global_step": 5, "epoch": 1}
    strategy.save_checkpoint(checkpoint, path)
    saved = digests(model, optimizer)
    strategy.checkpoint_io.teardown()  # committed on every rank

    strategy2, model2, optimizer2 = set_up(run_dir, 1)  # other weights, no optimizer state yet
    rest = strategy2.load_checkpoint(path)
    loaded = digests(model2, optimizer2)
    if dist.get_rank() == 0:
        print(f"saved {saved!r} loaded {loaded!r} rest {sorted(rest)} step {rest['global_step']}", flush=True)
    strategy2.checkpoint_io.teardown()  # its client's threads end before the process groups and the interpreter
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: about one run in ten aborted there, after all of the above was
    # done ("terminate called without an active exception", SIGABRT in C++ thread teardown). What this script
    # checks is printed and committed by then; the abort is noted as not understood.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
