"""Persisting memory snapshots to disk: on request, at a drain, when their trainer goes, each against a real daemon.

A persist that is refused leaves the snapshot held and retried at the
drain; a drain that still cannot persist says so through ``ckptd stop``; a
snapshot saved with ``overwrite`` persists over the checkpoint it replaced;
a disk save of a held path replaces the snapshot for readers; persist waits
for a snapshot's ranks and answers every rank; and bytes that changed in
memory are never written as a checkpoint that verifies. SIGTERM persists
the newest snapshot, ``--persist-on-exit never`` leaves a closed client's in
memory (and a daemon that exits when idle waits for it), and ``keep_last``
applies when a snapshot is persisted on exit.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import ckptd
from ckptd.client.memory import held_snapshots
from ckptd.protocol.messages import Abort, Error, Hello, decode

from helpers import SHM, equal_states, raw_socket, status, wait_until
from snapshots import full, held, state_at


def test_a_persist_refused_for_space_leaves_the_snapshot_held_and_the_drain_persists_it(
    daemon_factory, client_factory, root, run_dir, tmp_path
) -> None:
    room = tmp_path / "room"
    daemon = daemon_factory(faults=[{"op": "space", "match": str(root), "wait_for": str(room)}])
    client = client_factory()
    client.save_async(full(1), root / "s1", step=1, persist=False).result(30)
    with pytest.raises(ckptd.NoSpace):
        client.persist(root / "s1")
    snap = held(daemon, root / "s1")
    assert (snap["persisting"], snap["persisted"]) == (False, False)
    room.touch()  # space again: the drain must try once more
    assert daemon.stop() == 0
    assert ckptd.load(root / "s1")["w"].equal(full(1)["w"])
    assert "event=drain_persist snapshots=1" in (run_dir / "ckptd.log").read_text()


def test_a_drain_that_cannot_persist_makes_ckptd_stop_and_the_daemon_fail_naming_the_lost_snapshot(
    daemon_factory, client_factory, root, run_dir
) -> None:
    """``ckptd stop`` and the daemon's own exit status (what a supervisor sees of ``start --foreground``) both say
    that a held snapshot was lost."""
    daemon = daemon_factory(faults=[{"op": "space", "match": str(root)}])
    client = client_factory()
    client.save_async(full(2), root / "s2", step=2, persist=False).result(30)
    stopped = daemon.cli("stop")
    assert stopped.returncode != 0, stopped.stdout
    assert "could not persist 1 held snapshot(s)" in stopped.stderr and str(root / "s2") in stopped.stderr
    assert daemon.proc.wait(30) == 3
    lost = daemon.proc.stderr.read().decode()
    assert "could not persist 1 held snapshot(s), now lost" in lost and str(root / "s2") in lost, lost
    assert "event=drain_persist_failed" in (run_dir / "ckptd.log").read_text()
    assert not (root / "s2").exists()


def test_a_snapshot_saved_with_overwrite_persists_over_the_checkpoint_it_replaces(
    daemon, client_factory, root, run_dir
) -> None:
    client = client_factory()
    for name in ("explicit", "on-exit"):
        client.save_async(full(1), root / name, step=1).result(30)
        client.save_async(full(2), root / name, step=2, persist=False, overwrite=True).result(30)
        assert ckptd.load(root / name, run_dir=run_dir)["w"].equal(full(2)["w"])
        if name == "explicit":
            assert client.persist(root / "explicit") == root / "explicit"
            assert ckptd.read_index(root / "explicit").step == 2
    client.close()
    wait_until(lambda: ckptd.read_index(root / "on-exit").step == 2, 20, "the snapshot is persisted on exit")
    assert ckptd.load(root / "on-exit")["w"].equal(full(2)["w"])
    daemon.stop()


SLOW_RACE = [{"op": "write", "match": "/race", "errno": 0, "delay": 3.0}]


@pytest.mark.parametrize("first", ["save", "persist"])
def test_a_persist_and_a_save_of_the_same_path_never_fail_each_other(first, daemon_factory, client_factory,
                                                                     root, run_dir) -> None:
    """Whichever reaches the path first is written; the other is refused alone, saying why (both used to fail:
    a refused persist failed the save it ran into)."""
    daemon = daemon_factory(faults=SLOW_RACE)
    client = client_factory()
    path = root / "race"
    client.save_async(full(1), path, step=1, persist=False).result(30)
    with ThreadPoolExecutor(1) as pool:
        if first == "save":
            saved = client.save_async(full(2), path, step=2, overwrite=True)
            wait_until(lambda: any(s["path"] == str(path) for s in status(run_dir)["saves"]), 30, "the save")
            with pytest.raises(ckptd.Conflict, match="a save of .*race is being written; the memory snapshot"):
                client.persist(path)
            assert saved.result(60).path == path
            assert ckptd.load(path)["w"].equal(full(2)["w"])
        else:
            persisting = pool.submit(client.persist, path)
            wait_until(lambda: any(c["path"] == str(path) for c in status(run_dir)["checkpoints"]), 30,
                       "the persist")
            with pytest.raises(ckptd.Conflict, match="writing its memory snapshot of .*race to disk there now"):
                client.save_async(full(2), path, step=2, overwrite=True).result(60)
            assert persisting.result(60) == path
            assert ckptd.load(path)["w"].equal(full(1)["w"])
            client.save_async(full(2), path, step=2, overwrite=True).result(60)  # once on disk, the save goes
            assert ckptd.load(path)["w"].equal(full(2)["w"])
    assert daemon.stop(timeout=60) == 0  # a clean stop: the slot the dropped snapshot held goes back first


def test_a_held_snapshot_whose_disk_copy_retention_deleted_leaves_memory_too(daemon_factory, client_factory, root,
                                                                            run_dir) -> None:
    """Retention (``--keep DIR=1``) deleting a persisted snapshot's disk copy drops the held snapshot too: it is no
    longer listed or loaded, and persist() says nothing is held (it used to be held on as memory only, and an exit
    or a drain persisted it again, whose own retention then deleted a newer checkpoint)."""
    kept = root / "kept"
    kept.mkdir()
    daemon = daemon_factory("--keep", f"{kept}=1", "--keep-snapshots", "3")
    client = client_factory()
    for step in (10, 11):
        client.save_async(full(step), kept / f"step-{step}", step=step, persist=False).result(30)
        assert client.persist(kept / f"step-{step}") == kept / f"step-{step}"
    wait_until(lambda: not (kept / "step-10").exists(), 30, "retention deletes step-10 on disk")
    wait_until(lambda: all(s["path"] != str(kept / "step-10") for s in held_snapshots(run_dir)), 30,
               "the held step-10 dropped")
    with pytest.raises(ckptd.InvalidCheckpoint, match="holds no snapshot"):
        client.persist(kept / "step-10")
    assert ckptd.latest(kept, run_dir=run_dir) == kept / "step-11"
    client.close()
    assert daemon.stop(timeout=60) == 0
    assert sorted(p.name for p in kept.iterdir()) == ["step-11"]


def test_a_disk_save_of_a_held_path_replaces_the_snapshot_for_every_reader(daemon, client_factory, root,
                                                                             run_dir) -> None:
    client = client_factory()
    client.save_async(full(1), root / "persisted", step=1, persist=False).result(30)
    client.persist(root / "persisted")
    client.save_async(full(2), root / "persisted", step=2, overwrite=True).result(30)
    client.save_async(full(3), root / "memory-only", step=3, persist=False).result(30)
    client.save_async(full(4), root / "memory-only", step=4).result(30)
    for name, value in (("persisted", 2), ("memory-only", 4)):
        assert ckptd.load(root / name, run_dir=run_dir)["w"].equal(full(value)["w"]), name
        target = full(0)
        ckptd.load_into(target, root / name, run_dir=run_dir)
        assert target["w"].equal(full(value)["w"]), name
    assert held_snapshots(run_dir) == []
    assert "reason=saved_to_disk" in (run_dir / "ckptd.log").read_text()
    daemon.stop()


def test_persist_waits_for_every_rank_and_answers_every_caller_once_committed(daemon, client_factory, root,
                                                                            run_dir) -> None:
    rank0, rank1 = (client_factory(rank=r, world_size=2) for r in (0, 1))
    persister = client_factory()  # no snapshot of its own: the daemon is what waits
    first = rank0.save_async(full(0), root / "s1", step=1, persist=False)
    wait_until(lambda: held(daemon, root / "s1")["ranks_held"] == [0], 60, "rank 0 is held")
    with ThreadPoolExecutor(2) as pool:
        early = [pool.submit(c.persist, root / "s1") for c in (persister, rank0)]  # rank 0 waits for its HeldInMemory
        wait_until(lambda: held(daemon, root / "s1")["persists_waiting"] == 1, 60, "the daemon holds the persist")
        assert not any(f.done() for f in early)
        second = rank1.save_async(full(1), root / "s1", step=1, persist=False)
        assert [f.result(30) for f in early] == [root / "s1"] * 2
    assert [f.result(30).path for f in (first, second)] == [root / "s1"] * 2
    assert rank1.persist(root / "s1") == root / "s1"  # already on disk: answered at once
    assert ckptd.read_index(root / "s1").world_size == 2
    for r in (0, 1):
        assert ckptd.load(root / "s1", rank=r)["w"].equal(full(r)["w"])
    daemon.stop()


def test_persist_right_after_staging_never_finds_the_snapshot_missing(daemon, client_factory, root) -> None:
    client = client_factory()
    for step in range(10):
        client.save_async(full(step), root / f"step-{step}", step=step, persist=False).wait_staged()
        assert client.persist(root / f"step-{step}") == root / f"step-{step}"
    assert ckptd.load(root / "step-9")["w"].equal(full(9)["w"])
    daemon.stop()


def test_a_persist_onto_a_directory_a_user_made_after_the_snapshot_is_refused_before_a_byte_is_written(
        daemon, client_factory, root) -> None:
    """A directory that is no checkpoint appeared at a held snapshot's path: its persist wrote the whole
    snapshot aside, then failed saying the checkpoint "appeared while this one was written" (found by a
    new-user pass). It is refused first, as a disk save to that directory is, and the directory is left alone."""
    path = root / "run" / "step-1"
    client = client_factory()
    client.save_async(full(1), path, step=1, persist=False).result(30)
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ckptd.CheckpointExists, match="not a committed ckptd checkpoint"):
        client.persist(path, timeout=60)
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-1"]  # nothing written aside
    assert (path / "notes.txt").read_text() == "mine"
    assert held(daemon, path)["persisted"] is False  # still held: a persist once the name is free writes it


def test_persist_refuses_a_snapshot_whose_bytes_changed_in_memory(daemon, client_factory, root, run_dir) -> None:
    client = client_factory()
    client.save_async(full(5), root / "s5", step=5, persist=False).result(30)
    [(_, slot, size, _, _)] = held_snapshots(run_dir)[0]["shards"]
    with open(SHM / slot, "r+b") as f:  # one bit of a tensor flips in node memory
        f.seek(size - 1)
        byte = f.read(1)
        f.seek(size - 1)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ckptd.WriteFailed, match="changed in node memory since the daemon held it"):
        client.persist(root / "s5")
    assert not (root / "s5").exists()
    with pytest.raises(ckptd.InvalidCheckpoint, match="checksum"):
        ckptd.load(root / "s5", run_dir=run_dir)
    daemon.stop()


def test_a_persist_that_times_out_says_what_it_waited_for(daemon_factory, client_factory, root, tmp_path) -> None:
    go = tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "fsync", "match": "/slow.incomplete/", "errno": 0, "wait_for": str(go)}])
    client = client_factory()
    client.save_async(full(1), root / "slow", step=1, persist=False).result(30)
    with pytest.raises(TimeoutError, match=r"persist\(.*slow'\) was not committed to disk within 0.5 s"):
        client.persist(root / "slow", timeout=0.5)
    go.touch()
    daemon.stop()


def test_a_defect_where_a_persist_ends_answers_its_waiter_at_once_and_leaves_the_snapshot_held(
        daemon_factory, client_factory, root, run_dir) -> None:
    """A persist's end reached the memory tier through a ``Committed`` subscriber, whose defects the events
    swallow: the snapshot stayed ``persisting`` and ``persist()`` waited for its timeout (issue 39). The save
    pipeline calls the memory tier directly now, and a defect there is an internal error its waiter is told."""
    path = root / "snap"
    daemon = daemon_factory(faults=[{"op": "persist_end", "match": str(path)}])
    client = client_factory(commit_timeout=600)
    client.save_async(full(1), path, step=1, persist=False).result(30)
    with pytest.raises(ckptd.InternalError, match="injected defect in the persist_end"):
        client.persist(path, timeout=60)
    assert "event=fault op=persist_end" in (run_dir / "ckptd.log").read_text()  # the fault fired
    snap = held(daemon, path)
    assert (snap["persisting"], snap["persisted"]) == (False, False)  # held again: an exit or a drain tries again
    assert ckptd.load(path)["w"].equal(full(1)["w"])  # the write itself committed
    assert daemon.status()["daemon"]["pid"] == daemon.proc.pid


def test_an_abort_from_the_snapshots_own_job_never_fails_the_daemons_write_of_it_to_disk(
    daemon_factory, client_factory, root, tmp_path
) -> None:
    """An Abort ends the job's attempt still gathering its ranks, not a held snapshot's persist, which the daemon
    runs for ranks already answered: the persist's disk attempt bears the snapshot's job, and an Abort of that
    job at the path failed it with ``RanksMissing`` (issue 38, case 8d)."""
    go = tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "fsync", "match": "/slow.incomplete/", "errno": 0, "wait_for": str(go)}])
    client = client_factory(job="run-1")
    path = root / "slow"
    client.save_async(full(1), path, step=1, persist=False).result(30)
    with ThreadPoolExecutor(1) as pool:
        persisted = pool.submit(client.persist, path)
        wait_until(lambda: held(daemon, path)["persisting"], 30, "the persist under way")
        sock = raw_socket(daemon)
        try:  # a rank of run-1 in a process of its own, as ``ckptd.dcp.StorageWriter``'s Abort comes
            for request in (Hello(1, os.getpid(), os.getuid(), "test", job="run-1"),
                            Abort(2, str(path), "a rank of run-1 gave up", "run-1")):
                sock.send(request.to_wire())
                assert not isinstance(reply := decode(sock.recv()), Error), reply
        finally:
            sock.close()
        go.touch()
        assert persisted.result(60) == path
    assert ckptd.read_index(path).step == 1 and ckptd.load(path)["w"].equal(full(1)["w"])
    assert held(daemon, path)["persisted"]
    daemon.stop()


def test_persist_after_a_refused_snapshot_says_why_it_was_refused(daemon, client_factory, root) -> None:
    client = client_factory()
    client.save_async(full(1), root / "s1", step=1).result(30)  # on disk: the run restarts at step 1
    refused = client.save_async(full(2), root / "s1", step=1, persist=False)
    with pytest.raises(ckptd.CheckpointExists) as at_save:
        refused.result(30)
    with pytest.raises(ckptd.CheckpointExists) as at_persist:
        client.persist(root / "s1")
    message = str(at_persist.value)
    assert "snapshot of it failed" in message and at_save.value.message in message, message
    assert "holds no snapshot" not in message
    client.save_async(full(3), root / "s3", step=3, persist=False).result(30)  # another path: still persists
    assert client.persist(root / "s3") == root / "s3"
    assert ckptd.load(root / "s1")["w"].equal(full(1)["w"])  # the refused snapshot touched nothing


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


def test_keep_last_of_a_snapshot_applies_when_it_is_persisted_on_exit(daemon, client_factory, root) -> None:
    client = client_factory()
    client.save_async(full(1), root / "k1", step=1).result(30)
    client.save_async(full(2), root / "k2", step=2, persist=False, keep_last=1).result(30)
    client.close()
    wait_until(lambda: (root / "k2" / "ckptd.json").exists() and not (root / "k1").exists(), 20,
               "k2 persisted on exit and k1 removed by its keep_last")
    daemon.stop()
