"""Daemon settings: one dataclass, each field documented, checked on creation."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.protocol.endpoint import default_run_dir, endpoint_for
from ckptd.protocol.layout import PAGE_SIZE
from ckptd.protocol.shm import shm_usage

from ckptd.protocol.objects import is_object_path, object_url, require_library
from ckptd.protocol.peer_messages import FRAME_BYTES

from ckptd.storage.backends import load_storage

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Bytes per ``pwrite`` of a shard. Fewer, larger O_DIRECT writes cost the kernel less per byte: 1 GiB from a slot on
ext4 here took 0.07 CPU-seconds in 8 MiB writes, 0.03 in 64 MiB ones (the same pages pinned, fewer calls)."""


MIN_MEMORY_BUDGET = 1 << 20


def default_memory_budget() -> int:
    """Half of the slot directory's free space, at most a quarter of the node's RAM.

    Held snapshots live in the slot directory (``/dev/shm``), which is RAM:
    the rest stays for the slots being staged and for everything else on the node.
    """
    free = shm_usage().get("free_bytes")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(MIN_MEMORY_BUDGET, min(free // 2 if isinstance(free, int) else ram // 4, ram // 4))


def _roots_from_env() -> tuple[Path, ...]:
    raw = os.environ.get("CKPTD_ROOTS", "")
    return tuple(Path(p) for p in re.split(r":(?!//)", raw) if p) or (Path("/"),)  # a ':' of s3:// is no separator


def _real(path: Path | str) -> Path:
    """A local directory with its links resolved; an ``s3://`` prefix as it is (a store has no links)."""
    return Path(path) if is_object_path(path) else Path(os.path.realpath(path))


@dataclass
class DaemonConfig:
    """How one node's daemon runs."""

    run_dir: Path = field(default_factory=default_run_dir)
    """Private (0700) directory holding the socket, pid file and log."""
    roots: tuple[Path, ...] = field(default_factory=_roots_from_env)
    """Checkpoints may only be written below these (after resolving symlinks).
    Default: ``$CKPTD_ROOTS`` (``:``-separated; the ``:`` of an ``s3://`` root is kept), else ``/``, i.e. anywhere the
    daemon's user may write."""
    max_concurrent_writes: int = 2
    """Shard files written at once, node-wide; further commits queue FIFO."""
    exit_when_idle: float | None = None
    """Seconds with no clients and no work after which the daemon exits.
    Set for daemons that a client spawned; None runs until stopped."""
    direct_io: bool = True
    """Write with O_DIRECT where the filesystem supports it (measured faster
    and it keeps checkpoint bytes out of the page cache)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per write call; a multiple of the page size for O_DIRECT."""
    log_to_stderr: bool = False
    """Also log to stderr (``ckptd start --foreground``)."""
    mirrors: dict[Path, Path] = field(default_factory=dict)
    """``--mirror LOCAL_DIR=s3://bucket/prefix``: checkpoints committed under the
    directory are uploaded there after their commit (``ckptd/upkeep/mirror.py``)."""
    mirror_keep: int | None = None
    """Keep only this many newest checkpoints beside each mirrored one on the store (None: all)."""
    keep_last: dict[Path, int] = field(default_factory=dict)
    """Retention per directory: after a commit under one of these directories
    (the longest match wins), keep only that many newest checkpoints beside it.
    A ``keep_last`` given with the save takes precedence."""
    sweep: str = "remove"
    """On start, ``remove`` orphaned ``.incomplete`` directories, ``move`` them
    into ``.ckptd-swept/`` beside them, or leave them (``off``)."""
    space_margin_fraction: float = 0.01
    """Admission keeps this fraction of the target filesystem free..."""
    space_margin_bytes: int = 64 * 1024 * 1024
    """...but at least this many bytes."""
    max_concurrent_loads: int | None = None
    """Load leases held at once on this node when a load asks for the daemon's
    default (``max_concurrent_per_node`` not given); None: no limit."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP on this port (opt-in)."""
    metrics_addr: str = "127.0.0.1"
    """Address the metrics endpoint binds; 0.0.0.0 to let a remote Prometheus scrape."""
    metrics_textfile: Path | None = None
    """Write Prometheus metrics to this file every second (node-exporter textfile collector)."""
    shm_min_free: int = 16 * 1024 * 1024
    """Admission refuses saves while /dev/shm has less than this free."""
    housekeeping_interval: float = 1.0
    """Seconds between housekeeping rounds of the event loop: noticing dead
    clients (their slots, leases and unstaged writes), failing checkpoints past
    their commit timeout, updating metrics. Shorter notices sooner, for a
    little more CPU while idle."""
    drain_timeout: float = 60.0
    """On ``ckptd stop`` or SIGTERM, seconds to wait for checkpoints still
    missing ranks (their ranks may still commit); then they fail with
    ShuttingDown and their ``.incomplete`` directories are removed. Shards
    already being written are always finished."""
    memory_budget: int = field(default_factory=default_memory_budget)
    """Bytes of node memory held snapshots may occupy (whole slots). Default:
    half of the slot directory's free space, at most a quarter of the RAM."""
    keep_snapshots: int = 1
    """Newest snapshots kept per checkpoint directory; older ones are dropped
    once a newer one is completely held."""
    persist_on_exit: str = "newest"
    """When the last client of a snapshot's ranks closes or dies, ``newest``
    persists its newest snapshot not yet on disk; ``never`` leaves it in memory only."""
    peer_listen: str | None = field(default_factory=lambda: os.environ.get("CKPTD_PEER_LISTEN") or None)
    """``tcp://HOST:PORT`` where other nodes' daemons reach this one (``ckptd/peers``); None opens no TCP port.
    Default: ``$CKPTD_PEER_LISTEN``, so a daemon a client spawns (which inherits the client's environment) opens it
    too; unset or empty, None."""
    peers: tuple[str, ...] = ()
    """Other nodes' peer endpoints (``--peer``, repeatable): the first is this node's buddy, which holds a replica
    of every snapshot held here; all of them are asked when this node restores one it lost."""
    peer_keys: Path | None = None
    """The peer keys file (``ckptd/core/keys.py``): the public keys of the peers trusted, and the endpoints of
    those this daemon connects to. Needed by ``--peer``; without it, ``--peer-listen`` takes its peers from the
    ring its ranks send (``ckptd/peers/placement.py``)."""
    replicas: int | None = None
    """Copies of each snapshot on other nodes: 1 (on the buddy) when a ``--peer`` or ``--peer-listen`` is given,
    else 0."""
    peer_timeout: float = 10.0
    """Seconds a peer has to answer each step of a stream before the replication fails."""
    peer_rate: int | None = None
    """Bytes a second the streams to the buddy keep to, together (``--peer-rate``; None: as fast as the link)."""
    peer_encrypt: bool = False
    """Encrypt the replicas' bytes on the data port (``--peer-encrypt``): AES-256-GCM frames, where by default
    they travel in the clear under a GMAC tag, authenticated and checked just the same (``ckptd/peers/bulk.py``):
    for a network others can read. A stream is encrypted when either of its two daemons asks for it."""
    peer_send_changed: bool = True
    """Send the buddy only the chunks of a snapshot it does not hold from this node already (``ckptd/peers/chunks.py``:
    one SHA-256 pass over each snapshot, 1.7 GB/s on a core here); False (``--peer-send-all``): every byte, no
    digests, for a link faster than that where the link's share does not matter."""
    storage: str | None = field(default_factory=lambda: os.environ.get("CKPTD_STORAGE") or None)
    """``module:Class`` of the checkpoint storage (``ckptd.storage.contract.Storage``); default ``$CKPTD_STORAGE``,
    else None: the local filesystem. Tests load their fault-injecting one here."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).absolute()
        if not self.roots:
            raise ValueError("at least one root is needed")
        for root in self.roots:
            if not is_object_path(root) and not os.path.isdir(root):
                raise ValueError(f"root {root} does not exist or is not a directory; create it first "
                                 f"(mkdir -p {root}) or give another --root / CKPTD_ROOTS")
        self.roots = tuple(_real(r) for r in self.roots)
        if self.max_concurrent_writes < 1:
            raise ValueError(f"max_concurrent_writes must be at least 1, got {self.max_concurrent_writes}")
        if self.chunk_bytes < PAGE_SIZE or self.chunk_bytes % PAGE_SIZE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {PAGE_SIZE}, got {self.chunk_bytes}")
        if self.exit_when_idle is not None and self.exit_when_idle <= 0:
            raise ValueError(f"exit_when_idle must be positive seconds, got {self.exit_when_idle}")
        if not 0 < self.housekeeping_interval < float("inf"):
            raise ValueError(f"housekeeping_interval must be positive finite seconds, got {self.housekeeping_interval}")
        if not 0 <= self.drain_timeout < float("inf"):
            raise ValueError(f"drain_timeout must be finite non-negative seconds, got {self.drain_timeout}")
        if self.max_concurrent_loads is not None and self.max_concurrent_loads < 1:
            raise ValueError(f"max_concurrent_loads must be at least 1, got {self.max_concurrent_loads}")
        if self.sweep not in ("remove", "move", "off"):
            raise ValueError(f"sweep must be remove, move or off, got {self.sweep!r}")
        if any(k < 1 for k in self.keep_last.values()):
            raise ValueError(f"keep_last values must be at least 1, got {self.keep_last}")
        self.keep_last = {_real(d): k for d, k in self.keep_last.items()}
        for directory, keep in self.keep_last.items():
            if not any(directory.is_relative_to(r) for r in self.roots):
                shown = object_url(directory) if is_object_path(directory) else directory
                raise ValueError(f"--keep {shown}={keep}: the directory is outside every --root, so no checkpoint is "
                                 f"ever saved there and the rule would never apply")
        for local, remote in self.mirrors.items():
            if is_object_path(local) or not is_object_path(remote):
                raise ValueError(f"--mirror {local}={remote}: mirror a local directory to an s3:// prefix")
            if not os.path.isdir(local):
                raise ValueError(f"--mirror {local}: no such directory (create it first)")
        mirrors = {_real(d): Path(r) for d, r in self.mirrors.items()}
        if len(mirrors) != len(self.mirrors):
            raise ValueError(f"--mirror names one directory twice: {sorted(map(str, self.mirrors))}")
        self.mirrors = mirrors
        _check_mirrors(self.mirrors, self.roots)
        if any(is_object_path(p) for p in (*self.roots, *self.mirrors.values())):
            require_library()  # before a start, not at every save
        if self.mirror_keep is not None and (self.mirror_keep < 1 or not self.mirrors):
            raise ValueError(f"mirror_keep must be at least 1 and needs a --mirror, got {self.mirror_keep}"
                             f"{'' if self.mirrors else ' without --mirror'}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port between 1 and 65535, got {self.metrics_port}")
        if self.metrics_textfile is not None and not Path(self.metrics_textfile).absolute().parent.is_dir():
            raise ValueError(f"metrics_textfile {self.metrics_textfile}: its directory does not exist")
        shm = shm_usage()
        limit = shm.get("total_bytes")
        if not isinstance(limit, int):
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if not MIN_MEMORY_BUDGET <= self.memory_budget <= limit:
            raise ValueError(f"memory_budget {self.memory_budget} bytes is out of range: it must be at least "
                             f"{MIN_MEMORY_BUDGET} (1 MiB) and at most the size of {shm.get('dir')} ({limit} bytes), "
                             "where held snapshots live")
        if self.keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be at least 1, got {self.keep_snapshots}")
        if self.persist_on_exit not in ("newest", "never"):
            raise ValueError(f"persist_on_exit must be newest or never, got {self.persist_on_exit!r}")
        self._check_peers()
        if self.storage is not None:
            load_storage(self.storage)  # refuse a bad --storage here, before a detached start
        self.endpoint = endpoint_for(self.run_dir)

    def _check_peers(self) -> None:
        for flag, endpoint in [(peer_listen_named(self.peer_listen), self.peer_listen),
                               *(("--peer", p) for p in self.peers)]:
            if endpoint is not None:
                check_peer_endpoint(flag, endpoint)
        if len(set(self.peers)) != len(self.peers) or (self.peer_listen is not None and self.peer_listen in self.peers):
            raise ValueError(f"--peer names one endpoint twice, or this daemon's own --peer-listen: {list(self.peers)}")
        if self.peers and self.peer_keys is None:
            raise ValueError("--peer and its peers' keys need --peer-keys FILE: the public keys of the peers this "
                             "daemon trusts (one line per node, as `ckptd peer-key` prints it); or leave placement to "
                             "the ranks: --peer-listen alone")
        if self.peer_keys is not None:
            from ckptd.core.keys import PeerKeys

            self.peer_keys = Path(self.peer_keys).absolute()
            try:
                keys = PeerKeys(self.peer_keys)  # a bad file or a --peer without a key: refused now, before a start
            except OSError as exc:  # a usage error like any other bad option (exit 2), naming the option
                raise ValueError(f"--peer-keys {self.peer_keys}: cannot read it ({exc.strerror or exc}); make it "
                                 f"with `ckptd peer-key --run-dir DIR --endpoint tcp://HOST:PORT >> FILE` on each "
                                 f"node") from None
            for endpoint in self.peers:
                keys.key_for(endpoint)
        if self.replicas is None:
            self.replicas = 1 if self.peers or self.peer_listen else 0
        if self.replicas not in (0, 1) or (self.replicas and not (self.peers or self.peer_listen)):
            raise ValueError(f"replicas must be 0 or 1, and 1 needs a --peer or --peer-listen (a buddy that holds "
                             f"the copy, given or set by the ranks' ring), got {self.replicas}")
        if not 0 < self.peer_timeout < float("inf"):
            raise ValueError(f"peer_timeout must be positive finite seconds, got {self.peer_timeout}")
        slowest = math.ceil(2 * FRAME_BYTES / self.peer_timeout)  # a frame within half the buddy's patience
        if self.peer_rate is not None and self.peer_rate < slowest:
            raise ValueError(f"--peer-rate {self.peer_rate} bytes/s is too slow: a stream's 4 MiB frame would take "
                             f"more than half of --peer-timeout ({self.peer_timeout:g} s), and the buddy gives up on "
                             f"a stream that long silent; give at least {slowest} bytes/s, or a longer --peer-timeout")

    def retention_for(self, checkpoint: Path) -> int | None:
        """The configured keep_last for a checkpoint's directory, if any."""
        matches = [d for d in self.keep_last if checkpoint.parent.is_relative_to(d)]
        return self.keep_last[max(matches, key=lambda d: len(d.parts))] if matches else None


def _check_mirrors(mirrors: dict[Path, Path], roots: tuple[Path, ...]) -> None:
    """Refuse mirrors that cannot work: the prefixes of two rules would hold each other's checkpoints (the
    create-only index makes one rule's uploads fail), a bucket's root is no prefix, a DIR outside every root
    never gets a checkpoint."""
    for local, remote in mirrors.items():
        shown = f"--mirror {local}={object_url(remote)}"
        if len(remote.parts) < 3:
            raise ValueError(f"{shown}: mirror to a prefix in the bucket (s3://bucket/prefix), not its root")
        if not any(local.is_relative_to(r) for r in roots if not is_object_path(r)):
            raise ValueError(f"{shown}: the directory is outside every --root, so no checkpoint is ever saved there")
        for other_local, other in mirrors.items():
            if other_local != local and remote.is_relative_to(other):
                raise ValueError(f"{shown} and --mirror {other_local}={object_url(other)}: one prefix holds the other; "
                                 f"give each directory a prefix of its own")


def check_peer_endpoint(flag: str, endpoint: str) -> None:
    """``ValueError`` naming ``flag`` unless ``endpoint`` is a peer endpoint: ``tcp://HOST:PORT``, its port one
    below another (PORT + 1 is its data port)."""
    if not re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}", endpoint) or not 1 <= int(endpoint.rsplit(":", 1)[1]) <= 65534:
        raise ValueError(f"{flag} {endpoint}: expected tcp://HOST:PORT, PORT between 1 and 65534 (PORT + 1 is its "
                         f"data port, which carries the replicas' bytes)")


def peer_listen_named(value: str | None) -> str:
    """How an error names the peer endpoint ``value``: ``--peer-listen``, and where it came from when that is the
    environment (``CKPTD_PEER_LISTEN``, the default a spawned daemon inherits), which the user set, not the flag."""
    if value is not None and value == os.environ.get("CKPTD_PEER_LISTEN"):
        return "--peer-listen (from $CKPTD_PEER_LISTEN)"
    return "--peer-listen"
