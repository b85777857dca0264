"""On an object store an attempt's ``p.incomplete`` is ``p``'s own prefix: cleaning up an attempt never removes ``p``.

A store has no rename, so ``p.incomplete`` and ``p`` name one prefix
(``ckptd/storage/store.py``). Every cleanup of a failed or abandoned
attempt (a refused save's Abort, a failed attempt set aside, the last daemon
letting go of a dead run's attempt, a start's sweep) removes that prefix; when
``p`` is a committed checkpoint (its index is there), removing it would delete
a checkpoint that was acknowledged. Found by the stateful test (``dcp``: a
``dcp.save`` to an ``s3://`` path already committed was refused, as the store
never replaces, and the committed checkpoint was gone after it). Real daemon,
real ranks, moto's S3 server.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from helpers import seeded_state as state

import ckptd
from ckptd.dcp import StorageWriter
from ckptd.protocol.index import INDEX_NAME


def _keys(s3, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", []))


@pytest.mark.timeout(300)
def test_a_dcp_save_refused_on_a_committed_s3_checkpoint_leaves_that_checkpoint_whole(
        s3, bucket, daemon_factory, client_factory) -> None:
    """``dcp.save`` to an ``s3://`` path that holds a checkpoint is refused (a store never replaces in place), and
    the writer's Abort after the refusal must fail only its own attempt: the committed checkpoint stays, every
    object of it, and loads as saved."""
    daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    url = f"s3://{bucket}/run/step-1"
    saved = state(seed=1)
    client.save_async(saved, url, step=1).result(60)
    before = _keys(s3, bucket)
    assert f"run/step-1/{INDEX_NAME}" in before
    with pytest.raises(CheckpointException, match="a save does not replace a checkpoint"):
        dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=StorageWriter(url, client=client))
    assert _keys(s3, bucket) == before, "the refused save's cleanup removed objects of the committed checkpoint"
    loaded = ckptd.load(url)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved
                                                 if isinstance(saved[k], torch.Tensor))
