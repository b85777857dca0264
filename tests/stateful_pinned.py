"""Stateful sequences that fail today, each pinning a defect the stateful test found, by hand (not in ``make test``:
the file is named so it is not collected; run it by name once the fix lands, then move it to
``tests/test_stateful.py``):

    .venv/bin/python -m pytest -q -n 0 --timeout=600 tests/stateful_pinned.py
"""

from __future__ import annotations

from s3server import S3Server

from stateful import CheckpointMachine
from stateful_world import CONFIGS


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
    machine = type("Machine_node_lost", (CheckpointMachine,),
                   {"s3": aws, "cfg": CONFIGS["node_lost"], "shadowing_allowed": False})()
    try:
        machine.world, machine.form = 3, "torchrun-c10d"
        machine.job = machine._new_job()
        machine._save_all("disk", "step-1", False, None, False)
        machine._save_all("memory", "step-2", False, None, False)
        machine._save_all("memory", "step-3", False, None, False)
        machine.node_is_lost(1, True, False)  # nodes 1 and 2: step 1 on disk is resumed
        machine._save_all("memory", "step-2", True, None, False)
        machine.node_is_lost(2, False, False)  # fails: resumed from step 1, where step 2 survives
        machine.settle()
    finally:
        machine.teardown()
