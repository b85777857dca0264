"""Who a daemon's peers are: its own CurveZMQ key pair, and the public keys it accepts.

Each daemon keeps one key pair in its run directory (mode 0700, so only its
user reads the secret): ``peer.key`` holds the public key, ``peer.key_secret``
both. ``ckptd peer-key`` prints the public key as a line of the peer keys
file, so a deployment gathers one line per node before any daemon starts.

The peer keys file (``--peer-keys FILE``) lists the peers a daemon trusts,
one per line: ``KEY`` (40 characters of Z85) and, for a peer it connects to
(``--peer``), that peer's endpoint after it. A line that starts with ``# ``
is a comment (a ``#`` elsewhere is a letter of Z85). The file is read
again whenever it changes, so a replacement node's key is accepted once its
line is added, with no restart; where two lines name one endpoint, the later
wins (append a replacement's line, or replace its predecessor's). A key taken
out of the file refuses that peer's next connection, not one already made. A connection whose key is
not in it is refused by the CURVE handshake (pyzmq's ZAP authenticator),
before any message of it is read.

A daemon started with ``--peer-listen`` and no keys file is told its peers
by the ranks of the job it serves instead (``Ring``, ``placement.py``):
``Trust`` accepts the keys of the file and of the newest ring together, and
where both name an endpoint, the file's key wins (a deployment's static
word over a job's).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq

from ckptd.protocol.messages import PEER_KEY as KEY

log = logging.getLogger("ckptd")
PUBLIC_NAME = "peer.key"
SECRET_NAME = "peer.key_secret"


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes

    @classmethod
    def of(cls, run_dir: Path) -> "KeyPair":
        """The run directory's key pair, made on first use (the secret readable by this user only)."""
        secret_file, public_file = run_dir / SECRET_NAME, run_dir / PUBLIC_NAME
        try:
            public, secret = _pair_of(secret_file.read_bytes())
        except FileNotFoundError:
            run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            public, secret = zmq.curve_keypair()
            tmp = secret_file.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(public + b"\n" + secret + b"\n")
            os.replace(tmp, secret_file)  # two daemons racing on one run directory: one pair wins, whole
            public, secret = secret_file.read_bytes().split()
        except ValueError:
            raise ValueError(f"{secret_file} is not a key pair (two lines of Z85); remove it and a new one is "
                             f"made, then give its peers the new public key (ckptd peer-key)") from None
        public_file.write_bytes(public + b"\n")
        return cls(public, secret)


def _pair_of(text: bytes) -> tuple[bytes, bytes]:
    """The public and secret key of a key pair file's text; ValueError unless both are 40 characters of Z85: a
    pair of other words reached the CURVE socket, which refused it with no more than "Invalid argument"."""
    public, secret = text.split()
    if not all(KEY.fullmatch(key.decode(errors="replace")) for key in (public, secret)):
        raise ValueError("not two Z85 keys")
    return public, secret


def key_line(run_dir: Path, endpoint: str | None) -> str:
    """The line of a peer keys file that names this run directory's daemon (its public key, then where peers
    reach it)."""
    public = KeyPair.of(run_dir).public.decode()
    return f"{public} {endpoint}" if endpoint else public


class PeerKeys:
    """The trusted peers of ``--peer-keys FILE``: their keys, and the endpoints of those that have one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # the authenticator's thread asks too
        self._stamp: tuple[int, int] | None = None
        self.keys: frozenset[bytes] = frozenset()
        self.endpoints: dict[str, bytes] = {}
        self.reload()

    def reload(self) -> None:
        """Read the file again if it changed; a file that became unreadable keeps the keys read before."""
        with self._lock:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            try:
                text = self.path.read_text()
            except UnicodeDecodeError as exc:
                raise ValueError(f"{self.path}: not text ({exc.reason} at byte {exc.start}); expected lines of "
                                 f"`ckptd peer-key`") from None
            keys, endpoints = parse_keys(text, self.path)
            self.keys, self.endpoints, self._stamp = keys, endpoints, stamp
        log.info("event=peer_keys_read file=%s keys=%d", self.path, len(keys))

    def key_for(self, endpoint: str) -> bytes:
        """The public key of the peer at ``endpoint`` (to connect to it), or ValueError saying what to add."""
        self.reload()
        key = self.endpoints.get(endpoint)
        if key is None:
            raise ValueError(f"--peer {endpoint}: {self.path} names no key for it; add the line that "
                             f"`ckptd peer-key --endpoint {endpoint}` prints on that node")
        return key

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP authenticator's question (a connecting peer's Z85 public key): is it trusted?"""
        try:
            self.reload()
        except (OSError, ValueError) as exc:
            log.warning("event=peer_keys_unreadable file=%s error=%s", self.path, exc)
        allowed = key in self.keys
        if not allowed:
            log.warning("event=peer_refused key=%s reason=unknown_key", key.decode(errors="replace"))
        return allowed


