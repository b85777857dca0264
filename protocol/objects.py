"""Checkpoints on an object store (``s3://bucket/prefix``): names, reads and listings.

The daemon (through its storage seam, ``ckptd/storage/store.py``) and the client
(``load``, ``latest``) both read object stores with what is here; only the
daemon writes. The client library is ``obstore`` (an optional extra:
``pip install ckptd[s3]``), chosen by measurement (``benchmarks/objects.py``,
``benchmarks/RESULTS.md``): uploads as fast as boto3, ranged downloads about
4x faster, conditional create-only puts, multipart uploads that abort when
their input fails. It is imported only when an ``s3://`` name is used.

Names: ``Path("s3://bucket/run/step-1")`` normalises to ``s3:/bucket/run/step-1``
(a relative path whose first part is ``s3:``); ``is_object_path`` tells such
a name, ``object_url`` spells it back. Keys are the remaining parts joined by
``/``. Configuration is the standard AWS environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
``AWS_ENDPOINT_URL`` for MinIO or Ceph) and, for what the environment leaves
unset, the ``[default]`` (or ``$AWS_PROFILE``) sections of ``~/.aws/config``
and ``~/.aws/credentials``.

Every failure is an ``OSError`` (``FileNotFoundError`` for a missing key)
whose message names the object's URL, and the bucket when it does not exist.
"""

from __future__ import annotations

import configparser
import errno
import io
import itertools
import os
import re
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

SCHEME = "s3:"
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
"""A URL's scheme at the start of a name (``gs:``, ``S3:``, ``s3a:``...)."""
PARALLEL_READS = 8
"""Ranged GETs in flight for one shard."""
READ_PART = 16 * 1024 * 1024
"""Bytes per ranged GET."""
RETRIES = {"max_retries": 3, "backoff": {"init_backoff": timedelta(milliseconds=100),
                                          "max_backoff": timedelta(seconds=2), "base": 2},
           "retry_timeout": timedelta(seconds=20)}
"""Transient errors are retried a little, then reported: a stopped endpoint fails a save in seconds."""

INSTALL = "pip install 'ckptd[s3]'"
"""The command that installs what ``s3://`` names need."""

INSTANCE_METADATA = "169.254.169.254"
"""Where the library looks for credentials the environment and files do not hold."""

_stores: dict[str, Any] = {}
_lock = threading.Lock()


def is_object_path(path: Path | str) -> bool:
    """Whether ``path`` names an object (``s3://...``, or a ``Path`` made from one).

    ValueError for any other URL (``gs://``, ``S3://``, ``s3a://``) and for
    ``s3:`` without a slash, so a misspelt URL never becomes a local
    relative path. (``s3:/b/k``, what ``Path("s3://b/k")`` prints, is an
    object here; ``check_url`` refuses it where a user typed it.)
    """
    first = Path(path).parts[:1]
    if first == (SCHEME,):
        return True
    text = os.fspath(path)
    scheme = _URL.match(text)
    if scheme is not None and (text[scheme.end():].startswith("/") or scheme.group(1).lower() == "s3"):
        raise ValueError(f"{text!r} is not a name ckptd can use: only s3://bucket/prefix names an object store "
                         f"(not {scheme.group(1)}:), anything else is a local path")
    return False


def check_url(path: Path | str) -> None:
    """Refuse a string spelt ``s3:/bucket/key`` (one slash): a typo of ``s3://``, never read as local; and an
    object name the store would refuse (``.``/``..`` or empty segments, control characters), before any work."""
    if isinstance(path, str) and path.startswith(SCHEME) and not path.startswith(SCHEME + "//"):
        raise ValueError(f"{path!r} is not an s3:// URL: write s3://bucket/prefix")
    if not is_object_path(path):
        return
    text = os.fspath(path)
    segments = text[len(SCHEME + "//"):].removesuffix("/").split("/") if isinstance(path, str) else Path(path).parts[1:]
    if not segments or not segments[0]:
        raise ValueError(f"{text!r} names no bucket: write s3://bucket/prefix")
    for segment in segments:
        if segment in ("", ".", ".."):
            raise ValueError(f"{text!r} has a segment {segment!r}: object names have no empty, '.' or '..' segments")
        if any(ord(c) < 32 or c == "\x7f" for c in segment):
            raise ValueError(f"{text!r} holds a control character, which an object name cannot")


def user_path(path: Path | str) -> Path | str:
    """A checkpoint name as ckptd hands it back: the ``s3://bucket/key`` URL (a str) for an object, else a Path."""
    return object_url(path) if is_object_path(path) else Path(path)


