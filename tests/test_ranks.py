"""One node, several ranks: one commit when all are durable; timeouts, backpressure, write slots, retention."""

from __future__ import annotations

import errno
import json
import time

import pytest
import torch

import ckptd

from helpers import wait_until

SLOW = [{"op": "write", "match": "slow", "errno": 0, "delay": 1.0}]


def test_four_ranks_on_one_node_commit_once_after_all_are_durable(daemon, client_factory, root) -> None:
    clients = [client_factory(rank=r, world_size=4) for r in range(4)]
    futures = [c.save_async({"r": torch.tensor(r)}, root / "ckpt", step=5) for r, c in enumerate(clients[:3])]
    durable = lambda: [c["ranks_durable"] for c in daemon.status()["checkpoints"]]  # noqa: E731
    wait_until(lambda: durable() == [3], 60, lambda: f"three ranks durable: {durable()}")
    assert not any(f.done() for f in futures), "no rank may resolve before every rank is durable"
    assert not (root / "ckpt").exists()
    futures.append(clients[3].save_async({"r": torch.tensor(3)}, root / "ckpt", step=5))
    results = [f.result(30) for f in futures]
    assert {r.path for r in results} == {root / "ckpt"}
    files = sorted(p.name for p in (root / "ckpt").iterdir())
    assert files == ["ckptd.json"] + [f"rank-{r:05d}-of-00004.safetensors" for r in range(4)]
    assert [ckptd.load(root / "ckpt", rank=r)["r"].item() for r in range(4)] == [0, 1, 2, 3]


