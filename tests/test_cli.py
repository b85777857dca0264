"""The CLI against a real daemon: status, list, start and stop, metrics; exit codes 0 ok, 1 daemon unreachable,
2 usage, 3 error reply."""

from __future__ import annotations

import json

import torch

from helpers import ckptd_cli, wait_until


def test_status_exits_zero_and_prints_a_readable_table(daemon) -> None:
    out = daemon.cli("status")
    assert out.returncode == 0
    assert f"pid {daemon.proc.pid}" in out.stdout and "in progress: nothing" in out.stdout


def test_status_json_has_the_documented_top_level_keys(daemon) -> None:
    out = daemon.cli("status", "--json")
    assert out.returncode == 0
    info = json.loads(out.stdout)
    assert set(info) == {"daemon", "clients", "writes", "saves", "checkpoints", "completed", "errors",
                         "shm_mapped_bytes", "shm", "roots", "loads", "errors_total", "memory"}
    assert info["daemon"]["pid"] == daemon.proc.pid
    assert info["roots"][0]["path"] == str(daemon.root)
    # the tests' in-process status (helpers.status) reads the same document, field for field
    def keys(doc):
        return {k: keys(v) for k, v in doc.items()} if isinstance(doc, dict) else None
    in_process = daemon.status()
    assert keys(in_process) == keys(info)
    assert in_process["daemon"]["pid"] == info["daemon"]["pid"]
    assert [r["path"] for r in in_process["roots"]] == [r["path"] for r in info["roots"]]


def test_status_and_stop_exit_one_when_no_daemon_runs(run_dir) -> None:
    for cmd in ("status", "stop"):
        out = ckptd_cli(cmd, "--run-dir", str(run_dir))
        assert out.returncode == 1, out
        assert "no ckptd daemon is running" in out.stderr


def test_usage_errors_exit_two(run_dir) -> None:
    assert ckptd_cli().returncode == 2
    assert ckptd_cli("frobnicate").returncode == 2
    out = ckptd_cli("start", "--max-concurrent-writes", "many")
    assert out.returncode == 2 and "--max-concurrent-writes: expected a whole number" in out.stderr
    out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--max-concurrent-writes", "0")
    assert out.returncode == 2 and "--max-concurrent-writes" in out.stderr


def test_an_error_exits_three(daemon) -> None:
    out = daemon.cli("start")
    assert out.returncode == 3 and "already running" in out.stderr


def test_start_detaches_and_stop_drains(run_dir, root) -> None:
    out = ckptd_cli("start", "--run-dir", str(run_dir), "--root", str(root))
    assert out.returncode == 0, out.stderr
    assert "ckptd started" in out.stdout
    assert ckptd_cli("status", "--run-dir", str(run_dir)).returncode == 0
    out = ckptd_cli("stop", "--run-dir", str(run_dir))
    assert out.returncode == 0 and "stopped" in out.stdout
    assert ckptd_cli("status", "--run-dir", str(run_dir)).returncode == 1


def test_status_watch_redraws_with_progress_bars_while_a_save_runs(daemon_factory, client_factory, root,
                                                                   tmp_path) -> None:
    """The save is held in its fsync (the fault waits for ``watched``) until the watch has redrawn three times, so
    every frame shows it, however slowly a loaded node starts the CLI."""
    import torch

    watched = tmp_path / "watched"
    daemon = daemon_factory(faults=[{"op": "fsync", "match": "slow", "errno": 0, "wait_for": str(watched)}])
    fut = client_factory().save_async({"w": torch.ones(1000)}, root / "slow")
    saves = lambda: [(s["state"], s["written"] == s["bytes"]) for s in daemon.status()["saves"]]  # noqa: E731
    wait_until(lambda: saves() == [("fsync", True)], 60, lambda: f"the save written and held in its fsync: {saves()}")
    try:
        out = daemon.cli("status", "--watch", "--interval", "0.2", "--count", "3")
    finally:
        watched.touch()
    assert out.returncode == 0
    frames = out.stdout.split("\x1b[H\x1b[2J")
    assert frames[0] == "" and len(frames) == 4, out.stdout
    assert all("[########################] 100.0%" in f and "fsync" in f for f in frames[1:]), out.stdout
    fut.result(30)
    assert daemon.cli("status", "--watch", "--json").returncode == 2