def absolute(path: str | os.PathLike) -> str:
    """A checkpoint name as a client sends it to the daemon (every call that takes a path or URL): an
    object's ``s3://`` URL, or the absolute local path (the daemon resolves its links)."""
    return object_url(path) if is_object_path(path) else os.path.abspath(path)


def resolved(path: str | os.PathLike) -> str:
    """A name as the daemon keys it, to compare with the names it reports: an object's ``s3://`` URL, or the
    local path with its parent's links and ``..`` resolved."""
    if is_object_path(path):
        return object_url(path)
    return os.path.join(os.path.realpath(os.path.dirname(os.fspath(path)) or "."), os.path.basename(path))


def canonical(path: str | os.PathLike) -> str:
    """One name per place, to tell whether two names are the same checkpoint or directory: an object's ``s3://``
    URL, or the local path with every link resolved (``resolved`` leaves the last part as it is)."""
    return object_url(path) if is_object_path(path) else os.path.realpath(path)


def object_url(path: Path | str) -> str:
    """``s3://bucket/key`` for a name ``is_object_path`` accepts."""
    return "s3://" + "/".join(Path(path).parts[1:])


def display(path: Path | str) -> str:
    """How a name reads in a message: ``s3://...`` for an object, else as it is.

    An object's ``.incomplete`` part is left out: on a store it names the
    same prefix as the checkpoint (``ckptd/storage/store.py``), so the message
    names the keys that exist.
    """
    if not is_object_path(path):
        return str(path)
    return object_url("/".join(p[: -len(".incomplete")] if p.endswith(".incomplete") else p
                               for p in Path(path).parts))


def split(path: Path | str) -> tuple[str, str]:
    """(bucket, key) of an object name; ValueError naming it when it has no bucket."""
    parts = Path(path).parts
    if not is_object_path(path) or len(parts) < 2:
        raise ValueError(f"{path!s} is not an s3://bucket/key name")
    return parts[1], "/".join(parts[2:])


def _aws_settings() -> dict[str, str]:
    """Region, endpoint and keys from ``~/.aws/config`` and ``~/.aws/credentials`` (the environment wins)."""
    profile = os.environ.get("AWS_PROFILE", "default")
    found: dict[str, str] = {}
    for env, section in (("AWS_CONFIG_FILE", "default" if profile == "default" else f"profile {profile}"),
                         ("AWS_SHARED_CREDENTIALS_FILE", profile)):
        default = "~/.aws/config" if env == "AWS_CONFIG_FILE" else "~/.aws/credentials"
        parser = configparser.ConfigParser()
        parser.read(os.path.expanduser(os.environ.get(env, default)))
        if parser.has_section(section):
            found.update(parser[section])
    keys = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
            "aws_session_token": "session_token", "region": "region", "endpoint_url": "endpoint"}
    env = {"access_key_id": "AWS_ACCESS_KEY_ID", "secret_access_key": "AWS_SECRET_ACCESS_KEY",
           "session_token": "AWS_SESSION_TOKEN", "region": "AWS_REGION", "endpoint": "AWS_ENDPOINT_URL"}
    return {keys[k]: v for k, v in found.items() if k in keys and not os.environ.get(env[keys[k]])}


def require_library() -> None:
    """ValueError with the install command when the object store library is missing (a daemon checks at start)."""
    try:
        import obstore.store  # noqa: F401
    except ImportError:
        raise ValueError(f"s3:// paths need the obstore package: {INSTALL}") from None


def check_bucket(path: Path | str) -> None:
    """One listing of the bucket of ``path``: ``FileNotFoundError`` naming it when it does not exist, and
    the other failures of ``os_error`` (an endpoint down may come back; the caller decides)."""
    bucket, _ = split(path)
    listing(Path(SCHEME, bucket))


def store(bucket: str) -> Any:
    """The (cached) ``obstore`` S3 store of ``bucket``, configured as the AWS tools are."""
    with _lock:
        if bucket not in _stores:
            require_library()
            from obstore.store import S3Store

            config = _aws_settings()
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or config.get("endpoint", "")
            if "region" not in config and not os.environ.get("AWS_REGION"):
                config["region"] = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
            _stores[bucket] = S3Store(bucket, config=config, retry_config=RETRIES,
                                      client_options={"allow_http": endpoint.startswith("http://")})
        return _stores[bucket]


