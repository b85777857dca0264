"""A persisted snapshot never outranks a checkpoint committed after it (issue 38, case 2).

A snapshot of step 15 held in memory, then a disk save of step 20 in the same
directory with ``keep_last=1``: however the snapshot reaches disk afterwards
(its trainer's ``close()``, an explicit ``persist``, a drain), step 20 stays
committed and ``latest``. Retention orders a directory by step (then by the
time a save was acknowledged), never by the time a persist happened to run.
A persist that finds its path committed with exactly its bytes (a buddy's drain
wrote them while the origin was paused) is done, not lost (case 5), and a stop
beside a trainer snapshotting every step persists the last one it acknowledged.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckptd

from ckptd.protocol.endpoint import LOG_NAME
from helpers import wait_until
from snapshots import full
from test_peers import _pair


def _held_then_saved(client, directory):
    client.save_async(full(15), directory / "step-15", step=15, persist=False, keep_last=1).result(30)
    client.save_async(full(20), directory / "step-20", step=20, keep_last=1).result(30)
    assert (directory / "step-20" / "ckptd.json").exists()


@pytest.mark.parametrize("how", ["close", "persist", "drain"])
def test_persisting_an_older_snapshot_never_deletes_a_newer_committed_checkpoint(how, daemon, client_factory, root,
                                                                                run_dir) -> None:
    directory = root / "run"
    client = client_factory()
    _held_then_saved(client, directory)
    if how == "close":
        client.close()
        wait_until(lambda: daemon.status()["clients"] == [], 30, "the client is gone")
    elif how == "persist":
        with pytest.raises(ckptd.CheckpointExists, match="step-20"):
            client.persist(directory / "step-15")
    assert daemon.stop(timeout=60) == 0
    assert (directory / "step-20" / "ckptd.json").exists(), sorted(p.name for p in directory.iterdir())
    assert ckptd.latest(directory) == directory / "step-20"
    assert ckptd.load(directory / "step-20")["w"].equal(full(20)["w"])
    assert not (directory / "step-15").exists()
    log = (run_dir / "ckptd.log").read_text()
    if how != "persist":
        assert f"event=snapshot_not_persisted path={directory / 'step-15'} step=15 reason=newer_on_disk" in log, log


def test_a_directory_kept_by_keep_spares_the_newer_checkpoint_when_an_older_snapshot_persists(
        daemon_factory, client_factory, root, run_dir) -> None:
    directory = root / "kept"
    directory.mkdir()
    daemon = daemon_factory("--keep", f"{directory}=1")
    client = client_factory()
    client.save_async(full(15), directory / "step-15", step=15, persist=False).result(30)
    client.save_async(full(20), directory / "step-20", step=20).result(30)
    client.close()
    assert daemon.stop(timeout=60) == 0
    assert sorted(p.name for p in directory.iterdir()) == ["step-20"]


def test_an_origin_paused_while_its_buddy_drained_finds_its_snapshot_committed_by_the_buddy_and_loses_nothing(
        root, tmp_path) -> None:
    """The origin does not answer for longer than the drain's 2 s (SIGSTOP): its buddy judges it gone and persists
    its replica. Resumed, the origin's own drain finds the same bytes committed (issue 38, case 5): no loss, and
    ``ckptd stop`` exits 0, where it said the committed snapshot was lost (exit 3)."""
    pair = _pair(root, tmp_path, origin_extra=("--persist-on-exit", "never"))
    state = {"w": torch.randn(50_000), "step": 9}
    path = root / "run" / "step-9"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async(state, path, step=9, persist=False).wait_replicated(60)
        client.close()
        os.kill(pair.origin.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: open(f"/proc/{pair.origin.proc.pid}/stat").read().split()[2] == "T", 10,
                       "the origin is stopped")
            stopped = pair.buddy.cli("stop", timeout=120)
            assert stopped.returncode == 0, stopped.stderr
        finally:
            os.kill(pair.origin.proc.pid, signal.SIGCONT)
        buddy_log = (pair.buddy_dir / "ckptd.log").read_text()
        assert "event=drain_persist_replica" in buddy_log and "did not answer" in buddy_log, buddy_log
        assert (path / "ckptd.json").exists()
        stopped = pair.origin.cli("stop", timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert pair.origin.proc.wait(30) == 0
        origin_log = (pair.origin_dir / "ckptd.log").read_text()
        assert f"event=snapshot_not_persisted path={path} reason=committed_by_another" in origin_log
        back = ckptd.load(path)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 9
    finally:
        pair.kill()


TRAINER = '''
import sys, torch, ckptd
run_dir, directory, acked = sys.argv[1:]
client = ckptd.Client(run_dir=run_dir, spawn=False)
w, step = torch.zeros(1000), 0
while True:
    step += 1
    w.fill_(step)
    try:
        client.save_async({"w": w}, f"{directory}/step-{step}", step=step, persist=False).result()
    except ckptd.CkptdError:
        break
    open(acked, "w").write(str(step))
'''


@pytest.mark.timeout(300)
def test_a_stop_beside_a_trainer_snapshotting_every_step_persists_the_last_snapshot_it_acknowledged(
        daemon_factory, root, tmp_path) -> None:
    """``ckptd stop`` while a trainer snapshots as fast as it can: a snapshot whose shard came before the drain
    began but was held after the drain chose what to persist is persisted too (it was acknowledged and never
    written, and the stop exited 0). A race, so several rounds; the new-user pass saw it in 3 of 12."""
    for round_ in range(4):
        directory, acked = root / f"r{round_}", tmp_path / f"acked-{round_}"
        directory.mkdir()
        daemon = daemon_factory()
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(daemon.run_dir), str(directory), str(acked)])
        try:
            wait_until(lambda: acked.exists() and int(acked.read_text() or 0) > 20, 60, "20 snapshots acknowledged")
            assert daemon.stop(timeout=120) == 0
        finally:
            trainer.kill()
            trainer.wait()
        step = int(acked.read_text())
        newest = ckptd.latest(directory)
        assert newest is not None and ckptd.read_index(newest).step >= step, (round_, step, newest)
        assert ckptd.load(newest)["w"][0].item() == ckptd.read_index(newest).step
    sweeper = daemon_factory()  # the killed trainer's slots: a daemon's start reclaims a dead client's
    wait_until(lambda: not sweeper.status()["clients"], 30, "no clients")
    assert sweeper.stop(timeout=60) == 0


def test_retention_after_a_persist_orders_by_step_not_by_when_the_snapshot_was_held(daemon, client_factory,
                                                                                     root) -> None:
    """A snapshot of step 3 (``keep_last=1``), then a disk save of step 2 committed after it: persisting step 3 makes
    it the newest by step, and its retention deletes step 2, though step 2 was committed after step 3 was held (the
    time the persisted index records)."""
    directory = root / "run"
    client = client_factory()
    client.save_async(full(3), directory / "step-3", step=3, persist=False, keep_last=1).result(30)
    client.save_async(full(2), directory / "step-2", step=2, keep_last=1).result(30)
    assert client.persist(directory / "step-3") == directory / "step-3"
    wait_until(lambda: sorted(p.name for p in directory.iterdir()) == ["step-3"], 30,
               lambda: f"retention leaves only step-3: {sorted(p.name for p in directory.iterdir())}")
    assert ckptd.latest(directory) == directory / "step-3"



def test_a_disk_save_committed_during_an_older_snapshots_persist_leaves_one_checkpoint_under_keep_last_1(
        daemon_factory, client_factory, root) -> None:
    """Step 5 held in memory, its persist stopped at its shard's fsync (the fault, proved by its log line); step 6
    saved to disk (``keep_last=1``) commits meanwhile, its retention passing over step 5 in flight. Once step 5's
    persist commits, its retention finds step 6 newer by step and by time: step 5 goes, as it would have had its
    persist ended first, and only step 6 is left (both were left before)."""
    gate = root.parent / "persist-may-go-on"
    daemon = daemon_factory(faults=[{"op": "fsync", "match": "step-5", "errno": 0, "wait_for": str(gate)}])
    directory, log_path = root / "run", daemon.run_dir / LOG_NAME
    client = client_factory()
    client.save_async(full(5), directory / "step-5", step=5, persist=False, keep_last=1).result(30)
    with ThreadPoolExecutor(1) as pool:
        persisting = pool.submit(client_factory().persist, directory / "step-5")
        wait_until(lambda: "event=fault op=fsync" in log_path.read_text(), 30, "step 5's persist stopped at its fsync")
        client.save_async(full(6), directory / "step-6", step=6, keep_last=1).result(30)
        assert sorted(p.name for p in directory.iterdir()) == ["step-5.incomplete", "step-6"]
        gate.touch()
        assert persisting.result(60) == directory / "step-5"
    wait_until(lambda: sorted(p.name for p in directory.iterdir()) == ["step-6"], 30,
               lambda: f"retention leaves only step-6: {sorted(p.name for p in directory.iterdir())}")
    assert ckptd.latest(directory) == directory / "step-6"
    assert ckptd.load(directory / "step-6")["w"].tolist()[:1] == [6.0]
