"""Cleanup never harms or holds up other saves, and a commit whose last fsync failed says what is true.

Real daemons with injected storage faults (``tests/faults.py``).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import ckptd
from helpers import wait_until


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


@pytest.mark.timeout(120)
def test_the_daemon_answers_while_a_checkpoint_directory_is_being_created(daemon_factory, client_factory, root,
                                                                           tmp_path) -> None:
    go = tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "touch", "match": "/held.incomplete/", "errno": 0, "wait_for": str(go)}])
    fut = client_factory().save_async({"w": torch.ones(10)}, root / "held")
    wait_until(lambda: "event=fault op=touch" in (daemon.run_dir / "ckptd.log").read_text(), 20,
               "the touch fault fired")
    status = daemon.status()  # the loop answers while admission's I/O is held on its worker
    assert [c["state"] for c in status["checkpoints"]] == ["preparing"]
    assert not fut.done()
    go.touch()
    assert fut.result(30).path == root / "held"
