"""One state model for every attempt, disk or memory: each way an attempt ends is a move of ``NEXT_STATES``.

The table is read as a graph (every state an attempt can be in leads to an end), and a real daemon is driven
through the ends a node can reach on its own (committed, failed on disk and in memory, a snapshot persisted,
dropped for a newer one and shadowed by a disk save): each is logged as the end it is, and no move the table
does not list (``cannot go from``, an ``InternalError``) ever happens.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

import ckptd
from ckptd.lifecycle.attempt import ENDED, NEXT_REPLICA_STATES, NEXT_REPLICATION, NEXT_STATES, AttemptState
from ckptd.protocol.messages import ReplicationState
from ckptd.protocol.endpoint import LOG_NAME
from helpers import SHM, wait_until
from test_incarnations import RUN_1, Rank
from test_peers import _pair


@pytest.mark.parametrize("table", [NEXT_STATES, NEXT_REPLICA_STATES], ids=["attempts", "replicas"])
def test_every_state_leads_to_an_end_and_only_the_ends_lead_nowhere(table) -> None:
    assert ENDED == {AttemptState.COMMITTED, AttemptState.FAILED, AttemptState.DROPPED, AttemptState.LET_GO,
                     AttemptState.ADOPTED}
    assert set(NEXT_STATES) | set(NEXT_REPLICA_STATES) == set(AttemptState), "every state is some kind's"
    for start in table:
        seen, todo = set(), [start]
        while todo:
            state = todo.pop()
            seen.add(state)
            todo += [s for s in table[state] if s not in seen]
        assert seen & ENDED, f"{start.value} leads to no end"
        assert all(s in table for s in table[start]), f"{start.value} leads out of its kind's table"


def test_a_snapshots_replication_reaches_its_buddy_again_from_every_state_it_is_sent_from() -> None:
    """The second track: every state is in the table, a snapshot that was sent (or failed, or was superseded) can
    be sent again (a late rank joined), a restored one is sent on once the peer it was read from lost its copy,
    and a peer's replica a drain adopted is never sent on."""
    assert set(NEXT_REPLICATION) == set(ReplicationState)
    R = ReplicationState
    assert {s for s, after in NEXT_REPLICATION.items() if not after} == {R.ADOPTED}
    for state in set(ReplicationState) - {R.ADOPTED}:
        assert R.REPLICATING in NEXT_REPLICATION[state], f"{state.value} is never sent again"
    assert {R.REPLICATED, R.FAILED, R.SUPERSEDED} <= NEXT_REPLICATION[R.REPLICATING]
    assert all(R.OFF not in after for after in NEXT_REPLICATION.values()), "nothing goes back to not sent"


ENDED_LINE = re.compile(r"event=attempt_ended kind=(\w+) path=(\S+) state=(.+?) why=(.*)$")


def ended(log: str, why: bool = False) -> list[tuple[str, ...]]:
    """(kind, path's name, end) of every attempt the daemon logged as ended, and why (``why``)."""
    rows = []
    for line in log.splitlines():
        found = ENDED_LINE.search(line)
        if found:
            kind, path, state, reason = found.groups()
            rows.append((kind, path.rsplit("/", 1)[-1], state, reason) if why else (kind, path.rsplit("/", 1)[-1],
                                                                                     state))
    return rows


