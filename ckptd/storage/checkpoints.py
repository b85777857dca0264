"""The checkpoint operations the daemon's lifecycle calls: written once on a backend's file operations, with the
few steps that differ left to the backend (``local.py``: publish by rename; ``store.py``: by the index last).

Commit, admission, the memory tier, retention, the mirror and the sweep ask a
backend to do something with a checkpoint: resolve a user's path, admit a save
(or a snapshot) to a name, begin an attempt, check its shards, publish it,
discard it, delete a committed one, list the attempts a directory holds. They
never ask which backend it is. Where the backends differ (a name replaced in
place or never; a check that costs nothing here and a request there; a
directory or a prefix), the difference lives inside the operation, behind the
private hooks each backend sets (``_early``, ``_replace_refusal``, ``_blocked``,
``_guard``, ``_listed_attempt``).

Every operation is I/O: the admit, commit and maintenance pools call them.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

from ckptd.protocol.errors import CheckpointExists, CkptdError, InvalidCheckpoint, PathNotAllowed, WriteFailed
from ckptd.protocol.index import CHECKSUM_ALGORITHM, INCOMPLETE_SUFFIX, INDEX_NAME, committed_in, read_index
from ckptd.protocol.inspect import read_shard_header
from ckptd.protocol.objects import display, is_permanent

from ckptd.storage.contract import Files, Kind, ShardWriter, Space
from ckptd.storage.ownership import (
    check_replaceable, is_owner_marker, owner_marker, release, remove_markers, why_not_leftover, why_not_replaceable,
)

log = logging.getLogger("ckptd")


class Checkpoints:
    """What a checkpoint needs of storage, on the backend whose file operations are ``files``.

    ``attempt`` is always ``incomplete_path(final)``; ``final`` the name readers see.
    """

    _early: ClassVar[bool] = True
    """Whether what is at a name is asked before a save is accepted (it costs nothing a save would notice);
    otherwise ``begin`` asks, after Accepted and before anything is written."""

    def __init__(self, files: Files) -> None:
        self.files = files

    # -- what an attempt asks of the backend it was bound to at admission -----------------------------------------

    def space(self, directory: Path) -> Space:
        """The room in ``directory``'s filesystem (a store: unbounded, ``Space.bounded``)."""
        return self.files.space(directory)

    def shard_header(self, shard: Path, size: int) -> tuple[Any, Any, int]:
        """A written shard's tensor entries, metadata and data start, read back from its header."""
        return read_shard_header(shard, size, self.files)

    def remove_tree(self, path: Path) -> None:
        """Remove what an attempt set aside (``discard``, ``release``), with everything under it."""
        self.files.remove_tree(path)

    def published(self, final: Path) -> None:
        """A checkpoint took its name: this daemon's owner markers in it go (readers ignore them, so a failure to
        remove them harms nobody and is only logged)."""
        remove_markers(self.files, final)

    def let_go(self, attempt: Path, final: Path) -> Path | None:
        """Give up this daemon's part of a shared attempt directory: its marker goes, and so does the directory
        once no other daemon claims it (set aside, returned to be removed later); None if it is gone or claimed."""
        try:
            if not self.holds(attempt) or not release(self.files, attempt):
                return None
        except FileNotFoundError:  # removed meanwhile by the other node's daemon letting go
            return None
        return self.discard(attempt, final)

    # -- what each backend decides -----------------------------------------------------------------------------

    def _replace_refusal(self, final: Path) -> str | None:
        """Why nothing at ``final`` can ever be replaced here (None: a committed ckptd checkpoint there can be)."""
        return None

    def _blocked(self, path: Path) -> Path | None:
        """The nearest existing ancestor of ``path`` if it is no directory (a checkpoint could never go there)."""
        return None

    def _guard(self, publishing: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
        """What a delete holds while it checks its victim is the version it judged and sets it aside: the lock a
        publish holds where a name changes hands in place, else nothing to wait for."""
        return publishing

    def _listed_attempt(self, listed: Path) -> Path | None:
        """The attempt a listed name without an index may hold (None: an attempt is listed by its own name)."""
        return None

    def _outside_roots_hint(self, final: Path) -> str:
        """What to add to the refusal of a path outside the daemon's roots."""
        return ""

    def _refuse_link(self, final: Path) -> None:
        """Refuse a checkpoint name that is a symbolic link (where names can be links)."""

    # -- the operations ------------------------------------------------------------------------------------------

    def resolve(self, raw: str, roots: tuple[Path, ...]) -> Path:
        """The final checkpoint path for the user's ``raw``, if it lies strictly under one of ``roots``.

        Symlinks and ``..`` in the parent are resolved first, so neither can lead a write outside the roots.
        """
        path = Path(raw)
        if path.name in ("", ".", "..") or path.name.endswith(INCOMPLETE_SUFFIX):
            raise PathNotAllowed(f"checkpoint path {raw!r} must end in a name that is not {INCOMPLETE_SUFFIX!r}")
        try:
            final = self.files.resolve(path.parent) / path.name
            if not any(final.is_relative_to(root) and final != root for root in roots):
                allowed = ", ".join(display(r) for r in roots)
                raise PathNotAllowed(f"checkpoint path {display(final)} is not strictly below the daemon's allowed "
                                     f"roots ({allowed}){self._outside_roots_hint(final)}")
            self._refuse_link(final)
        except OSError as exc:  # a name too long, a loop of links...
            raise PathNotAllowed(f"checkpoint path {raw!r:.200} cannot be used: {exc.strerror or exc}") from None
        return final

    def admit(self, final: Path, overwrite: bool) -> None:
        """Refuse a save to ``final`` before it is accepted, where asking costs nothing a save would notice."""
        self._refuse_inside_a_checkpoint(final)
        if self._early and self.files.stat(final) is not None:
            self.refuse_existing(final, overwrite)

    def _refuse_inside_a_checkpoint(self, final: Path) -> None:
        """A checkpoint holds no other: one saved inside it would be an entry ckptd did not write there, so the
        outer one could never again be replaced, deleted or dropped by retention. Asked where a stat costs
        nothing (``_early``: on local disk, a stat per parent); a store's names are not asked."""
        if not self._early:
            return
        for parent in final.parents:
            if self.files.stat(parent / INDEX_NAME) is not None:
                raise PathNotAllowed(f"checkpoint path {display(final)} lies inside checkpoint {display(parent)}; "
                                     f"a checkpoint holds no other: save beside it (a sibling path) instead")

    def persistable(self, final: Path, overwrite: bool) -> None:
        """Refuse a memory snapshot of ``final`` now if it could never be persisted there (its parent is blocked
        by a file, or something is at a name that is never replaced). A store that does not answer for now (an
        outage) holds the snapshot up: persisting it asks again."""
        blocked = self._blocked(final.parent)
        if blocked is not None:
            raise PathNotAllowed(f"snapshot {final} could never be persisted: {blocked} is not a directory")
        self._refuse_inside_a_checkpoint(final)
        if self._replace_refusal(final) is None:
            return
        try:
            there = self.files.stat(final) is not None
        except OSError as exc:
            if is_permanent(exc):
                raise WriteFailed(f"snapshot {display(final)}: the store cannot be asked whether the name is "
                                  f"taken: {exc}") from exc
            log.info("event=snapshot_unchecked path=%s error=%r", display(final), exc)
            return
        if there:
            self.refuse_existing(final, overwrite)

    def refuse_existing(self, final: Path, overwrite: bool) -> None:
        """Something is at ``final``: only a committed ckptd checkpoint, with ``overwrite``, may be replaced."""
        refusal = self._replace_refusal(final)
        if refusal is not None:
            raise CheckpointExists(refusal)
        if overwrite:
            check_replaceable(self.files, final)
            return
        reason = why_not_replaceable(self.files, final)
        if reason is None:
            raise CheckpointExists(f"checkpoint {final} already exists; pass overwrite=True to replace it")
        raise CheckpointExists(f"{final} already exists, and overwrite=True would not replace it either: "
                               f"{reason}; save under another path")

    def begin(self, final: Path, attempt: Path, *, overwrite: bool, coordinated: bool) -> None:
        """Refuse what is in the way, then create ``attempt`` with this daemon's owner marker.

        A leftover ``attempt`` holding nothing but ckptd's files and written by
        no live ckptd here is removed first; anything else there is refused,
        untouched. A coordinated attempt is shared with other nodes' daemons,
        so it is created if missing and never removed.
        """
        files, parent = self.files, final.parent
        try:
            if not self._early and files.stat(final) is not None:  # the check ``admit`` left to now
                self.refuse_existing(final, overwrite)
            blocked = self._blocked(parent)
            if blocked is not None:
                raise WriteFailed(f"cannot create {attempt}: {blocked} is not a directory")
            leftover = files.stat(attempt) is not None and not coordinated
            reason = why_not_leftover(files, attempt) if leftover else None
            if reason is not None:
                raise CheckpointExists(f"{display(attempt)} is in the way of this save and is not a dead save's "
                                       f"leftover ({reason}); move it away or save under another path")
            files.mkdir(parent, parents=True, exist_ok=True)
            if leftover:
                files.remove_tree(attempt)
            files.mkdir(attempt, exist_ok=coordinated)
            files.touch(attempt / owner_marker())
        except CkptdError:
            raise
        except OSError as exc:  # on a store too: unreachable, credentials refused, no such bucket
            raise WriteFailed(f"cannot create {display(attempt)}: {exc.strerror or exc}") from None

    def check_shards(self, attempt: Path, sizes: dict[str, int], ranks: dict[str, int]) -> None:
        """Every listed shard (``sizes``: file name to bytes; ``ranks``: to its rank, for messages) is in
        ``attempt`` at its size, and nothing else but owner markers is left there (removed)."""
        files = self.files
        for entry in files.scandir(attempt):
            if entry.name not in sizes and not is_owner_marker(entry.name):
                (files.remove_tree if entry.kind is Kind.DIR else files.unlink)(entry.path)
        for name, size in sizes.items():
            st = files.stat(attempt / name, follow=True)
            if st is None:
                raise WriteFailed(f"shard {name} of rank {ranks[name]} is missing from {attempt}")
            if st.size != size:
                raise WriteFailed(f"shard {name} of rank {ranks[name]} holds {st.size} bytes, not the {size} written")

    def holds(self, attempt: Path) -> bool:
        """Whether ``attempt`` is still there (a settled one is gone once another node's daemon ended it)."""
        return self.files.stat(attempt) is not None

    def delete(self, checkpoint: Path, *, judged: bytes | None, publishing: AbstractContextManager[Any]) -> bool | None:
        """Delete a committed checkpoint judged deletable while its index was ``judged``, in two phases: set
        aside under ``publishing`` where a name changes hands in place (with this daemon's owner marker, so a
        crash leaves what the start-up sweep removes), then removed. True once deleted, False if it was gone
        already, None if it was saved again meanwhile (kept)."""
        with self._guard(publishing):
            if self.index_bytes(checkpoint) != judged:
                return None
            doomed = self.set_aside(checkpoint, marker=owner_marker())
        if doomed is None:
            return False
        self.files.remove_tree(doomed)
        return True

    def index_bytes(self, checkpoint: Path) -> bytes | None:
        """The bytes of ``checkpoint``'s index (None: it has none)."""
        st = self.files.stat(checkpoint / INDEX_NAME)
        return None if st is None else self.files.read(checkpoint / INDEX_NAME, 0, st.size)

    def newer_beside(self, final: Path, order: tuple[int, float]) -> Path | None:
        """The newest committed checkpoint beside ``final`` (in its directory, ``final`` itself left out) if it is
        newer than ``order`` (step, then the time it was acknowledged: retention's and ``latest``'s order), else
        None. A memory snapshot older than it is not persisted: it would never be ``latest``, and its directory's
        retention would count it as newer than what was committed after it."""
        beside = [(key, path) for key, path in committed_in(final.parent, self.files) if path != final]
        if beside and beside[-1][0] > order:
            return beside[-1][1]
        return None

    def holds_same(self, final: Path, world_size: int, shards: dict[int, tuple[int, int]]) -> bool:
        """Whether ``final`` is a committed checkpoint of ``world_size`` ranks whose shards are exactly ``shards``
        (rank: size, crc32c): the same bytes as a snapshot being persisted, written by another holder of them
        (its buddy's drain, a node restored from that buddy). Then that persist is done, not refused."""
        try:
            index = read_index(final, self.files)
        except InvalidCheckpoint:
            return False
        return (index.world_size == world_size and index.checksum_algorithm == CHECKSUM_ALGORITHM
                and {f.rank: (f.size, f.checksum) for f in index.files} == shards)

    def listed(self, directory: Path) -> tuple[list[Path], list[Path]]:
        """What ``directory`` lists: (committed checkpoints, attempts), where an attempt is a ``.incomplete``
        name, or a name without an index that holds one (``_listed_attempt``)."""
        committed, attempts = [], []
        for entry in self.files.scandir(directory):
            if entry.kind is not Kind.DIR:
                continue
            if entry.name.endswith(INCOMPLETE_SUFFIX):
                attempts.append(entry.path)
                continue
            st = self.files.stat(entry.path / INDEX_NAME, follow=True)
            if st is not None and st.kind is Kind.FILE:
                committed.append(entry.path)
            elif (attempt := self._listed_attempt(entry.path)) is not None:
                attempts.append(attempt)
        return committed, attempts

    # -- what each backend implements ----------------------------------------------------------------------------

    def open_shard(self, path: Path, *, direct: bool) -> ShardWriter:
        """Start writing the shard file ``path`` (O_DIRECT where asked and allowed)."""
        raise NotImplementedError

    def publish(self, attempt: Path, final: Path, index: bytes, *, overwrite: bool,
                publishing: AbstractContextManager[Any]) -> None:
        """Write ``index`` into ``attempt`` and make the attempt the checkpoint ``final``, atomically.

        ``CheckpointExists`` if something took the name meanwhile and ``overwrite`` does not allow replacing it
        (or it cannot be replaced); ``PublishedNotDurable`` if the name is taken but not durable; any other
        ``OSError``: nothing was published. ``publishing`` is held while the name changes hands.
        """
        raise NotImplementedError

    def discard(self, attempt: Path, final: Path) -> Path | None:
        """Make a failed attempt's name free at once; returns what is left to remove later (None: nothing)."""
        raise NotImplementedError

    def set_aside(self, checkpoint: Path, *, marker: str | None) -> Path | None:
        """Make a committed checkpoint vanish for readers at once; returns what is left to remove (None: it was
        already gone). With ``marker`` (the daemon's owner marker), a crash before the removal leaves what the
        start-up sweep removes."""
        raise NotImplementedError

    def sweep(self, attempt: Path, *, move_to: Path | None) -> None:
        """Remove a dead attempt, or move it into ``move_to`` where it can be moved (else it is removed)."""
        raise NotImplementedError
