"""The shared memory a daemon holds snapshots in is never left behind: not by a stop that abandons stalled work,
not by a killed daemon (the next start unlinks it), not under a pid a new daemon inherits."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import ckptd

from ckptd.protocol.shm import SHM_DIR_ENV

from helpers import SHM, equal_states, segments_of, status, tmpfs, wait_until
from snapshots import state_at


def test_a_stop_that_abandons_stalled_maintenance_still_unlinks_every_snapshot_it_held(
    daemon_factory, client_factory, root, run_dir, tmp_path
) -> None:
    disk = root / "disk"
    disk.mkdir()
    stall = {"op": "remove_tree", "match": str(disk / "old"), "errno": 0, "wait_for": str(tmp_path / "never")}
    daemon = daemon_factory("--drain-timeout", "1", "--keep-snapshots", "2", faults=[stall])
    client = client_factory()
    for step in (1, 2, 3):  # s1 is dropped for s3 (its slot goes back to the client), s2 and s3 stay held
        client.save_async(state_at(step), root / f"s{step}", step=step, persist=False).result(30)
    assert len(segments_of(daemon.proc.pid)) == 2
    client.save_async({"x": torch.ones(10)}, disk / "old", step=1).result(30)
    client.save_async({"x": torch.ones(10)}, disk / "new", step=2, keep_last=1).result(30)  # retention stalls
    log = run_dir / "ckptd.log"
    wait_until(lambda: "event=fault op=remove_tree" in log.read_text(), 30, "retention stalls in the store")
    assert daemon.stop() == 0
    assert "event=maintenance_abandoned" in log.read_text()  # the stall outlived the drain
    assert segments_of(daemon.proc.pid) == [], "the daemon left held snapshots in /dev/shm"
    assert equal_states(ckptd.load(root / "s3"), state_at(3))  # the newest was persisted while it drained


PREDECESSOR = r'''
import os, sys
from pathlib import Path
Path(sys.argv[1], f"ckptd-{os.getuid()}-{os.getpid()}-7").write_bytes(b"x" * 65536)  # left under this pid
os.execv(sys.executable, [sys.executable, "-m", "ckptd", *sys.argv[2:]])  # the same pid starts the daemon
'''


def test_a_daemon_started_under_its_dead_predecessors_pid_unlinks_the_segments_left_under_it(run_dir, root) -> None:
    cmd = [sys.executable, "-c", PREDECESSOR, str(SHM), "start", "--foreground", "--quiet", "--run-dir", str(run_dir),
           "--root", str(root)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def serving() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                return status(run_dir, timeout=2)["daemon"]["pid"] == proc.pid
            except AssertionError:  # not answering yet
                return False
        wait_until(serving, 60, "the daemon answers")
        assert segments_of(proc.pid) == [], "a start-up left its predecessor's segment in /dev/shm"
        assert "owner=predecessor_with_this_pid" in (run_dir / "ckptd.log").read_text()
    finally:
        for name in segments_of(proc.pid):
            (SHM / name).unlink()
        proc.terminate()
        proc.wait(30)


def test_a_killed_daemons_held_snapshots_are_unlinked_by_the_next_start(daemon_factory, client_factory, root,
                                                                        run_dir, tmp_path, monkeypatch) -> None:
    # Every start sweeps the dead pids' slots of its shared-memory folder: in /dev/shm another test's daemon could
    # sweep this one's first, so the two daemons here share a tmpfs of their own and the log proves the sweep
    with tmpfs(tmp_path / "shm", 64) as shm:
        monkeypatch.setenv(SHM_DIR_ENV, str(shm))
        daemon = daemon_factory()
        client = client_factory()
        client.save_async(state_at(1), root / "s1", step=1, persist=False).result(30)
        prefix = f"ckptd-{os.getuid()}-{daemon.proc.pid}-"

        def left() -> list[str]:
            return sorted(p.name for p in shm.iterdir() if p.name.startswith(prefix))
        held = left()
        assert held, "the daemon holds the snapshot's slot under its own pid"
        daemon.kill()
        assert left() == held  # a SIGKILL unlinks nothing
        log = run_dir / "ckptd.log"
        before = log.read_text().count("event=slots_reclaimed")
        daemon_factory()
        wait_until(lambda: left() == [], 30, lambda: f"the next start unlinks the dead daemon's slots: {left()}")
        wait_until(lambda: log.read_text().count("event=slots_reclaimed") > before, 30, "the start logs its sweep")
