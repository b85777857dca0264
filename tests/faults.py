"""A storage that fails, delays or kills the daemon on cue (tests only).

Loaded by ``ckptd start --storage tests.faults:FaultyStorage`` with the
faults as JSON in ``CKPTD_FAULTS``; production code knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ckptd.storage.contract import Entry, LocalStorage, Space, Stat

log = logging.getLogger("ckptd")
SPEC = "tests.faults:FaultyStorage"
"""What ``--storage`` (or ``CKPTD_STORAGE``) names to load this class."""
ENV = "CKPTD_FAULTS"
COMPLETIONS = ("completion", "checksummed", "persist_end", "then", "ended")
"""The ops that are no storage call but a completion on the daemon's loop thread."""
POOL_WORK = "work"
"""The op that holds (``wait_for``) or delays the work submitted to a pool, on its worker thread."""


@dataclass(frozen=True)
class Fault:
    """Fail, delay or kill the daemon at calls of ``op`` whose path contains ``match``.

    ``op`` is one of open, write, fsync, write_file, fsync_dir, rename,
    exchange (the swap of an overwrite; its path is the final name), touch
    (owner markers), unlink, remove_tree, resolve (a checkpoint's parent, on the
    daemon's admit pool), scandir (a directory listed: retention lists the
    checkpoints' directory), stat (a file looked up: the start reads the run
    directory's list of directories saved into), and space: the filesystem reports
    no free space (until the ``wait_for`` file exists, if one is named). Each fault that acts logs
    ``event=fault`` first, so a test can tell which call it hit.

    Two are no storage calls: ``completion`` raises ``RuntimeError`` in the loop-thread completion of a shard's
    write into a checkpoint whose path matches (``Saves._write_finished``), and ``checksummed`` in that of a
    snapshot shard's checksum (``Holding._checksummed``), ``persist_end`` in the memory tier's handling of a
    snapshot's write to disk that ended (``Holding._judge_persist_end``), ``ended`` in the end hook of a
    checkpoint's or a snapshot's attempt (``Saves.ended``, ``Holding.ended``, which ``Registry.end`` calls): a
    defect of the daemon's own code that no storage call can reach (the loop thread does no I/O). The storage
    loaded into the daemon installs them.
    ``then`` raises in the loop-thread completion of any work submitted to the pool ``match`` names (``status``,
    ``peer`` (a stream to the buddy), ``peer_ask`` (a listing, a restore), ``replica`` (the buddy's offers and
    fetches); ``Workers.submit``): every one must reach its ``failed`` path, and through it whoever waits.
    ``work`` holds the work itself submitted to the pool ``match`` names, on its worker thread, before it runs
    (``wait_for``, ``delay``; with ``errno`` 0 it then runs): what the loop does meanwhile is what a slow pool
    lets happen (a failed snapshot's slots not yet handed back).
    """

    op: str
    match: str = ""
    errno: int = errno.EIO
    """Raise this OSError (0: do not raise)."""
    delay: float = 0.0
    """Seconds to sleep first."""
    kill: bool = False
    """SIGKILL the daemon itself: a crash at exactly this point."""
    after: bool = False
    """Act after the call succeeded instead of before it."""
    wait_for: str = ""
    """Block until this file exists (at most a minute): the test says when the call may go on."""
    exact: bool = False
    """Match only the path equal to ``match`` (a directory, not the names below it)."""
    armed_by: str = ""
    """Act only once this file exists: calls before it pass (a ``Status`` fault the daemon's start must not meet)."""
    skip: int = 0
    """Let this many matching calls through before acting (a snapshot held at a path, then its replacement hit)."""
    defect: bool = False
    """Raise ``RuntimeError`` instead of an ``OSError``: a defect of the daemon's code under a storage call, which no
    handler of storage errors catches (``space`` raises it too, where it otherwise reports a full filesystem)."""

    def hits(self, op: str, where: str, after: bool) -> bool:
        matches = where == self.match if self.exact else self.match in where
        armed = not self.armed_by or os.path.exists(self.armed_by)
        return self.op == op and self.after == after and matches and armed


