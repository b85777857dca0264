"""Which rank of how many this process is."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    distributed: bool
    """torch.distributed is initialized (so ranks can agree through it)."""


def detect_ranks() -> Ranks:
    """From torch.distributed when initialized, else torchrun's environment, else rank 0 of 1."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return Ranks(dist.get_rank(), dist.get_world_size(), local, True)
    except ImportError:
        pass
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not inside WORLD_SIZE={world}")
    return Ranks(rank, world, local, False)


def detect_rank() -> tuple[int, int]:
    ranks = detect_ranks()
    return ranks.rank, ranks.world_size
