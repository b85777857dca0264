"""Candidates for the replication transport, against a plain TCP stream of the same bytes in the same run (issue #40,
item 1: measured here; the daemon's transport is not changed by it).

    python -m benchmarks --only transport [--size-gib 0.25] [--repeat 5]      (a case of the registry)
    python -m benchmarks.transport --mib 256 --repeat 5                        (alone, prints the table)

Two processes on 127.0.0.1: this one sends, a receiver subprocess (``python -m benchmarks.transport --receive``) places every byte into
one buffer (the replica's slot) and checks what the candidate checks. Per candidate and frame size: seconds from
connect to the receiver's last acknowledgement, and each process's CPU seconds (``time.process_time``: every thread
of it, ZeroMQ's I/O threads included). Every candidate runs once per round, round after round, so a loaded machine
weighs on each alike; compare the ratios to the plain TCP stream of the same round, never the absolute figures.

Frame sizes: the CURVE link's former piece (16 MiB, ``WINDOW`` unanswered on a ZeroMQ link), its former restore
piece (2 MiB), and the data port's frame as the daemon has it now (``ckptd.peers.bulk.FRAME``). The keyed candidates stand for "a plain data connection keyed from the authenticated
CURVE control channel": here the key reaches the receiver over its stdin, the stand-in for that channel. Each
frame carries a 12-byte header (frame number, length), bound into the tag or the AEAD's associated data; the nonce
is the frame number under a key used for one stream only. Every side runs on one thread, as the daemon's link does;
sender and receiver share the machine's cores here (two nodes would not).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import crc32c
import zmq

from ckptd.peers.bulk import send_parts

try:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    from cryptography.hazmat.primitives.poly1305 import Poly1305
except ImportError:  # a bench-only requirement (requirements-dev.txt): its rows say so
    AESGCM = ChaCha20Poly1305 = Poly1305 = None

MAX_PIECE, FETCH_PIECE, WINDOW = 16 << 20, 2 << 20, 4
"""The frames the CURVE link used before the data port (issue #40's measurement was made at these)."""
HEADER = struct.Struct("<QI")
"""Frame number, length: authenticated with the frame (a tag over it, or the AEAD's associated data)."""

CANDIDATES: dict[str, tuple[str, str]] = {
    "tcp": ("plain TCP socket (reference)", "none"),
    "zmq": ("ZeroMQ, plain", "none"),
    "curve": ("ZeroMQ CURVE, one connection (today)", "integrity, authenticity, confidentiality"),
    "curve2": ("ZeroMQ CURVE, two connections, two I/O threads", "integrity, authenticity, confidentiality"),
    "aesgcm": ("AES-256-GCM frames over plain TCP", "integrity, authenticity, confidentiality"),
    "chacha": ("ChaCha20-Poly1305 frames over plain TCP", "integrity, authenticity, confidentiality"),
    "gmac": ("GMAC tag per frame (AES-256-GCM over the data as associated data: ckptd's plain frames), plain data "
             "over TCP", "integrity, authenticity"),
    "poly1305": ("Poly1305 tag per frame (one-time key from keyed BLAKE2b), plain data over TCP",
                 "integrity, authenticity"),
    "hmac": ("HMAC-SHA256 tag per frame, plain data over TCP", "integrity, authenticity"),
    "blake2b": ("keyed BLAKE2b-256 tag per frame, plain data over TCP", "integrity, authenticity"),
}
"""Name: (label, what it gives beyond TCP's own checksum). The ``cryptography`` ones are absent without it."""
NEEDS_CRYPTOGRAPHY = ("aesgcm", "chacha", "gmac", "poly1305")
PRIMITIVES = ("crc32c", "aesgcm", "chacha", "gmac", "poly1305", "hmac", "blake2b")
"""Computed alone on one core over the frames (no socket): crc32c is the checksum ckptd uses (protocol/checksums.py)."""


def frames() -> tuple[int, ...]:
    """The frame sizes measured: the CURVE link's former two, and the data port's (``ckptd.peers.bulk.FRAME``)."""
    from ckptd.peers.bulk import FRAME

    return tuple(dict.fromkeys((MAX_PIECE, FETCH_PIECE, FRAME)))


def absent() -> dict[str, str]:
    """The candidates this interpreter cannot run: why, for their rows."""
    if AESGCM is None:
        why = "not installed (cryptography; pip install -r requirements-dev.txt)"
    elif not hasattr(AESGCM, "encrypt_into"):
        why = "cryptography too old (no AEAD encrypt_into; pip install -r requirements-dev.txt)"
    else:
        return {}
    return {n: why for n in NEEDS_CRYPTOGRAPHY}


def _nonce(i: int) -> bytes:
    return b"\0\0\0\0" + i.to_bytes(8, "little")


def _tagger(name: str, key: bytes) -> Callable[[int, bytes, memoryview], bytes]:
    """``tag(i, header, data)`` of a MAC candidate."""
    if name == "blake2b":
        def tag(i: int, head: bytes, data: memoryview) -> bytes:
            h = hashlib.blake2b(head, key=key, digest_size=32)
            h.update(data)
            return h.digest()
    elif name == "gmac":  # the number is the nonce, the length is in GHASH's last block: the header is bound
        gcm = AESGCM(key)

        def tag(i: int, head: bytes, data: memoryview) -> bytes:
            return gcm.encrypt(_nonce(i), b"", data)
    elif name == "hmac":
        def tag(i: int, head: bytes, data: memoryview) -> bytes:
            h = hmac.new(key, head, "sha256")
            h.update(data)
            return h.digest()
    else:  # poly1305: a one-time key per frame, as ChaCha20-Poly1305 derives one from its keystream
        def tag(i: int, head: bytes, data: memoryview) -> bytes:
            p = Poly1305(hashlib.blake2b(i.to_bytes(8, "little"), key=key, digest_size=32).digest())
            p.update(head)
            p.update(data)
            return p.finalize()
    return tag


TAG_BYTES = {"blake2b": 32, "hmac": 32, "gmac": 16, "poly1305": 16}


def _aead(name: str, key: bytes) -> Any:
    return AESGCM(key) if name == "aesgcm" else ChaCha20Poly1305(key)


# ----------------------------------------------------------------------------------------------- the receiver


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the sender closed the stream early")
        got += n


def _receive_tcp(name: str, size: int, frame: int, key: bytes, slot: memoryview) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    conn, _ = listener.accept()
    listener.close()
    head = bytearray(HEADER.size)
    if name in TAG_BYTES:
        tag, theirs = _tagger(name, key), bytearray(TAG_BYTES[name])
    elif name != "tcp":
        aead, sealed = _aead(name, key), bytearray(frame + 16)
    with conn:
        for i, offset in enumerate(range(0, size, frame)):
            if name == "tcp":  # the bytes straight into the slot: the floor
                _recv_exact(conn, slot[offset:offset + frame])
                continue
            _recv_exact(conn, memoryview(head))
            number, length = HEADER.unpack(head)
            if number != i or length != min(frame, size - offset):
                raise ValueError(f"frame {number} of {length} bytes where {i} was due")
            into = slot[offset:offset + length]
            if name in TAG_BYTES:  # into the slot, then checked; a frame that fails is never held
                _recv_exact(conn, into)
                _recv_exact(conn, memoryview(theirs))
                if not hmac.compare_digest(tag(i, bytes(head), into), theirs):
                    raise ValueError(f"frame {i} failed its {name} tag")
            else:  # ciphertext and tag into a buffer, decrypted (and checked) into the slot
                view = memoryview(sealed)[:length + 16]
                _recv_exact(conn, view)
                aead.decrypt_into(_nonce(i), view, bytes(head), into)
        conn.sendall(b"k")


def _receive_zmq(name: str, size: int, key: dict, slot: memoryview) -> None:
    ctx = zmq.Context(io_threads=2 if name == "curve2" else 1)
    sock = ctx.socket(zmq.ROUTER)
    if name != "zmq":
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = key["public"].encode(), key["secret"].encode()
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"port": port}), flush=True)
    got = 0
    while got < size:  # as the buddy does: each piece copied into the slot, then acknowledged
        ident, where, data = sock.recv_multipart(copy=False)
        offset, chunk = int.from_bytes(where.bytes, "little"), data.buffer
        slot[offset:offset + len(chunk)] = chunk
        got += len(chunk)
        sock.send_multipart([ident.bytes, b"ok"])
    sock.close(linger=1000)
    ctx.term()