class FaultyStorage(LocalStorage):
    """The local filesystem, with the faults listed in ``CKPTD_FAULTS`` injected.

    The daemon's checkpoint operations on local names (``ckptd/storage/local.py``: a shard's writer,
    publish, discard, set aside) run on it, so each fault acts inside the operation that makes the call.
    """

    def __init__(self, faults: list[Fault] | None = None) -> None:
        if faults is None:
            faults = [Fault(**f) for f in json.loads(os.environ.get(ENV) or "[]")]
        self.faults = faults
        self._paths: dict[int, str] = {}
        self._hits: dict[int, int] = {}
        """Matching calls seen per fault (by its place in ``faults``), for ``skip``."""
        if any(f.op in (*COMPLETIONS, POOL_WORK) for f in faults):
            self._install_completion_faults()

    def _install_completion_faults(self) -> None:
        from ckptd.lifecycle.holding import Holding
        from ckptd.lifecycle.saves import Saves

        write_finished, checksummed, inject = Saves._write_finished, Holding._checksummed, self._inject

        def raising(saves, write, pending, fut):  # noqa: ANN001, ANN202 - Saves._write_finished's own signature
            inject("completion", str(pending.path))
            return write_finished(saves, write, pending, fut)

        def raising_held(holding, ident, msg, snap, shard, fut):  # noqa: ANN001, ANN202 - Holding._checksummed's own
            inject("checksummed", str(snap.path))
            return checksummed(holding, ident, msg, snap, shard, fut)

        judge_persist_end = Holding._judge_persist_end

        def raising_end(holding, snap, error):  # noqa: ANN001, ANN202 - Holding._judge_persist_end's own signature
            inject("persist_end", str(snap.path))
            return judge_persist_end(holding, snap, error)

        Saves._write_finished, Holding._checksummed, Holding._judge_persist_end = raising, raising_held, raising_end

        def raising_ended(hook):  # noqa: ANN001, ANN202 - a pipeline's ``ended``, its own signature kept
            def ended(pipeline, attempt, state, error, reason):  # noqa: ANN001, ANN202
                inject("ended", str(attempt.path))
                return hook(pipeline, attempt, state, error, reason)
            return ended

        Saves.ended, Holding.ended = raising_ended(Saves.ended), raising_ended(Holding.ended)

        from ckptd.core.workers import Workers

        submit = Workers.submit

        def raising_then(workers, pool, work, then, failed):  # noqa: ANN001, ANN202 - Workers.submit's own signature
            def then_or_defect(fut):  # noqa: ANN001, ANN202
                inject("then", pool)
                return then(fut)

            def held_work():  # noqa: ANN202 - the work's own result
                inject(POOL_WORK, pool)
                return work()
            return submit(workers, pool, held_work, then_or_defect, failed)

        Workers.submit = raising_then

    def _inject(self, op: str, where: str, *, after: bool = False) -> None:
        for i, f in enumerate(self.faults):
            # a ``space`` fault that is no defect reports a full filesystem instead (``space``)
            if f.hits(op, where, after) and (op != "space" or f.defect) and self._past_skip(i):
                raises = "defect" if op in COMPLETIONS or f.defect else f"errno={f.errno}" if f.errno else ""
                action = "kill" if f.kill else raises or f"delay={f.delay:g}"
                log.warning("event=fault op=%s after=%s action=%s path=%s", op, after, action, where)
                if f.delay:
                    time.sleep(f.delay)
                deadline = time.monotonic() + 60
                while f.wait_for and not os.path.exists(f.wait_for) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if f.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                if op in COMPLETIONS or f.defect:
                    raise RuntimeError(f"injected defect in the {op} of {where}")
                if f.errno:
                    raise OSError(f.errno, f"{os.strerror(f.errno)} (injected)", where)

    def _past_skip(self, i: int) -> bool:
        """Whether fault ``i``, which matches this call, acts on it (it has let its ``skip`` calls through)."""
        self._hits[i] = self._hits.get(i, 0) + 1
        return self._hits[i] > self.faults[i].skip

    def _around(self, op: str, where: str, call, *args, **kwargs):
        self._inject(op, where)
        result = call(*args, **kwargs)
        self._inject(op, where, after=True)
        return result

    def open_new(self, path: Path, *, direct: bool) -> tuple[int, bool]:
        self._inject("open", str(path))
        fd, is_direct = super().open_new(path, direct=direct)
        self._paths[fd] = str(path)
        return fd, is_direct

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return self._around("write", self._paths.get(fd, ""), super().pwrite, fd, data, offset)

    def fsync(self, fd: int) -> None:
        self._around("fsync", self._paths.get(fd, ""), super().fsync, fd)

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)

    def write_file(self, path: Path, data: bytes) -> None:
        self._around("write_file", str(path), super().write_file, path, data)

    def fsync_dir(self, path: Path) -> None:
        self._around("fsync_dir", str(path), super().fsync_dir, path)

    def rename(self, src: Path, dst: Path) -> None:
        self._around("rename", str(dst), super().rename, src, dst)

    def exchange(self, a: Path, b: Path) -> None:
        self._around("exchange", str(b), super().exchange, a, b)

    def touch(self, path: Path) -> None:
        self._around("touch", str(path), super().touch, path)

    def unlink(self, path: Path) -> None:
        self._around("unlink", str(path), super().unlink, path)

    def stat(self, path: Path, *, follow: bool = False) -> Stat | None:
        return self._around("stat", str(path), super().stat, path, follow=follow)

    def scandir(self, path: Path) -> list[Entry]:
        return self._around("scandir", str(path), super().scandir, path)

    def resolve(self, path: Path) -> Path:
        return self._around("resolve", str(path), super().resolve, path)

    def space(self, path: Path) -> Space:
        self._inject("space", str(path))  # only its ``defect`` faults raise; the others report the space as full
        room = super().space(path)
        for f in self.faults:
            if f.hits("space", str(path), False) and not f.defect and not (f.wait_for and os.path.exists(f.wait_for)):
                log.warning("event=fault op=space action=full path=%s", path)
                return dataclasses.replace(room, free=0)
        return room

    def remove_tree(self, path: Path) -> None:
        self._around("remove_tree", str(path), super().remove_tree, path)
