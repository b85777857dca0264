"""Stopping a daemon: ``ckptd stop`` and SIGTERM drain what is in flight, refuse new saves, and fail what never
completes with ``ShuttingDown`` (never ``DaemonUnavailable``), removing its directory, before exiting 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptd

from helpers import filled_state as state, wait_until

SLOW = [{"op": "write", "match": "slow", "errno": 0, "delay": 1.5}]


def test_sigterm_drains_in_flight_saves_then_exits_zero(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory(faults=SLOW)
    client = client_factory()
    fut = client.save_async({"w": torch.ones(100)}, root / "slow")
    fut.wait_staged(10)
    wait_until(lambda: daemon.status()["saves"])
    assert daemon.stop(timeout=30) == 0
    assert fut.result(10).path == root / "slow"
    assert ckptd.read_index(root / "slow").world_size == 1
    assert not (daemon.run_dir / "ckptd.sock").exists() and not (daemon.run_dir / "ckptd.pid").exists()


def test_sigterms_that_keep_coming_while_the_daemon_drains_and_exits_leave_its_exit_status_zero(daemon) -> None:
    """A supervisor may signal again while the daemon leaves (a second Ctrl-C, a kill loop): once drained, the
    daemon ignores that, and a clean stop never ends as "killed by SIGTERM" (the interpreter restores the
    default action as it exits)."""
    sent = 0
    while daemon.proc.poll() is None:
        try:
            os.kill(daemon.proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # reaped between the poll and the kill
            break
        sent += 1
        time.sleep(0.001)
    assert daemon.proc.wait(30) == 0, f"exit status {daemon.proc.returncode} after {sent} SIGTERMs"
    assert sent > 1


def test_a_save_reported_staged_is_drained_by_a_stop_that_follows(daemon_factory, client_factory, root) -> None:
    """With background staging, ``staged`` means the daemon holds the save: a stop right after it drains the save
    (20,000 tensors make the commit message slow to build, which is when the stop used to get there first)."""
    daemon = daemon_factory()
    client = client_factory(background_staging=True)
    fut = client.save_async({f"t{i}": torch.full((4,), float(i)) for i in range(20_000)}, root / "many")
    fut.wait_staged(60)
    assert daemon.stop(timeout=60) == 0
    assert fut.result(10).path == root / "many"
    assert ckptd.load(root / "many")["t19999"].tolist() == [19999.0] * 4


def test_ckptd_stop_refuses_new_saves_while_draining(daemon_factory, client_factory, root) -> None:
    # the write must outlast starting the `ckptd stop` interpreter, or the drain is over (and the
    # daemon gone) before the second save is tried: on a loaded machine that takes seconds
    daemon = daemon_factory(faults=[{**SLOW[0], "delay": 6}])
    client = client_factory(max_inflight=2)
    first = client.save_async({"w": torch.ones(100)}, root / "slow")
    wait_until(lambda: daemon.status()["saves"])
    stopper = subprocess.Popen([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(daemon.run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: daemon.proc.poll() is not None or _draining(daemon))
    with pytest.raises(ckptd.ShuttingDown):
        client.save_async({"w": torch.ones(100)}, root / "refused").result(30)
    assert first.result(30).path == root / "slow"
    out, err = stopper.communicate(timeout=30)
    assert stopper.returncode == 0, err
    assert "stopped" in out
    assert daemon.proc.wait(10) == 0
    assert not (root / "refused").exists()


def _draining(daemon) -> bool:
    try:
        return daemon.status()["daemon"]["draining"]
    except AssertionError:  # no answer: it has just exited
        return False


def _stop(daemon, how: str) -> None:
    if how == "sigterm":
        daemon.proc.send_signal(signal.SIGTERM)
    else:
        out = daemon.cli("stop", "--timeout", "60", timeout=90)
        assert out.returncode == 0, out.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["stop", "sigterm"])
def test_stopping_with_a_checkpoint_missing_ranks_fails_it_with_shutting_down_and_removes_its_directory(
    daemon_factory, client_factory, root, how
) -> None:
    daemon = daemon_factory("--drain-timeout", "1")
    rank0 = client_factory(rank=0, world_size=2, heartbeat=0.2, timeout=5.0)
    fut = rank0.save_async(state(1), root / "half", step=1)  # rank 1 never comes
    _stop(daemon, how)
    with pytest.raises(ckptd.ShuttingDown, match=r"waited for ranks \[1\] of 2"):
        fut.result(30)
    assert daemon.proc.wait(30) == 0
    assert sorted(os.listdir(root)) == [], "the unfinished checkpoint's directory must be removed"


@pytest.mark.timeout(90)
def test_a_stop_waits_for_the_removal_its_deadline_started_before_it_exits(daemon_factory, client_factory,
                                                                          root) -> None:
    """The drain's deadline fails the checkpoint and sets its directory aside; removing it (slowed here to
    1.5 s) is maintenance, which the exit abandons, but only after a grace a local removal ends within."""
    daemon = daemon_factory("--drain-timeout", "1",
                            faults=[{"op": "remove_tree", "match": "discarded", "errno": 0, "delay": 1.5}])
    rank0 = client_factory(rank=0, world_size=2, heartbeat=0.2, timeout=5.0)
    fut = rank0.save_async(state(1), root / "half", step=1)  # rank 1 never comes
    _stop(daemon, "sigterm")
    with pytest.raises(ckptd.ShuttingDown):
        fut.result(30)
    assert daemon.proc.wait(30) == 0
    assert "event=fault op=remove_tree" in (daemon.run_dir / "ckptd.log").read_text()
    assert sorted(os.listdir(root)) == [], "the failed attempt's directory must be removed before the exit"


@pytest.mark.timeout(90)
def test_a_drain_lets_the_missing_rank_commit_and_refuses_new_checkpoints(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory("--drain-timeout", "120")
    rank0 = client_factory(rank=0, world_size=2, heartbeat=0.2, timeout=5.0)
    rank1 = client_factory(rank=1, world_size=2, heartbeat=0.2, timeout=5.0)
    first = rank0.save_async(state(1), root / "both", step=1)
    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: daemon.status()["daemon"]["draining"], 15, "the daemon drains")
    with pytest.raises(ckptd.ShuttingDown, match="accepts no new saves"):
        rank1.save_async(state(5), root / "new", step=5).result(30)
    second = rank1.save_async(state(2), root / "both", step=1)
    first.result(30)
    second.result(30)
    assert daemon.proc.wait(30) == 0
    assert ckptd.load(root / "both", rank=0)["w"][0].item() == 1.0
    assert ckptd.load(root / "both", rank=1)["w"][0].item() == 2.0
    assert sorted(os.listdir(root)) == ["both"]


def test_a_save_that_arrived_before_the_stop_is_drained_however_long_its_examination_takes(daemon_factory,
                                                                                            client_factory, root,
                                                                                            tmp_path) -> None:
    """The stop comes while the daemon still examines a shard it received (its parent's resolution held by the
    fault until the test lets it go): the shard arrived before the drain, so it is drained, not refused as new."""
    gate = tmp_path / "go"
    held = root / "held"
    held.mkdir()
    daemon = daemon_factory(faults=[{"op": "resolve", "match": str(held), "exact": True, "errno": 0,
                                     "wait_for": str(gate)}])
    client = client_factory(timeout=60)
    fut = client.save_async({"w": torch.ones(100)}, held / "ckpt", block=False)
    log = daemon.run_dir / "ckptd.log"
    wait_until(lambda: f"event=fault op=resolve after=False action=delay=0 path={held}" in log.read_text(), 30,
               "the daemon examines the shard")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "event=drain" in log.read_text(), 30, "the daemon drains")
    gate.touch()
    assert daemon.proc.wait(60) == 0
    assert fut.result(10).path == held / "ckpt"
    assert ckptd.load(held / "ckpt")["w"].tolist() == [1.0] * 100
