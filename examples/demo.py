"""ckptd in a training loop, then a resume: what `make demo` runs.

1. Train a small model on CPU, saving asynchronously every SAVE_EVERY steps.
   The first Client on the node spawns the daemon (nothing is started by hand).
2. Right after one save is handed off, print `ckptd status`: the save is in
   flight while training goes on.
3. "Crash": drop everything, build a fresh model, resume from ckptd.latest()
   and show training continues from the saved step with the saved weights.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from torch import nn

import ckptd
from ckptd.cli import main as ckptd_cli

ROOT = Path("demo-checkpoints").absolute()
STEPS = 300
SAVE_EVERY = 50
RESUMED_STEPS = 50


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(50_000, 128), nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 50_000, (64, 16), generator=g)
    target = (tokens % 7).float().mean(dim=1, keepdim=True)
    return tokens, target


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, client: ckptd.Client | None) -> float:
    loss_fn = nn.MSELoss()
    pending: ckptd.SaveFuture | None = None
    loss = torch.tensor(0.0)
    for step in steps:
        tokens, target = batch(step)
        loss = loss_fn(model(tokens), target)
        opt.zero_grad()
        loss.backward()
        if pending is not None:
            pending.wait_staged()  # the only wait: the copy to shared memory, long done by now
        opt.step()
        if client is not None and (step + 1) % SAVE_EVERY == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}
            pending = client.save_async(state, ROOT / f"step-{step + 1:06d}", step=step + 1)
            pending.add_done_callback(lambda f, s=step + 1: print(f"  step {s}: checkpoint durable ({_describe(f)})"))
            if step + 1 == 2 * SAVE_EVERY:
                pending.wait_staged()  # staged: the daemon is writing it now
                print(f"\n$ ckptd status   (while the step-{step + 1} save is written)")
                ckptd_cli(["status"])
                print()
        if step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    return loss.item()


def _describe(fut: ckptd.SaveFuture) -> str:
    exc = fut.exception()
    if exc is not None:
        return f"FAILED: {exc}"
    r = fut.result()
    return f"{r.bytes_written / 2**20:.1f} MiB in {r.seconds * 1000:.0f} ms"


def main() -> None:
    shutil.rmtree(ROOT, ignore_errors=True)
    print(f"== training {STEPS} steps, saving every {SAVE_EVERY} into {ROOT}")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ckptd.Client(background_staging=True) as client:  # spawns this node's daemon if none runs
        started = time.perf_counter()
        train(model, opt, range(STEPS), client)
        print(f"trained in {time.perf_counter() - started:.1f} s; waiting for the last save")
    saved_weight = model[1].weight.detach().clone()

    print("\n== simulated crash: fresh model and optimizer, resume from ckptd.latest()")
    del model, opt
    latest = ckptd.latest(ROOT)
    assert latest is not None, "no committed checkpoint found"
    state = ckptd.load(latest)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    start = state["step"]
    print(f"resumed from {latest.name} (step {start}); weights equal the trained ones: "
          f"{torch.equal(model[1].weight, saved_weight)}")
    loss = train(model, opt, range(start, start + RESUMED_STEPS), client=None)
    print(f"continued to step {start + RESUMED_STEPS}, loss {loss:.4f}")
    print("\ncheckpoints:", ", ".join(p.name for p in sorted(ROOT.iterdir())))
    print("the daemon keeps running for a while and exits when idle; `ckptd stop` stops it now.")


if __name__ == "__main__":
    main()