def test_prometheus_metrics_are_served_and_written_to_a_textfile(daemon_factory, client_factory, root, tmp_path) -> None:
    import socket
    import urllib.request

    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    textfile = tmp_path / "ckptd.prom"
    daemon_factory("--metrics-port", str(port), "--metrics-textfile", str(textfile))
    client_factory().save_async({"w": torch.ones(1000)}, root / "c").result(30)
    scrape = lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()  # noqa: E731
    # the snapshot is taken once a second, the textfile written with it
    wait_until(lambda: "ckptd_checkpoints_committed_total 1.0" in scrape(), 60, "the commit in the served metrics")
    wait_until(lambda: textfile.exists() and "ckptd_checkpoints_committed_total 1.0" in textfile.read_text(), 60,
               "the commit in the textfile")
    body = scrape()
    assert "ckptd_up 1.0" in body
    assert "ckptd_checkpoints_committed_total 1.0" in body
    assert f'ckptd_root_free_bytes{{root="{root}"}}' in body
    written = [line for line in body.splitlines() if line.startswith("ckptd_written_bytes_total")]
    assert float(written[0].split()[1]) > 4000
    assert "ckptd_checkpoints_committed_total 1.0" in textfile.read_text()


def test_a_metrics_textfile_that_stops_being_writable_is_logged_once_and_again_when_it_is_written(
        daemon_factory, tmp_path) -> None:
    """Its directory removed after the start: the first failed write is logged, the next ones (each second) are
    not; once the directory is back, the file is written again and that is logged."""
    import shutil
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path / "prom"
    folder.mkdir()
    textfile = folder / "ckptd.prom"
    daemon = daemon_factory("--metrics-port", str(port), "--metrics-textfile", str(textfile))
    log = lambda: (daemon.run_dir / "ckptd.log").read_text()  # noqa: E731

    def uptime() -> float:  # the snapshot's, served: a new value is a new update, whose write follows it
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        return next(float(line.split()[1]) for line in body.splitlines() if line.startswith("ckptd_uptime_seconds"))

    wait_until(lambda: "ckptd_up 1.0" in textfile.read_text(), 60, "the textfile written")
    shutil.rmtree(folder)
    wait_until(lambda: "event=metrics_textfile_failed" in log(), 60, "the failed write logged")
    seen = {uptime()}

    def two_more_updates() -> bool:
        seen.add(uptime())
        return len(seen) >= 3
    wait_until(two_more_updates, 60, "two more updates")
    assert log().count("event=metrics_textfile_failed") == 1
    folder.mkdir()
    wait_until(lambda: "event=metrics_textfile_written" in log(), 60, "the write logged once it works again")
    assert "ckptd_up 1.0" in textfile.read_text()
    assert log().count("event=metrics_textfile_failed") == 1 and "background_failed" not in log()


def test_ckptd_list_shows_committed_incomplete_and_foreign(daemon, client, root) -> None:
    client.save_async({"w": torch.ones(100)}, root / "step-7", step=7).result(30)
    (root / "step-8.incomplete").mkdir()
    (root / "step-8.incomplete" / "rank-00000-of-00002.safetensors").write_bytes(b"x" * 10)
    (root / "somebody-elses").mkdir()
    out = daemon.cli("list", str(root))
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[1].split()[:3] == ["step-7", "committed", "7"]
    assert lines[2].split()[:2] == ["step-8.incomplete", "incomplete"]
    assert lines[3].split()[:2] == ["somebody-elses", "foreign"]
    rows = json.loads(daemon.cli("list", str(root), "--json").stdout)
    assert [(r["name"], r["state"], r["ranks"]) for r in rows] == [
        ("step-7", "committed", 1), ("step-8.incomplete", "incomplete", 1), ("somebody-elses", "foreign", None)]
