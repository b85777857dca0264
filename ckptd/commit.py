"""Turning durable shards into a committed checkpoint, exactly once.

A checkpoint in progress lives at ``p.incomplete/``. Each rank's shard is
written and fsync'd there; when the last rank of the world is durable, the
index ``ckptd.json`` is written and fsync'd (the marker is written last),
``p.incomplete`` is renamed to ``p`` and the parent directory is fsync'd.
Only then are the ranks told ``Done``. If anything fails, ``p.incomplete``
is removed and no ``p`` appears.

All bookkeeping here runs on the server's socket thread; only ``finalize``
and ``discard`` do I/O, and the server runs those on its commit thread.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.protocol.errors import CheckpointExists, Conflict, PathNotAllowed, WriteFailed
from ckptd.protocol.index import INCOMPLETE_SUFFIX, CheckpointIndex, ShardRecord, incomplete_path, shard_name
from ckptd.protocol.messages import Commit

from .storage import Storage

_replaced = itertools.count()


@dataclass
class PendingCheckpoint:
    """A checkpoint some ranks have committed and that is not final yet."""

    path: Path
    world_size: int
    step: int | None
    overwrite: bool
    started_at: float = field(default_factory=time.monotonic)
    shards: dict[int, ShardRecord] = field(default_factory=dict)
    ranks_seen: set[int] = field(default_factory=set)
    waiting: list[tuple[bytes, int, int]] = field(default_factory=list)
    """(client, request id, rank) of every rank owed a Done or Error."""
    state: str = "writing"

    @property
    def incomplete(self) -> Path:
        return incomplete_path(self.path)

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.world_size

    def index(self) -> CheckpointIndex:
        files = tuple(self.shards[r] for r in sorted(self.shards))
        return CheckpointIndex(world_size=self.world_size, step=self.step, created=time.time(), files=files)


def resolve_path(raw: str, roots: tuple[Path, ...]) -> Path:
    """The final checkpoint path for ``raw``, if it lies under an allowed root.

    Symlinks and ``..`` in the parent are resolved first, so neither can lead
    the write outside the roots.
    """
    path = Path(raw)
    if not path.is_absolute():
        raise PathNotAllowed(f"checkpoint path {raw!r} must be absolute")
    if path.name in ("", ".", "..") or path.name.endswith(INCOMPLETE_SUFFIX):
        raise PathNotAllowed(f"checkpoint path {raw!r} must end in a name that is not {INCOMPLETE_SUFFIX!r}")
    final = Path(os.path.realpath(path.parent)) / path.name
    if not any(final.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise PathNotAllowed(f"checkpoint path {final} is outside the daemon's allowed roots ({allowed})")
    if final.is_symlink():
        raise PathNotAllowed(f"checkpoint path {final} is a symbolic link")
    return final


class Commits:
    """Checkpoints in progress on this daemon, by final path."""

    def __init__(self, storage: Storage, roots: tuple[Path, ...]) -> None:
        self.storage = storage
        self.roots = roots
        self.pending: dict[Path, PendingCheckpoint] = {}

    def admit(self, commit: Commit, client: bytes) -> tuple[PendingCheckpoint, Path]:
        """Register one rank's commit; returns its checkpoint and shard file path."""
        final = resolve_path(commit.path, self.roots)
        pending = self.pending.get(final)
        if pending is None:
            if os.path.lexists(final) and not commit.overwrite:
                raise CheckpointExists(f"checkpoint {final} already exists; pass overwrite=True to replace it")
            pending = PendingCheckpoint(final, commit.world_size, commit.step, commit.overwrite)
            self._prepare_directory(pending)
            self.pending[final] = pending
        elif pending.world_size != commit.world_size or pending.step != commit.step:
            raise Conflict(
                f"checkpoint {final} is being written with world size {pending.world_size} and step "
                f"{pending.step}; this commit says world size {commit.world_size}, step {commit.step}"
            )
        if commit.rank in pending.ranks_seen:
            raise Conflict(f"rank {commit.rank} of checkpoint {final} is already being written")
        pending.ranks_seen.add(commit.rank)
        pending.waiting.append((client, commit.id, commit.rank))
        return pending, pending.incomplete / shard_name(commit.rank, commit.world_size)

    def _prepare_directory(self, pending: PendingCheckpoint) -> None:
        """Create ``p.incomplete`` fresh; a leftover from a dead save is removed."""
        parent = pending.path.parent
        if os.path.lexists(parent) and not parent.is_dir():
            raise WriteFailed(f"cannot create {pending.incomplete}: {parent} is not a directory")
        try:
            os.makedirs(parent, exist_ok=True)
            if os.path.lexists(pending.incomplete):
                self.storage.remove_tree(pending.incomplete)
            self.storage.mkdir(pending.incomplete)
        except OSError as exc:
            raise WriteFailed(f"cannot create {pending.incomplete}: {exc.strerror or exc}") from None

    def shard_durable(self, pending: PendingCheckpoint, record: ShardRecord) -> bool:
        """Record a durable shard; True when the checkpoint can be finalized."""
        pending.shards[record.rank] = record
        if pending.complete:
            pending.state = "committing"
        return pending.complete

    def finalize(self, pending: PendingCheckpoint) -> None:
        """Index, rename, fsync the parent: the checkpoint becomes visible (I/O)."""
        storage, final = self.storage, pending.path
        replaced = None
        try:
            storage.write_file(pending.incomplete / "ckptd.json", pending.index().to_json())
            storage.fsync_dir(pending.incomplete)
            if os.path.lexists(final):
                if not pending.overwrite:
                    raise CheckpointExists(f"checkpoint {final} appeared while this one was written")
                replaced = final.with_name(f"{final.name}.replaced-{os.getpid()}-{next(_replaced)}{INCOMPLETE_SUFFIX}")
                storage.rename(final, replaced)
            storage.rename(pending.incomplete, final)
            storage.fsync_dir(final.parent)
        except OSError as exc:
            raise WriteFailed(f"committing {final} failed: {exc.strerror or exc}") from None
        if replaced is not None:
            storage.remove_tree(replaced)

    def discard(self, pending: PendingCheckpoint) -> None:
        """Remove what a failed checkpoint left behind (I/O)."""
        self.storage.remove_tree(pending.incomplete)

    def forget(self, pending: PendingCheckpoint) -> None:
        self.pending.pop(pending.path, None)
