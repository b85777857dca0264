"""Fixtures: real daemon subprocesses on ipc:// endpoints in private temp dirs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from ckptd.protocol.endpoint import endpoint_for

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parent.parent
FAULTS_SPEC = "tests.faults:FaultyStorage"


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
        """Run the ``ckptd`` CLI against this daemon."""
        cmd = [sys.executable, "-m", "ckptd", *args[:1], "--run-dir", str(self.run_dir), *args[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env)

    def status(self) -> dict:
        out = self.cli("status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def short_tempdir(prefix: str) -> Path:
    """Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def start_daemon(run_dir: Path, root: Path, *extra: str, faults: list[dict] | None = None,
                 timeout: float = 20) -> Daemon:
    env = dict(os.environ)
    env.pop("CKPTD_FAULTS", None)
    if faults:
        env["CKPTD_FAULTS"] = json.dumps(faults)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        extra = ("--storage", FAULTS_SPEC, *extra)
    cmd = [sys.executable, "-m", "ckptd", "start", "--foreground", "--quiet",
           "--run-dir", str(run_dir), "--root", str(root), *extra]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    daemon = Daemon(run_dir, root, proc, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited at start: {proc.stderr.read().decode()}")
        if (run_dir / "ckptd.sock").exists() and daemon.cli("status", timeout=10).returncode == 0:
            if (run_dir / "ckptd.pid").read_text().strip() == str(proc.pid):
                return daemon
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("daemon did not come up")


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = short_tempdir("ckrun-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    r.mkdir()
    return r


@pytest.fixture
def daemon_factory(run_dir: Path, root: Path) -> Iterator:
    """Start daemons (optionally with injected faults); all are stopped after the test."""
    started: list[Daemon] = []

    def make(*extra: str, faults: list[dict] | None = None) -> Daemon:
        d = start_daemon(run_dir, root, *extra, faults=faults)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc.poll() is None:
            d.kill()


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory()


@pytest.fixture
def client_factory(run_dir: Path) -> Iterator:
    """Clients bound to the test's run dir (never spawning unless asked); closed after."""
    import ckptd

    made = []

    def make(**kwargs):
        kwargs.setdefault("spawn", False)
        kwargs.setdefault("timeout", 10.0)
        c = ckptd.Client(run_dir=run_dir, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            c.close()
        except Exception:
            pass


@pytest.fixture
def client(daemon: Daemon, client_factory):
    return client_factory()


def own_segments() -> set[str]:
    """This process's ckptd segments in /dev/shm."""
    prefix = f"ckptd-{os.getuid()}-{os.getpid()}-"
    return {p.name for p in SHM.iterdir() if p.name.startswith(prefix)}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test must leave this process's /dev/shm as it found it."""
    before = own_segments()
    yield
    leaked = own_segments() - before
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"test leaked shared-memory segments {sorted(leaked)}"
