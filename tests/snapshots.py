"""What the memory-tier tests share: states whose bytes a test knows, and the daemon's view of what it holds.

``STATE_SRC`` is source text, so that trainer and resumer scripts running in
their own interpreters build exactly the states this process compares against.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ckptd.client.memory import held_snapshots


STATE_SRC = r'''
def state_at(step):
    import torch
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "b": torch.arange(step, step + 7, dtype=torch.int64),
            "step": step}
'''
exec(STATE_SRC)  # state_at(step): the test knows the bytes of every step


def full(value: float, n: int = 50_000) -> dict:
    """A small state filled with ``value``: which snapshot a reader got reads off any element."""
    return {"w": torch.full((n,), float(value))}


def held(daemon, path: Path) -> dict:
    """The daemon's status entry for the snapshot it holds at ``path``."""
    return next(s for s in daemon.status()["memory"]["snapshots"] if s["path"] == str(path))


def held_paths(run_dir) -> set[str]:
    """The paths of every snapshot the daemon on ``run_dir`` holds, as a client finds them."""
    return {s["path"] for s in held_snapshots(run_dir)}
