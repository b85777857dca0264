"""What the crash tests share with their soak variant: the kill points of a save, the
states they save, and the checks that a checkpoint is whole or absent."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

import ckptd

NAME = "ckpt-under-fire"
"""The checkpoint every fault matches; nothing else saved here contains this string."""


def make_state(seed: int, mib: float = 0.25) -> dict:
    """A small mixed state: several dtypes, a 0-dim tensor, plain values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(int(mib * 2**18), generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "i": torch.randint(-(2**40), 2**40, (17,), generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scale": torch.tensor(float(seed) + 0.5, dtype=torch.float64),
        },
        "step": seed,
        "name": f"state-{seed}",
    }


def same(a, b) -> bool:
    """Bitwise equality of two saved structures (NaN-safe: compares bytes)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def assert_whole(path: Path, states: dict[int, dict]) -> None:
    """``path`` is committed: the index reads, and every rank loads (CRC checked) as saved."""
    index = ckptd.read_index(path)
    assert index.world_size == len(states), index
    for rank, state in states.items():
        loaded = ckptd.load(path, rank=rank)
        assert same(loaded, state), f"{path} rank {rank} does not load back bitwise"


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".incomplete"))


# (id, fault, what the path must be afterwards). Paths the faults see:
#   write/fsync:  <root>/ckpt-under-fire.incomplete/rank-00000-of-00001.safetensors
#   write_file:   <root>/ckpt-under-fire.incomplete/ckptd.json
#   fsync_dir:    <root>/ckpt-under-fire.incomplete   (then <root>, which no
#                 substring can single out: "after the parent fsync" is not addressable)
#   rename:       destination <root>/ckpt-under-fire
SHARD = f"{NAME}.incomplete/rank-"
KILL_POINTS = [
    ("mid-shard-write", {"op": "write", "match": SHARD, "after": True}, "absent"),
    ("before-shard-fsync", {"op": "fsync", "match": SHARD}, "absent"),
    ("after-shard-fsync", {"op": "fsync", "match": SHARD, "after": True}, "absent"),
    ("before-index-write", {"op": "write_file", "match": f"{NAME}.incomplete/ckptd.json"}, "absent"),
    ("after-index-write", {"op": "write_file", "match": f"{NAME}.incomplete/ckptd.json", "after": True}, "absent"),
    ("before-dir-fsync", {"op": "fsync_dir", "match": f"{NAME}.incomplete"}, "absent"),
    ("after-dir-fsync", {"op": "fsync_dir", "match": f"{NAME}.incomplete", "after": True}, "absent"),
    ("before-rename", {"op": "rename", "match": f"/{NAME}"}, "absent"),
    ("after-rename", {"op": "rename", "match": f"/{NAME}", "after": True}, "committed"),
]
