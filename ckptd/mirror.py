"""Mirroring committed local checkpoints to an object store, in the background.

``ckptd start --mirror /ckpts/run=s3://bucket/run [--mirror-keep N]``: every
checkpoint committed under ``/ckpts/run`` is uploaded after its commit to
the same relative name under the prefix, shards first (each a multipart
upload through the storage seam, as a direct ``s3://`` save writes them),
the index last and create-only, so the mirrored copy exists for readers
only once it is whole. The training job never waits for it.

A failed upload is retried ``RETRIES`` times with exponential backoff
(``BACKOFF_S``, doubling); every attempt, failure and retry shows in
``ckptd status`` and the metrics. After an upload, mirror retention keeps the
newest ``--mirror-keep`` checkpoints beside it on the store; local retention
never deletes a checkpoint whose upload is queued or running (``busy``).
Uploads run one checkpoint at a time on their own thread, never on the
daemon's write pools.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptd.protocol.index import INDEX_NAME
from ckptd.protocol.objects import display

from .catalog import read_index
from .retention import apply_retention
from .storage import Storage

log = logging.getLogger("ckptd")
RETRIES = 5
BACKOFF_S = 1.0
CHUNK = 16 * 1024 * 1024
RECENT = 10
"""Finished uploads ``ckptd status`` still shows."""


@dataclass
class Upload:
    """One checkpoint on its way to the mirror (``ckptd status`` shows these fields)."""

    source: str
    dest: str
    total: int = 0
    sent: int = 0
    state: str = "queued"
    """queued, uploading, retrying, uploaded or failed."""
    attempts: int = 0
    error: str | None = None
    started: float | None = None
    seconds: float | None = None

    def view(self) -> dict[str, Any]:
        out = asdict(self)
        elapsed = self.seconds if self.seconds is not None else (time.monotonic() - self.started if self.started else 0)
        out["throughput_bps"] = self.sent / elapsed if elapsed > 0 else 0.0
        del out["started"]
        return out


@dataclass
class Mirrors:
    """The ``--mirror`` rules and their uploads (``submit``/``busy``/``snapshot`` run on the loop thread)."""

    storage: Storage
    rules: dict[Path, Path]
    keep: int | None = None
    uploads: dict[Path, Upload] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    counts: dict[str, int] = field(default_factory=lambda: {"uploaded": 0, "failed": 0, "retries": 0})

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-mirror")

    def target(self, checkpoint: Path) -> Path | None:
        """Where ``checkpoint`` is mirrored (the longest matching rule), or None."""
        matches = [d for d in self.rules if checkpoint.parent.is_relative_to(d)]
        if not matches:
            return None
        local = max(matches, key=lambda d: len(d.parts))
        return self.rules[local] / checkpoint.relative_to(local)

    def submit(self, checkpoint: Path) -> None:
        dest = self.target(checkpoint)
        if dest is None:
            return
        upload = Upload(str(checkpoint), display(dest))
        with self._lock:
            self.uploads[checkpoint] = upload
        self._pool.submit(self._run, checkpoint, dest, upload)

    def busy(self) -> set[Path]:
        """Local checkpoints whose upload is queued or running: local retention keeps them."""
        with self._lock:
            return set(self.uploads)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"rules": {str(k): display(v) for k, v in self.rules.items()}, "keep": self.keep,
                    "uploads": [u.view() for u in self.uploads.values()], "recent": [u.view() for u in self.recent],
                    **self.counts}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, checkpoint: Path, dest: Path, upload: Upload) -> None:
        upload.started = time.monotonic()
        try:
            for attempt in range(RETRIES + 1):
                upload.attempts, upload.state = attempt + 1, "uploading"
                try:
                    self._upload(checkpoint, dest, upload)
                    break
                except Exception as exc:  # noqa: BLE001 - every failure is retried, then reported
                    upload.error = getattr(exc, "message", None) or f"{getattr(exc, 'strerror', None) or exc}"
                    log.warning("event=mirror_failed path=%s dest=%s attempt=%d error=%s", checkpoint,
                                upload.dest, attempt + 1, upload.error)
                    if attempt == RETRIES:
                        upload.state = "failed"
                        self.counts["failed"] += 1
                        return
                    upload.state = "retrying"
                    self.counts["retries"] += 1
                    time.sleep(BACKOFF_S * 2 ** attempt)
            upload.state, upload.error = "uploaded", None
            self.counts["uploaded"] += 1
            log.info("event=mirrored path=%s dest=%s bytes=%d", checkpoint, upload.dest, upload.sent)
            if self.keep is not None:
                apply_retention(self.storage, dest, self.keep, set())
        finally:
            upload.seconds = time.monotonic() - upload.started
            with self._lock:
                self.uploads.pop(checkpoint, None)
                self.recent.append(upload)

    def _upload(self, checkpoint: Path, dest: Path, upload: Upload) -> None:
        """Shards through the seam (multipart, parts in parallel), then the index, create-only."""
        storage = self.storage
        index = read_index(storage, checkpoint)
        upload.total, upload.sent = index.total_bytes, 0
        if storage.stat(dest / INDEX_NAME) is not None:
            raise FileExistsError(f"{display(dest)} already exists on the mirror")
        for record in index.files:
            fd, _ = storage.open_new(dest / record.file, direct=False)
            try:
                for offset in range(0, record.size, CHUNK):
                    want = min(CHUNK, record.size - offset)
                    data = storage.read(checkpoint / record.file, offset, want)
                    if len(data) != want:
                        raise OSError(f"{checkpoint / record.file} ended early: changed while it was uploaded")
                    storage.pwrite(fd, memoryview(data), offset)
                    upload.sent += len(data)
                storage.fsync(fd)
            finally:
                storage.close(fd)
        storage.write_file(dest / INDEX_NAME, index.to_json())
