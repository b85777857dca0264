"""Mirroring committed local checkpoints to an object store, in the background.

``ckptd start --mirror /ckpts/run=s3://bucket/run [--mirror-keep N]``: every
checkpoint committed under ``/ckpts/run`` is uploaded after its commit to
the same relative name under the prefix, shards first (each a multipart
upload through the storage seam, as a direct ``s3://`` save writes them),
the index last and create-only, so the mirrored copy exists for readers
only once it is whole. The training job never waits for it.

Whether a checkpoint is on the mirror is never remembered: every time it
is asked, the answer comes from the store, which holds it when its index
there is byte for byte the local one (so its files' sizes and checksums
too). So the state survives a stop or a crash, and a checkpoint saved again
under its name (``overwrite=True``) is not on the mirror until its new
version is: at start the mirror compares each DIR's committed checkpoints
with the store and queues what is missing, and local retention
(``unmirrored``) keeps every checkpoint whose current content is not (yet)
on the mirror, whether its upload is queued, retrying, failed for good or
was dropped by a stop. A stop waits for queued uploads up to its drain
deadline and logs what it leaves for the next start.

A mirror is a copy of its DIR, so a newer save of a name replaces the older
one on the store: its index is deleted first (the old version is then gone
for readers, never half replaced), the new shards are uploaded over the old
ones, the new index is written last, and only then are the old version's
objects the new one does not name removed. A crash in between leaves no
index on the store, and the local copy, not being on the mirror, stays
until the next start uploads it. An index on the store that is newer than
the local one, or as new but different, is another checkpoint of that name:
a permanent failure.

With ``--mirror-keep N``, a checkpoint older than the N newest on the store
beside it is not uploaded (mirror retention would delete it at once) and
counts as settled for local retention, so a restart does not upload again
what mirror retention deleted.

Local retention deferred for an upload runs once it is done: the retention
the checkpoint committed last beside it asked for (as its commit ran it), its
save's ``keep_last`` read from its index (so a restart does not forget it),
or the directory's ``--keep``.

A transient failure (endpoint down, timeouts) is retried without end, with
exponential backoff (``BACKOFF_S`` doubling to ``MAX_BACKOFF_S``) while the
other uploads go on; a permanent one (no such bucket, access denied, a newer
checkpoint of that name on the store) fails the upload at once and shows in
``ckptd status`` with its error, and the checkpoint stays local. Every
attempt, failure and retry shows in ``ckptd status`` and the metrics. After
each checkpoint's turn (uploaded or skipped), mirror retention keeps the
newest ``--mirror-keep`` of the checkpoints on the store beside it: only
what is there counts. Uploads run one checkpoint at a time on their own
thread, never on the daemon's write pools.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import INCOMPLETE_SUFFIX, INDEX_NAME, CheckpointIndex, committed_in, read_index
from ckptd.protocol.objects import display, is_permanent

from ckptd.storage.backends import Backends
from ckptd.storage.contract import Files, Kind
from ckptd.upkeep.retention import apply_retention

log = logging.getLogger("ckptd")
BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
CHUNK = 16 * 1024 * 1024
RECENT = 10
"""Finished uploads ``ckptd status`` still shows."""
ACTIVE = ("uploading", "retaining")
"""States of an upload the mirror thread is working on (``retaining``: uploaded or skipped, the retentions it
allows running): never picked again, and a commit meanwhile is uploaded after it."""
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
    """queued, uploading, retrying, uploaded, skipped (older than ``--mirror-keep`` keeps on the store) or failed
    (for good: the checkpoint stays local)."""
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

    storage: Backends
    rules: dict[Path, Path]
    keep: int | None = None
    uploads: dict[Path, Upload] = field(default_factory=dict)
    """Queued, running or retrying uploads."""
    failed: dict[Path, Upload] = field(default_factory=dict)
    """Uploads that failed for good since start: these checkpoints are only local."""
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    counts: dict[str, int] = field(default_factory=lambda: {"uploaded": 0, "skipped": 0, "failed": 0, "retries": 0})
    after_upload: Callable[[Path, int | None], None] | None = None
    """Called (on the mirror thread) after an upload with the newest local checkpoint beside the uploaded one
    and the ``keep_last`` that newest one's save asked for (from its index: a restart does not forget it)."""

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._again: set[Path] = set()
        """Checkpoints committed again while their upload ran: queued again when it ends."""
        self._closed = False
        self._retain_again: dict[Path, tuple[float, int]] = {}
        """Store directories whose ``--mirror-keep`` failed (an outage), by the one checkpoint there it runs
        beside: (when it runs again, how many times it failed). No upload need come there again to trim it."""
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
        """Queue ``checkpoint`` (just committed) for upload."""
        dest = self.target(checkpoint)
        if dest is None:
            return
        with self._cond:
            queued = self.uploads.get(checkpoint)
            if queued is not None and queued.state not in ACTIVE:
                return
            # one uploading is of the version before this commit (overwrite=True): upload again after it
            self.failed.pop(checkpoint, None)
            self._again.add(checkpoint)
            if queued is None:
                self._queue(checkpoint)
            self._cond.notify()

    def _queue(self, checkpoint: Path) -> None:
        """(Under the lock) the upload waiting in ``_again`` becomes a queued upload."""
        dest = self.target(checkpoint)
        assert dest is not None
        self._again.discard(checkpoint)
        self.uploads[checkpoint] = Upload(str(checkpoint), display(dest))

    def unmirrored(self, checkpoints: list[Path]) -> set[Path]:
        """Those of ``checkpoints`` under a rule that are not on the mirror: local retention keeps them.

        Asks the store every time (off the loop thread), never a memory of an
        earlier upload: the checkpoint may have been saved again since. A
        store that cannot be reached leaves every one of them unmirrored.
        """
        out = set()
        for checkpoint in checkpoints:
            if self.target(checkpoint) is None:
                continue
            try:
                if self._settled(checkpoint):
                    continue
            except (OSError, InvalidCheckpoint) as exc:
                log.info("event=mirror_unknown path=%s error=%s", checkpoint, getattr(exc, "message", exc))
            out.add(checkpoint)
        return out

    def idle(self) -> bool:
        """Whether no upload is queued, running or waiting for a retry (a ``--mirror-keep`` waiting for one does
        not hold a drain up: the next start's scan runs it)."""
        with self._cond:
            return not self.uploads

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"rules": {str(k): display(v) for k, v in self.rules.items()}, "keep": self.keep,
                    "uploads": [u.view() for u in self.uploads.values()], "recent": [u.view() for u in self.recent],
                    "unmirrored": [u.view() for u in self.failed.values()], **self.counts}

    def close(self) -> None:
        """Stop uploading; what is left is logged, and the next start queues it again (``_scan``)."""
        with self._cond:
            self._closed = True
            left = [str(p) for p, u in self.uploads.items() if u.state != "retaining"]  # those are on the store
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
                    retain = [d for d, (due, _) in self._retain_again.items() if due <= now]
                    if retain:
                        break
                    waiting = [(u.due, p) for p, u in self.uploads.items() if u.state not in ACTIVE]
                    ready = [w for w in waiting if w[0] <= now]
                    if ready:
                        checkpoint = min(ready)[1]
                        upload = self.uploads[checkpoint]
                        upload.state = "uploading"
                        break
                    dues = [w[0] for w in waiting] + [due for due, _ in self._retain_again.values()]
                    self._cond.wait(min(dues) - now if dues else None)
            if retain:
                for dest in retain:
                    self._retain_on_store(dest)
                continue
            self._attempt(checkpoint, upload)

    def _scan(self) -> None:
        """Queue every committed checkpoint under a rule's DIR that the store does not hold; then run
        ``--mirror-keep`` where they go: a daemon killed between an upload and the retention after it left the
        store holding one too many, and a start that uploads nothing there would never trim it."""
        beside: dict[Path, Path] = {}
        for local in self.rules:
            for checkpoint in self._committed_under(local, SCAN_DEPTH):
                if checkpoint in self.unmirrored([checkpoint]):
                    log.info("event=mirror_queued path=%s reason=not_on_mirror", checkpoint)
                    self.submit(checkpoint)
                dest = self.target(checkpoint)
                if dest is not None:
                    beside.setdefault(dest.parent, dest)
        for dest in beside.values():
            self._retain_on_store(dest)

    def _committed_under(self, directory: Path, depth: int) -> list[Path]:
        found = [path for _, path in committed_in(directory, self.storage.files)]
        if depth > 1:
            try:
                entries = self.storage.files.scandir(directory)
            except OSError:
                return found
            for entry in entries:
                if entry.kind is Kind.DIR and entry.path not in found and not entry.name.endswith(INCOMPLETE_SUFFIX):
                    found += self._committed_under(entry.path, depth - 1)
        return found

    def _settled(self, checkpoint: Path) -> bool:
        """Whether the mirror needs nothing more of ``checkpoint``: on it, or retired by ``--mirror-keep``."""
        index = read_index(checkpoint, self.storage.files)
        return self._on_mirror(checkpoint, index) or self._retired(checkpoint, index)

    def _on_mirror(self, checkpoint: Path, index: CheckpointIndex) -> bool:
        """Whether the store holds this version of the checkpoint: its index there is the local ``index``."""
        dest = self.target(checkpoint)
        assert dest is not None
        files = self.storage.files
        st = files.stat(dest / INDEX_NAME)
        if st is None:
            return False
        mine = index.to_json()
        return st.size == len(mine) and files.read(dest / INDEX_NAME, 0, st.size) == mine

    def _retired(self, checkpoint: Path, index: CheckpointIndex) -> bool:
        """Whether ``--mirror-keep`` newer checkpoints are on the store beside where ``checkpoint`` goes: its
        retention would delete this one at once (the order is retention's: ``committed_in``)."""
        if self.keep is None:
            return False
        dest = self.target(checkpoint)
        assert dest is not None
        mine = (index.step if index.step is not None else -1, index.created)
        beside = committed_in(dest.parent, self.storage.files)
        newer = [path for key, path in beside if key > mine and path != dest]
        return len(newer) >= self.keep

    def _attempt(self, checkpoint: Path, upload: Upload) -> None:
        dest = self.target(checkpoint)
        assert dest is not None
        upload.attempts += 1
        upload.started = upload.started or time.monotonic()
        skipped: str | None = None
        try:
            files = self.storage.files
            if files.stat(checkpoint / INDEX_NAME) is None:  # deleted (the user's retention) before its turn
                skipped = "deleted_locally"
            elif self._retired(checkpoint, index := read_index(checkpoint, files)):
                skipped = "older_than_mirror_keep"
            elif not self._on_mirror(checkpoint, index):
                self._upload(checkpoint, dest, index, upload)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, transient ones retried
            self._failed(checkpoint, upload, exc)
            return
        upload.seconds = time.monotonic() - upload.started
        upload.state = "retaining"
        # The retentions it allows run while it is still listed in ``uploads``: until they are done (or handed to
        # the maintenance thread) the daemon is not idle, and a store half-way through --mirror-keep's deletion
        # (index gone, shards left) is never shown as settled.
        self._retain_on_store(dest)
        try:  # local retention may now delete it: the retention the last one committed beside it asked for, again
            beside = committed_in(checkpoint.parent, self.storage.files)
            if self.after_upload is not None and beside:
                # the last committed, not the highest step: a commit's retention keeps the checkpoint it committed
                # (a rollback's lower step too), so the retention deferred for the mirror is that one's
                newest = max(beside, key=lambda found: found[0][1])[1]
                self.after_upload(newest, read_index(newest, self.storage.files).keep_last)
        except (OSError, InvalidCheckpoint) as exc:  # the checkpoint stays until the next retention
            log.error("event=mirror_local_retention_failed path=%s error=%r", checkpoint, exc)
        with self._cond:  # logged with its removal from ``uploads``: ``close`` lists only what is left
            upload.state, upload.error = "skipped" if skipped else "uploaded", None
            self.counts["skipped" if skipped else "uploaded"] += 1
            self._ended(checkpoint, upload)
            if skipped:
                log.info("event=mirror_skipped path=%s dest=%s reason=%s", checkpoint, upload.dest, skipped)
            else:
                log.info("event=mirrored path=%s dest=%s bytes=%d", checkpoint, upload.dest, upload.sent)

    def _retain_on_store(self, dest: Path) -> None:
        """``--mirror-keep`` beside ``dest``, counting only the checkpoints on the store.

        Run for the newest one there, never for ``dest`` itself: a skipped checkpoint (older than those kept,
        or deleted locally) is not on the store, and retention run for it counted it as one of the kept and
        deleted a newer one in its place. Uploads need not go in step order (a retry's backoff, a restart's
        scan), so the skipped one may well be the oldest. A run that fails (the store away: the listing, or a
        victim's deletion) runs again, backing off as uploads do, until it succeeds: else the store kept one
        too many for good where no upload came there again.
        """
        if self.keep is None:
            return
        failed: list[Path] = []
        try:
            beside = committed_in(dest.parent, self.storage.files)
            if beside:
                apply_retention(self.storage, beside[-1][1], self.keep, set(), spare_later=False, failed=failed)
        except Exception as exc:  # noqa: BLE001 - tried again below
            log.error("event=mirror_retention_failed path=%s error=%r", dest, exc)
            failed.append(dest)
        with self._cond:
            if not failed:
                self._retain_again.pop(dest, None)
                return
            tries = self._retain_again.get(dest, (0.0, 0))[1] + 1
            delay = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (tries - 1))
            self._retain_again[dest] = (time.monotonic() + delay, tries)
            log.warning("event=mirror_retention_retry path=%s attempt=%d in_s=%g", dest, tries, delay)

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
                self._ended(checkpoint, upload)
                if checkpoint not in self.uploads:  # not committed again meanwhile
                    self.failed[checkpoint] = upload
                return
            if checkpoint in self._again:  # committed again while this ran: the new version is queued at once
                self._ended(checkpoint, upload)
                return
            upload.state = "retrying"
            upload.due = time.monotonic() + min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (upload.attempts - 1))
            self.counts["retries"] += 1

    def _ended(self, checkpoint: Path, upload: Upload) -> None:
        """(Under the lock) ``upload`` is over; a commit of the same checkpoint meanwhile is queued now."""
        self.uploads.pop(checkpoint, None)
        self.recent.append(upload)
        if checkpoint in self._again:
            self._queue(checkpoint)
            self._cond.notify()

    def _upload(self, checkpoint: Path, dest: Path, index: CheckpointIndex, upload: Upload) -> None:
        """Shards, then the index, through the store's own checkpoint operations (``open_shard``, ``publish``):
        an older version of the checkpoint on the store is replaced by the store's one rule (retired first,
        its leftover objects removed by the publish; see ``ObjectCheckpoints.publish``)."""
        store, files = self.storage, self.storage.files  # each call on the backend its name is on
        upload.total, upload.sent = index.total_bytes, 0
        if files.stat(dest / INDEX_NAME) is not None:
            theirs = read_index(dest, files)
            if theirs.created >= index.created:
                raise FileExistsError(errno.EEXIST, f"another checkpoint of this name, saved at {theirs.created:.3f} "
                                      f"(this one at {index.created:.3f}), is on the mirror", display(dest))
            log.info("event=mirror_replacing path=%s dest=%s", checkpoint, upload.dest)
            store.set_aside(dest, marker=None)  # the old version is gone for readers before a shard changes
        for record in index.files:
            shard = store.open_shard(dest / record.file, direct=False)
            try:
                for offset in range(0, record.size, CHUNK):
                    want = min(CHUNK, record.size - offset)
                    data = files.read(checkpoint / record.file, offset, want)
                    if len(data) != want:
                        raise OSError(f"{checkpoint / record.file} ended early: changed while it was uploaded")
                    shard.write(memoryview(data), offset)
                    upload.sent += len(data)
                shard.finish(record.size)
            finally:
                shard.close()
        if read_index(checkpoint, files) != index:  # saved again while it was read: that version goes next
            raise OSError(errno.EAGAIN, "the checkpoint was saved again while it was uploaded", str(checkpoint))
        store.publish(dest, dest, index.to_json(), overwrite=True, publishing=nullcontext())
