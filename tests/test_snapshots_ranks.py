"""Memory snapshots across nodes: every rank agrees on ``latest``, and a snapshot some rank lost is never chosen.

Two daemons on one machine stand for two nodes, one rank each, under
torch.distributed (gloo). Both ranks snapshot; node B's daemon is then
SIGKILLed and restarted (its memory is gone), so rank 1 can no longer
restore the snapshot rank 0's daemon still holds: both ranks must fall back
to the newest checkpoint on disk, and load it. On one node too, a snapshot
that one rank never sent is never chosen, and the complete one before it is kept.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd.protocol.names import DRAIN_FAILED_NAME

from helpers import equal_states, join_ranks, short_tempdir, start_daemon, wait_for_ranks, wait_until
from zygote import start_ranks

WORLD = 2


def _worker(rank: int, init_file: str, run_dirs: list[str], root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    log: dict = {}
    try:
        run_dir, top = run_dirs[rank], Path(root)
        client = ckptd.Client(run_dir=run_dir, spawn=False, commit_timeout=30, timeout=5, heartbeat=0.2)
        state = lambda step: {"rank": torch.full((1000,), rank * 100 + step, dtype=torch.int32), "step": step}  # noqa: E731
        client.save_async(state(0), top / "disk", step=0).result(60)
        log["snapshot"] = str(client.save_async(state(1), top / "memory", step=1, persist=False).result(60).path)
        log["before"] = str(ckptd.latest(top, run_dir=run_dir))
        log["before_step"] = ckptd.load(log["before"], run_dir=run_dir)["step"]
        Path(out, f"held-{rank}").touch()
        wait_until(Path(out, "restarted").exists, 60, "the test never restarted node B's daemon")
        log["after"] = str(ckptd.latest(top, run_dir=run_dir))
        loaded = ckptd.load(log["after"], run_dir=run_dir)
        log["after_ok"] = torch.equal(loaded["rank"], state(0)["rank"]) and loaded["step"] == 0
        client.close()
    except BaseException:
        log["crash"] = traceback.format_exc()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(log))
    dist.destroy_process_group()


def test_ranks_agree_on_latest_and_never_choose_a_snapshot_one_node_lost(root: Path, tmp_path: Path) -> None:
    run_a, run_b = short_tempdir("cka-"), short_tempdir("ckb-")
    out = tmp_path / "out"
    out.mkdir()
    daemon_a = start_daemon(run_a, root, "--persist-on-exit", "never")
    daemon_b = start_daemon(run_b, root, "--persist-on-exit", "never")
    ctx = start_ranks(_worker, (str(tmp_path / "init"), [str(run_a), str(run_b)], str(root), str(out)), WORLD)
    try:
        deadline = time.monotonic() + 120
        wait_for_ranks(out, "held", WORLD, ctx, deadline, "the ranks never held their snapshot")
        assert [s["ranks_held"] for s in daemon_a.status()["memory"]["snapshots"]] == [[0]]
        assert [s["ranks_held"] for s in daemon_b.status()["memory"]["snapshots"]] == [[1]]
        daemon_b.kill()  # node B's memory is gone
        assert daemon_b.proc.returncode == -9
        daemon_b = start_daemon(run_b, root, "--persist-on-exit", "never")
        (out / "restarted").touch()
        join_ranks(ctx, time.monotonic() + 120)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        stopped = daemon_a.stop()
        daemon_b.stop()
    # node A still held its share of the snapshot, its directory's newest: no drain persists a snapshot of several
    # nodes, and the stop says it is lost instead of exiting 0 (``ckptd stop`` prints the same line)
    assert stopped == 3
    lost = (run_a / DRAIN_FAILED_NAME).read_text()
    assert f"{root / 'memory'}: a snapshot of several nodes (this node held 1 of its 2 ranks)" in lost, lost
    logs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    for r, log in enumerate(logs):
        assert "crash" not in log, log["crash"]
        assert log["snapshot"] == log["before"] == str(root / "memory") and log["before_step"] == 1, (r, log)
        assert log["after"] == str(root / "disk") and log["after_ok"], (r, log)
    assert sorted(os.listdir(root)) == ["disk"]  # the snapshot was never written


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


def test_a_snapshot_passed_over_for_its_placement_is_named_for_that_not_for_a_world_size(caplog) -> None:
    """Rank 0's warning says why a snapshot of several nodes is passed over: another world size, or (the same
    size) ranks placed on other nodes than when it was saved, where the node holds other ranks' shards (a new-user
    pass was told "this job has 3" by a job of 3)."""
    from ckptd.client.memory import _warn_other_world

    with caplog.at_level("WARNING", logger="ckptd"):
        _warn_other_world([((7, 1.0), "/ckpts/step-7", 1, (1,))], (3, 0.0))  # this process is a world of 1
        _warn_other_world([((7, 1.0), "/ckpts/step-7", 2, (0,))], (3, 0.0))
    placed, sized = [r.getMessage() for r in caplog.records]
    assert "this node holds the shards of ranks [1], not this rank's" in placed and "this job has" not in placed
    assert "was saved by 2 ranks and spans nodes; this job has 1, so it is passed over" in sized
