"""The ends no other test checks the log of: each driven through real daemons, each logged as the end it is.

``tests/test_lifecycle.py`` drives the ends a node reaches on its own; this file drives the rest and reads the
``event=attempt_ended`` line each one logs (its kind, path, state and why), with no move outside the state table
(``cannot go from``) on any daemon:

* an attempt, on disk or in memory, left missing ranks by contributors that died, ended by a rank of another run
  arriving at its path (``Registry.end_orphaned``: ``abandoned``, where housekeeping's own finding is ``orphaned``),
  and by a late rank of its own run (``orphaned``);
* a snapshot still gathering its ranks ended by its run's ``Abort``, by a rank of its run that disagrees with the
  first (``Conflict``), or by a disk save committing its path (``saved_to_disk``); and a persisted snapshot still
  held whose disk copy retention (keep_last) deleted;
* a save spread over two nodes: its run's ``Abort`` on global rank 0's daemon (whether that daemon holds a shard of
  it or not), and the other node's daemon letting go of its part, for each reason it has (a rank of its run saved
  the path again; its directory gone, published or discarded by rank 0's daemon);
* the buddy's replica of a peer's shard dropped because it was offered again, its stream failed, its checksum was
  not the origin's, or the offer was refused; and a replica whose origin stopped half-way ended by housekeeping
  (``stalled``).

and one that stalled: a shard of it sealed, the other never offered (``Replica.overdue``: nothing came for
``replicas.STALLED_S``, 60 s, so that test takes a minute of real time; no option shortens it).
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
import zmq

import ckptd
from ckptd.client.flatten import flatten
from ckptd.core.keys import KeyPair
from ckptd.peers import bulk
from ckptd.peers.replicas import STALLED_S
from ckptd.protocol.endpoint import LOG_NAME
from ckptd.protocol.errors import ErrorCode, RanksMissing
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.messages import Abort, Done, Error, Finalize, Ok, Snapshot
from ckptd.protocol.peer_messages import Offer, Seal, Ticket
from helpers import SHM, Daemon, segments_of, short_tempdir, start_daemon, wait_until
from test_fuzz_peers import _peer_socket
from test_incarnations import RUN_1, RUN_2, Rank
from test_lifecycle import ended
from test_peers import _answers, _node, _raw_offer, _send_shard

GONE = "its directory is gone: another node's daemon published or discarded it"
AGAIN = "a rank of its run saved the path again"


def _logged(daemon: Daemon) -> str:
    return (daemon.run_dir / LOG_NAME).read_text()


@pytest.mark.timeout(120)
def test_a_newcomer_abandons_a_dead_runs_attempt_and_a_snapshot_ends_by_abort_or_by_retention(
        daemon_factory, client_factory, root: Path) -> None:
    """A rank of run 1 stages, on disk and in memory, and is killed; a rank of run 2 saves the same path: its
    arrival fails run 1's attempt (``abandoned``) and its own commits. Housekeeping runs only at the daemon's start
    here, so only the newcomer can find the dead run's attempt (a round finding it first would log ``orphaned``).
    Then a snapshot still waiting for its rank 1 is failed by its run's ``Abort`` (as ``ckptd.dcp``'s rank 0 sends
    when a rank's shard never came), and a persisted snapshot goes from memory when retention deletes its disk
    copy."""
    daemon = daemon_factory("--housekeeping-interval", "3600", "--persist-on-exit", "never")
    killed: list[int] = []
    try:
        for name, mode in (("left-disk", "hold"), ("left-memory", "hold-memory")):
            left = Rank(RUN_1, daemon.run_dir, root / name, 0, 2, 1.0, mode)
            assert left.event()["event"] == "staged"
            killed.append(left.proc.pid)
            left.kill()  # rank 1 of run 1 never comes, and no rank of run 1 is left to bring it
            newcomer = Rank(RUN_2, daemon.run_dir, root / name, 0, 1, 2.0, "wait" + mode[len("hold"):])
            assert [newcomer.event()["event"], newcomer.event()["event"]] == ["staged", "done"]
            assert newcomer.proc.wait(30) == 0
        # a late rank of the dead run's own: the attempt is orphaned (no rank of its run can complete it), not
        # abandoned to another run; the late rank's own attempt then waits for the dead one (housekeeping would end
        # it), so it is killed too
        left = Rank(RUN_1, daemon.run_dir, root / "late", 0, 2, 1.0, "hold")
        assert left.event()["event"] == "staged"
        killed.append(left.proc.pid)
        left.kill()
        late = Rank(RUN_1, daemon.run_dir, root / "late", 1, 2, 1.0, "hold")
        assert late.event()["event"] == "staged"
        wait_until(lambda: ("checkpoint", "late", "failed", "orphaned") in ended(_logged(daemon), why=True), 30,
                   "the late rank's arrival ends its run's orphaned attempt")
        killed.append(late.proc.pid)
        late.kill()

        lonely = client_factory(rank=0, world_size=2)
        gathering = lonely.save_async({"w": torch.ones(4)}, root / "gathering", step=1, persist=False)
        gathering.staged.result(30)  # admitted: the snapshot waits for rank 1
        conn = lonely._conn
        assert isinstance(conn.call(Abort(conn.next_id(), str(root / "gathering"), "rank 1 failed", lonely.job)),
                          Ok)
        with pytest.raises(RanksMissing, match="was aborted: rank 1 failed"):
            gathering.result(30)
        wait_until(lambda: all((SHM / name).exists() for name in lonely.slot_names), 30, "the slot handed back")

        client = client_factory()
        client.save_async({"w": torch.ones(4)}, root / "kept" / "s-1", step=1, keep_last=1, persist=False).result(30)
        client.persist(root / "kept" / "s-1")
        client.save_async({"w": torch.full((4,), 2.0)}, root / "kept" / "d-2", step=2, keep_last=1).result(30)
        wait_until(lambda: not (root / "kept" / "s-1").exists(), 30, "retention to delete s-1's disk copy")

        rows = lambda: ended(_logged(daemon), why=True)  # noqa: E731
        wanted = [("checkpoint", "left-disk", "failed", "abandoned"), ("checkpoint", "left-disk", "committed", ""),
                  ("snapshot", "left-memory", "failed", "abandoned"), ("checkpoint", "late", "failed", "orphaned"),
                  ("snapshot", "gathering", "failed", "aborted"),
                  ("checkpoint", "s-1", "committed", ""), ("checkpoint", "d-2", "committed", ""),
                  ("snapshot", "s-1", "dropped", "retention_deleted_disk_copy")]
        wait_until(lambda: rows() == wanted, 30, lambda: f"each end logged once, in order; logged: {rows()}")
        log = _logged(daemon)
        assert "cannot go from" not in log and log.count("why=orphaned") == 1
        assert [s["path"] for s in daemon.status()["memory"]["snapshots"]] == [str(root / "left-memory")]
        assert ckptd.load(root / "left-disk")["w"].tolist()[:1] == [2.0]  # run 2's, never run 1's
        assert sorted(p.name for p in (root / "kept").iterdir()) == ["d-2"]
    finally:
        for pid in killed:  # what the killed ranks staged: housekeeping, which would reclaim it, never runs here
            for name in segments_of(pid):
                (SHM / name).unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_a_snapshot_still_gathering_fails_by_a_rank_that_disagrees_or_by_a_disk_save_of_its_path(
        daemon_factory, client_factory, root: Path) -> None:
    """Two ends of a snapshot no rank has been answered for yet (not acknowledged, so it fails rather than being
    dropped): its run's rank 1 saying another step than rank 0 fails it on both ranks (``Conflict``); and a disk
    save by another run committing the path while its rank 1 is still to come fails it (``saved_to_disk``: it
    must never shadow that newer save), its rank 0 told why and its slot handed back."""
    daemon = daemon_factory("--housekeeping-interval", "3600")
    rank0 = client_factory(rank=0, world_size=2, job="run-s")
    rank1 = client_factory(rank=1, world_size=2, job="run-s")
    first = rank0.save_async({"w": torch.ones(4)}, root / "disagreed", step=1, persist=False)
    first.staged.result(30)  # admitted: the snapshot waits for rank 1
    with pytest.raises(ckptd.Conflict, match="rank 1 says world size 2, step 2"):
        rank1.save_async({"w": torch.ones(4)}, root / "disagreed", step=2, persist=False).result(30)
    with pytest.raises(ckptd.Conflict, match="rank 1 says world size 2, step 2"):
        first.result(30)

    gathering = rank0.save_async({"w": torch.ones(4)}, root / "shadowed", step=3, persist=False)
    gathering.staged.result(30)
    other = client_factory(job="run-t")
    other.save_async({"w": torch.full((4,), 2.0)}, root / "shadowed", step=4).result(30)
    with pytest.raises(ckptd.InvalidCheckpoint, match="a disk save committed the same path"):
        gathering.result(30)
    for client in (rank0, rank1):
        wait_until(lambda c=client: all((SHM / name).exists() for name in c.slot_names), 30, "the slots handed back")

    rows = lambda: ended(_logged(daemon), why=True)  # noqa: E731
    wanted = [("snapshot", "disagreed", "failed", "Conflict"), ("checkpoint", "shadowed", "committed", ""),
              ("snapshot", "shadowed", "failed", "saved_to_disk")]
    wait_until(lambda: rows() == wanted, 30, lambda: f"each end logged once, in order; logged: {rows()}")
    assert "cannot go from" not in _logged(daemon)
    assert not daemon.status()["memory"]["snapshots"]
    assert ckptd.load(root / "shadowed")["w"].tolist() == [2.0] * 4


def _durable(client: ckptd.Client, path: Path, value: float, step: int) -> ShardRecord:
    """This rank's shard of a save spread over several nodes, made durable by its node's daemon (as
    ``ckptd.dcp.StorageWriter`` commits it: answered ``Durable``, finalized or aborted by global rank 0)."""
    flat = flatten({"w": torch.full((1024,), value)}, rank=client.rank)
    saved, reply = client._save_flat(flat, str(path), step=step, overwrite=False, keep_last=None, block=True,
                                     persist=True, started=time.monotonic(), coordinated=True)
    durable = reply.result(30)
    saved.result(30)
    return ShardRecord(durable.file, durable.rank, durable.size, durable.checksum, durable.tensors)


@pytest.mark.timeout(120)
def test_a_save_over_two_nodes_ends_failed_by_its_abort_and_let_go_on_the_node_that_does_not_publish(
        root: Path) -> None:
    """Two daemons as two nodes, one shared root: rank 0 saves through A (global rank 0's daemon), rank 1 through
    B, and the test stands for their agreement (``client/coordinate.py``), sending A the ``Finalize`` or ``Abort``.
    A save of the path again by the run's ranks lets go of each node's settled attempt (the run agreed on it); an
    Abort fails A's attempt, or one made from the Abort where A holds no shard of it, and removes the directory;
    B lets go of its part of every attempt whose directory A published or removed."""
    nodes = [start_daemon(short_tempdir("ckea-"), root), start_daemon(short_tempdir("ckeb-"), root)]
    a, b = nodes
    try:
        rank0 = ckptd.Client(run_dir=a.run_dir, spawn=False, rank=0, world_size=2, job="run-j")
        rank1 = ckptd.Client(run_dir=b.run_dir, spawn=False, rank=1, world_size=2, job="run-j")
        conn = rank0._conn
        for value in (1.0, 2.0):  # the same ranks save the path again: both nodes let the first attempt go
            files = (_durable(rank0, root / "again", value, 1), _durable(rank1, root / "again", value, 1))
        # A publishes the second save's shards: B's settled attempt finds its directory gone
        assert isinstance(conn.call(Finalize(conn.next_id(), str(root / "again"), 2, 1, False, None, files,
                                             rank0.job), timeout=30), Done)
        _durable(rank0, root / "aborted", 1.0, 2)
        _durable(rank1, root / "aborted", 1.0, 2)
        _durable(rank1, root / "never", 1.0, 3)  # rank 0's shard never reached A
        for name in ("aborted", "never"):
            assert isinstance(conn.call(Abort(conn.next_id(), str(root / name), "a rank failed", rank0.job),
                                        timeout=30), Ok)
        rank0.close()
        rank1.close()

        wanted = [(a, [("checkpoint", "again", "let go", AGAIN), ("checkpoint", "again", "committed", ""),
                       ("checkpoint", "aborted", "failed", "aborted"),
                       ("checkpoint", "never", "failed", "aborted")]),
                  (b, [("checkpoint", "again", "let go", AGAIN), ("checkpoint", "again", "let go", GONE),
                       ("checkpoint", "aborted", "let go", GONE), ("checkpoint", "never", "let go", GONE)])]
        for node, rows in wanted:  # B looks at its settled attempts every 5 s (saves.LOOK_INTERVAL_S)
            logged = lambda node=node: ended(_logged(node), why=True)  # noqa: E731
            wait_until(lambda: sorted(logged()) == sorted(rows), 30, lambda: f"{node.run_dir}: logged {logged()}")
            assert "cannot go from" not in _logged(node)
            wait_until(lambda: not node.status()["checkpoints"], 30, "no attempt left in status")
        wait_until(lambda: sorted(p.name for p in root.iterdir()) == ["again"], 30,
                   lambda: f"nothing left beside again: {sorted(p.name for p in root.iterdir())}")
        assert [float(ckptd.load(root / "again", rank=r)["w"][0]) for r in range(2)] == [2.0, 2.0]
    finally:
        for node in nodes:
            node.kill()
            shutil.rmtree(node.run_dir, ignore_errors=True)


def _offered(sock: zmq.Socket, offer: Offer) -> Ticket | Error:
    sock.send(offer.to_wire())
    return _answers(sock, [offer.id])[offer.id]


@pytest.mark.timeout(240)
def test_each_way_the_buddy_drops_a_replica_it_receives_is_logged_with_why(root: Path, tmp_path: Path) -> None:
    """The buddy, offered shards by a trusted peer (the test, under the origin's key): a shard offered again before
    its seal drops the first attempt (``offered_again``), a stream that breaks part-way drops its replica
    (``stream_failed``), bytes whose checksum is not the offer's are not held (``checksum``), and an offer of a path
    outside the buddy's roots is refused (``offer_refused``); each is answered saying so, and only the replica
    offered again, then sent whole, is held. A replica of two ranks whose origin sealed one and never offered the
    other is ended by housekeeping once nothing came for ``STALLED_S`` (``stalled``), its file removed."""
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, _ = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    keys.write_text("".join(lines))
    buddy = start_daemon(buddy_dir, root, "--peer-listen", buddy_ep, "--peer-keys", str(keys),
                         "--memory-budget", "64MiB")
    sock = _peer_socket(buddy_ep, KeyPair.of(buddy_dir).public, KeyPair.of(origin_dir))
    try:
        half, half_data = _raw_offer(60, root / "run" / "stalled", 6, nbytes=bulk.FRAME)
        shard = dataclasses.replace(Snapshot.from_wire(half.shard), world_size=2)
        half = dataclasses.replace(half, shard=shard.to_wire(), ranks=(0, 1))  # rank 1 of its node never comes
        ticket = _offered(sock, half)
        assert isinstance(ticket, Ticket), ticket
        stalled_at = time.monotonic()  # before its last bytes and its seal: nothing of it comes after those
        sealed = _send_shard(sock, buddy_ep, half, ticket, half_data)
        assert isinstance(_answers(sock, [sealed])[sealed], Ok)

        first, _ = _raw_offer(10, root / "run" / "again", 1, nbytes=bulk.FRAME)
        assert isinstance(_offered(sock, first), Ticket)
        again, again_data = _raw_offer(20, root / "run" / "again", 2, nbytes=bulk.FRAME)
        ticket = _offered(sock, again)
        assert isinstance(ticket, Ticket), ticket
        sealed = _send_shard(sock, buddy_ep, again, ticket, again_data)
        assert isinstance(_answers(sock, [sealed])[sealed], Ok)

        broken, broken_data = _raw_offer(30, root / "run" / "broken", 3, nbytes=2 * bulk.FRAME)
        ticket = _offered(sock, broken)
        assert isinstance(ticket, Ticket), ticket
        with socket.create_connection(bulk.data_address(buddy_ep), timeout=30) as conn:
            conn.sendall(ticket.token)
            bulk.send(conn, ticket.key, memoryview(broken_data)[:bulk.FRAME])  # frame 0 of 2, then the link closes
        sock.send(Seal(31, broken.id).to_wire())
        seal = _answers(sock, [31])[31]
        assert isinstance(seal, Error) and "its stream on the data port failed" in seal.message, seal

        crc, crc_data = _raw_offer(40, root / "run" / "crc", 4, nbytes=bulk.FRAME)
        crc = dataclasses.replace(crc, checksum=crc.checksum ^ 1)  # the origin's checksum is not its bytes'
        ticket = _offered(sock, crc)
        assert isinstance(ticket, Ticket), ticket
        sealed = _send_shard(sock, buddy_ep, crc, ticket, crc_data)
        seal = _answers(sock, [sealed])[sealed]
        assert isinstance(seal, Error) and "is not the origin's" in seal.message, seal

        outside, _ = _raw_offer(50, tmp_path / "elsewhere" / "outside", 5, nbytes=bulk.FRAME)
        refused = _offered(sock, outside)
        assert isinstance(refused, Error) and refused.code == ErrorCode.PATH_NOT_ALLOWED, refused

        log = _logged(buddy)
        assert "event=replica_stream_failed" in log and "event=replica_refused" in log
        replicas = [row for row in ended(log, why=True) if row[0] == "replica" and row[1] != "stalled"]
        assert replicas == [("replica", "again", "dropped", "offered_again"),
                            ("replica", "broken", "dropped", "stream_failed"),
                            ("replica", "crc", "dropped", "checksum"),
                            ("replica", "outside", "dropped", "offer_refused")], replicas
        assert "cannot go from" not in log
        (held,) = buddy.status()["peers"]["replicas_held"]["held"]
        assert held["path"] == str(root / "run" / "again") and held["shards"][0][3] == again.checksum
        assert buddy.status()["peers"]["replicas_held"]["receiving"] == 1  # the half replica, not listed
        stalled = ("replica", "stalled", "dropped", "stalled")
        wait_until(lambda: stalled in ended(_logged(buddy), why=True), 150,
                   lambda: f"the half replica ended by housekeeping; logged: {ended(_logged(buddy), why=True)}")
        assert time.monotonic() - stalled_at >= STALLED_S  # not before nothing came for that long
        assert buddy.status()["peers"]["replicas_held"]["receiving"] == 0
        assert "cannot go from" not in _logged(buddy)
        wait_until(lambda: segments_of(buddy.proc.pid) == [held["shards"][0][1]], 30,
                   lambda: f"the dropped replicas' files removed; the buddy's: {segments_of(buddy.proc.pid)}")
    finally:
        sock.close()
        buddy.kill()
