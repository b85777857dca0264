"""``ckptd start``'s options have one source: the parser, the config and a detached start's argv agree."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ckptd
from ckptd.cli import _parser
from ckptd.core.config import DaemonConfig
from ckptd.tools.options import START_OPTIONS, config_kwargs, detached_argv
from helpers import short_tempdir

NOT_OPTIONS = {"run_dir", "log_to_stderr", "chunk_bytes", "space_margin_fraction", "space_margin_bytes",
               "shm_min_free"}
"""Config fields that are no start option: the run dir has its own (every command's), the rest are tuning
knobs the tests and benchmarks set in code."""


def _start_args(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_args(["start", *argv])


def test_every_config_field_a_user_sets_is_a_start_option_and_nothing_else_is() -> None:
    fields = {f.name for f in dataclasses.fields(DaemonConfig)} - NOT_OPTIONS
    assert {o.field for o in START_OPTIONS} == fields


def test_a_detached_start_hands_its_child_exactly_the_config_the_parent_built(tmp_path: Path) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    for r in roots:
        r.mkdir()
    argv = ["--root", str(roots[0]), "--root", str(roots[1]), "--max-concurrent-writes", "3",
            "--exit-when-idle", "2.5", "--buffered-io", "--keep", f"{roots[0]}=4", "--max-concurrent-loads", "2",
            "--metrics-textfile", str(tmp_path / "m.prom"), "--sweep", "move", "--drain-timeout", "7.25",
            "--housekeeping-interval", "0.5", "--memory-budget", "64MiB", "--keep-snapshots", "2",
            "--persist-on-exit", "never", "--metrics-addr", "0.0.0.0"]
    parent = DaemonConfig(run_dir=tmp_path / "run", **config_kwargs(_start_args(argv)))
    child_argv = detached_argv(parent, _start_args(argv))
    child = DaemonConfig(run_dir=tmp_path / "run", **config_kwargs(_start_args(child_argv)))
    assert dataclasses.asdict(child) == dataclasses.asdict(parent)
    assert parent.direct_io is False and parent.memory_budget == 64 << 20 and parent.drain_timeout == 7.25
    assert "--metrics-port" not in child_argv  # not given: the child applies the default itself


def test_options_not_given_leave_the_configs_own_defaults(tmp_path: Path) -> None:
    built = DaemonConfig(run_dir=tmp_path, **config_kwargs(_start_args(["--root", str(tmp_path)])))
    default = DaemonConfig(run_dir=tmp_path, roots=(tmp_path,))
    assert dataclasses.asdict(built) | {"memory_budget": 0} == dataclasses.asdict(default) | {"memory_budget": 0}


def test_the_help_quotes_the_configs_defaults() -> None:
    text = _parser()._subparsers._group_actions[0].choices["start"].format_help()  # type: ignore[union-attr]
    flat = " ".join(text.split())
    for option in START_OPTIONS:
        default = option.default_text()
        if default:
            assert f"(default {default})" in flat, option.flag
    assert "(default 60)" in flat and "(default remove)" in flat


def test_ckptd_peer_listen_is_the_default_of_peer_listen_passed_on_by_a_detached_start_and_a_flag_wins(
        tmp_path: Path, monkeypatch) -> None:
    """A daemon a client spawns inherits the client's environment: ``CKPTD_PEER_LISTEN`` opens its peer endpoint."""
    root = ["--root", str(tmp_path)]
    monkeypatch.setenv("CKPTD_PEER_LISTEN", "tcp://127.0.0.1:29100")
    from_env = DaemonConfig(run_dir=tmp_path / "run", **config_kwargs(_start_args(root)))
    assert from_env.peer_listen == "tcp://127.0.0.1:29100" and from_env.replicas == 1
    assert detached_argv(from_env, _start_args(root))[-2:] == ["--peer-listen", "tcp://127.0.0.1:29100"]
    flag = [*root, "--peer-listen", "tcp://127.0.0.1:29101"]
    given = DaemonConfig(run_dir=tmp_path / "run", **config_kwargs(_start_args(flag)))
    assert given.peer_listen == "tcp://127.0.0.1:29101"
    assert "tcp://127.0.0.1:29100" not in detached_argv(given, _start_args(flag))
    monkeypatch.setenv("CKPTD_PEER_LISTEN", "")
    unset = DaemonConfig(run_dir=tmp_path / "run", **config_kwargs(_start_args(root)))
    assert unset.peer_listen is None and unset.replicas == 0
    assert "--peer-listen" not in detached_argv(unset, _start_args(root))


@pytest.mark.parametrize("value, why", [("bogus", "expected tcp://HOST:PORT"),
                                        ("tcp://192.0.2.1:29100", "cannot listen there")], ids=["form", "address"])
def test_a_bad_ckptd_peer_listen_fails_the_clients_spawn_naming_the_variable(tmp_path: Path, monkeypatch, value,
                                                                            why) -> None:
    """The user set the variable, not the flag: the error a spawning client raises says so, and no daemon runs."""
    run_dir = short_tempdir("ckenv-")
    monkeypatch.setenv("CKPTD_PEER_LISTEN", value)
    monkeypatch.setenv("CKPTD_ROOTS", str(tmp_path))
    with pytest.raises(ckptd.DaemonUnavailable, match=rf"--peer-listen \(from \$CKPTD_PEER_LISTEN\) {value}: {why}"):
        ckptd.Client(run_dir=run_dir, timeout=20)
    assert not (run_dir / "ckptd.sock").exists()


def test_a_ckptd_peer_listen_whose_data_port_is_taken_fails_the_clients_spawn_naming_the_variable(
        tmp_path: Path, monkeypatch) -> None:
    """The data port (the peer port + 1) is taken by another program: the error names the variable too."""
    run_dir = short_tempdir("ckenv-")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1] - 1
        monkeypatch.setenv("CKPTD_PEER_LISTEN", f"tcp://127.0.0.1:{port}")
        monkeypatch.setenv("CKPTD_ROOTS", str(tmp_path))
        with pytest.raises(ckptd.DaemonUnavailable, match=rf"--peer-listen \(from \$CKPTD_PEER_LISTEN\) "
                                                          rf"tcp://127.0.0.1:{port}: cannot open its data port"):
            ckptd.Client(run_dir=run_dir, timeout=20)
    assert not (run_dir / "ckptd.sock").exists()


def test_ckptd_start_from_a_folder_holding_a_ckptd_directory_starts_the_installed_ckptd(tmp_path: Path) -> None:
    """The detached daemon imported ``ckptd`` from the directory ``ckptd start`` ran in (a checkout of another
    release, say), and died of it at start."""
    if sys.version_info < (3, 11):
        pytest.skip("Python 3.10 cannot keep the current directory off the path (-P)")
    there = tmp_path / "elsewhere"
    (there / "ckptd").mkdir(parents=True)
    (there / "ckptd" / "__init__.py").write_text("raise ImportError('the ckptd of another checkout')\n")
    run_dir = short_tempdir("ckcwd-")
    cli = [str(Path(sys.executable).with_name("ckptd")), "start", "--run-dir", str(run_dir), "--root", str(tmp_path)]
    started = subprocess.run(cli, cwd=there, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr
        assert "another checkout" not in started.stderr
    finally:
        subprocess.run([*cli[:1], "stop", "--run-dir", str(run_dir)], capture_output=True, timeout=120)
