"""Every way a save can fail arrives as a typed error that says what is true, nothing committed is harmed, and
cleaning up after a failure never harms the saves that follow (storage faults injected through ``tests/faults.py``)."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

import ckptd

from ckptd.protocol.endpoint import LOG_NAME
from ckptd.protocol.messages import Abort, Error, Ok, Ping, Pong, Status, decode
from helpers import raw_socket, wait_until


def test_path_outside_the_allowed_roots_fails_with_path_not_allowed(client, root, tmp_path) -> None:
    outside = tmp_path / "elsewhere" / "ckpt"
    with pytest.raises(ckptd.PathNotAllowed, match="not strictly below the daemon.s allowed roots"):
        client.save_async({"x": torch.ones(2)}, outside).result(30)
    assert not outside.parent.exists()


def test_symlink_leading_out_of_the_roots_is_refused(client, root, tmp_path) -> None:
    (tmp_path / "escape").mkdir()
    (root / "link").symlink_to(tmp_path / "escape")
    with pytest.raises(ckptd.PathNotAllowed):
        client.save_async({"x": 1}, root / "link" / "ckpt").result(30)
    with pytest.raises(ckptd.PathNotAllowed):
        client.save_async({"x": 1}, root / ".." / "dotdot").result(30)
    assert list((tmp_path / "escape").iterdir()) == []


def test_existing_checkpoint_is_kept_without_overwrite_and_replaced_with_it(client, root) -> None:
    client.save_async({"v": torch.tensor(1)}, root / "c").result(30)
    with pytest.raises(ckptd.CheckpointExists, match="overwrite=True"):
        client.save_async({"v": torch.tensor(2)}, root / "c").result(30)
    assert ckptd.load(root / "c")["v"].item() == 1
    client.save_async({"v": torch.tensor(3)}, root / "c", overwrite=True).result(30)
    assert ckptd.load(root / "c")["v"].item() == 3
    assert sorted(p.name for p in root.iterdir()) == ["c"]


@pytest.mark.parametrize("persist", [True, False], ids=["disk", "snapshot"])
def test_a_save_inside_a_committed_checkpoint_is_refused_and_the_checkpoint_stays_whole(client, root,
                                                                                     persist) -> None:
    client.save_async({"v": torch.tensor(1)}, root / "step-1").result(30)
    for inner in (root / "step-1" / "inner", root / "step-1" / "a" / "b"):
        with pytest.raises(ckptd.PathNotAllowed, match=f"lies inside checkpoint {root / 'step-1'}"):
            client.save_async({"v": torch.tensor(2)}, inner, overwrite=True, persist=persist).result(30)
    assert sorted(p.name for p in (root / "step-1").iterdir() if not p.name.endswith(".safetensors")) == [
        "ckptd.json"]
    client.save_async({"v": torch.tensor(3)}, root / "step-1", overwrite=True).result(30)  # still replaceable
    client.delete(root / "step-1")  # and deletable
    assert not (root / "step-1").exists()


@pytest.mark.parametrize("persist", [True, False], ids=["disk", "snapshot"])
def test_a_save_inside_a_held_snapshot_or_holding_one_is_refused_and_the_snapshot_still_persists(
        client, root, persist) -> None:
    client.save_async({"v": torch.tensor(1)}, root / "run" / "step-m", step=1, persist=False).result(30)
    for path, where in ((root / "run" / "step-m" / "inner", "lies inside"), (root / "run", "would hold")):
        with pytest.raises(ckptd.PathNotAllowed, match=f"{where} memory snapshot {root / 'run' / 'step-m'}"):
            client.save_async({"v": torch.tensor(2)}, path, step=2, persist=persist).result(30)
    assert not (root / "run").exists()  # nothing of either reached the disk
    assert client.persist(root / "run" / "step-m") == root / "run" / "step-m"
    assert ckptd.load(root / "run" / "step-m")["v"].item() == 1


def test_unwritable_path_fails_with_write_failed(client, root) -> None:
    (root / "file").write_text("not a directory")
    with pytest.raises(ckptd.WriteFailed, match="is not a directory"):
        client.save_async({"x": 1}, root / "file" / "ckpt").result(30)


@pytest.mark.parametrize(
    "fault",
    [
        {"op": "write", "match": "broken", "errno": errno.EIO},
        {"op": "fsync", "match": "broken", "errno": errno.ENOSPC},
        {"op": "open", "match": "broken", "errno": errno.EACCES},
        {"op": "rename", "match": "broken", "errno": errno.EIO},
    ],
    ids=lambda f: f"{f['op']}-{errno.errorcode[f['errno']]}",
)
def test_failed_write_leaves_no_final_directory_and_the_daemon_keeps_serving(
    daemon_factory, client_factory, root, fault
) -> None:
    daemon = daemon_factory(faults=[fault])
    client = client_factory()
    client.save_async({"w": torch.ones(100)}, root / "good-before").result(30)
    with pytest.raises(ckptd.WriteFailed, match=os.strerror(fault["errno"])):
        client.save_async({"w": torch.ones(100)}, root / "broken").result(30)
    # the end state: a discard sets the attempt aside (broken.discarded-<id>.incomplete), then removes it
    wait_until(lambda: sorted(os.listdir(root)) == ["good-before"], 30,
               lambda: f"the failed attempt removed and no final directory: {sorted(os.listdir(root))}")
    client.save_async({"w": torch.ones(100)}, root / "good-after").result(30)
    assert sorted(p.name for p in root.iterdir()) == ["good-after", "good-before"]
    assert torch.equal(ckptd.load(root / "good-before")["w"], torch.ones(100))
    errors = daemon.status()["errors"]
    assert any("broken" in e["message"] for e in errors)


def test_pending_save_fails_with_daemon_unavailable_when_the_daemon_is_killed(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory(faults=[{"op": "write", "match": "slow", "errno": 0, "delay": 30}])
    client = client_factory(heartbeat=0.2, timeout=5.0)
    fut = client.save_async({"w": torch.ones(10)}, root / "slow")
    wait_until(lambda: daemon.status()["saves"], 30, "the save reaches the daemon")
    daemon.kill()
    started = time.monotonic()
    with pytest.raises(ckptd.DaemonUnavailable, match="died|not answered"):
        fut.result(15)
    assert time.monotonic() - started < 10
    assert not (root / "slow").exists()
    # a later save says clearly that no daemon answers (spawn=False)
    with pytest.raises(ckptd.DaemonUnavailable, match="no ckptd daemon answers"):
        client.save_async({"w": torch.ones(10)}, root / "later")


def test_client_without_spawn_raises_a_clear_error_when_no_daemon_runs(run_dir) -> None:
    with pytest.raises(ckptd.DaemonUnavailable, match="ckptd start"):
        ckptd.Client(run_dir=run_dir, spawn=False)


@pytest.mark.timeout(120)
def test_a_retry_right_after_a_failed_save_keeps_its_directory(daemon_factory, client_factory, root, tmp_path) -> None:
    # "busy"'s index write holds the commit thread until the test lets it go, so the failed
    # attempt's cleanup cannot run before the retry is admitted: removing the failed attempt's
    # directory in place then would remove the retry's.
    go = tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "write_file", "match": "/busy.incomplete/", "errno": 0,
                                     "wait_for": str(go)}])
    log = daemon.run_dir / "ckptd.log"
    client = client_factory()
    busy = client.save_async({"w": torch.ones(10)}, root / "busy")
    wait_until(lambda: "event=fault op=write_file" in log.read_text(), 20, "the write fault fired")
    lonely = client_factory(rank=0, world_size=2, commit_timeout=0.5)
    with pytest.raises(ckptd.RanksMissing):
        lonely.save_async({"w": torch.ones(100)}, root / "racy", step=1).result(30)
    retry = client_factory().save_async({"w": torch.full((100,), 2.0)}, root / "racy", step=1)
    wait_until(lambda: log.read_text().count(f"event=admitted path={root.resolve() / 'racy'} ") == 2, 20,
               "the retry was admitted")
    assert not busy.done(), "the commit thread must still be held for this test to mean anything"
    go.touch()
    assert retry.result(30).path == root / "racy"
    assert torch.equal(ckptd.load(root / "racy")["w"], torch.full((100,), 2.0))
    busy.result(30)
    wait_until(lambda: sorted(os.listdir(root)) == ["busy", "racy"], 20, "the failed attempt's files went")


def test_a_failed_parent_fsync_after_the_rename_reports_the_checkpoint_as_visible(
    daemon_factory, client_factory, root
) -> None:
    parent = str(root.resolve())
    daemon_factory(faults=[{"op": "fsync_dir", "match": parent, "exact": True, "errno": errno.EIO}])
    client = client_factory()
    with pytest.raises(ckptd.WriteFailed, match="is committed and visible") as failed:
        client.save_async({"w": torch.ones(100)}, root / "honest").result(30)
    assert "may not survive" in str(failed.value)
    # what the error says is true: the checkpoint is there, whole, and holds no owner marker
    assert torch.equal(ckptd.load(root / "honest")["w"], torch.ones(100))
    assert sorted(os.listdir(root / "honest")) == ["ckptd.json", "rank-00000-of-00001.safetensors"]


def test_a_defect_in_a_completion_answers_every_waiting_rank_at_once_and_the_daemon_keeps_serving(
        daemon_factory, client_factory, root) -> None:
    """A completion on the loop thread that raises (injected: ``completion`` in ``tests/faults.py``) fails its
    attempt on every rank waiting for it with an ``InternalError``, logged with its traceback; before, it was only
    logged and the ranks waited for their commit timeout (here ten minutes: the wait would outlast the test)."""
    daemon = daemon_factory(faults=[{"op": "completion", "match": "doomed", "errno": 0}])
    clients = [client_factory(rank=r, world_size=2, commit_timeout=600) for r in (0, 1)]
    futures = [c.save_async({"w": torch.full((64,), float(c.rank))}, root / "doomed") for c in clients]
    for fut in futures:
        with pytest.raises(ckptd.InternalError, match="injected defect in the completion"):
            fut.result(120)
    log = (daemon.run_dir / LOG_NAME).read_text()
    assert "event=fault op=completion" in log and "Traceback" in log
    wait_until(lambda: not (root / "doomed.incomplete").exists(), what="the failed attempt's directory removed")
    assert not (root / "doomed").exists()
    for fut in [c.save_async({"w": torch.ones(4)}, root / "after", step=1) for c in clients]:
        fut.result(60)
    assert ckptd.load(root / "after")["w"].tolist() == [1.0] * 4


@pytest.mark.parametrize("persist", [True, False], ids=["disk", "memory"])
def test_a_defect_in_an_attempts_end_hook_answers_its_waiting_ranks_at_once_and_the_daemon_serves_on(
        daemon_factory, client_factory, root, persist) -> None:
    """The pipeline's hook that ``Registry.end`` hands an ended attempt to raises (injected: ``ended`` in
    ``tests/faults.py``) before it answered a rank: the registry logs it with its traceback, counts it, and tells
    every rank still waiting an ``InternalError`` at once; before, they waited for their commit timeout (ten
    minutes here), or for ever. The attempt stays ended, and the next save of another path goes through."""
    daemon = daemon_factory(faults=[{"op": "ended", "match": "doomed", "errno": 0}])
    lonely = client_factory(rank=0, world_size=2, commit_timeout=600)
    fut = lonely.save_async({"w": torch.ones(64)}, root / "doomed", step=1, persist=persist)
    fut.staged.result(30)  # admitted: the attempt waits for rank 1; its run gives up on it (as ckptd.dcp's rank 0
    # does), so it ends failed, and its hook raises before rank 0 is told
    conn = lonely._conn
    assert isinstance(conn.call(Abort(conn.next_id(), str(root / "doomed"), "rank 1 failed", lonely.job)), Ok)
    with pytest.raises(ckptd.InternalError, match="injected defect in the ended"):
        fut.result(120)
    log = (daemon.run_dir / LOG_NAME).read_text()
    assert "event=fault op=ended" in log and "event=end_hook_failed" in log and "Traceback" in log
    assert daemon.status()["errors_total"] >= 1
    client = client_factory()
    client.save_async({"w": torch.ones(4)}, root / "after", step=2, persist=persist).result(60)
    assert ckptd.load(root / "after", run_dir=daemon.run_dir)["w"].tolist() == [1.0] * 4


def test_a_defect_in_a_pool_job_answers_its_request_at_once_with_an_error_and_the_daemon_serves_on(
        daemon_factory, root, tmp_path) -> None:
    """Every completion of the worker pools has a failure path (``Workers.submit`` requires one): a Status whose
    pool job raised a defect (injected under ``space``, which Status asks of every root) is answered at once with an
    ``InternalError``. Status had none, like some fifteen others (Restore, peer replies, replication), and its
    caller waited for its own timeout (issue 38, case 8e)."""
    armed = tmp_path / "armed"
    daemon = daemon_factory(faults=[{"op": "space", "match": str(root), "exact": True, "defect": True,
                                     "armed_by": str(armed)}])
    armed.touch()
    sock = raw_socket(daemon)
    try:
        sock.send(Status(1).to_wire())
        assert sock.poll(10_000), "Status was not answered within 10 s"
        reply = decode(sock.recv())
        assert isinstance(reply, Error) and reply.code == ckptd.InternalError.code, reply
        assert "injected defect in the space" in reply.message
        sock.send(Ping(2).to_wire())
        assert isinstance(decode(sock.recv()), Pong)
    finally:
        sock.close()
    log = (daemon.run_dir / LOG_NAME).read_text()
    assert "event=fault op=space" in log and "Traceback" in log
    assert daemon.stop() == 0


@pytest.mark.timeout(120)
def test_a_failed_snapshots_rank_is_told_only_once_its_slot_is_back_so_its_retry_finds_it(daemon_factory,
                                                                                         client_factory, root,
                                                                                         tmp_path) -> None:
    """The daemon took a snapshot shard's slot over (renamed to its own name) once it was checksummed; a failure
    hands it back under the client's name on the maintenance pool. The client reuses its slot the moment it is
    told, so its rank is told only once the slot is back: told before (as it was), a retry at once found no slot
    (``BadSlot``) whenever the pool was slow. Here the pool's hand-back is held until the test lets it go; a
    request the rank's connection makes meanwhile is answered, and the failed save's answer has not come before
    it (replies on one connection keep their order)."""
    arm, go = tmp_path / "arm", tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "work", "match": "maintenance", "exact": True, "errno": 0,
                                     "armed_by": str(arm), "wait_for": str(go)}])
    rank0 = client_factory(rank=0, world_size=2, job="run-b")
    first = rank0.save_async({"w": torch.ones(1024)}, root / "given-back", step=1, persist=False)
    conn = rank0._conn
    wait_until(lambda: daemon.status()["memory"]["snapshots"], 30, "the snapshot admitted")
    wait_until(lambda: any(s["path"] == str(root / "given-back") and s.get("ranks_held") == [0]
                           for s in daemon.status()["memory"]["snapshots"]), 30, "rank 0's shard checksummed")
    arm.touch()
    assert isinstance(conn.call(Abort(conn.next_id(), str(root / "given-back"), "rank 1 failed", rank0.job),
                                timeout=30), Ok)
    log = daemon.run_dir / LOG_NAME
    wait_until(lambda: "event=fault op=work" in log.read_text(), 30, "the slot's hand-back held on the pool")
    assert isinstance(conn.call(Ping(conn.next_id()), timeout=30), Pong)
    assert not first.done(), "the rank was told before its slot was back under its name"
    go.touch()
    with pytest.raises(ckptd.RanksMissing, match="was aborted: rank 1 failed"):
        first.result(30)
    retry = rank0.save_async({"w": torch.full((1024,), 2.0)}, root / "again", step=2, persist=False)
    rank1 = client_factory(rank=1, world_size=2, job="run-b")
    rank1.save_async({"w": torch.full((1024,), 2.0)}, root / "again", step=2, persist=False).result(30)
    retry.result(30)  # its slot was there: admitted and held
