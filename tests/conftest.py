"""Fixtures: real daemon subprocesses on ipc:// endpoints in private temp dirs.

Only fixtures (and the order modules run in) live here; what tests call directly is in ``helpers.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

from helpers import SHM, Daemon, own_segments, short_tempdir, start_daemon

if TYPE_CHECKING:  # imported where used: moto is a dev-only package that `make test-nonumpy`'s venv does without
    from s3server import S3Server

LONGEST_FIRST = ("test_readme", "test_bench_smoke", "test_object_storage", "test_stateful", "test_stateful_found",
                 "test_fabric", "test_dcp_writer", "test_snapshots", "test_node_loss", "test_torchrun_example",
                 "test_launch_names", "test_lifecycle_ends", "test_mirror", "test_mirror_retention",
                 "test_snapshots_reads",
                 "test_crash_consistency", "test_lightning_sharded", "test_drain", "test_snapshots_persist",
                 "test_fsdp2_example", "test_dcp_replace", "test_dcp_reader", "test_dcp_clients",
                 "test_multinode_debris", "test_incarnations", "test_fuzz_daemon", "test_ring", "test_peers",
                 "test_peer_outages", "test_fuzz_peers")
"""The modules that take longest (seconds of waiting on processes each), run first: longest first, as measured
by ``make test PYTEST_ARGS=--durations=0`` (setup, call and teardown summed per module)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test`` hands whole modules to its workers in collection order (``--dist loadscope``): a long module
    that started last would run on alone at the end, so the longest start first; the rest keep their order."""
    missing = [name for name in LONGEST_FIRST if not (Path(__file__).parent / f"{name}.py").exists()]
    if missing:  # a module renamed or split without this list: it would silently lose its early start
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names modules that do not exist: {missing}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.split("::")[0]).stem, len(rank)))


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


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test must leave this process's /dev/shm as it found it."""
    before = own_segments()
    yield
    leaked = own_segments() - before
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"test leaked shared-memory segments {sorted(leaked)}"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """A real S3 HTTP endpoint on localhost (moto's server, ``s3server.py``), one per test module."""
    from s3server import S3Server

    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def aws(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """``s3`` with this process and the daemons it starts pointed at it (endpoint and credentials)."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return s3


@pytest.fixture
def bucket(aws: S3Server) -> str:
    """A fresh bucket on ``aws``."""
    return aws.new_bucket()