def receiver() -> None:
    """Commands on stdin, one JSON line each; on stdout the port, then the stream's CPU seconds and checksum."""
    slot = bytearray()
    for line in sys.stdin:
        cmd = json.loads(line)
        if len(slot) != cmd["size"]:
            slot = bytearray(cmd["size"])
            slot[:] = bytes(len(slot))  # touched: no page faults inside a timed stream
        view = memoryview(slot)
        started = time.process_time()
        if cmd["name"] in ("zmq", "curve", "curve2"):
            _receive_zmq(cmd["name"], cmd["size"], cmd.get("curve", {}), view)
        else:
            _receive_tcp(cmd["name"], cmd["size"], cmd["frame"], bytes.fromhex(cmd.get("key", "")), view)
        cpu = time.process_time() - started
        print(json.dumps({"cpu": cpu, "crc": crc32c.crc32c(view)}), flush=True)


# ----------------------------------------------------------------------------------------------- the sender


class Receiver:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.transport", "--receive"],
                                     cwd=Path(__file__).resolve().parent.parent, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def ask(self, cmd: dict) -> int:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())["port"]

    def result(self) -> dict:
        return json.loads(self._line())

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiver exited ({self.proc.wait()})")
        return line

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def _send_tcp(name: str, port: int, data: memoryview, frame: int, key: bytes) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    if name in TAG_BYTES:
        tag = _tagger(name, key)
    elif name != "tcp":
        aead, sealed = _aead(name, key), bytearray(frame + 16)
    with sock:
        for i, offset in enumerate(range(0, len(data), frame)):
            chunk = data[offset:offset + frame]
            if name == "tcp":
                sock.sendall(chunk)
                continue
            head = HEADER.pack(i, len(chunk))
            if name in TAG_BYTES:  # header, data and tag in one call: sent apart, the tag waited behind the data
                send_parts(sock, [memoryview(head), chunk, memoryview(tag(i, head, chunk))])  # for an ACK (Nagle)
            else:
                out = memoryview(sealed)[:len(chunk) + 16]
                aead.encrypt_into(_nonce(i), chunk, head, out)
                sock.sendall(head)
                sock.sendall(out)
        if sock.recv(1) != b"k":
            raise ConnectionError("the receiver did not acknowledge the stream")


