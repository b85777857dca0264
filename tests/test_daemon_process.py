"""The daemon as a process: status, start, spawning, idling, housekeeping, and what it refuses (stopping and draining:
``test_drain.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

import ckptd
from ckptd.core.config import DaemonConfig
from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.messages import WriteShard, Error, Hello, Status, StatusReply, Welcome, decode
from ckptd.protocol.layout import plan_layout
from ckptd.core.render import render_status

from helpers import dead_pid, raw_socket, start_daemon, status, wait_until

SLOW = [{"op": "write", "match": "slow", "errno": 0, "delay": 1.5}]


def test_status_shows_a_save_in_flight(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory(faults=SLOW)
    client = client_factory()
    fut = client.save_async({"w": torch.ones(1000)}, root / "slow", step=9)
    status = daemon.status()
    (ckpt,) = status["checkpoints"]
    assert ckpt["path"] == str(root / "slow") and ckpt["step"] == 9
    assert ckpt["ranks_durable"] == 0 and ckpt["world_size"] == 1
    (save,) = status["saves"]
    assert save["state"] in ("queued", "writing") and save["bytes"] > 0
    assert status["writes"]["writing"] + status["writes"]["queued"] == 1
    text = render_status(status)  # what `ckptd status` prints (the CLI itself is tested in test_cli.py)
    assert "in progress:" in text and "ranks durable 0/1" in text
    fut.result(30)
    after = daemon.status()
    assert after["checkpoints"] == [] and after["completed"]["count"] == 1
    assert after["completed"]["last"]["path"] == str(root / "slow")


def test_second_start_on_the_same_run_dir_refuses_clearly(daemon) -> None:
    out = daemon.cli("start", "--foreground")
    assert out.returncode == 3
    assert "already running" in out.stderr and str(daemon.proc.pid) in out.stderr
    assert daemon.proc.poll() is None


def test_daemon_process_never_loads_torch(daemon, client, root) -> None:
    client.save_async({"w": torch.ones(10)}, root / "c").result(30)
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch" not in maps


def test_a_client_spawns_a_detached_daemon_once_even_when_ranks_race(run_dir, root, monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_ROOTS", str(root))
    clients: list = [None] * 4
    errors: list = []

    def make(i: int) -> None:
        try:
            clients[i] = ckptd.Client(run_dir=run_dir, spawn=True, timeout=20)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    pid = int((run_dir / "ckptd.pid").read_text())
    try:
        assert os.getsid(pid) != os.getsid(0), "the daemon must run in its own session"
        for i, c in enumerate(clients):
            c.save_async({"i": torch.tensor(i)}, root / f"from-{i}").result(30)
        status = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "--run-dir", str(run_dir)],
                                capture_output=True, text=True, timeout=30)
        assert f'"pid": {pid}' in status.stdout
        assert status.stdout.count('"saves": 1') == 4
    finally:
        for c in clients:
            c.close()
        out = subprocess.run([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(run_dir)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr


def test_a_client_with_a_short_silence_timeout_still_gives_a_spawned_daemon_time_to_start(
    run_dir, root, monkeypatch
) -> None:
    """``timeout`` is how long a running daemon may stay silent; starting Python takes longer than 0.1 s."""
    monkeypatch.setenv("CKPTD_ROOTS", str(root))
    client = ckptd.Client(run_dir=run_dir, spawn=True, heartbeat=0.05, timeout=0.1)
    try:
        pid = int((run_dir / "ckptd.pid").read_text())
        assert status(run_dir)["daemon"]["pid"] == pid
    finally:
        client.close()
        out = subprocess.run([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(run_dir)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr


def test_an_idle_client_whose_daemon_was_stopped_spawns_a_new_one_for_its_next_save(run_dir, root, monkeypatch) -> None:
    """Nothing was pending when the daemon stopped, so only its pid tells: the next save must not go to nobody."""
    monkeypatch.setenv("CKPTD_ROOTS", str(root))
    client = ckptd.Client(run_dir=run_dir, spawn=True)
    try:
        client.save_async({"w": torch.ones(4)}, root / "before").result(30)
        first_pid = int((run_dir / "ckptd.pid").read_text())
        out = subprocess.run([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(run_dir)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        wait_until(lambda: not Path(f"/proc/{first_pid}").exists(), 30, "the stopped daemon exited")
        state = {"w": torch.arange(4.0)}
        client.save_async(state, root / "after").result(30)
        assert torch.equal(ckptd.load(root / "after")["w"], state["w"])
        assert int((run_dir / "ckptd.pid").read_text()) != first_pid
    finally:
        client.close()
        subprocess.run([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(run_dir)],
                       capture_output=True, text=True, timeout=60)


def test_daemon_started_with_exit_when_idle_exits_after_its_last_client(run_dir, root, client_factory) -> None:
    daemon = start_daemon(run_dir, root, "--exit-when-idle", "2")  # long enough to say hello on a loaded machine
    try:
        c = client_factory()
        c.save_async({"x": 1}, root / "c").result(30)
        time.sleep(3.0)  # past the 2 s idle limit: a daemon that forgot its client would have exited by now
        assert daemon.proc.poll() is None, "must not exit while a client is connected"
        c.close()
        assert daemon.proc.wait(15) == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.kill()


def test_the_daemon_looks_for_dead_clients_at_its_housekeeping_interval(daemon_factory) -> None:
    """A dead client is forgotten at the next housekeeping round: soon with a short interval,
    not at all within seconds with an hour-long one (the default is 1 s)."""
    for interval, forgotten in (("3600", False), ("0.05", True)):
        daemon = daemon_factory("--housekeeping-interval", interval)
        gone = dead_pid()
        sock = raw_socket(daemon)
        sock.send(Hello(1, gone, os.getuid(), "test").to_wire())
        assert decode(sock.recv()).type == "welcome"
        pids = lambda: [c["pid"] for c in daemon.status()["clients"]]  # noqa: E731
        if forgotten:
            wait_until(lambda: gone not in pids(), 60, f"the daemon forgets the dead client (pid {gone})")
        else:
            time.sleep(1.5)  # past the default interval
            assert gone in pids(), "a housekeeping round ran before the hour-long interval was up"
        sock.close()
        daemon.stop()


@pytest.mark.parametrize("interval", [0, -1.0, float("inf"), float("nan")])
def test_a_housekeeping_interval_that_is_not_positive_finite_seconds_is_refused_naming_it(tmp_path, interval) -> None:
    with pytest.raises(ValueError, match="housekeeping_interval must be positive finite seconds"):
        DaemonConfig(run_dir=tmp_path / "run", roots=(tmp_path,), housekeeping_interval=interval)


def test_garbage_and_rule_breaking_requests_get_error_replies_and_the_daemon_serves_on(daemon, root) -> None:
    sock = raw_socket(daemon)
    layout = plan_layout([("w", "F32", (4,))], {})
    commit = WriteShard(7, f"ckptd-{os.getuid()}-{os.getpid()}-0", layout.nbytes, layout.data_start,
                    layout.entries, str(root / "x"), 0, 1, None, False, False, None, 60.0, 0.0, layout.nbytes)
    cases = [
        (b"\xc1garbage", ErrorCode.BAD_MESSAGE),
        (msgpack.packb({"v": 99, "type": "status", "id": 3}), ErrorCode.UNSUPPORTED_VERSION),
        (msgpack.packb({"v": 1, "type": "welcome", "id": 4, "daemon_pid": 1, "daemon_version": "x", "roots": []}),
         ErrorCode.BAD_MESSAGE),
        (commit.to_wire(), ErrorCode.UNKNOWN_CLIENT),  # no hello yet
    ]
    for payload, code in cases:
        sock.send(payload)
        reply = decode(sock.recv())
        assert isinstance(reply, Error) and reply.code == code, reply
    sock.send(Hello(1, os.getpid(), os.getuid(), "test").to_wire())
    assert isinstance(decode(sock.recv()), Welcome)
    # a slot that does not exist, and a slot named for another process
    sock.send(commit.to_wire())
    reply = decode(sock.recv())
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_SLOT and "cannot open slot" in reply.message
    other = WriteShard(8, f"ckptd-{os.getuid()}-1-0", layout.nbytes, layout.data_start, layout.entries,
                   str(root / "x"), 0, 1, None, False, False, None, 60.0, 0.0, layout.nbytes)
    sock.send(other.to_wire())
    reply = decode(sock.recv())
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_SLOT and "pid" in reply.message
    sock.send_multipart([b"two", b"frames"])
    assert decode(sock.recv()).code == ErrorCode.BAD_MESSAGE
    sock.send(Status(9).to_wire())
    assert isinstance(decode(sock.recv()), StatusReply)
    sock.close()
    assert not (root / "x").exists() and not (root / "x.incomplete").exists()


def test_a_slot_whose_header_disagrees_with_the_commit_is_refused(daemon, client, root) -> None:
    # stage a real save to get a real slot, then lie about its tensor table
    client.save_async({"w": torch.ones(4)}, root / "real").result(30)
    (slot,) = client.slot_names
    sock = raw_socket(daemon)
    sock.send(Hello(1, os.getpid(), os.getuid(), "test").to_wire())
    decode(sock.recv())
    layout = plan_layout([("v", "F32", (4,))], {})
    lie = WriteShard(2, slot, layout.nbytes, layout.data_start, layout.entries, str(root / "lie"), 0, 1, None, False, False, None, 60.0, 0.0, layout.nbytes)
    sock.send(lie.to_wire())
    reply = decode(sock.recv())
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_SLOT, reply
    sock.close()
    assert not (root / "lie").exists()


def test_a_client_whose_own_start_meets_a_daemon_started_meanwhile_reaches_that_daemon(run_dir, root,
                                                                                      monkeypatch) -> None:
    """A supervisor restarted the daemon, which does not answer yet (stopped here) when a client looks: the client's
    own start is refused (a daemon runs there), and the client waits for that daemon instead of failing (found by
    the new-user pass: a save right after a supervisor's restart failed with DaemonUnavailable)."""
    import psutil

    monkeypatch.setenv("CKPTD_ROOTS", str(root))
    daemon = start_daemon(run_dir, root)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    outcome: dict = {}

    def make() -> None:
        try:
            outcome["client"] = ckptd.Client(run_dir=run_dir, spawn=True, timeout=0.5)
        except Exception as exc:  # reported below
            outcome["error"] = exc

    def own_starts() -> list:
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                if "--exit-when-idle" in p.cmdline():
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
        return found

    thread = threading.Thread(target=make)
    try:
        thread.start()
        seen: list = []
        wait_until(lambda: seen.extend(own_starts()) or seen or "error" in outcome, 60, "the client's own start")
        assert seen, f"the client never started a daemon of its own: {outcome}"
        wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in seen), 60,
                   "the client's own start to be refused")
        assert "error" not in outcome, f"the client gave up on the daemon that runs there: {outcome['error']}"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    thread.join(60)
    client = outcome.get("client")
    assert client is not None, outcome
    try:
        client.save_async({"w": torch.ones(4)}, root / "after-restart").result(30)
        assert status(run_dir)["daemon"]["pid"] == daemon.proc.pid
    finally:
        client.close()
        daemon.kill()
