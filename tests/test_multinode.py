"""Several nodes on one machine: two daemons, four ranks under torch.distributed (gloo).

Ranks 0-1 talk to daemon A, ranks 2-3 to daemon B, all writing one shared
checkpoint root. The ranks agree through the client's own gloo group and
global rank 0's daemon commits.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import ckptd

from helpers import join_ranks, short_tempdir, start_daemon, wait_for_ranks, wait_until
from zygote import start_ranks

WORLD = 4
SLOW_B = [{"op": "write", "match": "doomed", "errno": 0, "delay": 5.0}]


def _worker(rank: int, init_file: str, run_dirs: list[str], root: str, out: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank % 2)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    log: dict = {}
    try:
        client = ckptd.Client(run_dir=run_dirs[rank // 2], spawn=False, commit_timeout=30, timeout=5, heartbeat=0.2)
        state = {"rank": torch.full((1000,), rank, dtype=torch.int32), "step": 1}
        log["first"] = str(client.save_async(state, Path(root) / "first", step=1).result(60).path)
        # node B's ranks hold an extra tensor under a replicated key: each daemon sees its own ranks agree, global
        # rank 0 sees the nodes differ; every rank is told, nothing is saved
        shared = {"w": torch.ones(8), **({"extra": torch.ones(2)} if rank >= 2 else {})}
        try:
            client.save_async({**state, "shared": shared}, Path(root) / "mixed", step=1,
                              replicated=("shared",)).result(60)
            log["mixed"] = "succeeded"
        except ckptd.CkptdError as exc:
            log["mixed"] = f"{type(exc).__name__}: {exc}"
        Path(out, f"ready-{rank}").touch()
        started = time.monotonic()
        try:
            client.save_async(state, Path(root) / "doomed", step=2).result(60)
            log["doomed"] = "succeeded"
        except ckptd.CkptdError as exc:
            log["doomed"] = f"{type(exc).__name__}: {exc}"
        log["doomed_s"] = time.monotonic() - started
        Path(out, f"settled-{rank}").touch()
        deadline = time.monotonic() + 60
        while not Path(out, "restarted").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        log["after"] = str(client.save_async(state, Path(root) / "after", step=3).result(60).path)
        client.close()
    except BaseException:
        log["crash"] = traceback.format_exc()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(log))
    dist.destroy_process_group()


def test_two_nodes_commit_once_and_a_dead_daemon_fails_every_rank_then_recovers(root: Path, tmp_path: Path) -> None:
    run_a, run_b = short_tempdir("cka-"), short_tempdir("ckb-")
    out = tmp_path / "out"
    out.mkdir()
    daemon_a = start_daemon(run_a, root)
    daemon_b = start_daemon(run_b, root, faults=SLOW_B)
    ctx = start_ranks(_worker, (str(tmp_path / "init"), [str(run_a), str(run_b)], str(root), str(out)), WORLD)
    try:
        deadline = time.monotonic() + 120
        wait_for_ranks(out, "ready", WORLD, ctx, deadline, "ranks never finished their first save")
        # the first checkpoint: one directory, four shards, one index, committed by daemon A
        index = ckptd.read_index(root / "first")
        assert index.world_size == WORLD and sorted(f.rank for f in index.files) == [0, 1, 2, 3]
        for r in range(WORLD):
            assert ckptd.load(root / "first", rank=r)["rank"][0].item() == r
        assert daemon_a.status()["completed"]["count"] == 1
        assert daemon_b.status()["completed"]["count"] == 0  # B only wrote shards
        # kill node B's daemon while it writes the doomed checkpoint
        while not daemon_b.status()["saves"]:
            assert time.monotonic() < deadline, "node B never started writing"
            time.sleep(0.05)
        daemon_b.kill()
        wait_for_ranks(out, "settled", WORLD, ctx, deadline, "the doomed save never ended on every rank")
        daemon_b = start_daemon(run_b, root)
        (out / "restarted").touch()
        join_ranks(ctx, time.monotonic() + 120)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        daemon_a.kill()
        if daemon_b.proc.poll() is None:
            daemon_b.kill()
    logs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    for r, log in enumerate(logs):
        assert "crash" not in log, log["crash"]
        assert log["mixed"].startswith("Conflict") and "'shared'" in log["mixed"] and "ranks 0 and 2" in log["mixed"], (
            r, log["mixed"])
        assert log["doomed"].startswith("DaemonUnavailable"), (r, log["doomed"])
        assert "rank 2" in log["doomed"] or "rank 3" in log["doomed"]
        assert log["doomed_s"] < 30
        assert log["after"] == str(root / "after")
    assert not (root / "doomed").exists() and not (root / "mixed").exists()
    wait_until(lambda: not (root / "doomed.incomplete").exists(), 60, "the aborted checkpoint was not cleaned up")
    assert ckptd.read_index(root / "after").world_size == WORLD
    assert ckptd.latest(root) == root / "after"
