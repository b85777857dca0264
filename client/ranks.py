"""Which rank of how many this process is."""

from __future__ import annotations

import os


def detect_rank() -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed, else torchrun's env, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not inside WORLD_SIZE={world}")
    return rank, world
