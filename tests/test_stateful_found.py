"""Sequences the stateful test found, each a defect fixed since, replayed by hand against real daemons, ranks and
peers (the ``node_lost`` configuration): resumes that mixed two saves of one path (even of two runs), a snapshot
of several ranks per node refused on every rank, and a lost node resumed from further back than it needed.

And the shortest sequences the ``one_model`` configuration finds of issue 38's open cases, each skipped while its
case is in ``stateful_world.AWAITING_ISSUE_38`` (take it out once the fix is merged: the replay must pass); and one
it found where the model, not the daemons, was wrong (a buddy's drain persisting a replica whose origin drained
first)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import wait_until
from s3server import S3Server

from stateful import HANG_S, CheckpointMachine, Drawn, NodeLossMachine, TiersMachine, configured
from stateful_world import CONFIGS


def _machine(aws: S3Server, world: int = 3) -> CheckpointMachine:
    """The ``node_lost`` configuration's machine (three nodes, ``world`` ranks spread evenly over them)."""
    machine = type("Machine_node_lost", (NodeLossMachine,), {"s3": aws, "cfg": CONFIGS["node_lost"]})()
    machine.world, machine.form = world, "torchrun-c10d"
    machine.job = machine._new_job()
    return machine


def _snapshot_then_crash(machine: CheckpointMachine, ranks: list[int], name: str, overwrite: bool) -> None:
    """``ranks`` of the job snapshot ``name``; once each one's daemon holds its shard the job is SIGKILLed (the
    other ranks never save: the save is never acknowledged) and a new run starts."""
    path = machine.w.path("memory", name)
    before = {n: {s["created"] for s in info["memory"]["snapshots"] if s["path"] == path}
              for n, info in enumerate(machine._statuses())}
    machine._save(machine.job, ranks, "memory", name, overwrite=overwrite)

    def held() -> bool:
        infos = machine._statuses()
        return all(any(s["path"] == path and s["complete"] and s["created"] not in before[machine.job.node_of[r]]
                       for s in infos[machine.job.node_of[r]]["memory"]["snapshots"]) for r in ranks)
    wait_until(held, HANG_S, f"ranks {ranks}' shards of {path} held")
    machine._crash_job()


def _resume(machine: CheckpointMachine) -> dict[int, dict]:
    """Every rank of the job resumes (``latest`` + ``load_into``); what each was told."""
    cids = {}
    for rank in machine.job.ranks:
        cid = cids[rank.rank] = machine.job.next_id()
        rank.send(op="resume", id=cid, root=str(machine.w.root / "run"))
        rank.wait_for("returned", cid)
    return {r: machine.job.ranks[r].wait_for("done", cid, HANG_S) for r, cid in cids.items()}


def _one_save(told: dict[int, dict]) -> None:
    saves = {r: tuple(o["tag"][:2]) if o.get("tag") else None for r, o in told.items()}
    assert len(set(saves.values())) == 1, f"the ranks resumed from {told[0]['path']} as different saves " \
                                          f"(incarnation, save id): {saves}"


def test_a_snapshot_of_two_ranks_per_node_on_three_nodes_is_held_whole(aws: S3Server) -> None:
    """Found by the ``node_lost_wide`` soak at its first snapshot: six ranks, two per node, snapshot ``snap-1`` (a
    free path), every rank in turn. Every rank is told ``CheckpointExists`` ("not held by every rank: rank 1 ...
    is already held in memory", ranks 1, 3 and 5). A daemon of several nodes takes a snapshot as complete once
    the shards that reached it are held (``ckptd/lifecycle/holding.py``, ``_checksummed``; ``HeldSnapshot.complete``
    counts no ranks for a coordinated one), so the node's first rank's shard takes the path, and its second rank,
    arriving after that, meets a held snapshot there. Ranks of a node that save a few milliseconds apart (here
    each rank's save is sent once the previous one's returned) lose every snapshot."""
    machine = _machine(aws, world=6)
    try:
        sid, cids = machine._save(machine.job, list(range(6)), "memory", "step-1")
        told = machine._outcomes(machine.job, cids)
        assert all(o["ok"] for o in told.values()), f"snapshot {sid} of a free path: {told}"
    finally:
        machine.job.kill()
        machine.w.close()


