"""The peer a trainer uses without ckptd: ``torch.save`` then ``fsync``.

``torch.save`` alone returns once the bytes are in the page cache, which is
not a checkpoint a crash leaves behind; the fair comparison with ckptd's
"durable" is ``torch.save`` + ``flush`` + ``fsync``. The trainer is blocked
for all of it, so its blocking time and its time to durable are the same
number. The time ``torch.save`` itself takes is kept too, to show how much
of the total is serialization and how much is the disk.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .limits import drop_cached
from .measure import Series


@dataclass
class TorchSaveResult:
    durable: Series = field(default_factory=Series)
    """``torch.save`` + ``fsync``: the caller is blocked for all of it."""
    serialize: Series = field(default_factory=Series)
    """``torch.save`` returning (bytes in the page cache, not yet durable)."""
    file_bytes: int = 0


def torch_save(state: Any, scratch: Path, repeat: int) -> TorchSaveResult:
    """One warm-up and ``repeat`` timed ``torch.save`` + ``fsync`` to a new file each."""
    result = TorchSaveResult()
    for i in range(1 + repeat):
        path = scratch / f"torch-save-{i}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            t1 = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        result.file_bytes = path.stat().st_size
        drop_cached(path)
        if i >= 1:
            result.serialize.add(t1 - t0)
            result.durable.add(t2 - t0)
    return result
