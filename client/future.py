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
from typing import Callable


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
        self.replication: Callable[[float | None], None] | None = None
        """For a memory snapshot: waits for its replica on the buddy node (``wait_replicated``)."""

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until staging is finished; raises if staging failed."""
        self.staged.result(timeout)

    def wait_replicated(self, timeout: float | None = None) -> None:
        """Block until the snapshot is held (``result()``) and its replica is held by the buddy node's daemon too
        (``ckptd start --peer``): from then on it survives the loss of this node. Raises ``InvalidCheckpoint``
        if it will not be replicated (a disk save, no buddy, the buddy refused or could not be reached, or a
        newer snapshot of its directory was replicated first), ``TimeoutError`` after ``timeout`` seconds."""
        self.result(timeout)
        if self.replication is None:
            from ckptd.protocol.errors import InvalidCheckpoint

            raise InvalidCheckpoint("a disk save (persist=True) has no replica in a peer's memory: it is on disk")
        self.replication(timeout)