def test_a_snapshot_refused_on_some_nodes_is_never_resumed_as_a_mix_with_what_they_hold(aws: S3Server) -> None:
    """Found by the ``node_lost`` soak (after a double loss and a daemon restart); the shortest form needs neither
    peers nor a loss, only snapshots on several nodes and one daemon restarted. Save 2 of ``snap-2`` is held on
    the three nodes; node 0's daemon is SIGKILLed and restarted (its shard is gone; the job restarts). The new
    run snapshots ``snap-2`` again without ``overwrite``: nodes 1 and 2 refuse it, and every rank is told
    ``CheckpointExists`` ("not held by every rank"), rightly; but node 0 holds its rank's shard of the refused save
    as a complete snapshot (``ckptd status``: ``complete: true``), and the next resume (``latest`` +
    ``load_into``, every rank) loads rank 0 from incarnation 2's refused save and ranks 1 and 2 from incarnation
    1's save 2: a mix of two runs, and one of its saves never acknowledged."""
    machine = _machine(aws)
    try:
        machine._save_all("disk", "step-1", False, None, False)
        machine._save_all("memory", "step-2", False, None, False)
        machine.daemon_is_killed_and_restarted(0)
        _, cids = machine._save(machine.job, [2, 1, 0], "memory", "step-2")
        told = machine._outcomes(machine.job, cids)
        assert {o.get("error") for o in told.values()} == {"CheckpointExists"}, told
        _one_save(_resume(machine))
    finally:
        machine.job.kill()
        machine.w.close()


def test_a_snapshot_over_a_held_one_killed_before_every_node_held_it_is_never_resumed_as_a_mix(
        aws: S3Server) -> None:
    """Found by the ``node_lost`` configuration's soak (with a node loss first; this is the shortest form, with no
    loss at all). Three nodes hold save 2 of ``snap-3`` (acknowledged). Ranks 0 and 1 snapshot it again with
    ``overwrite=True`` and the job is killed before rank 2 saves: save 3 is never acknowledged. A daemon of several
    nodes acknowledges a snapshot once its own ranks are held (``ckptd/lifecycle/holding.py``, ``_checksummed``:
    ``snap.complete`` counts this node's ranks), so nodes 0 and 1 replace save 2 with save 3 while node 2 keeps
    save 2; ``ckptd.latest`` agrees on the path alone (``client/memory.py``, ``_agreed``), and ``load_into`` gives
    ranks 0 and 1 save 3 and rank 2 save 2."""
    machine = _machine(aws)
    try:
        machine._save_all("disk", "step-1", False, None, False)
        machine._save_all("memory", "step-3", False, None, False)
        _snapshot_then_crash(machine, [0, 1], "step-3", overwrite=True)
        _one_save(_resume(machine))
    finally:
        machine.job.kill()
        machine.w.close()


def test_a_snapshot_partly_lost_with_two_nodes_and_partly_saved_again_is_never_resumed_as_a_mix(
        aws: S3Server) -> None:
    """Found by the ``node_lost`` soak (``launch`` losing nodes 0 and 1, a crash mid-save of ``snap-3`` later).
    Save 2 of ``snap-3`` is held on the three nodes and replicated; nodes 0 and 1 are lost together, and the
    resume reads node 1's shard back from node 2 (step 1 on disk is resumed: rank 0's has no holder left). A new
    run's rank 0 snapshots ``snap-3`` (node 0's replacement holds none) and the job is killed before the others
    save: node 0 holds rank 0 of the new run's save, nodes 1 and 2 ranks 1 and 2 of save 2, and the next resume
    loads those three as one checkpoint."""
    machine = _machine(aws)
    try:
        machine._save_all("disk", "step-1", False, None, False)
        machine._save_all("memory", "step-3", False, None, False)
        machine.node_is_lost(0, True, False)
        _snapshot_then_crash(machine, [0], "step-3", overwrite=False)
        _one_save(_resume(machine))
    finally:
        machine.job.kill()
        machine.w.close()


