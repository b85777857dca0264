"""Mirroring committed local checkpoints to an object store, in the background.

``ckptd start --mirror /ckpts/run=s3://bucket/run [--mirror-keep N]``: every
checkpoint committed under ``/ckpts/run`` is uploaded after its commit to
the same relative name under the prefix, shards first (each a multipart
upload through the storage seam, as a direct ``s3://`` save writes them),
the index last and create-only, so the mirrored copy exists for readers
only once it is whole. The training job never waits for it.

Whether a checkpoint is on the mirror is never remembered in memory only:
it is on the mirror when the store holds an index there equal to the local
one. So the state survives a stop or a crash: at start the mirror compares
each DIR's committed checkpoints with the store and queues what is missing,
and local retention (``unmirrored``) keeps every checkpoint not (yet) on
the mirror, whether its upload is queued, retrying, failed for good or was
dropped by a stop. A stop waits for queued uploads up to its drain deadline
and logs what it leaves for the next start.

A transient failure (endpoint down, timeouts) is retried without end, with
exponential backoff (``BACKOFF_S`` doubling to ``MAX_BACKOFF_S``) while the
other uploads go on; a permanent one (no such bucket, access denied, another
checkpoint of that name on the store) fails the upload at once and shows in
``ckptd status`` with its error, and the checkpoint stays local. Every
attempt, failure and retry shows in ``ckptd status`` and the metrics. After
an upload, mirror retention keeps the newest ``--mirror-keep`` checkpoints
beside it on the store. Uploads run one checkpoint at a time on their own
thread, never on the daemon's write pools.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import INCOMPLETE_SUFFIX, INDEX_NAME
from ckptd.protocol.objects import display, is_permanent

from .catalog import committed_in, read_index
from .retention import apply_retention
from .storage import Kind, Storage

log = logging.getLogger("ckptd")
BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
CHUNK = 16 * 1024 * 1024
RECENT = 10
"""Finished uploads ``ckptd status`` still shows."""
SCAN_DEPTH = 4
"""How deep under a mirrored DIR the start-up scan looks for committed checkpoints."""


@dataclass
class Upload:
    """One checkpoint on its way to the mirror (``ckptd status`` shows these fields)."""

    source: str
    dest: str
    total: int = 0
    sent: int = 0
    state: str = "queued"
    """queued, uploading, retrying, uploaded or failed (for good: the checkpoint stays local)."""
    attempts: int = 0
    error: str | None = None
    started: float | None = None
    seconds: float | None = None
    due: float = 0.0
    """When the next attempt may start (monotonic): a retry waits its backoff without holding up others."""

    def view(self) -> dict[str, Any]:
        out = asdict(self)
        elapsed = self.seconds if self.seconds is not None else (time.monotonic() - self.started if self.started else 0)
        out["throughput_bps"] = self.sent / elapsed if elapsed > 0 else 0.0
        del out["started"], out["due"]
        return out


@dataclass
class Mirrors:
    """The ``--mirror`` rules and their uploads (``submit``/``snapshot``/``idle`` run on the loop thread)."""

    storage: Storage
    rules: dict[Path, Path]
    keep: int | None = None
    uploads: dict[Path, Upload] = field(default_factory=dict)
    """Queued, running or retrying uploads."""
    failed: dict[Path, Upload] = field(default_factory=dict)
    """Uploads that failed for good since start: these checkpoints are only local."""
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    counts: dict[str, int] = field(default_factory=lambda: {"uploaded": 0, "failed": 0, "retries": 0})
    after_upload: Callable[[Path], None] | None = None
    """Called (on the mirror thread) after an upload with the newest local checkpoint beside the uploaded one."""

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._mirrored: set[Path] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ckptd-mirror", daemon=True)

    def start(self) -> None:
        """Compare each DIR with the store, queue what is missing, then upload as checkpoints commit."""
        self._thread.start()

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
        with self._cond:
            if checkpoint in self.uploads:
                return
            self.failed.pop(checkpoint, None)
            self.uploads[checkpoint] = Upload(str(checkpoint), display(dest))
            self._cond.notify()

    def unmirrored(self, checkpoints: list[Path]) -> set[Path]:
        """Those of ``checkpoints`` under a rule that are not on the mirror: local retention keeps them.

        Asks the store (off the loop thread): a store that cannot be reached
        leaves every one of them unmirrored.
        """
        out = set()
        for checkpoint in checkpoints:
            with self._cond:
                known = checkpoint in self._mirrored and checkpoint not in self.uploads
            if known or self.target(checkpoint) is None:
                continue
            try:
                if self._on_mirror(checkpoint):
                    continue
            except (OSError, InvalidCheckpoint) as exc:
                log.info("event=mirror_unknown path=%s error=%s", checkpoint, getattr(exc, "message", exc))
            out.add(checkpoint)
        return out

    def unmirrored_beside(self, newest: Path) -> set[Path]:
        """``unmirrored`` for the committed checkpoints beside ``newest`` (what its retention may delete)."""
        if self.target(newest) is None:
            return set()
        return self.unmirrored([path for _, path in committed_in(self.storage, newest.parent)])

    def idle(self) -> bool:
        """Whether no upload is queued, running or waiting for a retry."""
        with self._cond:
            return not self.uploads

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return {"rules": {str(k): display(v) for k, v in self.rules.items()}, "keep": self.keep,
                    "uploads": [u.view() for u in self.uploads.values()], "recent": [u.view() for u in self.recent],
                    "unmirrored": [u.view() for u in self.failed.values()], **self.counts}

    def close(self) -> None:
        """Stop uploading; what is left is logged, and the next start queues it again (``_scan``)."""
        with self._cond:
            self._closed = True
            left = [str(p) for p in self.uploads]
            self._cond.notify()
        if left:
            log.warning("event=mirror_left count=%d paths=%s note=uploaded_at_next_start", len(left), ",".join(left))

    # -- the mirror thread ----------------------------------------------------

    def _loop(self) -> None:
        self._scan()
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    waiting = [(u.due, p) for p, u in self.uploads.items() if u.state != "uploading"]
                    ready = [w for w in waiting if w[0] <= now]
                    if ready:
                        checkpoint = min(ready)[1]
                        upload = self.uploads[checkpoint]
                        upload.state = "uploading"
                        break
                    self._cond.wait(min(w[0] for w in waiting) - now if waiting else None)
            self._attempt(checkpoint, upload)

    def _scan(self) -> None:
        """Queue every committed checkpoint under a rule's DIR that the store does not hold."""
        for local in self.rules:
            for checkpoint in self._committed_under(local, SCAN_DEPTH):
                if checkpoint in self.unmirrored([checkpoint]):
                    log.info("event=mirror_queued path=%s reason=not_on_mirror", checkpoint)
                    self.submit(checkpoint)

    def _committed_under(self, directory: Path, depth: int) -> list[Path]:
        found = [path for _, path in committed_in(self.storage, directory)]
        if depth > 1:
            try:
                entries = self.storage.scandir(directory)
            except OSError:
                return found
            for entry in entries:
                if entry.kind is Kind.DIR and entry.path not in found and not entry.name.endswith(INCOMPLETE_SUFFIX):
                    found += self._committed_under(entry.path, depth - 1)
        return found

    def _on_mirror(self, checkpoint: Path) -> bool:
        """Whether the store holds this checkpoint: its index there equals the local one (remembered once true)."""
        dest = self.target(checkpoint)
        assert dest is not None
        st = self.storage.stat(dest / INDEX_NAME)
        if st is None:
            return False
        mine = read_index(self.storage, checkpoint).to_json()
        same = st.size == len(mine) and self.storage.read(dest / INDEX_NAME, 0, st.size) == mine
        if same:
            with self._cond:
                self._mirrored.add(checkpoint)
        return same

    def _attempt(self, checkpoint: Path, upload: Upload) -> None:
        dest = self.target(checkpoint)
        assert dest is not None
        upload.attempts += 1
        upload.started = upload.started or time.monotonic()
        try:
            if not self._on_mirror(checkpoint):
                self._upload(checkpoint, dest, upload)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, transient ones retried
            self._failed(checkpoint, upload, exc)
            return
        with self._cond:  # logged with its removal from ``uploads``: ``close`` lists only what is left
            self._mirrored.add(checkpoint)
            upload.state, upload.error = "uploaded", None
            upload.seconds = time.monotonic() - upload.started
            self.counts["uploaded"] += 1
            self.uploads.pop(checkpoint, None)
            self.recent.append(upload)
            log.info("event=mirrored path=%s dest=%s bytes=%d", checkpoint, upload.dest, upload.sent)
        try:
            if self.keep is not None:
                apply_retention(self.storage, dest, self.keep, set())
        except Exception as exc:  # noqa: BLE001 - the upload stands; retention reports its own failure
            log.error("event=mirror_retention_failed path=%s error=%r", checkpoint, exc)
        try:
            beside = committed_in(self.storage, checkpoint.parent)
            if self.after_upload is not None and beside:
                self.after_upload(beside[-1][1])  # local retention may now delete it: run it for the newest there
        except OSError as exc:  # the checkpoint stays until the next retention
            log.error("event=mirror_local_retention_failed path=%s error=%r", checkpoint, exc)

    def _failed(self, checkpoint: Path, upload: Upload, exc: Exception) -> None:
        upload.error = getattr(exc, "message", None) or " ".join(
            str(x) for x in (getattr(exc, "strerror", None) or exc, getattr(exc, "filename", None) or "") if x)
        permanent = is_permanent(exc)
        log.warning("event=mirror_failed path=%s dest=%s attempt=%d permanent=%s error=%s", checkpoint,
                    upload.dest, upload.attempts, permanent, upload.error)
        with self._cond:
            if permanent:
                upload.state, upload.seconds = "failed", time.monotonic() - upload.started
                self.counts["failed"] += 1
                self.uploads.pop(checkpoint, None)
                self.failed[checkpoint] = upload
                self.recent.append(upload)
                return
            upload.state = "retrying"
            upload.due = time.monotonic() + min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (upload.attempts - 1))
            self.counts["retries"] += 1

    def _upload(self, checkpoint: Path, dest: Path, upload: Upload) -> None:
        """Shards through the seam (multipart, parts in parallel), then the index, create-only."""
        storage = self.storage
        index = read_index(storage, checkpoint)
        upload.total, upload.sent = index.total_bytes, 0
        if storage.stat(dest / INDEX_NAME) is not None:
            raise FileExistsError(errno.EEXIST, "another checkpoint of this name is on the mirror", display(dest))
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
