"""A multi-node attempt its job abandoned leaves nothing behind: not while the daemons run, not after a restart.

Two daemons as two nodes (one run dir each, one shared root), four ranks under
torch.distributed: ranks 0-1 save through daemon A, ranks 2-3 through daemon
B. Ranks 0, 1 and 2 make their shards durable; rank 3 never saves, so the
ranks wait in their agreement; then the job is killed. Three shards lie in
``doomed.incomplete`` and no rank of the run is left to finalize or abort it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd.protocol.endpoint import LOG_NAME
from helpers import short_tempdir, start_daemon, wait_for_ranks, wait_until
from test_lifecycle import ended
from zygote import start_ranks

WORLD = 4


def _worker(rank: int, init_file: str, run_dirs: list[str], root: str, out: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank % 2)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    client = ckptd.Client(run_dir=run_dirs[rank // 2], spawn=False, commit_timeout=300, timeout=10)
    state = {"rank": torch.full((4096,), rank, dtype=torch.int32)}
    client.save_async(state, Path(root) / "first", step=1).result(120)
    Path(out, f"ready-{rank}").touch()
    if rank == 3:
        time.sleep(600)  # never saves: the others wait for it until the job is killed
    client.save_async(state, Path(root) / "doomed", step=2).result(600)


def durable(daemon, path: Path, ranks: int) -> bool:
    return any(c["path"] == str(path) and c["ranks_durable"] == ranks and c["state"] == "writing"
               for c in daemon.status()["checkpoints"])


def kill_job(ctx) -> None:
    for p in ctx.processes:
        os.kill(p.pid, signal.SIGKILL)
    for p in ctx.processes:
        p.join(30)
        assert p.exitcode == -signal.SIGKILL  # killed by the test, not ended by itself


@pytest.mark.timeout(300)
@pytest.mark.parametrize("daemons", ["running", "killed-and-restarted"])
def test_a_multi_node_attempt_whose_job_was_killed_leaves_no_incomplete_directory(root: Path, tmp_path: Path,
                                                                                  daemons: str) -> None:
    run_a, run_b = short_tempdir("cka-"), short_tempdir("ckb-")
    out = tmp_path / "out"
    out.mkdir()
    node_a, node_b = start_daemon(run_a, root), start_daemon(run_b, root)
    ctx = start_ranks(_worker, (str(tmp_path / "init"), [str(run_a), str(run_b)], str(root), str(out)), WORLD)
    doomed = root / "doomed"
    try:
        wait_for_ranks(out, "ready", WORLD, ctx, time.monotonic() + 120, "the ranks never saved their first")
        wait_until(lambda: durable(node_a, doomed, 2) and durable(node_b, doomed, 1), 120,
                   "ranks 0 and 1 durable on node A, rank 2 on node B")
        assert sorted(p.name for p in (root / "doomed.incomplete").iterdir() if p.name.startswith("rank-")) == [
            "rank-00000-of-00004.safetensors", "rank-00001-of-00004.safetensors", "rank-00002-of-00004.safetensors"]
        if daemons == "killed-and-restarted":  # the nodes' daemons die with the job; node A's comes back first
            node_a.kill()
            node_b.kill()
            assert node_a.proc.returncode == node_b.proc.returncode == -signal.SIGKILL
        kill_job(ctx)
        if daemons == "killed-and-restarted":
            node_a = start_daemon(run_a, root)
        # the end state: a discard sets the attempt aside (doomed.discarded-<id>.incomplete), then removes it
        wait_until(lambda: sorted(os.listdir(root)) == ["first"], 60,
                   lambda: f"doomed.incomplete removed and nothing left beside first: {sorted(os.listdir(root))}")
        for node in (node_a, node_b):
            if node.proc.poll() is None:
                wait_until(lambda: not node.status()["checkpoints"], 60, "no attempt left in status")
        if daemons == "running":  # each node's part of the attempt ended let go (the registry's end, with why)
            for node in (node_a, node_b):
                assert ("checkpoint", "doomed", "let go", "its contributors all died") in ended(
                    (node.run_dir / LOG_NAME).read_text(), why=True)
        assert [int(ckptd.load(root / "first", rank=r)["rank"][0]) for r in range(WORLD)] == [0, 1, 2, 3]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for node in (node_a, node_b):
            if node.proc.poll() is None:
                node.kill()