def parse_keys(text: str, where: Path) -> tuple[frozenset[bytes], dict[str, bytes]]:
    """Keys and endpoints from a peer keys file's text; ValueError naming the first bad line."""
    keys: set[bytes] = set()
    endpoints: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split()
        if not words or words[0] == "#" or raw.lstrip().startswith("# "):
            continue
        if len(words) > 2 or not KEY.fullmatch(words[0]) or (len(words) == 2 and not words[1].startswith("tcp://")):
            raise ValueError(f"{where}:{number}: expected `KEY [tcp://HOST:PORT]` (KEY: 40 characters of Z85, as "
                             f"`ckptd peer-key` prints it), got {raw.strip()[:80]!r}")
        keys.add(words[0].encode())
        if len(words) == 2:
            if words[1] in endpoints:  # a replacement's line appended below its predecessor's: the last one wins
                log.warning("event=peer_keys_duplicate file=%s line=%d endpoint=%s: a later line names this "
                            "endpoint again and wins", where, number, words[1])
            endpoints[words[1]] = words[0].encode()
    return frozenset(keys), endpoints


class Trust:
    """The peers a daemon accepts and the keys it reaches them with: those of ``--peer-keys FILE`` (if given) and
    those of the ring its job's ranks sent (``set_ring``; the newest ring replaces the one before). The ZAP
    authenticator's thread asks ``callback`` while the loop thread sets a ring: each is replaced whole, never
    changed in place."""

    def __init__(self, file: PeerKeys | None) -> None:
        self.file = file
        self.ring_keys: frozenset[bytes] = frozenset()
        self.ring_endpoints: dict[str, bytes] = {}

    def set_ring(self, endpoints: tuple[str, ...], keys: tuple[str, ...]) -> None:
        """Trust the keys of a ring (its nodes' daemons), instead of the ring's before."""
        self.ring_endpoints = {ep: key.encode() for ep, key in zip(endpoints, keys)}
        self.ring_keys = frozenset(self.ring_endpoints.values())

    def reload(self) -> None:
        """Read the keys file again if it changed (``PeerKeys.reload``; the ring's keys need no reading)."""
        if self.file is not None:
            self.file.reload()

    @property
    def endpoints(self) -> dict[str, bytes]:
        """Every known peer's key by endpoint: the ring's, and the keys file's (which wins where both name one)."""
        return {**self.ring_endpoints, **(self.file.endpoints if self.file is not None else {})}

    def key_for(self, endpoint: str) -> bytes:
        """The key of the peer at ``endpoint``: the file's where it names one, else the ring's; ValueError saying
        what to add where neither does."""
        if self.file is not None:
            try:
                self.file.reload()
            except (OSError, ValueError) as exc:  # the keys read before stand, and the ring's
                log.warning("event=peer_keys_unreadable file=%s error=%s", self.file.path, exc)
            key = self.file.endpoints.get(endpoint)
            if key is not None:
                return key
        key = self.ring_endpoints.get(endpoint)
        if key is None:
            source = f"{self.file.path} names no key for it" if self.file is not None else "no keys file is given"
            raise ValueError(f"peer {endpoint}: {source}, nor does the ring of this daemon's ranks; add the line "
                             f"that `ckptd peer-key --endpoint {endpoint}` prints on that node")
        return key

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP authenticator's question (a connecting peer's Z85 public key): is it trusted?"""
        if key in self.ring_keys:
            return True
        if self.file is not None:
            return self.file.callback(domain, key)
        log.warning("event=peer_refused key=%s reason=unknown_key", key.decode(errors="replace"))
        return False