def _endpoint() -> str:
    """The endpoint as a message names it: ``endpoint http://...``, or AWS's own."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f"endpoint {url}" if url else "the AWS S3 endpoint"


class NoSuchBucket(FileNotFoundError):
    """The bucket itself does not exist: told apart from a missing object by type, never by the message's words
    (a bucket or key may well be named ``my-bucket``)."""


def os_error(exc: Exception, path: Path | str) -> OSError:
    """An ``obstore`` failure as an ``OSError`` naming the object, and what went wrong in words.

    A missing bucket names the bucket; refused credentials are a
    ``PermissionError``; missing credentials and an endpoint that cannot be
    reached (or does not answer) say so and name the endpoint.
    """
    text = str(exc)
    kind = type(exc).__name__
    bucket = Path(path).parts[1] if len(Path(path).parts) > 1 else "?"
    if "NoSuchBucket" in text:
        return NoSuchBucket(errno.ENOENT, f"bucket {bucket!r} does not exist", object_url(path))
    if kind == "PreconditionError":
        return OSError(errno.ESTALE, "the object changed while it was being read", object_url(path))
    if kind == "AlreadyExistsError":
        return FileExistsError(errno.EEXIST, "already exists", object_url(path))
    lowered = text.lower()
    if "credential" in lowered or INSTANCE_METADATA in text:  # no keys: the library asked the instance metadata
        return PermissionError(errno.EACCES, f"no usable AWS credentials for bucket {bucket!r} (set AWS_ACCESS_KEY_ID "
                               f"and AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials): {_first_line(text)}",
                               object_url(path))
    if isinstance(exc, FileNotFoundError) or kind == "NotFoundError":
        return FileNotFoundError(errno.ENOENT, "no such object", object_url(path))
    if kind in ("PermissionDeniedError", "UnauthenticatedError") or "AccessDenied" in text or "403 Forbidden" in text:
        return PermissionError(errno.EACCES, f"access denied to bucket {bucket!r} (check the credentials in use "
                               f"and the bucket policy): {_first_line(text)}",
                               object_url(path))
    if any(word in lowered for word in ("connect", "timed out", "timeout", "dns error", "error sending request")):
        # A multipart upload cut off: the library aborts it, and reports the abort's failure, not the cut
        detail = (ABORT_FAILED if "DELETE" in text and "uploadId=" in text else _first_line(text))
        return ConnectionError(errno.EHOSTUNREACH, f"{_endpoint()} unreachable for bucket {bucket!r}: {detail}",
                               object_url(path))
    return OSError(errno.EIO, f"object store request failed: {_first_line(text)}", object_url(path))


ABORT_FAILED = ("the upload was cut off, and aborting its multipart upload failed too: its parts stay on the store "
                "(invisible, but billed) until a lifecycle rule with AbortIncompleteMultipartUpload removes them")


def _first_line(text: str) -> str:
    return text.splitlines()[0][:300] if text else "(no detail)"


def is_permanent(exc: BaseException) -> bool:
    """Whether retrying cannot help: no bucket, access refused, the name taken, the source gone."""
    from .errors import InvalidCheckpoint

    if isinstance(exc, FileNotFoundError):
        return isinstance(exc, NoSuchBucket)
    return isinstance(exc, (FileExistsError, PermissionError, InvalidCheckpoint))


def call(path: Path | str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(store, key, ...)`` for the object ``path``, failures as ``os_error``."""
    bucket, key = split(path)
    where = store(bucket)
    try:
        return fn(where, key, *args, **kwargs)
    except Exception as exc:
        raise os_error(exc, path) from None


def head(path: Path | str) -> dict | None:
    """Size and time of the object ``path``, or None when there is none."""
    import obstore
    try:
        return call(path, obstore.head)
    except NoSuchBucket:
        raise
    except FileNotFoundError:
        return None


def listing(path: Path | str) -> tuple[list[str], list[dict]]:
    """(sub-prefix names, objects) directly under the prefix ``path``."""
    import obstore
    bucket, key = split(path)
    where = store(bucket)
    try:
        result = obstore.list_with_delimiter(where, key or None)
    except Exception as exc:
        raise os_error(exc, path) from None
    names = [p.rsplit("/", 1)[-1] for p in result["common_prefixes"]]
    return names, list(result["objects"])


def read(path: Path | str, offset: int, size: int) -> bytes:
    """At most ``size`` bytes of the object from ``offset`` (empty past its end)."""
    import obstore
    if size <= 0:
        return b""
    meta = head(path)
    if meta is None:
        raise FileNotFoundError(errno.ENOENT, "no such object", object_url(path))
    end = min(offset + size, meta["size"])
    return bytes(call(path, obstore.get_range, start=offset, end=end)) if end > offset else b""


