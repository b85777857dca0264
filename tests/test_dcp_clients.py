"""``ckptd.dcp.StorageWriter(path)`` without ``client=``: one client per process, reused by every later writer.

DCP code makes a writer per save. Two gloo ranks do that for saves to
several paths with ``dcp.save``, ``dcp.async_save`` THREAD and PROCESS, and
the daemon sees one client per process (each rank's, and each of DCP's
checkpoint processes'), holding all of that process's saves. One process
keeps its client across a daemon killed and restarted, a forked child makes
its own, and after ``close()`` the next writer makes a new one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd.dcp import StorageWriter
from helpers import join_ranks, short_tempdir, start_daemon, wait_for_ranks, wait_until
from sharded_ranks import run_rank
from zygote import start_ranks


def _state(value: float) -> dict:
    return {"w": torch.full((1 << 12,), value), "step": int(value)}


def _writers_per_save(rank: int, world: int, init: str, run_dir: str, root: str, out: str) -> None:
    """A writer per save, none given a client: a, b (THREAD), a again, then c and d (PROCESS); then this rank stays
    alive until ``out/checked`` exists, so the test sees the daemon's clients."""
    def body() -> dict:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        writers: list[StorageWriter] = []

        def writer(name: str) -> StorageWriter:
            writers.append(StorageWriter(Path(root, name), run_dir=run_dir, commit_timeout=120))
            return writers[-1]

        dcp.save(_state(1.0), storage_writer=writer("a"))
        first_slots = writers[0].client.slot_names
        dcp.async_save(_state(2.0), storage_writer=writer("b")).result(120)
        dcp.save(_state(3.0), storage_writer=writer("a"))
        for name in ("c", "d"):
            dcp.async_save(_state(4.0), storage_writer=writer(name),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(300)
        log = {"clients": len({id(w.client) for w in writers}), "first_slots": first_slots,
               "slots": writers[0].client.slot_names}
        Path(out, f"saved-{rank}").touch()
        wait_until(lambda: Path(out, "checked").exists(), timeout=240, what="the test's check")
        return log

    run_rank(rank, world, init, out, "shared", body)


@pytest.mark.timeout(600)
def test_writers_without_a_client_share_one_per_process_for_every_path_and_executor(tmp_path: Path):
    root, run_dir = tmp_path / "ckpts", short_tempdir("ckdcpc-")
    root.mkdir()
    daemon = start_daemon(run_dir, root)
    ctx = start_ranks(_writers_per_save, (2, str(tmp_path / "init"), str(run_dir), str(root), str(tmp_path)), 2)
    try:
        deadline = time.monotonic() + 400
        wait_for_ranks(tmp_path, "saved", 2, ctx, deadline, "the saves did not end")
        clients = daemon.status()["clients"]
        ranks = {p.pid for p in ctx.processes}
        per_rank = sorted(c["saves"] for c in clients if c["pid"] in ranks)
        others = [c for c in clients if c["pid"] not in ranks]  # DCP's checkpoint process of each rank
        assert per_rank == [3, 3], clients  # a, b, a: one client per rank held all three
        assert sorted(c["saves"] for c in others) == [2, 2] and len({c["pid"] for c in others}) == 2, clients
        (tmp_path / "checked").touch()
        join_ranks(ctx, deadline)
        wait_until(lambda: not daemon.status()["clients"], timeout=60, what="every client to go with its process")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        daemon.kill()
    logs = [json.loads((tmp_path / f"shared-{r}.json").read_text()) for r in range(2)]
    assert all("crash" not in log for log in logs), logs
    assert all(log["clients"] == 1 and log["slots"] == log["first_slots"] for log in logs), logs
    for name, value in (("a", 3.0), ("b", 2.0), ("c", 4.0), ("d", 4.0)):
        assert torch.equal(ckptd.load(root / name)["w"], _state(value)["w"]), name


def _one_process(rank: int, run_dir: str, root: str, out: str) -> None:
    """Without torch.distributed: save, fork a child that saves, wait for the daemon's restart, save, close, save."""
    log: dict = {}
    try:
        first = StorageWriter(Path(root, "p1"), run_dir=run_dir)
        dcp.save(_state(1.0), storage_writer=first)
        shared, slots = first.client, first.client.slot_names
        child = os.fork()
        if child == 0:  # the parent's client is not the child's: it makes its own and saves through it
            writer = StorageWriter(Path(root, "child"), run_dir=run_dir)
            dcp.save(_state(5.0), storage_writer=writer)
            os._exit(0 if writer.client is not shared and writer.client._pid == os.getpid() else 3)
        log["child_exit"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        Path(out, "saved-0").touch()
        wait_until(lambda: Path(out, "restarted").exists(), timeout=240, what="the daemon's restart")
        again = StorageWriter(Path(root, "p2"), run_dir=run_dir)
        dcp.save(_state(2.0), storage_writer=again)  # reconnects: the same client, the same slots
        log["same_after_restart"] = again.client is shared and again.client.slot_names == slots
        again.close()
        fresh = StorageWriter(Path(root, "p3"), run_dir=run_dir)
        dcp.save(_state(3.0), storage_writer=fresh)
        log["closed"], log["new_after_close"] = shared._closed, fresh.client is not shared
    except BaseException as exc:
        log["crash"] = repr(exc)
    Path(out, "one.json").write_text(json.dumps(log))


@pytest.mark.timeout(300)
def test_the_shared_client_outlives_a_daemon_restart_and_is_never_a_forked_childs(tmp_path: Path):
    root, run_dir = tmp_path / "ckpts", short_tempdir("ckdcpo-")
    root.mkdir()
    daemon = start_daemon(run_dir, root)
    ctx = start_ranks(_one_process, (str(run_dir), str(root), str(tmp_path)), 1)
    try:
        deadline = time.monotonic() + 240
        wait_for_ranks(tmp_path, "saved", 1, ctx, deadline, "the first saves did not end")
        daemon.kill()
        daemon = start_daemon(run_dir, root)
        (tmp_path / "restarted").touch()
        join_ranks(ctx, deadline)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        daemon.kill()
    log = json.loads((tmp_path / "one.json").read_text())
    assert log == {"child_exit": 0, "same_after_restart": True, "closed": True, "new_after_close": True}, log
    for name, value in (("p1", 1.0), ("child", 5.0), ("p2", 2.0), ("p3", 3.0)):
        assert torch.equal(ckptd.load(root / name)["w"], _state(value)["w"]), name