def test_a_lost_node_resumes_from_the_newest_snapshot_every_rank_can_read_back_past_a_newer_partial_one(
        aws: S3Server) -> None:
    """Found by the ``node_lost`` configuration: three nodes, one rank each, snapshots beside a disk checkpoint.

    Step 3's snapshot loses node 1's shard for good (nodes 1 and 2 lost together); the job resumes from step 1 on
    disk and snapshots step 2 again, replicated everywhere. Node 0 then holds two replicas of node 2's rank: step
    3's (left from before) and step 2's. When node 2 is lost, its replacement's ``ckptd.latest`` reads back only
    the newest replica that restores, step 3's, which node 1 does not hold; the ranks agree on what all of them
    hold and resume from step 1 on disk, though step 2 is whole across the surviving memory (nodes 0 and 1 hold
    their own shards, node 0 the replica of rank 2's). The issue asks for "the newest step complete across the
    surviving memory"."""
    machine = _machine(aws)
    try:
        machine._save_all("disk", "step-1", False, None, False)
        machine._save_all("memory", "step-2", False, None, False)
        machine._save_all("memory", "step-3", False, None, False)
        machine.node_is_lost(1, True, False)  # nodes 1 and 2: step 1 on disk is resumed
        machine._save_all("memory", "step-2", True, None, False)
        machine.node_is_lost(2, False, False)  # fails: resumed from step 1, where step 2 survives
        machine.settle()
    finally:
        machine.teardown()


def _tiers_machine(aws: S3Server, world: int = 1) -> TiersMachine:
    """The ``one_model`` configuration's machine, every rule on: node 0 runs ``world`` ranks, node 1 its buddy."""
    cfg = replace(CONFIGS["one_model"], awaiting_fixes=frozenset())
    machine = type("Machine_one_model", (TiersMachine,), {"s3": aws, "cfg": cfg})()
    machine.world, machine.form = world, "job"
    machine.job = machine._new_job()
    return machine


def _awaiting(case: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(configured("one_model").awaits(case),
                              reason=f"issue 38's {case} awaits its fix (stateful_world.AWAITING_ISSUE_38)")


@_awaiting("persist_outranks_newer")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["close", "kill", "drain"])
def test_a_snapshot_persisted_after_a_newer_checkpoint_committed_never_deletes_it(aws: S3Server, how: str) -> None:
    """Issue 38, case 2, as ``one_model`` finds it: snapshot ``snap-15`` (step 15, ``keep_last=1``), then disk save
    ``step-20`` (``keep_last=1``, acknowledged); the job closes, is killed, or node 0's daemon drains, and the
    daemon persists ``snap-15``: retention counts it as the newest and deletes ``step-20``."""
    machine = _tiers_machine(aws)
    try:
        machine.a_snapshot_then_a_newer_checkpoint_then_the_snapshot_persisted(how)
        machine.every_acknowledged_checkpoint_loads_as_saved()
        machine.every_tier_holds_what_the_model_says()
    finally:
        machine.teardown()


@_awaiting("replica_of_a_replaced_save")
@pytest.mark.timeout(300)
def test_a_restored_snapshot_rolled_back_by_the_next_run_leaves_no_replica_of_the_old_run(aws: S3Server) -> None:
    """Issue 38, case 3, as ``one_model`` finds it: run 1 snapshots ``snap-3`` (step 3, replicated); node 0 is lost
    and run 2 resumes from it (read back from the buddy); run 2 snapshots ``snap-3`` at step 2 with
    ``overwrite=True`` (replicated): the buddy lists both, run 1's step 3 and run 2's step 2, so the next loss of
    node 0 restores run 1's bytes."""
    machine = _tiers_machine(aws)
    try:
        machine._save_all("memory", "step-3", False, None, False)
        machine.the_origin_node_is_lost()
        path = machine.w.path("memory", "step-3")
        machine.a_snapshot_is_rolled_back_to_a_lower_step(Drawn(snapshot=(path, 3)), False)
        machine.every_tier_holds_what_the_model_says()
        machine.the_origin_node_is_lost()
    finally:
        machine.teardown()


@_awaiting("replicated_but_gone")
@pytest.mark.timeout(300)
def test_a_snapshot_whose_buddy_restarted_is_not_shown_replicated(aws: S3Server) -> None:
    """Issue 38, case 7, as ``one_model`` finds it: ``snap-3`` replicated, the buddy's daemon SIGKILLed and started
    again (its replicas gone); node 0 still shows ``snap-3`` replicated, and the buddy lists no replica of it."""
    machine = _tiers_machine(aws)
    try:
        machine.the_buddy_is_restarted("step-3")
        machine.every_tier_holds_what_the_model_says()
    finally:
        machine.teardown()


@_awaiting("paused_origin_calls_its_snapshot_lost")
@pytest.mark.timeout(300)
def test_an_origin_paused_while_its_buddy_drains_calls_nothing_lost(aws: S3Server) -> None:
    """Issue 38, case 5, as ``one_model`` finds it: ``snap-3`` replicated; node 0's daemon SIGSTOPped while its buddy
    drains (the buddy judges it gone and persists the replica), then continued and drained: its ``ckptd stop``
    exits 3, calling ``snap-3``, committed with the same bytes, lost."""
    machine = _tiers_machine(aws)
    try:
        machine.the_origin_is_paused_while_its_buddy_drains("step-3")
        machine.every_acknowledged_checkpoint_loads_as_saved()
    finally:
        machine.teardown()


