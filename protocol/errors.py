"""Error codes and the exceptions that carry them.

Every failure that crosses the wire is an ``Error`` reply with one of the
stable numeric codes below. The daemon raises these exceptions wherever it
finds a problem, and one place in the server turns them into replies; the
client turns a reply back into the same exception class, so a training script
catches ``ckptd.CheckpointExists`` whichever side noticed the problem.

Codes are part of the wire format: never renumber, only append.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "ErrorCode",
    "CkptdError",
    "BadMessage",
    "UnsupportedVersion",
    "UnknownClient",
    "BadSlot",
    "PathNotAllowed",
    "CheckpointExists",
    "WriteFailed",
    "Conflict",
    "ShuttingDown",
    "InternalError",
    "DaemonUnavailable",
    "InvalidCheckpoint",
    "RanksMissing",
    "NoSpace",
    "Busy",
    "error_for_code",
]


class ErrorCode(IntEnum):
    """Stable numeric codes carried by ``Error`` replies."""

    BAD_MESSAGE = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_CLIENT = 3
    BAD_SLOT = 4
    PATH_NOT_ALLOWED = 5
    CHECKPOINT_EXISTS = 6
    WRITE_FAILED = 7
    CONFLICT = 8
    SHUTTING_DOWN = 9
    INTERNAL = 10
    DAEMON_UNAVAILABLE = 11
    INVALID_CHECKPOINT = 12
    RANKS_MISSING = 13
    NO_SPACE = 14
    BUSY = 15


class CkptdError(Exception):
    """Base of every ckptd error; ``code`` says which kind it is."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadMessage(CkptdError, ValueError):
    """A request was malformed: wrong types, sizes, offsets or fields."""

    code = ErrorCode.BAD_MESSAGE


class UnsupportedVersion(CkptdError):
    """The peer speaks a protocol version this side does not."""

    code = ErrorCode.UNSUPPORTED_VERSION


class UnknownClient(CkptdError):
    """A request came from a client that never said hello."""

    code = ErrorCode.UNKNOWN_CLIENT


class BadSlot(CkptdError):
    """A shared-memory slot is missing, foreign, too small or inconsistent."""

    code = ErrorCode.BAD_SLOT


class PathNotAllowed(CkptdError, PermissionError):
    """The checkpoint path lies outside the daemon's allowed roots."""

    code = ErrorCode.PATH_NOT_ALLOWED


class CheckpointExists(CkptdError, FileExistsError):
    """The final checkpoint path exists and ``overwrite`` was not given."""

    code = ErrorCode.CHECKPOINT_EXISTS


class WriteFailed(CkptdError, OSError):
    """Writing, syncing or renaming the checkpoint failed on disk."""

    code = ErrorCode.WRITE_FAILED


class Conflict(CkptdError):
    """Another save to the same path disagrees with this one."""

    code = ErrorCode.CONFLICT


class ShuttingDown(CkptdError):
    """The daemon is draining and accepts no new work."""

    code = ErrorCode.SHUTTING_DOWN


class InternalError(CkptdError):
    """A bug in ckptd; the message carries what the daemon saw."""

    code = ErrorCode.INTERNAL


class DaemonUnavailable(CkptdError, ConnectionError):
    """No daemon answers, or the daemon died with work pending."""

    code = ErrorCode.DAEMON_UNAVAILABLE


class InvalidCheckpoint(CkptdError):
    """A checkpoint on disk is missing, incomplete or fails its checks."""

    code = ErrorCode.INVALID_CHECKPOINT


class RanksMissing(CkptdError, TimeoutError):
    """Some ranks of a checkpoint never committed, or failed; nothing was committed."""

    code = ErrorCode.RANKS_MISSING


class NoSpace(CkptdError, OSError):
    """Admission control: the target filesystem or /dev/shm lacks room for the save."""

    code = ErrorCode.NO_SPACE


class Busy(CkptdError):
    """``save_async(block=False)`` found every in-flight slot taken."""

    code = ErrorCode.BUSY


_BY_CODE: dict[int, type[CkptdError]] = {
    cls.code: cls
    for cls in (
        BadMessage,
        UnsupportedVersion,
        UnknownClient,
        BadSlot,
        PathNotAllowed,
        CheckpointExists,
        WriteFailed,
        Conflict,
        ShuttingDown,
        InternalError,
        DaemonUnavailable,
        InvalidCheckpoint,
        RanksMissing,
        NoSpace,
        Busy,
    )
}


def error_for_code(code: int, message: str) -> CkptdError:
    """Build the exception for a code received on the wire."""
    cls = _BY_CODE.get(code, InternalError)
    if cls is InternalError and code != ErrorCode.INTERNAL:
        message = f"unknown error code {code}: {message}"
    return cls(message)