def _send_zmq(name: str, port: int, data: memoryview, frame: int, server_public: bytes) -> None:
    ctx = zmq.Context(io_threads=2 if name == "curve2" else 1)
    socks = []
    for _ in range(2 if name == "curve2" else 1):
        sock = ctx.socket(zmq.DEALER)
        if name != "zmq":
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    unanswered = [0] * len(socks)
    for i, offset in enumerate(range(0, len(data), frame)):  # WINDOW pieces unanswered per connection, as a link
        k = i % len(socks)
        while unanswered[k] >= WINDOW:
            socks[k].recv()
            unanswered[k] -= 1
        socks[k].send_multipart([offset.to_bytes(8, "little"), data[offset:offset + frame]], copy=False)
        unanswered[k] += 1
    for k, sock in enumerate(socks):
        for _ in range(unanswered[k]):
            sock.recv()
        sock.close(0)
    ctx.term()


def stream(rx: Receiver, name: str, data: memoryview, frame: int, want: int) -> tuple[float, float, float]:
    """One stream of ``data``: wall seconds, the sender's CPU seconds, the receiver's."""
    cmd: dict[str, Any] = {"name": name, "size": len(data), "frame": frame}
    if name in ("curve", "curve2"):
        public, secret = zmq.curve_keypair()
        cmd["curve"] = {"public": public.decode(), "secret": secret.decode()}
    elif name != "zmq":
        cmd["key"] = (key := os.urandom(32)).hex()  # what the CURVE control channel would carry
    port = rx.ask(cmd)
    cpu0, t0 = time.process_time(), time.perf_counter()
    if name in ("zmq", "curve", "curve2"):
        _send_zmq(name, port, data, frame, cmd.get("curve", {}).get("public", "").encode())
    else:
        _send_tcp(name, port, data, frame, bytes.fromhex(cmd.get("key", "")))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    got = rx.result()
    if got["crc"] != want:
        raise AssertionError(f"{name}: the receiver's bytes differ from the sender's")
    return wall, cpu, got["cpu"]


