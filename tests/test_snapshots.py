"""Memory snapshots: held by the node's daemon, restored from memory, persisted when their trainer dies.

Real daemons, real trainer processes: a trainer snapshots every step and is
SIGKILLed; a fresh process resumes from the newest snapshot, bitwise, read
from the daemon's memory (its disk copy moved away to prove it), and the
copy the daemon persisted survives a daemon restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.client.memory import held_snapshots

from helpers import SHM, ckptd_cli, segments_of, status, wait_until

STATE_SRC = r'''
def state_at(step):
    import torch
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "b": torch.arange(step, step + 7, dtype=torch.int64),
            "step": step}
'''
exec(STATE_SRC)  # the test knows the bytes of every step

TRAINER = STATE_SRC + r'''
import json, os, sys, time
import ckptd
run_dir, root, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = ckptd.Client(run_dir=run_dir, spawn=False)
for step in range(1, steps + 1):
    client.save_async(state_at(step), f"{root}/step-{step}", step=step, persist=False).result(60)
print(json.dumps({"pid": os.getpid(), "slots": client.slot_names, "lent": client._slots.lent_names}), flush=True)
time.sleep(120)  # the test kills us
'''

RESUMER = STATE_SRC + r'''
import json, sys, torch, ckptd
run_dir, root = sys.argv[1], sys.argv[2]
path = ckptd.latest(root, run_dir=run_dir)
loaded = ckptd.load(path, run_dir=run_dir)
want = state_at(loaded["step"])
target = {"w": torch.zeros(300_000), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
ckptd.load_into(target, path, run_dir=run_dir)
print(json.dumps({"path": str(path), "step": loaded["step"],
                  "bitwise": all(torch.equal(loaded[k], want[k]) and torch.equal(target[k], want[k]) for k in "wb")}))
'''


def resume(run_dir: Path, root: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", RESUMER, str(run_dir), str(root)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)


@pytest.mark.timeout(120)
def test_a_killed_trainer_resumes_bitwise_from_memory_and_its_persisted_snapshot_survives_a_restart(
    daemon_factory, root, run_dir, tmp_path
) -> None:
    daemon = daemon_factory()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir), str(root), "3"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = trainer.stdout.readline()
    assert line, trainer.stderr.read()[-3000:]
    info = json.loads(line)
    assert len(info["lent"]) == 1 and len(info["slots"]) == 2  # one slot held, one to stage the next snapshot
    trainer.kill()
    assert trainer.wait(30) == -signal.SIGKILL  # the trainer died, it did not exit

    # the daemon persists the dead trainer's newest snapshot; its other slots go, the held one stays
    persisted = lambda: [(s["path"], s["step"], s["persisted"]) for s in daemon.status()["memory"]["snapshots"]]  # noqa: E731
    wait_until(lambda: persisted() == [(str(root / "step-3"), 3, True)], 15,
               lambda: f"the daemon persists the newest snapshot of a dead trainer; it holds {persisted()}")
    assert sorted(os.listdir(root)) == ["step-3"]  # steps 1 and 2 were dropped from memory, never written
    # the held slot was renamed to the daemon's own (no sweep of dead clients' slots takes it): the others go
    wait_until(lambda: segments_of(info["pid"]) == [], 60, lambda: f"dead trainer's slots: {segments_of(info['pid'])}")
    (held_slot,) = [shard[1] for shard in held_snapshots(run_dir)[0]["shards"]]
    assert held_slot in segments_of(daemon.proc.pid)

    # from memory: with the disk copy moved away, a new process still resumes, bitwise
    os.rename(root / "step-3", tmp_path / "aside")
    assert resume(run_dir, root) == {"path": str(root / "step-3"), "step": 3, "bitwise": True}
    os.rename(tmp_path / "aside", root / "step-3")

    daemon.stop()
    assert not (SHM / held_slot).exists(), "a stopped daemon leaves none of the snapshots it held in /dev/shm"
    daemon_factory()
    assert held_snapshots(run_dir) == []
    assert resume(run_dir, root) == {"path": str(root / "step-3"), "step": 3, "bitwise": True}


def test_snapshots_are_held_not_written_and_the_pool_reuses_released_slots(daemon, client, root, run_dir) -> None:
    for step in range(1, 5):
        result = client.save_async(state_at(step), root / f"s{step}", step=step, persist=False).result(30)
        assert result.path == root / f"s{step}"
    assert os.listdir(root) == []  # no disk I/O at all
    assert len(client.slot_names) == 2  # one held, one to stage the next snapshot into
    assert ckptd.latest(root, run_dir=run_dir) == root / "s4"
    assert equal_states(ckptd.load(root / "s4", run_dir=run_dir), state_at(4))
    listing = daemon.cli("list", str(root))
    assert listing.returncode == 0 and "memory" in listing.stdout.splitlines()[1], listing.stdout
    assert client.persist(root / "s4") == root / "s4"
    assert equal_states(ckptd.load(root / "s4"), state_at(4))  # no run_dir: read from disk
    rows = json.loads(daemon.cli("list", str(root), "--json").stdout)
    assert [(r["name"], r["state"], r["in_memory"]) for r in rows] == [("s4", "committed", True)]
    with pytest.raises(ckptd.InvalidCheckpoint, match="holds no snapshot"):
        client.persist(root / "s1")  # dropped when s2 was held
    daemon.stop()


def test_a_snapshot_missing_on_one_rank_is_never_chosen_and_the_complete_one_is_kept(
    daemon, client_factory, root, run_dir
) -> None:
    # long enough to see the lonely snapshot held (and not chosen) before it fails, on a loaded machine too
    rank0, rank1 = (client_factory(rank=r, world_size=2, commit_timeout=10) for r in (0, 1))
    states = [{"r": torch.full((1000,), r), "step": 1} for r in (0, 1)]
    futures = [c.save_async(s, root / "s1", step=1, persist=False) for c, s in zip((rank0, rank1), states)]
    assert [f.result(30).path for f in futures] == [root / "s1"] * 2
    lonely = rank0.save_async({"r": torch.full((1000,), 9), "step": 2}, root / "s2", step=2, persist=False)
    wait_until(lambda: daemon.status()["memory"]["snapshots"][-1]["ranks_held"] == [0], 60, "rank 0 is held")
    assert ckptd.latest(root, run_dir=run_dir) == root / "s1"
    with pytest.raises(ckptd.RanksMissing, match=r"ranks \[1\] of 2"):
        lonely.result(30)
    assert [s["path"] for s in daemon.status()["memory"]["snapshots"]] == [str(root / "s1")]
    for r in (0, 1):
        assert equal_states(ckptd.load(root / "s1", rank=r, run_dir=run_dir), states[r])
    daemon.stop()


def test_the_budget_evicts_persisted_snapshots_then_refuses_saying_what_to_do(
    daemon_factory, client_factory, root, run_dir
) -> None:
    daemon = daemon_factory("--memory-budget", "2MiB", "--keep-snapshots", "2")
    client = client_factory()
    small = {"w": torch.ones(200_000)}  # 0.77 MiB each: two fit, three do not
    client.save_async(small, root / "a", step=1, persist=False).result(30)
    client.save_async(small, root / "b", step=2, persist=False).result(30)
    client.persist(root / "a")
    client.save_async(small, root / "c", step=3, persist=False).result(30)  # evicts a: it is on disk
    held = [s["path"] for s in daemon.status()["memory"]["snapshots"]]
    assert held == [str(root / "b"), str(root / "c")]
    with pytest.raises(ckptd.NoSpace) as refused:
        client.save_async(small, root / "d", step=4, persist=False).result(30)
    message = str(refused.value)
    assert "memory budget is 2.0 MiB" in message and "1.5 MiB are held in 2 snapshot(s)" in message
    assert "--memory-budget" in message and "persist" in message
    assert [s["path"] for s in daemon.status()["memory"]["snapshots"]] == held  # nothing newest was dropped
    daemon.stop()


def test_a_snapshot_larger_than_the_budget_is_refused_and_later_small_ones_are_held(
    daemon_factory, client_factory, root, run_dir
) -> None:
    daemon = daemon_factory("--memory-budget", "2MiB")
    client = client_factory()
    with pytest.raises(ckptd.NoSpace, match="memory budget is 2.0 MiB"):
        client.save_async({"w": torch.ones(1_000_000)}, root / "big", step=1, persist=False).result(30)
    assert max(SHM.joinpath(n).stat().st_size for n in client.slot_names) > 2 * 2**20  # the slot grew
    for step in range(2, 6):  # staged into that grown slot, or the next: the budget counts the bytes, not the slot
        small = {"w": torch.full((50_000,), float(step))}
        client.save_async(small, root / f"s{step}", step=step, persist=False).result(30)
        assert ckptd.load(root / f"s{step}", run_dir=run_dir)["w"].equal(small["w"])
    memory = daemon.status()["memory"]
    assert [s["path"] for s in memory["snapshots"]] == [str(root / "s5")]
    assert memory["held_bytes"] == memory["snapshots"][0]["bytes"] < 2**20
    daemon.stop()


@pytest.mark.parametrize("budget, says", [("lots", "expected a number of bytes"), ("0", "at least 1048576 (1 MiB)"),
                                          ("1024", "at least 1048576 (1 MiB)"), ("1PiB", "expected a number of bytes"),
                                          ("1000TiB", "at most the size of")])
def test_a_memory_budget_out_of_range_is_refused_at_start(run_dir, root, budget, says) -> None:
    out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--root", str(root),
                    "--memory-budget", budget)
    assert out.returncode == 2
    assert "memory" in out.stderr and says in out.stderr, out.stderr


def test_sigterm_persists_the_newest_snapshot_before_the_daemon_exits(daemon, client, root, run_dir) -> None:
    client.save_async(state_at(5), root / "s5", step=5, persist=False).result(30)
    assert not (root / "s5").exists()
    assert daemon.stop() == 0
    assert equal_states(ckptd.load(root / "s5"), state_at(5))
    assert "event=drain_persist snapshots=1" in (run_dir / "ckptd.log").read_text()


def test_with_persist_on_exit_never_a_closed_client_leaves_its_snapshot_in_memory_only(
    daemon_factory, client_factory, root, run_dir
) -> None:
    daemon = daemon_factory("--persist-on-exit", "never")
    client = client_factory()
    client.save_async(state_at(6), root / "s6", step=6, persist=False).result(30)
    client.close()
    wait_until(lambda: daemon.status()["clients"] == [], 60, "the client is gone")
    assert not (root / "s6").exists()
    assert equal_states(ckptd.load(root / "s6", run_dir=run_dir), state_at(6))
    daemon.stop()


def test_a_daemon_that_exits_when_idle_waits_while_it_holds_a_snapshot_not_on_disk(
    daemon_factory, client_factory, root, run_dir
) -> None:
    daemon = daemon_factory("--exit-when-idle", "0.3", "--persist-on-exit", "never")
    client = client_factory()
    client.save_async(state_at(7), root / "s7", step=7, persist=False).result(30)
    client.close()
    wait_until(lambda: daemon.status()["clients"] == [], 60, "the client is gone")
    time.sleep(1.5)  # five idle periods: an idle daemon would have exited by now
    assert daemon.proc.poll() is None, "the daemon exited with a snapshot held only in memory"
    persister = client_factory()
    assert persister.persist(root / "s7") == root / "s7"
    persister.close()
    assert daemon.proc.wait(30) == 0  # on disk now: idle, it exits
    assert equal_states(ckptd.load(root / "s7"), state_at(7))


def test_status_text_and_prometheus_metrics_show_the_snapshots_and_the_budget(
    daemon_factory, client_factory, root, run_dir, tmp_path
) -> None:
    metrics = tmp_path / "ckptd.prom"
    daemon = daemon_factory("--metrics-textfile", str(metrics), "--memory-budget", "64MiB")
    client = client_factory()
    client.save_async(state_at(8), root / "s8", step=8, persist=False).result(30)
    text = daemon.cli("status").stdout
    assert "memory snapshots: 1.1 MiB held of a 64.0 MiB budget" in text, text  # its bytes, not its 2 MiB slot
    assert f"{root / 's8'}  step 8" in text and "ranks held 1/1  memory only" in text, text

    def scraped() -> dict[str, float]:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return {k: float(v) for k, v in (line.split() for line in lines if line.startswith("ckptd_memory_"))}
    nbytes = daemon.status()["memory"]["snapshots"][0]["bytes"]
    want = {"ckptd_memory_budget_bytes": 64 * 2**20, "ckptd_memory_held_bytes": nbytes,
            "ckptd_memory_snapshots": 1, "ckptd_memory_snapshots_unpersisted": 1,
            "ckptd_memory_snapshots_held_total": 1, "ckptd_memory_snapshots_dropped_total": 0}
    wait_until(lambda: scraped() == want, 60, lambda: f"the metrics say {scraped()}")
    client.save_async(state_at(9), root / "s9", step=9, persist=False).result(30)  # keeps 1: s8 is dropped
    want.update({"ckptd_memory_snapshots_held_total": 2, "ckptd_memory_snapshots_dropped_total": 1})
    wait_until(lambda: {k: scraped().get(k) for k in want if k.endswith("_total")}
               == {k: v for k, v in want.items() if k.endswith("_total")}, 60, lambda: f"the metrics say {scraped()}")
    status = daemon.status()["memory"]
    assert (status["held_total"], status["dropped_total"]) == (2, 1), status
    daemon.stop()


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


def test_a_killed_daemons_held_snapshots_are_unlinked_by_the_next_start(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory()
    client = client_factory()
    client.save_async(state_at(1), root / "s1", step=1, persist=False).result(30)
    left = segments_of(daemon.proc.pid)
    assert left, "the daemon holds the snapshot's slot under its own pid"
    daemon.kill()
    assert segments_of(daemon.proc.pid) == left  # a SIGKILL unlinks nothing
    daemon_factory()
    wait_until(lambda: segments_of(daemon.proc.pid) == [], 30,
               lambda: f"the next start unlinks the dead daemon's slots: {segments_of(daemon.proc.pid)}")