def read_all(path: Path | str) -> bytes:
    """The whole object (an index)."""
    import obstore
    return bytes(call(path, obstore.get).bytes())


MERGE_GAP = 256 * 1024
"""Ranges closer than this are fetched as one request: a short stretch of unneeded bytes costs less than a request."""


def get_range(path: Path | str, start: int, end: int, *, etag: str | None = None) -> Any:
    """Bytes ``[start, end)`` of the object, as the library's read-only buffer: the one place a ranged GET is made.

    With ``etag`` the read succeeds only on that version of the object, so
    the ranges of one load all come from the same object.
    """
    import obstore
    options: dict[str, Any] = {"range": (start, end)}
    if etag is not None:
        options["if_match"] = etag
    return call(path, lambda where, key: obstore.get(where, key, options=options).bytes())


def requests(spans: Iterable[tuple[int, int]], *, whole: int | None = None) -> list[tuple[int, int]]:
    """The ranged GETs that fetch ``spans`` (byte ranges): overlapping and near ones merged, cut into
    ``READ_PART`` bytes (the last piece of a range up to a quarter more), in object order; ``whole``: the
    object's size, every byte (a checksum needs them all)."""
    wanted = [(0, whole)] if whole is not None else sorted(s for s in spans if s[1] > s[0])
    merged: list[list[int]] = []
    for begin, end in wanted:
        if merged and begin <= merged[-1][1] + MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    out = []
    for begin, end in merged:
        cuts = list(range(begin, end, READ_PART))[1:]
        if cuts and end - cuts[-1] < READ_PART // 4:  # a short tail joins the request before it: one request fewer
            cuts.pop()
        out += zip([begin, *cuts], [*cuts, end])
    return out


def fetch(path: Path | str, ranges: list[tuple[int, int]], land: Callable[[int, Any], None], *,
          etag: str | None = None, in_order: Callable[[Any], None] | None = None) -> None:
    """GET each of ``ranges`` (in object order), ``PARALLEL_READS`` in flight at every moment.

    ``land(start, data)`` runs on a reader thread as each response arrives
    (the copies into the targets overlap the transfers); ``in_order(data)``
    on the caller's thread, in object order (a running checksum). A new
    request starts only when the oldest response is taken, so at most
    ``PARALLEL_READS`` responses (each ``requests`` bounds) are held.
    """
    def one(start: int, end: int) -> Any:
        data = get_range(path, start, end, etag=etag)
        if len(data) != end - start:
            raise OSError(errno.EIO, f"object ended early ({len(data)} of {end - start} bytes at {start})",
                          object_url(path))
        land(start, data)
        return data

    todo = iter(ranges)
    with ThreadPoolExecutor(PARALLEL_READS, thread_name_prefix="ckptd-get") as pool:
        pending = deque(pool.submit(one, *r) for r in itertools.islice(todo, PARALLEL_READS))
        try:
            while pending:
                data = pending.popleft().result()
                pending.extend(pool.submit(one, *r) for r in itertools.islice(todo, 1))
                if in_order is not None:
                    in_order(data)
        finally:
            for future in pending:
                future.cancel()


class ObjectFile(io.RawIOBase):
    """An object read front to back like a file (``ckptd verify``/``inspect``): sequential ranged GETs."""

    def __init__(self, path: Path | str) -> None:
        super().__init__()
        meta = head(path)
        if meta is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", object_url(path))
        self.path, self.size, self._pos = path, meta["size"], 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        data = read(self.path, self._pos, min(len(buffer), READ_PART))
        memoryview(buffer).cast("B")[: len(data)] = data
        self._pos += len(data)
        return len(data)


def open_object(path: Path | str) -> ObjectFile:
    return ObjectFile(path)


def put(path: Path | str, data: bytes | Iterable[Any], *, create_only: bool = False) -> None:
    """Write one object whole; ``create_only``: ``FileExistsError`` if it is there already."""
    import obstore
    if create_only:
        call(path, obstore.put, data, mode="create")
    else:
        call(path, obstore.put, data, chunk_size=READ_PART, max_concurrency=PARALLEL_READS)


def delete(path: Path | str) -> None:
    import obstore
    call(path, obstore.delete)


def remove_prefix(path: Path | str) -> int:
    """Delete every object under the prefix ``path``; returns how many."""
    import obstore
    bucket, key = split(path)
    where = store(bucket)
    try:
        keys = [meta["path"] for batch in obstore.list(where, key + "/") for meta in batch]
        if keys:
            obstore.delete(where, keys)
    except Exception as exc:
        raise os_error(exc, path) from None
    return len(keys)
