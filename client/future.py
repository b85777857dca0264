"""What ``save_async`` returns: one future, two moments.

``SaveFuture`` is a ``concurrent.futures.Future`` that resolves with a
``SaveResult`` once the checkpoint is durable and committed under its final
name, or fails with a typed ``ckptd`` error. Its ``staged`` future resolves
earlier, when the tensors have been copied into shared memory: from then on
the caller may change them (run ``optimizer.step()``).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SaveResult:
    path: Path | str
    """Final path of the committed checkpoint: a Path, or the ``s3://bucket/key`` URL (a str) on an object store."""
    bytes_written: int
    """Bytes of this rank's shard."""
    seconds: float
    """From ``save_async`` being called to the commit being durable."""
    step: int | None


class SaveFuture(Future):
    """Resolves when durable; ``staged`` resolves when the tensors may change."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: Future = Future()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until staging is finished; raises if staging failed."""
        self.staged.result(timeout)
