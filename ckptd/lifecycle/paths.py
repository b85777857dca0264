"""Where a checkpoint may go: a user's path resolved under the daemon's roots, and what is in the way there.

Both run on the admit pool (I/O): admission resolves and checks a rank's path
before it is accepted, ``Commits.prepare`` checks again where asking earlier
would cost a store request, and every request that names a checkpoint
(finalize, abort, persist, delete) resolves it the same way.
"""

from __future__ import annotations

from pathlib import Path

from ckptd.protocol.errors import CheckpointExists, PathNotAllowed
from ckptd.protocol.index import INCOMPLETE_SUFFIX
from ckptd.protocol.objects import display, is_object_path

from ckptd.storage.contract import CheckpointStorage, Kind
from ckptd.storage.ownership import check_replaceable, why_not_replaceable


def resolve_path(storage: CheckpointStorage, raw: str, roots: tuple[Path, ...]) -> Path:
    """The final checkpoint path for ``raw``, if it lies under an allowed root (I/O).

    Symlinks and ``..`` in the parent are resolved first, so neither can lead
    the write outside the roots.
    """
    path = Path(raw)
    try:
        is_object = is_object_path(raw)
    except ValueError as exc:
        raise PathNotAllowed(f"checkpoint path: {exc}") from None
    if not path.is_absolute() and not is_object:
        raise PathNotAllowed(f"checkpoint path {raw!r} must be absolute (or an s3:// URL)")
    if path.name in ("", ".", "..") or path.name.endswith(INCOMPLETE_SUFFIX):
        raise PathNotAllowed(f"checkpoint path {raw!r} must end in a name that is not {INCOMPLETE_SUFFIX!r}")
    try:
        final = storage.resolve(path.parent) / path.name
        if not any(final.is_relative_to(root) and final != root for root in roots):
            allowed = ", ".join(display(r) for r in roots)
            hint = ""
            if is_object and len(final.parts) < 3:  # s3://bucket: a bucket, no checkpoint name in it
                hint = "; a checkpoint on an object store is named s3://BUCKET/NAME (a bucket is no checkpoint)"
            elif is_object:
                hint = (f"; to save there, start the daemon with --root {display(final.parent)} (a daemon the client "
                        f"spawns reads its roots from $CKPTD_ROOTS)")
            raise PathNotAllowed(f"checkpoint path {display(final)} is not strictly below the daemon's allowed roots "
                                 f"({allowed}){hint}")
        st = None if is_object else storage.stat(final)  # an object is never a link: no request before Accepted
        if st is not None and st.kind is Kind.LINK:
            raise PathNotAllowed(f"checkpoint path {final} is a symbolic link")
    except OSError as exc:  # a name too long, a loop of links...
        raise PathNotAllowed(f"checkpoint path {raw!r:.200} cannot be used: {exc.strerror or exc}") from None
    return final


def refuse_existing(storage: CheckpointStorage, final: Path, overwrite: bool) -> None:
    """Something is at ``final``: only a committed ckptd checkpoint, with ``overwrite``, may be replaced (I/O)."""
    refusal = storage.replace_refusal(final)
    if refusal is not None:
        raise CheckpointExists(refusal)
    if overwrite:
        check_replaceable(storage, final)
        return
    reason = why_not_replaceable(storage, final)
    if reason is None:
        raise CheckpointExists(f"checkpoint {final} already exists; pass overwrite=True to replace it")
    raise CheckpointExists(f"{final} already exists, and overwrite=True would not replace it either: "
                           f"{reason}; save under another path")