def test_ranks_come_from_torchrun_environment(daemon, run_dir, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    c = ckptd.Client(run_dir=run_dir, spawn=False)
    try:
        assert (c.rank, c.world_size, c.local_rank) == (2, 3, 1)
    finally:
        c.close()


def test_a_rank_that_never_commits_fails_every_rank_naming_it(daemon, client_factory, root) -> None:
    # long enough for both to commit on a loaded machine: only rank 1 must be missing
    a = client_factory(rank=0, world_size=3, commit_timeout=5.0)
    b = client_factory(rank=2, world_size=3, commit_timeout=5.0)
    fa = a.save_async({"x": 1}, root / "ckpt")
    fb = b.save_async({"x": 2}, root / "ckpt")
    for fut in (fa, fb):
        with pytest.raises(ckptd.RanksMissing, match=r"ranks \[1\] of 3 never committed"):
            fut.result(15)
    wait_until(lambda: not (root / "ckpt.incomplete").exists())
    assert not (root / "ckpt").exists()
    # the late rank is told the same, and a full retry afterwards succeeds
    late = client_factory(rank=1, world_size=3)
    with pytest.raises(ckptd.RanksMissing):
        late.save_async({"x": 3}, root / "ckpt").result(15)
    retry = [c.save_async({"x": i}, root / "ckpt") for i, c in enumerate((a, late, b))]
    assert all(f.result(30).path == root / "ckpt" for f in retry)


def test_one_failing_rank_fails_the_whole_checkpoint(daemon_factory, client_factory, root) -> None:
    daemon_factory(faults=[{"op": "write", "match": "rank-00001", "errno": errno.EIO}])
    clients = [client_factory(rank=r, world_size=2) for r in range(2)]
    futures = [c.save_async({"r": r}, root / "ckpt") for r, c in enumerate(clients)]
    for f in futures:
        with pytest.raises(ckptd.WriteFailed, match="rank-00001"):
            f.result(15)
    wait_until(lambda: not (root / "ckpt.incomplete").exists())
    assert not (root / "ckpt").exists()


def test_backpressure_blocks_or_raises_busy_and_status_shows_the_wait(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory(faults=SLOW)
    c = client_factory(max_inflight=1)
    first = c.save_async({"w": torch.ones(10)}, root / "slow-1")
    with pytest.raises(ckptd.Busy, match="still in flight"):
        c.save_async({"w": torch.ones(10)}, root / "slow-x", block=False)
    started = time.monotonic()
    second = c.save_async({"w": torch.ones(10)}, root / "slow-2")  # waits for the first
    assert first.done() and time.monotonic() - started > 0.3
    second.result(30)
    (client,) = daemon.status()["clients"]
    assert client["waited_s"] > 0.3 and client["saves"] == 2
    c.wait()
    assert not (root / "slow-x").exists()


def test_write_slots_cap_concurrent_writes_node_wide_fifo(daemon_factory, client_factory, root, tmp_path) -> None:
    gate = tmp_path / "gate"  # the first write waits for it: the other two queue behind it however slow the node
    daemon = daemon_factory("--max-concurrent-writes", "1",
                            faults=[{"op": "write", "match": "slow-0", "errno": 0, "wait_for": str(gate)}, *SLOW])
    clients = [client_factory() for _ in range(3)]
    futures = [c.save_async({"w": torch.ones(10)}, root / f"slow-{i}") for i, c in enumerate(clients)]
    writes = lambda: {k: daemon.status()["writes"][k] for k in ("max_concurrent", "writing", "queued")}  # noqa: E731
    wait_until(lambda: writes() == {"max_concurrent": 1, "writing": 1, "queued": 2}, 30,
               lambda: f"one write at a time, two queued: {writes()}")
    gate.touch()
    finished = []
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: finished.append(i))
    for f in futures:
        f.result(30)
    assert finished == [0, 1, 2]


def test_keep_last_deletes_only_older_committed_checkpoints(client, root) -> None:
    (root / "notes").mkdir()  # foreign: never touched
    (root / "old.incomplete").mkdir()
    for step in (1, 2, 3, 4):
        client.save_async({"s": step}, root / f"step-{step}", step=step, keep_last=2).result(30)
    wait_until(lambda: sorted(p.name for p in root.iterdir()) == ["notes", "old.incomplete", "step-3", "step-4"])


def test_retention_never_deletes_the_checkpoint_just_committed(client, root) -> None:
    client.save_async({"s": 10}, root / "step-10", step=10).result(30)
    client.save_async({"s": 5}, root / "rewound-5", step=5, keep_last=1).result(30)
    wait_until(lambda: [p.name for p in root.iterdir()] == ["rewound-5"])


def test_retention_that_fell_behind_the_commits_catches_up_in_one_run_for_the_newest(
    daemon_factory, client_factory, root, tmp_path
) -> None:
    # The one maintenance thread is held in the first retention's listing of run/ (until ``gate`` exists)
    # while twenty more commits there ask for retention: a busy node's thread falling behind.
    run, gate = root / "run", tmp_path / "gate"
    run.mkdir()
    daemon = daemon_factory(faults=[{"op": "scandir", "match": str(run.resolve()), "exact": True, "errno": 0,
                                     "wait_for": str(gate)}])
    log = daemon.run_dir / "ckptd.log"
    listings = lambda: log.read_text().count("event=fault op=scandir")  # noqa: E731  one per retention run
    client = client_factory()
    client.save_async({"s": 0}, run / "s0", step=0, keep_last=2).result(30)
    wait_until(lambda: listings() == 1, 30, "the first retention is held in its listing of run/")
    for step in range(1, 21):
        client.save_async({"s": step}, run / f"s{step}", step=step, keep_last=2).result(30)
    gate.touch()
    wait_until(lambda: sorted(p.name for p in run.iterdir()) == ["s19", "s20"], 60,
               lambda: f"retention caught up: run/ holds {sorted(p.name for p in run.iterdir())}")
    # the held run, one for the newest request, and at most one asked for while that one ran
    assert listings() <= 3, f"{listings()} retention runs for 21 commits: the backlog grew with every commit"


def test_daemon_configured_retention_applies_per_directory(daemon_factory, client_factory, root) -> None:
    (root / "run-a").mkdir()
    (root / "run-b").mkdir()
    daemon_factory("--keep", f"{root / 'run-a'}=1")
    c = client_factory()
    for step in (1, 2, 3):
        c.save_async({"s": step}, root / "run-a" / f"s{step}", step=step).result(30)
        c.save_async({"s": step}, root / "run-b" / f"s{step}", step=step).result(30)
    wait_until(lambda: sorted(p.name for p in (root / "run-a").iterdir()) == ["s3"])
    assert sorted(p.name for p in (root / "run-b").iterdir()) == ["s1", "s2", "s3"]


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
