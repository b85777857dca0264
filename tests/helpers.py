"""What every test shares: real daemon subprocesses, status over the protocol, polling, /dev/shm.

Test modules import from here (``from helpers import ...``), never from
``conftest`` or from one another; ``conftest.py`` holds only fixtures built on
these. Daemons run on ``ipc://`` endpoints in private directories under
``/tmp`` and clients name their slots by pid, so tests are safe to run in
parallel processes (``pytest -n``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import zmq

from ckptd.protocol.endpoint import endpoint_for
from ckptd.protocol.index import INDEX_NAME, CheckpointIndex, ShardRecord, shard_name
from ckptd.protocol.messages import Status, StatusReply, decode

SHM = Path("/dev/shm")
MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
FAULTS_SPEC = "tests.faults:FaultyStorage"
"""The fault-injecting storage (tests/faults.py), loaded by ``ckptd start --storage``."""
RSS_TOLERANCE = 32 * 2**20
"""How much more resident memory than before a load a daemon may keep (allocator caches)."""
HOUSEKEEPING_S = 0.1
"""Test daemons look for dead clients and overdue checkpoints this often (the
default is 1 s), so a test waiting on housekeeping does not sleep through it."""


def wait_until(cond: Callable[[], object], timeout: float = 10.0,
               what: str | Callable[[], str] = "the condition") -> None:
    """Poll ``cond`` until it is true; fail after ``timeout`` s saying ``what`` (a string, or a
    callable describing the state at the end) did not happen."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")
        time.sleep(0.05)


def ckptd_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the real ``ckptd`` CLI in its own interpreter, capturing its output."""
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def status(run_dir: Path, *, timeout: float = 10.0) -> dict:
    """The daemon's status, exactly as ``ckptd status --json`` prints it, asked in this process
    (spawning the CLI costs a Python start-up per poll)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint_for(run_dir))
        sock.send(Status(1).to_wire())
        if not sock.poll(int(timeout * 1000)):
            raise AssertionError(f"the daemon on {run_dir} did not answer Status within {timeout:g} s")
        reply = decode(sock.recv())
    finally:
        sock.close()
    assert isinstance(reply, StatusReply), f"Status got {reply!r}"
    return json.loads(json.dumps(reply.info))


@dataclass
class Daemon:
    """A ``ckptd start --foreground`` subprocess and where it lives."""

    run_dir: Path
    root: Path
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return endpoint_for(self.run_dir)

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run the real ``ckptd`` CLI against this daemon."""
        return ckptd_cli(*args[:1], "--run-dir", str(self.run_dir), *args[1:], timeout=timeout, env=self.env)

    def status(self) -> dict:
        return status(self.run_dir)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def raw_socket(daemon: Daemon) -> zmq.Socket:
    """A DEALER on the daemon's endpoint that waits at most 30 s for a reply (for hand-made requests;
    generous, as a loaded node may take seconds to answer)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(daemon.endpoint)
    return sock