@pytest.mark.timeout(300)
def test_a_snapshot_its_origin_dropped_as_older_than_the_disk_is_never_written_back_by_its_buddys_drain(
        aws: S3Server) -> None:
    """Found by the derandomized ``one_model`` run (4 x 10, its third sequence, at teardown): snapshot ``snap-15``
    (step 15, ``keep_last=1``, replicated) and disk save ``step-20`` (``keep_last=1``); node 0 drains and drops
    ``snap-15`` (``reason=older_than_disk``), while its buddy kept the replica. The next run saves ``step-2``
    (``keep_last=1``: ``step-20`` goes) and snapshots ``snap-3`` (``keep_last=1``). Both daemons drain; node 0
    exits first, persisting ``snap-3`` (``step-2`` goes); the buddy judged node 0 gone and persisted ``snap-15``,
    the directory's newest by step, whose ``keep_last=1`` deleted ``snap-3``: the second run's newest, lost. Node 0
    now tells its buddy to forget a snapshot it drops for good (``Forget``): the buddy holds no replica of
    ``snap-15`` once node 0 dropped it, and its drain writes nothing back. Node 1 is signalled once node 0 exited:
    the buddy's drain always finds its origin gone (in the stateful run both are signalled together, a race)."""
    machine = _tiers_machine(aws)
    try:
        machine.a_snapshot_then_a_newer_checkpoint_then_the_snapshot_persisted("drain")
        snap = machine.w.path("memory", "step-15")
        wait_until(lambda: snap not in _replicas(machine), 60,
                   lambda: f"the buddy still holds a replica of {snap}, which node 0 dropped: {_replicas(machine)}")
        machine.snapshots_and_checkpoints_of_one_directory_interleaved(
            [("disk", "step-2", False, 1), ("memory", "step-3", False, 1)])
        machine.every_acknowledged_checkpoint_loads_as_saved()
        machine.every_tier_holds_what_the_model_says()
        origin, buddy = machine.w.daemons
        signal_buddy = buddy.proc.send_signal

        def after_the_origin(sig: int) -> None:  # the drain rule signals node 0, then node 1
            origin.proc.wait(120)
            signal_buddy(sig)
        buddy.proc.send_signal = after_the_origin
        machine.daemon_is_stopped_and_restarted(False)
        assert not machine._persisted(snap), f"the buddy's drain wrote back {snap}, which its origin gave up"
        assert machine._persisted(machine.w.path("memory", "step-3")), "the second run's newest was lost"
        machine.every_acknowledged_checkpoint_loads_as_saved()
        machine.settle()
    finally:
        machine.teardown()


def _replicas(machine: CheckpointMachine) -> list[str]:
    """The complete replicas node 1 (the buddy) holds, by path."""
    return [r["path"] for r in machine._statuses()[1]["peers"]["replicas_held"]["held"] if r["complete"]]


def test_a_snapshot_restored_on_a_replacement_outlives_the_loss_of_the_peer_it_came_from_and_of_its_node_again(
        aws: S3Server) -> None:
    """Found by a new user, replayed on the ``node_lost`` machine: ``snap-3`` is held on the three nodes and
    replicated; node 1 is lost and its replacement reads its shard back from node 2 (``restored``); node 2 is lost
    next, taking that replica with it, and node 1 is lost once more. A restored snapshot was never sent on, so
    node 1's shard had no second copy and the last resume went back to disk: the machine's settle now waits until
    every ``restored`` snapshot has its copy on its buddy, and the resume must be the snapshot (its floor)."""
    machine = _machine(aws)
    try:
        machine._save_all("disk", "step-1", False, None, False)
        machine._save_all("memory", "step-3", False, None, False)
        machine.node_is_lost(1, False, False)
        machine.node_is_lost(2, False, False)
        path = machine.w.path("memory", "step-3")
        machine._wait_replication_settled()
        holdings = machine._holdings(2)
        assert {1} <= holdings.replicas.get(path, set()), "node 2's replacement holds no copy of node 1's shard"
        machine.node_is_lost(1, False, False)
        told = _resume(machine)
        assert {o["path"] for o in told.values()} == {path}, told
    finally:
        machine.job.kill()
        machine.w.close()
