"""What ``ckptd status`` reports: counters, and the snapshot of a narrow view of the node state.

The snapshot is a plain dict (msgpack on the wire, JSON from the CLI). Its
keys are documented in docs/status.md and checked against it by a test; add keys, never
rename them. ``snapshot`` reads only memory (on the loop thread);
``add_filesystems`` adds the numbers that need a system call per
filesystem and runs on a worker.
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import psutil

from ckptd.protocol import __version__
from ckptd.protocol.objects import display
from ckptd.protocol.shm import shm_usage

from ckptd.core.config import DaemonConfig
from ckptd.core.events import Committed, Failed, ReplicaEnded, SnapshotDropped, SnapshotFailed, SnapshotHeld
from ckptd.storage.backends import Backends


class NodeView(Protocol):
    """What status may read of the node state (``lifecycle/state.NodeState`` is one). Its writes and checkpoints
    are the lifecycle's (``lifecycle/writer.ShardWrite``, ``lifecycle/commit.PendingCheckpoint``), typed ``Any`` here:
    this ground never imports the lifecycle above it."""

    draining: bool
    writes: list[Any]
    """Shard writes admitted and not yet ended (``ShardWrite``)."""

    @property
    def client_records(self) -> Iterable[Any]: ...
    @property
    def checkpoints(self) -> Iterable[Any]: ...
    @property
    def shm_mapped_bytes(self) -> int: ...
    @property
    def shm_dir(self) -> Path: ...
    def lease_status(self) -> Mapping[str, Any]: ...
    def memory_status(self) -> Mapping[str, Any]: ...

RECENT_ERRORS = 20


class Stats:
    """Counters kept from the lifecycle's events (``server.py`` subscribes them) and the errors reported."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.started = time.time()
        self.committed_count = 0
        self.committed_bytes = 0
        self.last_committed: dict[str, Any] | None = None
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_ERRORS)
        self.errors_total = 0
        self.failed_count = 0
        self.snapshots_held = 0
        self.snapshots_dropped = 0
        self.snapshots_failed = 0
        self.replicas_ended: collections.Counter[str] = collections.Counter()
        """Replicas held for peers that ended, by ``dropped`` / ``adopted``."""
        self.process = psutil.Process()

    def committed(self, event: Committed) -> None:
        self.committed_count += 1
        self.committed_bytes += event.nbytes
        self.last_committed = {
            "path": display(event.path),
            "step": event.step,
            "bytes": event.nbytes,
            "seconds": round(event.seconds, 6),
            "gbps": round(event.nbytes / event.seconds / 1e9, 3) if event.seconds > 0 else None,
            "time": time.time(),
        }

    def failed(self, event: Failed) -> None:
        self.failed_count += 1

    def held(self, event: SnapshotHeld) -> None:
        self.snapshots_held += 1

    def dropped(self, event: SnapshotDropped) -> None:
        self.snapshots_dropped += 1

    def snapshot_failed(self, event: SnapshotFailed) -> None:
        self.snapshots_failed += 1

    def replica_ended(self, event: ReplicaEnded) -> None:
        self.replicas_ended["adopted" if event.adopted else "dropped"] += 1

    def replica_totals(self) -> dict[str, int]:
        """The ``peers.replicas_held`` counters of ``ckptd status``: replicas ended since start."""
        return {"dropped_total": self.replicas_ended["dropped"], "adopted_total": self.replicas_ended["adopted"]}

    def error(self, message: str) -> None:
        self.errors.append({"time": time.time(), "message": message})
        self.errors_total += 1

    def status(self, view: NodeView) -> dict[str, Any]:
        """Everything but the filesystems' numbers, from memory (the loop thread)."""
        now = time.monotonic()
        saves = [
            {
                "path": display(job.checkpoint),
                "rank": job.msg.rank,
                "world_size": job.msg.world_size,
                "state": job.state.value,
                "bytes": job.msg.nbytes,
                "written": job.written,
                "staged": job.progress.staged,
                "waited_s": round((job.started_at or now) - job.queued_at, 6),
                "elapsed_s": round(now - job.queued_at, 6),
            }
            for job in view.writes
        ]
        checkpoints = [
            {
                "path": display(p.path),
                "step": p.step,
                "world_size": p.world_size,
                "ranks_durable": len(p.shards),
                "state": p.state.value,
                "elapsed_s": round(now - p.started_at, 6),
            }
            for p in view.checkpoints
        ]
        info = {
            "daemon": {
                "pid": os.getpid(),
                "version": __version__,
                "uptime_s": round(time.time() - self.started, 3),
                "endpoint": self.config.endpoint,
                "run_dir": str(self.config.run_dir),
                "draining": view.draining,
                "rss_bytes": self.process.memory_info().rss,
                "cpu_percent": self.process.cpu_percent(None),
            },
            "clients": [
                {"pid": c.pid, "since": c.since, "saves": c.saves, "waited_s": round(c.waited_s, 6),
                 "last_waited_s": round(c.last_waited_s, 6)}
                for c in view.client_records
            ],
            "writes": {
                "max_concurrent": self.config.max_concurrent_writes,
                "writing": sum(1 for j in view.writes if j.state != "queued"),
                "queued": sum(1 for j in view.writes if j.state == "queued"),
                "throughput_bps": _throughput(view.writes, now),
            },
            "saves": saves,
            "checkpoints": checkpoints,
            "completed": {
                "count": self.committed_count,
                "bytes": self.committed_bytes,
                "failed": self.failed_count,
                "last": self.last_committed,
            },
            "errors": list(self.errors),
            "errors_total": self.errors_total,
            "shm_mapped_bytes": view.shm_mapped_bytes,
            "shm": {"dir": str(view.shm_dir), "total_bytes": None, "free_bytes": None},
            "loads": dict(view.lease_status()),
            "memory": {**view.memory_status(), "held_total": self.snapshots_held,
                       "dropped_total": self.snapshots_dropped, "failed_total": self.snapshots_failed},
            "roots": [{"path": display(r), "free_bytes": None, "total_bytes": None} for r in self.config.roots],
        }
        return info


def add_filesystems(info: dict[str, Any], storage: Backends) -> dict[str, Any]:
    """Fill in the roots' and the slot directory's free space (a system call each: off the loop)."""
    info["shm"] = shm_usage(Path(info["shm"]["dir"]))
    info["roots"] = [_root_usage(storage, Path(r["path"])) for r in info["roots"]]
    return info


def _throughput(jobs: list, now: float) -> float:
    """Bytes per second written right now, over the shards being written."""
    active = [j for j in jobs if j.started_at is not None and j.written]
    return round(sum(j.written / max(now - j.started_at, 1e-6) for j in active), 1)


def _root_usage(storage: Backends, root: Path) -> dict[str, Any]:
    try:
        space = storage.files.space(root)
    except OSError:
        return {"path": display(root), "free_bytes": None, "total_bytes": None}
    if not space.bounded:  # a store enforces its own quotas: it has no free space to show
        return {"path": display(root), "free_bytes": None, "total_bytes": None, "object_store": True}
    return {"path": display(root), "free_bytes": space.free, "total_bytes": space.total}
