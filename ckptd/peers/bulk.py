"""The bulk path between two daemons: a shard's bytes as authenticated frames over a plain TCP connection.

CurveZMQ carries the peer protocol (``link.py``, ``endpoint.py``); it is also
what limited a replica's stream to 0.18-0.35 x a plain TCP socket on the same
link (``benchmarks/RESULTS.md``, "Replication transport candidates"), so a
shard's bytes travel beside it instead. Each stream (a replica sent to the
buddy, or one read back by a node restoring it) gets a fresh 256-bit key and a
random token from the daemon that serves it, sent over the authenticated CURVE
channel (``Ticket``). The other daemon then connects to the data port, the peer
port + 1 (``data_address``), sends the token, and the frames follow::

    token (16 bytes), once
    header: frame number (u64 LE), length (u32 LE)   12 bytes
    payload (length bytes) + tag (16 bytes)

A frame is *encrypted* (AES-256-GCM: the payload is the ciphertext, the
header its associated data) or *plain* (the payload is the plaintext, the tag
its GMAC: AES-GCM with the payload as associated data, nothing encrypted).
Either way the nonce is the frame number (never repeated under a key: one key
per stream, numbers counted up from 0) and the tag covers the payload and its
length, so no frame can be altered, dropped, repeated, reordered, cut short or
taken from another stream without its tag failing or the count coming out
wrong: integrity and authenticity are the same in both. Plain frames leave the
bytes readable on the wire; they cost a GMAC pass (4.6-5.0 GB/s on a core here)
where encryption costs a cipher pass and a copy (2.2-3.1 GB/s), at both ends
(``benchmarks/RESULTS.md``: a stream of them ran at 0.56 x plain TCP, encrypted
ones at 0.42 x), so plain is what a stream uses unless either daemon runs with
``--peer-encrypt`` (``Ticket.encrypted``). The crc32c each shard carries from
its origin is still checked end to end on top of either.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Callable, Iterator, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ckptd.protocol.peer_messages import FRAME_BYTES, KEY_BYTES, TOKEN_BYTES

FRAME = FRAME_BYTES
"""Plaintext bytes in one frame, at most (the protocol's ``FRAME_BYTES``)."""
HEADER = struct.Struct("<QI")
TAG = 16


class FrameError(Exception):
    """A data stream that cannot be taken: a frame whose tag fails, out of order, too long, or the stream cut short."""


def new_stream() -> tuple[bytes, bytes]:
    """A token and a key for one stream, from the OS's random source."""
    return os.urandom(TOKEN_BYTES), AESGCM.generate_key(bit_length=8 * KEY_BYTES)


def data_address(endpoint: str) -> tuple[str, int]:
    """Where the data of the peer endpoint ``tcp://HOST:PORT`` is reached (or bound): the same host, port + 1
    (a wildcard host binds every address)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return ("" if host in ("*", "0.0.0.0") else host), int(port) + 1


def _nonce(number: int) -> bytes:
    return number.to_bytes(12, "big")


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``FrameError`` if the stream ends first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError(f"the connection ended {len(view) - got} bytes short of a frame")
        got += n


class Pacer:
    """At most ``rate`` bytes a second over every stream that shares it (``--peer-rate``): each frame waits for
    its turn, so replication leaves the rest of the link to training's own traffic. A frame still leaves at the
    link's speed, so what it can hold up behind it is one frame (``FRAME``, 4 MiB: 0.34 ms on 100 Gb/s, 3.4 ms on
    10 Gb/s), and the average stays at ``rate``."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self._free_at = clock()
        """When the link's share is free for the next frame (one thread of each stream asks at a time)."""
        self._lock = threading.Lock()

    def before(self, nbytes: int) -> None:
        """Wait, if need be, until ``nbytes`` more keep the streams at ``rate``; then they may go."""
        with self._lock:
            now = self.clock()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.rate
        if start > now:
            self.sleep(start - now)


def send_parts(sock: socket.socket, parts: Sequence[memoryview | bytes]) -> None:
    """Send ``parts`` back to back in as few calls as the kernel takes them (a plain frame's header, payload and tag
    in one ``sendmsg``: written apart, the tag would wait behind the payload for an ACK, Nagle's rule)."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = sock.sendmsg(views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def send(sock: socket.socket, key: bytes, data: memoryview, frame: int = FRAME, pace: Pacer | None = None,
         spans: list[tuple[int, int]] | None = None, *, encrypted: bool = True) -> int:
    """Send ``data`` as frames under ``key`` (the token was sent already), each after ``pace`` let it go: all of it,
    or only its ``spans`` ((offset, length), in order: the chunks the buddy does not build itself, ``chunks.py``);
    the bytes sent. Frames are numbered on across the spans, so the receiver, which knows the same spans, takes
    them in order. ``encrypted``: AES-256-GCM frames (else plain: the payload sent from ``data`` itself, with its
    GMAC tag)."""
    aead = AESGCM(key)
    out = bytearray(HEADER.size + (min(frame, max(len(data), 1)) + TAG if encrypted else 0))
    view = memoryview(out)
    number = sent = 0
    for begin, length in ([(0, len(data))] if spans is None else spans):
        for offset in range(begin, begin + length, frame):
            n = min(frame, begin + length - offset)
            if pace is not None:
                pace.before(n)
            HEADER.pack_into(out, 0, number, n)
            payload = data[offset:offset + n]
            if encrypted:
                aead.encrypt_into(_nonce(number), payload, bytes(view[:HEADER.size]),
                                  view[HEADER.size:HEADER.size + n + TAG])
                sock.sendall(view[:HEADER.size + n + TAG])
            else:
                send_parts(sock, (view[:HEADER.size], payload, aead.encrypt(_nonce(number), b"", payload)))
            number, sent = number + 1, sent + n
    return sent


def receive(sock: socket.socket, key: bytes, size: int, into: Callable[[int, int], memoryview],
            frame: int = FRAME, spans: list[tuple[int, int]] | None = None, *,
            encrypted: bool = True) -> Iterator[tuple[int, memoryview]]:
    """Take the ``size`` bytes of a stream under ``key`` (or only its ``spans``, as ``send`` sent them): each frame's
    payload lands in ``into(offset, length)`` (decrypted there where ``encrypted``, else received there) and is
    yielded as (offset, that view) only once its tag passed. ``FrameError`` at the first frame that fails."""
    aead, head = AESGCM(key), bytearray(HEADER.size)
    wire = memoryview(bytearray(min(frame, max(size, 1)) + TAG if encrypted else TAG))
    number = 0
    for begin, length in ([(0, size)] if spans is None else spans):
        offset, end = begin, begin + length
        while offset < end:
            recv_exact(sock, memoryview(head))
            got, n = HEADER.unpack(head)
            if got != number or not 0 < n <= min(frame, end - offset):
                raise FrameError(f"frame {got} of {n} bytes where frame {number} of at most "
                                 f"{min(frame, end - offset)} bytes was due")
            dest = into(offset, n)
            try:
                if encrypted:
                    recv_exact(sock, wire[:n + TAG])
                    aead.decrypt_into(_nonce(number), wire[:n + TAG], bytes(head), dest)
                else:
                    recv_exact(sock, dest)
                    recv_exact(sock, wire)
                    aead.decrypt(_nonce(number), wire, dest)  # the tag over ``dest``, or InvalidTag
            except InvalidTag:
                raise FrameError(f"frame {number} (bytes {offset}..{offset + n}) fails its authentication tag: "
                                 f"altered on the way, or not sent by the daemon the stream was announced to") from None
            yield offset, dest
            offset += n
            number += 1
