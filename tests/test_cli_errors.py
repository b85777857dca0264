"""Every user error through the real CLI and a real daemon: a clear message, never a traceback.

Each test names the mistake, checks the exit code (1 no daemon, 2 usage, 3
error) and that the message says what is wrong, and that nothing is left
behind (socket, pid file) by a start that failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

import ckptd
from ckptd.protocol.errors import PathNotAllowed
from ckptd.protocol.messages import MAX_NAME_BYTES

from helpers import FAULTS_SPEC, REPO, ckptd_cli, free_port, start_daemon


def assert_clear(out: subprocess.CompletedProcess, code: int, *phrases: str) -> None:
    assert out.returncode == code, out
    assert "Traceback" not in out.stderr, out.stderr
    for phrase in phrases:
        assert phrase in out.stderr, out.stderr


# --------------------------------------------------------------------------- start


def test_a_metrics_port_out_of_range_is_a_usage_error_and_starts_nothing(run_dir, root) -> None:
    for port in ("70000", "0", "-1", "http"):
        out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--root", str(root), "--metrics-port", port)
        assert_clear(out, 2, "--metrics-port", "between 1 and 65535")
    assert not (run_dir / "ckptd.sock").exists() and not (run_dir / "ckptd.pid").exists()


@pytest.mark.parametrize("detached", [False, True], ids=["foreground", "detached"])
def test_a_metrics_port_in_use_fails_the_start_naming_the_port_and_leaves_nothing(run_dir, root, detached) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mode = () if detached else ("--foreground",)
        out = ckptd_cli("start", *mode, "--run-dir", str(run_dir), "--root", str(root), "--metrics-port", str(port))
    assert_clear(out, 3, f"port {port}", "in use", "--metrics-port")
    assert not (run_dir / "ckptd.sock").exists() and not (run_dir / "ckptd.pid").exists()
    assert ckptd_cli("status", "--run-dir", str(run_dir)).returncode == 1


def _held_port_beside_a_free_one(offset: int) -> tuple[socket.socket, int]:
    """A listening socket on a port of 127.0.0.1, and the peer port whose data port (+ 1) is it (``offset`` 1) or
    which is it (``offset`` 0), its other port free now."""
    while True:
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1] - offset
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port + 1 - offset))
            except OSError:
                held.close()
                continue
        held.listen()
        return held, port


@pytest.mark.parametrize("offset", [0, 1], ids=["peer-port", "data-port"])
def test_a_peer_port_in_use_fails_the_start_as_a_metrics_port_does(run_dir, root, offset) -> None:
    """The peer port, or its data port (the peer port + 1), held by another program: the machine's state, not the
    option's form, so exit 3 (as a metrics port in use), naming the option, and nothing left behind."""
    held, port = _held_port_beside_a_free_one(offset)
    with held:
        out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--root", str(root),
                        "--peer-listen", f"tcp://127.0.0.1:{port}")
    assert_clear(out, 3, f"--peer-listen tcp://127.0.0.1:{port}",
                 "cannot listen there" if offset == 0 else "cannot open its data port")
    assert not (run_dir / "ckptd.sock").exists() and not (run_dir / "ckptd.pid").exists()


def test_a_metrics_textfile_in_a_missing_directory_is_a_usage_error(run_dir, root, tmp_path) -> None:
    out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--root", str(root),
                    "--metrics-textfile", str(tmp_path / "nowhere" / "ckptd.prom"))
    assert_clear(out, 2, "metrics_textfile", "does not exist")


def test_a_metrics_textfile_that_cannot_be_written_fails_the_start_naming_it_and_leaves_nothing(run_dir, root) -> None:
    """/proc exists as a directory, but no file can be made in it, root or not: found at the start (exit 3, as a
    metrics port in use), not logged as a failure each second after it."""
    out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--root", str(root),
                    "--metrics-textfile", "/proc/ckptd.prom")
    assert_clear(out, 3, "cannot write the metrics textfile /proc/ckptd.prom", "--metrics-textfile")
    assert not (run_dir / "ckptd.sock").exists() and not (run_dir / "ckptd.pid").exists()
    logged = (run_dir / "ckptd.log").read_text()  # where a detached start's reader looks, too
    assert "event=start_refused error=cannot write the metrics textfile /proc/ckptd.prom" in logged, logged


def test_a_root_that_does_not_exist_is_refused_at_start(run_dir, tmp_path) -> None:
    missing = tmp_path / "no-such-dir"
    out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--root", str(missing))
    assert_clear(out, 2, f"root {missing} does not exist", "mkdir -p")
    assert not (run_dir / "ckptd.sock").exists()