@pytest.mark.timeout(120)
def test_each_way_an_attempt_ends_on_a_node_is_a_move_of_the_table(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory("--keep-snapshots", "1", faults=[{"op": "write", "match": "doomed"}])
    client = client_factory()
    client.save_async({"w": torch.ones(4)}, root / "saved", step=1).result(30)
    with pytest.raises(ckptd.WriteFailed):
        client.save_async({"w": torch.ones(4)}, root / "doomed", step=2).result(30)
    client.save_async({"w": torch.ones(4)}, root / "mem" / "s-1", step=1, persist=False).result(30)
    client.save_async({"w": torch.ones(4)}, root / "mem" / "s-2", step=2, persist=False).result(30)  # drops s-1
    client.persist(root / "mem" / "s-2")
    client.save_async({"w": torch.ones(4)}, root / "shadow", step=3, persist=False).result(30)
    client.save_async({"w": torch.full((4,), 2.0)}, root / "shadow", step=3).result(30)  # the disk save shadows it
    lonely = client_factory(rank=0, world_size=2, commit_timeout=1.0)
    with pytest.raises(ckptd.RanksMissing):
        lonely.save_async({"w": torch.ones(4)}, root / "mem" / "s-9", step=9, persist=False).result(60)
    with pytest.raises(ckptd.RanksMissing):  # the same on disk
        lonely.save_async({"w": torch.ones(4)}, root / "d-9", step=9).result(60)
    # the failed snapshot's slot goes back under its client's name after the error (on the daemon's pool): the
    # client may only close once it is there, or its close unlinks nothing and the slot comes back after it
    wait_until(lambda: all((SHM / name).exists() for name in lonely.slot_names), 30, "the slot handed back")
    log_path = daemon.run_dir / LOG_NAME
    wanted = {("checkpoint", "saved", "committed"), ("checkpoint", "doomed", "failed"),
              ("snapshot", "s-1", "dropped"), ("checkpoint", "s-2", "committed"),
              ("checkpoint", "shadow", "committed"), ("snapshot", "shadow", "dropped"),
              ("snapshot", "s-9", "failed"), ("checkpoint", "d-9", "failed")}
    wait_until(lambda: wanted <= set(ended(log_path.read_text())), 30,
               lambda: f"every end logged; logged: {ended(log_path.read_text())}")
    assert "cannot go from" not in log_path.read_text()
    assert {("snapshot", "s-9", "failed", "overdue"), ("checkpoint", "d-9", "failed", "overdue")} <= set(
        ended(log_path.read_text(), why=True))
    assert ckptd.load(root / "shadow")["w"].tolist() == [2.0] * 4
    info = daemon.status()  # each end was published last: the counters its subscribers keep moved
    assert (info["completed"]["count"], info["completed"]["failed"]) == (3, 2), info["completed"]
    assert (info["memory"]["dropped_total"], info["memory"]["failed_total"]) == (2, 1), info["memory"]
    shown = daemon.cli("status").stdout  # and the human status says so
    assert "checkpoints" in shown and "; 2 failed" in shown.split("completed:", 1)[1].splitlines()[0], shown
    assert "; 1 failed" in shown.split("memory snapshots:", 1)[1].splitlines()[0], shown


def dropped(log: str) -> list[tuple[str, str]]:
    """(path's name, reason) of every snapshot the daemon logged as dropped."""
    return [(line.split(" path=", 1)[1].split(" ", 1)[0].rsplit("/", 1)[-1], line.rsplit("reason=", 1)[1])
            for line in log.splitlines() if "event=snapshot_dropped" in line]


@pytest.mark.timeout(120)
def test_each_way_a_snapshot_is_dropped_ends_it_through_the_registry_with_its_reason(
    daemon_factory, client_factory, root, run_dir
) -> None:
    """A snapshot ends dropped for a budget, a newer one kept, a replacement, a delete, and a newer checkpoint on
    disk; each end is the registry's (``Registry.end``: logged as ended, with the reason its pipeline publishes)
    and leaves no slot of the daemon's behind."""
    daemon = daemon_factory("--keep-snapshots", "2", "--memory-budget", "2MiB")
    client = client_factory()
    state = lambda v: {"w": torch.full((150_000,), float(v))}  # noqa: E731 - 0.57 MiB: three fit, four do not
    client.save_async(state(1), root / "b" / "s-1", step=1, persist=False).result(30)
    client.persist(root / "b" / "s-1")
    client.save_async(state(3), root / "c" / "s-3", step=3, persist=False).result(30)
    client.save_async(state(4), root / "c" / "s-4", step=4, persist=False).result(30)
    client.save_async(state(5), root / "c" / "s-5", step=5, persist=False).result(30)  # evicts s-1 (on disk), and
    # drops s-3 once held (keep 2)
    client.delete(root / "c" / "s-4")
    client.save_async(state(6), root / "c" / "s-5", step=5, persist=False, overwrite=True).result(30)  # replaced
    client.save_async(state(2), root / "b" / "s-2", step=2, persist=False).result(30)
    client.save_async(state(7), root / "b" / "d-9", step=9).result(30)  # a disk save newer than s-2
    client.close()  # its exit persists b's newest snapshot: s-2, older than d-9, is dropped instead
    log_path = daemon.run_dir / LOG_NAME
    wanted = {("s-1", "budget"), ("s-3", "newer"), ("s-5", "replaced"), ("s-4", "deleted"),
              ("s-2", "older_than_disk")}
    wait_until(lambda: wanted <= set(dropped(log_path.read_text())), 30,
               lambda: f"every drop logged; logged: {dropped(log_path.read_text())}")
    ends = [(name, end) for kind, name, end in ended(log_path.read_text()) if kind == "snapshot"]
    for name, _ in wanted:
        assert (name, "dropped") in ends, (name, ends)
    assert "cannot go from" not in log_path.read_text()
    held = {s["path"] for s in daemon.status()["memory"]["snapshots"]}
    assert held == {str(root / "c" / "s-5")}, held  # the replacement, persisted on exit
    assert ckptd.load(root / "c" / "s-5", run_dir=run_dir)["w"].tolist()[:2] == [6.0, 6.0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["wait", "wait-memory"], ids=["disk", "memory"])
def test_an_attempt_whose_ranks_can_never_all_come_ends_failed_saying_why(daemon, root, mode) -> None:
    """Housekeeping's three ends, for a checkpoint and a snapshot alike, each logged with its reason: a rank of
    the run that died before it saved (``rank_died``), every contributor dead while ranks are missing
    (``orphaned``), and (in the first test) a rank that never came within the timeout (``overdue``). The ranks
    still waiting are told the same reason."""
    died, orphaned = root / "died", root / "orphaned"
    doomed = Rank(RUN_1, daemon.run_dir, died, 1, 2, 1.0, "connect-only")
    doomed.event()
    waiting = Rank(RUN_1, daemon.run_dir, died, 0, 2, 1.0, mode)
    assert waiting.event()["event"] == "staged"
    doomed.kill()
    outcome = waiting.event()
    assert outcome["event"] == "failed" and "died before that rank saved" in outcome["message"], outcome
    left = Rank(RUN_1, daemon.run_dir, orphaned, 0, 2, 1.0, "hold" + mode[len("wait"):])
    assert left.event()["event"] == "staged"
    left.kill()  # rank 1 never comes, and no rank of the run is left to bring it
    kind = "snapshot" if mode.endswith("memory") else "checkpoint"
    log_path = daemon.run_dir / LOG_NAME
    wanted = {(kind, "died", "failed", "rank_died"), (kind, "orphaned", "failed", "orphaned")}
    wait_until(lambda: wanted <= set(ended(log_path.read_text(), why=True)), 60,
               lambda: f"both ends logged with why; logged: {ended(log_path.read_text(), why=True)}")
    assert "cannot go from" not in log_path.read_text()
    wait_until(lambda: not daemon.status()["checkpoints"] and not daemon.status()["memory"]["snapshots"], 60,
               "nothing of either attempt left in status")


@pytest.mark.timeout(240)
def test_a_replica_held_for_a_peer_ends_through_the_registry_dropped_or_adopted(root, tmp_path) -> None:
    """The buddy's replicas are the registry's too (``NEXT_REPLICA_STATES``): received then held, and ended
    dropped when a newer copy of the path replaces one and when its origin forgets it, adopted when a drain
    takes over the replica of an origin that is gone; each end logged with why, and no move outside the table."""
    pair = _pair(root, tmp_path, origin_extra=("--persist-on-exit", "never"), ring=True)
    run = root / "run"
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async({"w": torch.ones(50_000)}, run / "a", step=1, persist=False).wait_replicated(60)
        client.save_async({"w": torch.full((50_000,), 2.0)}, run / "a", step=1, persist=False,
                          overwrite=True).wait_replicated(60)  # its replica replaces the first one
        client.delete(run / "a")  # the origin lets it go: the buddy forgets its replica
        client.save_async({"w": torch.full((50_000,), 3.0)}, run / "b", step=2, persist=False).wait_replicated(60)
        client.close()
        totals = lambda: {k: v for k, v in pair.buddy.status()["peers"]["replicas_held"].items()  # noqa: E731
                          if k.endswith("_total")}
        wait_until(lambda: totals() == {"dropped_total": 2, "adopted_total": 0}, 30,
                   lambda: f"each replica's end published (ReplicaEnded), as status counts: {totals()}")
        pair.origin.kill()
        assert pair.origin.proc.returncode == -signal.SIGKILL  # the origin is gone; the buddy's drain adopts "b"
        assert pair.buddy.cli("stop", timeout=120).returncode == 0
        assert pair.buddy.proc.wait(30) == 0
        log = (pair.buddy_dir / LOG_NAME).read_text()
        replicas = [(name, end, why) for kind, name, end, why in ended(log, why=True) if kind == "replica"]
        assert replicas == [("a", "dropped", "replaced"), ("a", "dropped", "forgotten"), ("b", "adopted",
                                                                                          "origin_gone")], replicas
        assert "cannot go from" not in log
        assert ckptd.load(run / "b")["w"].tolist()[:1] == [3.0]  # the adopted replica, persisted by the drain
    finally:
        pair.kill()
