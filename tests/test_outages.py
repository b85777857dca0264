"""Brief endpoint outages against a real daemon: the S3 server (moto, ``tests/s3server.py``) behind a TCP
proxy the test cuts and restores (``tests/proxy.py``), so connections fail the way a restarting endpoint's do."""

from __future__ import annotations

import signal

import pytest
import torch
from helpers import keys, seeded_state as state, wait_until
from proxy import TcpProxy

import ckptd
from ckptd.protocol.endpoint import LOG_NAME


@pytest.fixture
def proxy(s3, bucket, monkeypatch):
    """The endpoint as this process and the daemons it starts see it: through the proxy."""
    with TcpProxy("127.0.0.1", s3.port) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def test_a_stop_during_a_brief_outage_still_persists_a_memory_only_snapshot(proxy, bucket, daemon_factory,
                                                                           client_factory, run_dir) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}", "--drain-timeout", "60")
    client = client_factory()
    url = f"s3://{bucket}/run/step-5"
    client.save_async(state(seed=5), url, step=5, persist=False).result(30)  # held in memory only
    proxy.cut()
    log = run_dir / LOG_NAME
    try:
        daemon.proc.send_signal(signal.SIGTERM)  # the drain persists the snapshot: its first write fails
        wait_until(lambda: "event=persist_failed" in log.read_text(), timeout=60, what="a persist failed by the outage")
        assert daemon.proc.poll() is None  # still draining
    finally:
        proxy.restore()
    assert daemon.proc.wait(90) == 0
    assert ckptd.latest(f"s3://{bucket}/run") == url  # persisted: not lost with the daemon's memory
    loaded = ckptd.load(url)
    assert loaded["step"] == 5 and torch.equal(loaded["w"], state(seed=5)["w"])
    assert "event=persist_retry" in log.read_text()


def test_a_memory_snapshot_of_an_object_name_taken_while_the_store_is_away_is_held(proxy, bucket, daemon_factory,
                                                                                 client_factory, run_dir) -> None:
    """A snapshot of an ``s3://`` name asks the store whether the name is taken; a store that does not answer
    holds it up no more than a memory snapshot waits for a disk: it is held, and persisted once the store is back."""
    daemon = daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    url = f"s3://{bucket}/run/step-6"
    proxy.cut()
    try:
        client.save_async(state(seed=6), url, step=6, persist=False).result(60)
    finally:
        proxy.restore()
    assert "event=snapshot_unchecked" in (run_dir / LOG_NAME).read_text()
    assert client.persist(url) == url
    assert ckptd.load(url)["step"] == 6
    assert daemon.stop(60) == 0


def test_what_a_failed_save_wrote_is_removed_once_the_endpoint_is_back(proxy, s3, bucket, daemon_factory,
                                                                      client_factory, run_dir) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    rank0 = client_factory(rank=0, world_size=2, commit_timeout=2.0)
    url = f"s3://{bucket}/run/step-1"
    fut = rank0.save_async(state(seed=1), url, step=1)
    wait_until(lambda: "run/step-1/rank-00000-of-00002.safetensors" in keys(s3, bucket), what="rank 0's shard uploaded")
    proxy.cut()  # rank 1 never commits; the removal after the timeout meets the outage
    log = run_dir / LOG_NAME
    try:
        with pytest.raises(ckptd.RanksMissing):
            fut.result(60)
        wait_until(lambda: "event=discard_failed" in log.read_text(), timeout=60, what="the removal failed")
        assert keys(s3, bucket, "run/")  # the shard and the owner marker are still there
    finally:
        proxy.restore()
    wait_until(lambda: keys(s3, bucket, "run/") == [], timeout=60,
               what=lambda: f"run/ emptied once the endpoint is back, holds {keys(s3, bucket, 'run/')}")
    assert not s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads")
    rank0.close()
    client_factory().save_async(state(seed=2), url, step=2).result(30)  # the path is free again
    assert ckptd.load(url)["step"] == 2
    assert daemon.status()["daemon"]["pid"] == daemon.proc.pid


def test_a_daemon_killed_mid_save_leaves_nothing_in_the_bucket_after_the_next_start(s3, bucket, daemon_factory,
                                                                                   client_factory) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    rank0 = client_factory(rank=0, world_size=2)
    rank0.save_async(state(seed=1), f"s3://{bucket}/run/step-1", step=1)
    wait_until(lambda: "run/step-1/rank-00000-of-00002.safetensors" in keys(s3, bucket), what="rank 0's shard uploaded")
    assert any(".ckptd-owner-" in k for k in keys(s3, bucket, "run/step-1/"))
    daemon.proc.send_signal(signal.SIGKILL)
    assert daemon.proc.wait(10) == -signal.SIGKILL  # the crash happened: nothing removed what the save wrote
    assert keys(s3, bucket, "run/")
    daemon_factory("--root", f"s3://{bucket}")  # its start-up sweep finds the dead daemon's attempt
    wait_until(lambda: keys(s3, bucket, "run/") == [], timeout=60,
               what=lambda: f"run/ emptied by the start-up sweep, holds {keys(s3, bucket, 'run/')}")


def test_an_upload_cut_off_by_an_outage_fails_naming_the_outage_and_leaves_no_object(proxy, s3, bucket,
                                                                                   daemon_factory, client_factory,
                                                                                   run_dir) -> None:
    """The endpoint goes away while a shard's multipart upload runs: the save names the unreachable endpoint (not
    the library's failed abort request), and once it is back nothing of the save is left but those parts, which
    only a lifecycle rule can remove (the client library cannot abort an upload it no longer holds)."""
    daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/run/step-1"
    proxy.cut_after(40 << 20)  # mid-upload, at a point chosen rather than raced for: the upload was created and
    # answered (its parts follow the answer), so the library holds its id and tries to abort it. Waiting for the
    # upload to be listed and cutting then raced: its creation's answer could still be on its way (CI, under load)
    fut = client_factory().save_async({"w": torch.ones(96 * 2**18)}, url, step=1)  # 96 MiB: many parts
    try:
        error = fut.exception(120)
    finally:
        proxy.restore()
    assert proxy.resets > 0, "the outage never came: the upload was not cut off"
    assert isinstance(error, ckptd.WriteFailed), error
    assert "unreachable" in str(error) and "aborting its multipart upload failed" in str(error), str(error)
    assert "Error performing DELETE" not in str(error)
    wait_until(lambda: keys(s3, bucket, "run/") == [], timeout=60,
               what=lambda: f"run/ emptied once the endpoint is back, holds {keys(s3, bucket, 'run/')}")
    client_factory().save_async(state(seed=2), url, step=2).result(60)  # the path is free again
    assert ckptd.load(url)["step"] == 2

