"""The byte layout of one shard: a safetensors file, built to be written fast.

A shard is exactly a safetensors file: an 8-byte little-endian header length,
a JSON header, then the tensor bytes back to back. We add two rules the
format allows but does not require, so the daemon can write the staged bytes
straight to disk with O_DIRECT and readers can map tensors without copying:

* the header is padded with spaces so the data starts on a 4096-byte
  boundary (``DATA_ALIGNMENT``);
* tensors are ordered by element size, largest first, so every tensor starts
  at a multiple of its own element size with no holes between tensors.

Client (building), daemon (checking what a client staged) and loader
(reading) all use this one module, so they cannot disagree.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .errors import BadMessage

PAGE_SIZE = 4096
"""The page size ckptd aligns to: slots, O_DIRECT writes and the start of a shard's data."""
DATA_ALIGNMENT = PAGE_SIZE
"""Tensor data starts at a multiple of this many bytes from the file start (so the data can be written
O_DIRECT straight from the slot)."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The safetensors library's own limit on the JSON header."""
HEADER_GUESS = 64 * 1024
"""Bytes a reader asks for first to get a shard's header: most headers fit, a longer one takes a second read
(on an object store each read is a request)."""

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
"""The dtype allow-list: safetensors dtype names and their element sizes."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a shard; offsets count from the data start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardLayout:
    """Everything needed to stage a shard: header bytes and tensor places."""

    header: bytes
    """Length prefix plus padded JSON; ``len(header)`` is the data start."""
    entries: tuple[TensorEntry, ...]
    nbytes: int
    """Total file size: header plus all tensor data."""

    @property
    def data_start(self) -> int:
        return len(self.header)


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def plan_layout(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]],
    metadata: Mapping[str, str],
) -> ShardLayout:
    """Place ``(name, dtype, shape)`` tensors and build the padded header."""
    specs = sorted(tensors, key=lambda t: (-DTYPE_SIZES[t[1]], t[0]))
    entries = []
    offset = 0
    for name, dtype, shape in specs:
        size = element_count(shape) * DTYPE_SIZES[dtype]
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, offset + size))
        offset += size
    header = encode_header(entries, metadata)
    return ShardLayout(header=header, entries=tuple(entries), nbytes=len(header) + offset)


def encode_header(entries: Sequence[TensorEntry], metadata: Mapping[str, str]) -> bytes:
    """JSON header with its length prefix, padded to ``DATA_ALIGNMENT``."""
    doc: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    padded = -(-(8 + len(body)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - 8
    return struct.pack("<Q", padded) + body + b" " * (padded - len(body))


LAYOUT_DIGEST_LEN = 32
"""Characters of a ``CheckedTable.digest`` (hex of 16 bytes)."""


class CheckedTable(tuple):
    """A tensor table that ``validate_entries`` passed, in offset order, and the data length it was checked against.

    Only ``validate_entries`` makes one: a table decoded from the wire is a
    plain tuple until it is checked, so a ``CheckedTable`` is always this
    process's own validation result, never a client's claim. Checking one
    again against the same length is free, which is what lets the daemon
    reuse a layout a client refers to by ``digest``.
    """

    data_len: int

    @functools.cached_property
    def digest(self) -> str:
        """Names this table (BLAKE2b of its rows as JSON): a commit may refer to a table sent before by this name."""
        rows = json.dumps([[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in self], ensure_ascii=False)
        return hashlib.blake2b(rows.encode("utf-8", "surrogatepass"), digest_size=LAYOUT_DIGEST_LEN // 2).hexdigest()


def validate_entries(entries: Sequence[TensorEntry], data_len: int) -> CheckedTable:
    """Check a tensor table against the allow-list and the data it indexes; returns it checked, in offset order.

    Raises ``BadMessage`` naming the first tensor that is wrong: unknown
    dtype, negative dimension, size that disagrees with shape x itemsize,
    bytes outside the data, overlap, or a hole (safetensors allows none).
    """
    if isinstance(entries, CheckedTable) and entries.data_len == data_len:
        return entries
    names = set()
    ordered = sorted(entries, key=lambda e: (e.begin, e.end))
    expected = 0
    for e in ordered:
        if e.name in names:
            raise BadMessage(f"tensor {e.name!r} appears twice")
        names.add(e.name)
        size = DTYPE_SIZES.get(e.dtype)
        if size is None:
            raise BadMessage(f"tensor {e.name!r}: dtype {e.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if any(d < 0 for d in e.shape):
            raise BadMessage(f"tensor {e.name!r}: negative dimension in shape {list(e.shape)}")
        want = element_count(e.shape) * size
        if e.end - e.begin != want:
            raise BadMessage(
                f"tensor {e.name!r}: shape {list(e.shape)} x {size} bytes = {want}, "
                f"but its offsets span {e.nbytes}"
            )
        if e.begin != expected:
            kind = "overlaps the tensor before it" if e.begin < expected else "leaves a hole before it"
            raise BadMessage(f"tensor {e.name!r} at offset {e.begin} {kind} (expected {expected})")
        expected = e.end
    if expected != data_len:
        raise BadMessage(f"tensors cover {expected} bytes of data but the shard holds {data_len}")
    table = CheckedTable(ordered)
    table.data_len = data_len
    return table


def parse_header(prefix: bytes | memoryview, file_size: int) -> tuple[list[TensorEntry], dict[str, str], int]:
    """Read and check a shard header; returns entries, metadata, data start.

    ``prefix`` must hold at least the whole header. Every check that
    ``validate_entries`` makes applies, against ``file_size``.
    """
    if file_size < 8 or len(prefix) < 8:
        raise BadMessage(f"shard of {file_size} bytes is too short for a safetensors header")
    (hlen,) = struct.unpack_from("<Q", prefix, 0)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > file_size:
        raise BadMessage(f"header length {hlen} does not fit a shard of {file_size} bytes")
    if len(prefix) < 8 + hlen:
        raise BadMessage(f"need {8 + hlen} header bytes, got {len(prefix)}")
    try:
        doc = json.loads(bytes(prefix[8 : 8 + hlen]))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadMessage(f"header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadMessage("header is not a JSON object")
    metadata = doc.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BadMessage("__metadata__ must map strings to strings")
    entries = [_entry_from_json(name, info) for name, info in doc.items()]
    validate_entries(entries, file_size - 8 - hlen)
    return entries, metadata, 8 + hlen


def _entry_from_json(name: str, info: object) -> TensorEntry:
    """One header entry, checked; its error is made only for a bad one (a shard's header has one entry per tensor,
    parsed at every admission and every read)."""
    dtype = shape = offsets = None
    if isinstance(info, dict):
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and all(type(d) is int for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
    ):
        raise BadMessage(f"tensor {name!r}: header entry must hold dtype, shape and two integer data_offsets")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