def compute_alone(name: str, data: memoryview, frame: int) -> float:
    """Seconds to run primitive ``name`` over ``data`` in ``frame`` pieces on this thread, no socket."""
    key, out = os.urandom(32), bytearray(frame + 16)
    tag = _tagger(name, key) if name in TAG_BYTES else None
    aead = _aead(name, key) if name in ("aesgcm", "chacha") else None
    t0 = time.perf_counter()
    for i, offset in enumerate(range(0, len(data), frame)):
        chunk = data[offset:offset + frame]
        if name == "crc32c":
            crc32c.crc32c(chunk)
        elif tag is not None:
            tag(i, HEADER.pack(i, len(chunk)), chunk)
        else:
            aead.encrypt_into(_nonce(i), chunk, HEADER.pack(i, len(chunk)), memoryview(out)[:len(chunk) + 16])
    return time.perf_counter() - t0


def measure(size: int, repeat: int, sizes: tuple[int, ...] | None = None) -> dict:
    """Every candidate at every frame size, ``repeat`` rounds after one warm-up round; the case's record."""
    sizes = tuple(dict.fromkeys(min(f, size) for f in (sizes or frames())))
    data = memoryview(bytearray(os.urandom(size)))
    want = crc32c.crc32c(data)
    gone = absent()
    names = [n for n in CANDIDATES if n not in gone]
    reps: dict[str, list[float]] = {}
    rx = Receiver()
    try:
        for rnd in range(1 + repeat):
            for frame in sizes:
                for name in names:
                    wall, cpu_send, cpu_recv = stream(rx, name, data, frame, want)
                    if rnd:
                        key = f"{name}_{frame >> 10}k"
                        for what, v in (("s", wall), ("cpu_send", cpu_send), ("cpu_recv", cpu_recv)):
                            reps.setdefault(f"{key}_{what}", []).append(v)
                for prim in PRIMITIVES:
                    if prim not in gone:
                        v = compute_alone(prim, data, frame)
                        if rnd:
                            reps.setdefault(f"alone_{prim}_{frame >> 10}k_s", []).append(v)
    finally:
        rx.close()
    return {"nbytes": size, "frames": list(sizes), "candidates": {n: CANDIDATES[n] for n in names},
            "absent": {CANDIDATES[n][0]: why for n, why in gone.items()},
            "reps": reps}


def transport_case(case: Any, scratch: Path) -> dict:
    return measure(int(case.size_gib * (1 << 30)), case.repeat)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.receive:
        receiver()
        return
    from .report import transport_table

    print(f"{args.mib} MiB, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    rec = measure(args.mib << 20, args.repeat)
    print(transport_table({"transport": {"name": "transport", **rec}}))
    print("every repetition:", json.dumps(rec["reps"]))


if __name__ == "__main__":
    main()
