"""One node, several ranks: one commit when all are durable; a missing or failing rank fails every rank the same way."""

from __future__ import annotations

import errno
import time

import pytest
import torch

import ckptd

from helpers import wait_until


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persist", [True, False], ids=["disk", "memory"])
def test_a_late_rank_of_a_failed_checkpoint_gets_the_same_error_at_once(daemon, client_factory, root,
                                                                        persist) -> None:
    """On disk and in memory alike (a snapshot's late rank used to start a snapshot of its own, wait its timeout
    for rank 0, which had come, and blame it): the late rank is told the attempt's own error at once."""
    rank0 = client_factory(rank=0, world_size=2, commit_timeout=3.0, job="run-l")
    with pytest.raises(ckptd.RanksMissing, match=r"ranks \[1\] of 2") as first:
        rank0.save_async({"w": torch.ones(4)}, root / "late", step=1, persist=persist).result(30)
    time.sleep(4)  # past the failed checkpoint's own commit timeout
    rank1 = client_factory(rank=1, world_size=2, commit_timeout=3.0, job="run-l")
    with pytest.raises(ckptd.RanksMissing) as late:
        rank1.save_async({"w": torch.ones(4)}, root / "late", step=1, persist=persist).result(30)
    assert str(late.value) == str(first.value), "the late rank must get the attempt's own error, not blame rank 0"
    assert not (root / "late").exists() and not daemon.status()["memory"]["snapshots"]
    # a retry by the rank that was in starts afresh, and rank 1 joins it
    again = [c.save_async({"w": torch.ones(4)}, root / "late", step=1, persist=persist) for c in (rank0, rank1)]
    for fut in again:
        fut.result(30)
    assert (root / "late").exists() == persist