def test_a_run_dir_that_cannot_be_created_is_refused_naming_it(root, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for mode in (("--foreground",), ()):
        out = ckptd_cli("start", *mode, "--run-dir", str(blocker), "--root", str(root))
        assert_clear(out, 3, f"cannot use {blocker} as the run directory", "--run-dir")


@pytest.mark.parametrize("detached", [False, True], ids=["foreground", "detached"])
def test_a_run_dir_holding_a_garbled_key_pair_is_refused_in_one_line_naming_the_file(run_dir, root, detached) -> None:
    """A key pair file of two words that are no Z85 keys reached the CURVE socket, which raised a bare
    ``ZMQError: Invalid argument``: a traceback in the foreground, and its last lines joined into one detached."""
    run_dir.mkdir(mode=0o700, exist_ok=True)
    (run_dir / "peer.key_secret").write_text("abc\ndef\n")
    mode = () if detached else ("--foreground",)
    out = ckptd_cli("start", *mode, "--run-dir", str(run_dir), "--root", str(root),
                    "--peer-listen", f"tcp://127.0.0.1:{free_port()}")
    assert_clear(out, 2, f"{run_dir / 'peer.key_secret'} is not a key pair", "remove it")
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert not (run_dir / "ckptd.sock").exists() and not (run_dir / "ckptd.pid").exists()


@pytest.mark.parametrize("detached", [False, True], ids=["foreground", "detached"])
def test_a_defect_at_start_is_one_line_naming_it_and_the_log_which_holds_its_traceback(run_dir, root,
                                                                                         detached) -> None:
    """An exception no user error explains (here a storage call that raises ``RuntimeError`` as the daemon
    starts) is told in one line, exit 3, with its traceback kept in the daemon's log."""
    env = {**os.environ, "CKPTD_FAULTS": json.dumps([{"op": "stat", "match": "ckptd.dirs", "defect": True}]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    mode = () if detached else ("--foreground",)  # the foreground logs to stderr too: still one line there
    out = ckptd_cli("start", *mode, "--run-dir", str(run_dir), "--root", str(root), "--storage", FAULTS_SPEC,
                    env=env)
    assert_clear(out, 3, "failed to start: RuntimeError: injected defect", f"traceback is in {run_dir / 'ckptd.log'}")
    said = [line for line in out.stderr.splitlines() if " level=" not in line]  # the foreground's own log lines aside
    assert len(said) == 1 and 'File "' not in out.stderr, out.stderr
    logged = (run_dir / "ckptd.log").read_text()
    assert "event=start_failed" in logged and "Traceback" in logged and "injected defect" in logged, logged
    assert not (run_dir / "ckptd.sock").exists() and not (run_dir / "ckptd.pid").exists()


# --------------------------------------------------------------------------- status / stop


def test_status_and_stop_say_not_running_when_a_killed_daemon_left_its_socket(run_dir, root) -> None:
    daemon = start_daemon(run_dir, root)
    pid = daemon.proc.pid
    daemon.kill()
    assert daemon.proc.returncode == -signal.SIGKILL
    assert (run_dir / "ckptd.sock").exists(), "the killed daemon must have left its socket"
    # a long --timeout: waiting on the dead socket would run into the subprocess timeout
    for cmd in (("status", "--timeout", "600"), ("stop", "--timeout", "600")):
        out = ckptd_cli(cmd[0], "--run-dir", str(run_dir), *cmd[1:], timeout=120)
        assert_clear(out, 1, "no ckptd daemon is running", f"pid {pid}", "has exited")


def test_a_client_reports_the_dead_daemon_and_a_new_start_takes_over(run_dir, root) -> None:
    start_daemon(run_dir, root).kill()
    with pytest.raises(ckptd.DaemonUnavailable, match="no ckptd daemon answers"):
        ckptd.Client(run_dir=run_dir, spawn=False, timeout=10)
    daemon = start_daemon(run_dir, root)
    try:
        assert ckptd_cli("status", "--run-dir", str(run_dir)).returncode == 0
    finally:
        daemon.stop()


def test_stop_timeout_bounds_the_wait_for_an_unresponsive_daemon(daemon) -> None:
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        out = daemon.cli("stop", "--timeout", "0.5")
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert_clear(out, 1, "did not answer within 0.5 s")
    assert daemon.cli("status").returncode == 0  # it was never told to stop


@pytest.mark.parametrize("args,option", [
    (("status", "--watch", "--interval", "-1"), "--interval"),
    (("status", "--watch", "--interval", "0"), "--interval"),
    (("status", "--watch", "--interval", "nan"), "--interval"),
    (("status", "--watch", "--count", "0"), "--count"),
    (("status", "--watch", "--count", "-3"), "--count"),
    (("status", "--timeout", "0"), "--timeout"),
    (("stop", "--timeout", "-1"), "--timeout"),
    (("stop", "--timeout", "inf"), "--timeout"),
    (("start", "--exit-when-idle", "0"), "--exit-when-idle"),
    (("start", "--max-concurrent-loads", "0"), "--max-concurrent-loads"),
    (("start", "--housekeeping-interval", "0"), "--housekeeping-interval"),
    (("start", "--housekeeping-interval", "nan"), "--housekeeping-interval"),
])
def test_a_bad_number_is_a_usage_error_naming_the_option(run_dir, args, option) -> None:
    out = ckptd_cli(args[0], "--run-dir", str(run_dir), *args[1:])
    assert_clear(out, 2, f"argument {option}: expected")


def test_status_into_a_closed_pipe_exits_quietly(daemon) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written (`| head` that has finished)
    try:
        cmd = [sys.executable, "-m", "ckptd", "status", "--run-dir", str(daemon.run_dir), "--json"]
        out = subprocess.run(cmd, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, env=daemon.env)
    finally:
        os.close(write_end)
    assert out.returncode == 0 and out.stderr == "", out.stderr


# --------------------------------------------------------------------------- saves


def test_saving_under_proc_names_the_pseudo_filesystem_not_a_lack_of_space(daemon_factory, client_factory) -> None:
    daemon_factory("--root", "/proc")
    client = client_factory()
    with pytest.raises(PathNotAllowed) as info:
        client.save_async({"w": torch.ones(4)}, "/proc/ckptd-test").result(30)
    assert "proc filesystem" in info.value.message and "no storage" in info.value.message
    assert "space" not in info.value.message.replace("no storage", "")


def test_a_name_whose_incomplete_form_is_too_long_is_refused_naming_the_limit(client, root) -> None:
    limit = MAX_NAME_BYTES - len(".incomplete")
    with pytest.raises(PathNotAllowed, match=f"at most {limit} bytes"):
        client.save_async({"w": torch.ones(4)}, root / ("x" * (limit + 1))).result(30)
    accented = "é" * (limit // 2 + 1)  # fewer characters than the limit, more bytes
    with pytest.raises(PathNotAllowed, match=f"is {len(accented.encode())} bytes long"):
        client.save_async({"w": torch.ones(4)}, root / accented).result(30)
    longest = root / ("y" * limit)
    client.save_async({"w": torch.ones(4)}, longest).result(30)
    assert ckptd.load(longest)["w"].tolist() == [1.0] * 4


# --------------------------------------------------------------------------- list


def test_list_escapes_control_characters_in_names(client, root) -> None:
    client.save_async({"w": torch.ones(4)}, root / "good").result(30)
    shutil.copytree(root / "good", root / "evil\nstep-9    committed")
    (root / "beep\x1b[2J").mkdir()
    out = ckptd_cli("list", str(root))
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert len(lines) == 4, lines  # a header and one line per entry
    assert any(line.startswith("evil\\nstep-9    committed ") for line in lines), lines
    assert any(line.startswith("beep\\x1b[2J ") for line in lines), lines
    assert "\x1b" not in out.stdout
    names = {r["name"] for r in json.loads(ckptd_cli("list", str(root), "--json").stdout)}
    assert names == {"good", "evil\nstep-9    committed", "beep\x1b[2J"}  # JSON keeps the real names


def test_status_escapes_control_characters_in_checkpoint_paths(daemon, client, root) -> None:
    client.save_async({"w": torch.ones(4)}, root / "two\nlines").result(30)
    out = daemon.cli("status")
    assert out.returncode == 0, out
    assert "two\nlines" not in out.stdout
    assert any(line.startswith("  last: ") and "two\\nlines step" in line for line in out.stdout.splitlines()), out.stdout


def test_list_of_a_missing_directory_is_a_usage_error(tmp_path) -> None:
    assert_clear(ckptd_cli("list", str(tmp_path / "nope")), 2, "is not a directory")


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:29100", "tcp://127.0.0.1:65535", "tcp://127.0.0.1"])
def test_peer_key_refuses_an_endpoint_that_peer_listen_would_refuse(run_dir, endpoint) -> None:
    """The line ``peer-key`` prints is what the keys file names the node by: an endpoint no daemon can listen on
    (its data port, PORT + 1, beyond the last port) is refused here, as ``--peer-listen`` refuses it."""
    out = ckptd_cli("peer-key", "--run-dir", str(run_dir), "--endpoint", endpoint)
    assert_clear(out, 2, f"--endpoint {endpoint}: expected tcp://HOST:PORT, PORT between 1 and 65534")
    assert not out.stdout