_GIVEN_PORTS: set[int] = set()
_PORTS = range(20000, 32768)
"""Below the kernel's ephemeral range (32768-60999 by default): a port no connection, gloo's or an HTTP client's,
is given as its own by the kernel, so only another test's daemon could take it between this choice and its bind."""
_PICK = random.SystemRandom()


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on now (for a daemon's --peer-listen), and the next one free too
    (its data port), neither one this process was given before (three nodes must not share one), drawn at random
    outside the ephemeral range: ``bind(0)`` handed out ports that the test suite's other processes then took as
    theirs (a daemon failed with "Address already in use")."""
    while True:
        port = _PICK.choice(_PORTS[:-1])
        if {port, port + 1} & _GIVEN_PORTS:
            continue
        try:
            with socket.socket() as s, socket.socket() as data:
                s.bind(("127.0.0.1", port))
                data.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        _GIVEN_PORTS.update((port, port + 1))
        return port


def short_tempdir(prefix: str) -> Path:
    """Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def start_daemon(run_dir: Path, root: Path, *extra: str, faults: list[dict] | None = None,
                 timeout: float = 20) -> Daemon:
    """Start a daemon and return once it answers Status from the pid it wrote."""
    env = dict(os.environ)
    env.pop("CKPTD_FAULTS", None)
    if faults:
        env["CKPTD_FAULTS"] = json.dumps(faults)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        extra = ("--storage", FAULTS_SPEC, *extra)
    if not any(a.startswith("--housekeeping-interval") for a in extra):
        extra = ("--housekeeping-interval", str(HOUSEKEEPING_S), *extra)
    cmd = [sys.executable, "-m", "ckptd", "start", "--foreground", "--quiet",
           "--run-dir", str(run_dir), "--root", str(root), *extra]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    daemon = Daemon(run_dir, root, proc, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited at start: {proc.stderr.read().decode()}")
        if (run_dir / "ckptd.sock").exists():
            try:
                info = status(run_dir, timeout=5)
            except AssertionError:
                continue
            if info["daemon"]["pid"] == proc.pid:
                return daemon
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("daemon did not come up")


def dead_pid() -> int:
    """A pid that named a process of this host which has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def segments_of(pid: int) -> list[str]:
    """The ckptd shared-memory segments a process (alive or dead) named, in /dev/shm."""
    prefix = f"ckptd-{os.getuid()}-{pid}-"
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefix))


def own_segments() -> set[str]:
    """This process's ckptd segments in /dev/shm."""
    return set(segments_of(os.getpid()))


@dataclass
class Footprint:
    """What a daemon holds (open fds, resident memory) and the clients' /dev/shm segments."""

    fds: int
    rss: int
    segments: int

    @classmethod
    def of(cls, pid: int, client_pids: tuple[int, ...] = (os.getpid(),)) -> "Footprint":
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024
        prefixes = tuple(f"ckptd-{os.getuid()}-{p}-" for p in client_pids)
        segments = sum(1 for p in SHM.iterdir() if p.name.startswith(prefixes))
        return cls(fds, rss, segments)

    def back_to(self, baseline: "Footprint") -> bool:
        return (self.fds <= baseline.fds and self.segments <= baseline.segments
                and self.rss <= baseline.rss + RSS_TOLERANCE)


class StatusPoller(threading.Thread):
    """Asks the daemon for its status in a loop while a load runs; every call must answer, and quickly."""

    def __init__(self, daemon) -> None:
        super().__init__(name="status-poller", daemon=True)
        self.daemon_ = daemon
        self.halt = threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.busiest = 0

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.monotonic()
            try:
                info = status(self.daemon_.run_dir, timeout=30)
            except AssertionError as exc:
                self.failures.append(str(exc))
                continue
            finally:
                self.latencies.append(time.monotonic() - t)
            self.busiest = max(self.busiest, len(info["saves"]))

    def stop(self) -> None:
        self.halt.set()
        self.join(60)


def wait_for_ranks(out: Path, marker: str, count: int, ctx: Any, deadline: float, what: str) -> None:
    """Until ``count`` rank processes of ``ctx`` have touched ``out/<marker>-<rank>``; fails at ``deadline``
    (monotonic) with ``what``, or at once when a rank has exited with an error."""
    while len(list(out.glob(f"{marker}-*"))) < count:
        assert time.monotonic() < deadline, what
        assert all(p.exitcode in (None, 0) for p in ctx.processes), "a rank crashed"
        time.sleep(0.05)


def join_ranks(ctx: Any, deadline: float, what: str = "the ranks did not finish") -> None:
    """Until every rank process of ``ctx`` has exited; fails at ``deadline`` (monotonic) with ``what``.

    ``ProcessContext.join(timeout)`` returns after the first rank's exit, not the last: joined once, the
    slower rank is still running (and is then killed by the test's clean-up before it wrote its results).
    It raises at once when a rank exited with an error.
    """
    while not ctx.join(max(0.1, min(5.0, deadline - time.monotonic()))):
        assert time.monotonic() < deadline, what


def keys(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    """The object keys in ``bucket`` under ``prefix``, read straight from the S3 server ``s3`` (no ckptd code)."""
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def mirrored(s3: Any, bucket: str, prefix: str = "mirror") -> list[str]:
    """Names of the checkpoints right under ``prefix`` in ``bucket`` whose index is there (what makes them exist
    for readers), read straight from the S3 server ``s3``."""
    return sorted(k.split("/")[-2] for k in keys(s3, bucket, f"{prefix}/") if k.count("/") == prefix.count("/") + 2
                  and k.endswith(f"/{INDEX_NAME}"))


def seeded_state(n: int = 1000, seed: int = 0) -> dict:
    """A small state whose tensors and ``step`` follow from ``seed``: a test knows what a checkpoint must hold."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(7, dtype=torch.int64), "step": seed}


def floats(mib: int) -> Any:
    """A float32 tensor of ``mib`` MiB of ones: a state whose size is what a test about space is about."""
    import torch

    return torch.ones(mib * MiB // 4)


@contextmanager
def tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` MiB mounted at ``path`` (created if needed), unmounted after: free space that is
    exact and genuinely runs out (the tests run as root; a refused mount fails the test)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def checkpoint(directory: Path, name: str, step: int | None, *, created: float = 1.0) -> Path:
    """A committed one-rank checkpoint written by hand (no daemon): a 16-byte shard and the index that lists it,
    for tests of what the daemon does to checkpoints it finds on disk."""
    path = directory / name
    path.mkdir(parents=True)
    shard = shard_name(0, 1)
    (path / shard).write_bytes(b"\0" * 16)
    index = CheckpointIndex(world_size=1, step=step, created=created,
                            files=(ShardRecord(file=shard, rank=0, size=16, checksum=0, tensors=1),))
    (path / INDEX_NAME).write_bytes(index.to_json())
    return path


def filled_state(value: float) -> dict:
    """A state filled with ``value`` (and ``step`` its integer part): which save a checkpoint holds reads off any
    element."""
    import torch

    return {"w": torch.full((1000,), value), "step": int(value)}


def torchrun_example(example: Path, daemon: Daemon, ckpt_dir: Path, procs: int, *args: str,
                     timeout: float = 240) -> str:
    """Run ``examples/<name>.py`` as users run it (``python -m torch.distributed.run --standalone``) on ``procs``
    ranks against the test's daemon (``CKPTD_RUN_DIR``), and return what it printed; a failed run fails the test
    with the launcher's output."""
    from zygote import run_module

    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1")
    out = run_module("torch.distributed.run", "--nproc-per-node", str(procs), "--standalone", str(example),
                     "--ckpt-dir", str(ckpt_dir), *args, env=env, cwd=str(REPO), timeout=timeout)
    assert out.returncode == 0, f"torchrun exited {out.returncode}\n{out.stdout}\n{out.stderr[-6000:]}"
    return out.stdout


def equal_states(a: Any, b: Any) -> bool:
    """Two states hold the same: the same keys at every level, tensors of one dtype and equal values, the same
    plain values (what a test compares a loaded checkpoint against)."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal_states(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b
