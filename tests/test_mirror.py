"""Mirror uploads survive a stop and a crash, and local retention never deletes what the mirror lacks:
a real daemon uploading to a real S3 endpoint on localhost (moto's server, ``tests/s3server.py``)."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import keys, mirrored, seeded_state as state, wait_until

from ckptd.storage.backends import Backends
from ckptd.storage.store import ObjectStorage
from ckptd.upkeep.mirror import Mirrors
from ckptd.protocol.endpoint import LOG_NAME
from ckptd.storage.contract import LocalStorage

import ckptd

pytestmark = pytest.mark.usefixtures("bucket")


def retention_has_run(client, root: Path) -> None:
    """Retention runs in order on one maintenance thread: once this later pair's retention has deleted
    other/a, every retention asked for before it has run too."""
    (root / "other").mkdir(exist_ok=True)
    client.save_async(state(), root / "other" / "a", step=1).result(30)
    client.save_async(state(), root / "other" / "b", step=2, keep_last=1).result(30)
    wait_until(lambda: not (root / "other" / "a").exists(), what="retention in other/")


def test_uploads_cut_off_by_a_crash_are_resumed_at_the_next_start_and_kept_locally_until_then(
        s3, bucket, daemon_factory, client_factory, root) -> None:
    run = root / "run"
    run.mkdir()
    args = ("--mirror", f"{run}=s3://{bucket}/mirror", "--keep", f"{run}=1")
    daemon = daemon_factory(*args)
    client = client_factory()
    s3.stop()
    try:
        for step in (1, 2):
            client.save_async(state(seed=step), run / f"step-{step}", step=step).result(30)
        wait_until(lambda: daemon.status()["mirror"]["retries"] >= 1, timeout=60, what="a failed upload attempt")
        client.close()
        daemon.proc.send_signal(signal.SIGKILL)
        assert daemon.proc.wait(10) == -signal.SIGKILL  # the crash happened
        daemon = daemon_factory(*args)
        client = client_factory()
        client.save_async(state(seed=3), run / "step-3", step=3).result(30)  # --keep 1: wants only step-3
        retention_has_run(client, root)
        assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-2", "step-3"]  # none of them is uploaded
        queued = lambda: {Path(u["source"]).name for u in daemon.status()["mirror"]["uploads"]}  # noqa: E731
        # the restart's scan asks the (stopped) store about each checkpoint it finds before it queues it
        wait_until(lambda: queued() == {"step-1", "step-2", "step-3"}, timeout=60,
                   what=lambda: f"all three queued for upload, not {queued()}")
    finally:
        s3.start()
    wait_until(lambda: mirrored(s3, bucket) == ["step-1", "step-2", "step-3"], timeout=60,
               what=lambda: f"all three on the mirror (status: {daemon.status()['mirror']})")
    assert ckptd.load(f"s3://{bucket}/mirror/step-1")["step"] == 1
    # once they are on the mirror, local retention catches up without waiting for another save
    wait_until(lambda: sorted(p.name for p in run.iterdir()) == ["step-3"], what="local retention after the uploads")


def test_a_stop_finishes_the_queued_uploads(s3, bucket, daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory("--mirror", f"{root}=s3://{bucket}/mirror")
    client = client_factory()
    for step in (1, 2, 3, 4):
        client.save_async(state(4 * 2**20, step), root / f"step-{step}", step=step).result(30)  # 16 MiB each
    client.close()
    assert daemon.stop(120) == 0  # SIGTERM right after the commits: the uploads are queued or running
    assert mirrored(s3, bucket) == ["step-1", "step-2", "step-3", "step-4"]


def test_a_stop_with_a_stalled_endpoint_leaves_the_uploads_and_store_requests_at_the_drain_deadline(
        bucket, daemon_factory, client_factory, root, run_dir, monkeypatch) -> None:
    stalled = socket.create_server(("127.0.0.1", 0), backlog=64)  # connects, never answers (a stopped endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{stalled.getsockname()[1]}")
    run = root / "run"
    run.mkdir()
    try:
        daemon = daemon_factory("--mirror", f"{run}=s3://{bucket}/mirror", "--drain-timeout", "1")
        client = client_factory()
        for step in (1, 2):  # keep_last: retention asks the (stalled) store what the mirror holds
            client.save_async(state(seed=step), run / f"step-{step}", step=step, keep_last=1).result(30)
        wait_until(lambda: any(u["state"] == "uploading" for u in daemon.status()["mirror"]["uploads"]),
                   what="an upload waiting on the stalled endpoint")
        client.close()
        # each request to the stalled endpoint waits out a 30 s timeout: the stop must not wait for them
        assert daemon.stop(25) == 0
    finally:
        stalled.close()
    log = (run_dir / LOG_NAME).read_text()
    assert "event=exit" in log and "event=mirrored" not in log
    [left] = [line for line in log.splitlines() if "event=mirror_left" in line]
    assert "count=2" in left and str(run / "step-1") in left and str(run / "step-2") in left
    assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-2"]  # neither is on the mirror


class HeldRemovals(ObjectStorage):
    """The store's objects, whose removals wait until the test lets them go on."""

    def __init__(self) -> None:
        self.reached, self.go_on = threading.Event(), threading.Event()

    def remove_tree(self, path: Path) -> None:
        self.reached.set()
        self.go_on.wait(60)
        super().remove_tree(path)


def test_a_stop_lists_as_left_only_the_uploads_not_done(s3, bucket, daemon, client_factory, root, caplog) -> None:
    run = root / "run"
    run.mkdir()
    client = client_factory()
    for step in (1, 2):
        client.save_async(state(seed=step), run / f"step-{step}", step=step).result(30)
    storage = HeldRemovals()
    mirrors = Mirrors(Backends(LocalStorage(), storage), {run: Path(f"s3://{bucket}/mirror")}, keep=1)
    mirrors.start()  # queues both; the mirror's retention after step-2's upload holds (deleting step-1)
    try:
        assert storage.reached.wait(60)
        with caplog.at_level(logging.INFO, logger="ckptd"):
            mirrors.close()
    finally:
        storage.go_on.set()
    assert [r.getMessage() for r in caplog.records if "event=mirror_left" in r.getMessage()] == []
    wait_until(lambda: mirrored(s3, bucket) == ["step-2"], what="the mirror's retention, let go on")


def test_a_permanently_failed_upload_is_shown_at_once_and_its_checkpoint_never_deleted(
        s3, bucket, daemon_factory, client_factory, root) -> None:
    run = root / "run"
    run.mkdir()
    missing = bucket
    daemon = daemon_factory("--mirror", f"{run}=s3://{missing}/e", "--keep", f"{run}=1")
    s3.client().delete_bucket(Bucket=missing)  # gone after the start (which checks it)
    client = client_factory()
    client.save_async(state(seed=1), run / "step-1", step=1).result(30)
    wait_until(lambda: daemon.status()["mirror"]["failed"] == 1, timeout=60, what="the upload failed for good")
    mirror = daemon.status()["mirror"]
    assert mirror["retries"] == 0  # a missing bucket is not retried
    [failed] = mirror["unmirrored"]
    assert failed["attempts"] == 1 and f"bucket '{missing}' does not exist" in failed["error"]
    client.save_async(state(seed=2), run / "step-2", step=2).result(30)
    retention_has_run(client, root)
    assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-2"]
    shown = daemon.cli("status").stdout
    assert "UNMIRRORED" in shown and "step-1" in shown and "does not exist" in shown


@pytest.mark.parametrize("args, error", [
    (("--mirror-keep", "2"), "without --mirror"),
    (("--mirror", "{root}/nowhere=s3://b/m"), "no such directory"),
    (("--mirror", "{root}=s3://b/m", "--mirror", "{root}/../ckpts=s3://b/n"), "one directory twice"),
    (("--mirror", "{root}=s3://b/mx", "--mirror", "{root}/a=s3://b/mx"), "one prefix holds the other"),
    (("--mirror", "{root}=s3://b/mx", "--mirror", "{root}/a=s3://b/mx/a"), "one prefix holds the other"),
    (("--mirror", "{root}=s3://b"), "not its root"),
    (("--mirror", "{root}=s3://b/"), "not its root"),
    (("--mirror", "{outside}=s3://b/m"), "outside every --root"),
])
def test_start_refuses_a_mirror_it_cannot_serve(args, error, root, run_dir) -> None:
    (root / "a").mkdir()
    done = subprocess.run([sys.executable, "-m", "ckptd", "start", "--foreground", "--run-dir", str(run_dir),
                           "--root", str(root), *(a.format(root=root, outside=run_dir) for a in args)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and error in done.stderr, done.stderr


def test_a_checkpoint_saved_again_is_never_deleted_locally_before_its_new_version_is_on_the_mirror(
        s3, bucket, daemon_factory, client_factory, root) -> None:
    run = root / "run"
    run.mkdir()
    daemon = daemon_factory("--mirror", f"{run}=s3://{bucket}/mirror", "--keep", f"{run}=2")
    client = client_factory()
    for step in (1, 2, 3):
        client.save_async(state(seed=step), run / f"step-{step}", step=step).result(30)
    wait_until(lambda: daemon.status()["mirror"]["uploaded"] == 3, timeout=60, what="three uploads")
    s3.stop()  # the new versions cannot reach the mirror: only the local copies hold them
    try:
        for step in (2, 3):
            client.save_async(state(seed=10 + step), run / f"step-{step}", step=step, overwrite=True).result(30)
        for step in (4, 5):
            client.save_async(state(seed=step), run / f"step-{step}", step=step).result(30)
        retention_has_run(client, root)
        assert {"step-2", "step-3"} <= {p.name for p in run.iterdir()}
        assert ckptd.load(run / "step-2")["step"] == 12
    finally:
        s3.start()
    for step in (2, 3):  # the new version replaced the old one on the mirror
        wait_until(lambda: _value_at(f"s3://{bucket}/mirror/step-{step}", "step") == 10 + step, timeout=90,
                   what=lambda: f"the new step-{step} on the mirror (status: {daemon.status()['mirror']})")
        loaded = ckptd.load(f"s3://{bucket}/mirror/step-{step}")
        assert torch.equal(loaded["w"], state(seed=10 + step)["w"])
    assert keys(s3, bucket, "mirror/step-2/") == ["mirror/step-2/ckptd.json",
                                                 "mirror/step-2/rank-00000-of-00001.safetensors"]
    wait_until(lambda: sorted(p.name for p in run.iterdir()) == ["step-4", "step-5"], timeout=60,
               what="local retention once everything is on the mirror")


def test_the_lightning_plugin_s_last_ckpt_on_the_mirror_follows_each_save(
        s3, bucket, daemon_factory, root) -> None:
    from ckptd.integrations.lightning import CkptdCheckpointIO

    run = root / "run"
    run.mkdir()
    daemon = daemon_factory("--mirror", f"{run}=s3://{bucket}/mirror")
    io = CkptdCheckpointIO(run_dir=daemon.run_dir, spawn=False, timeout=10.0)
    url = f"s3://{bucket}/mirror/last.ckpt"
    try:
        for step in (1, 2, 3):  # ModelCheckpoint(save_last=True) saves last.ckpt again at each epoch
            io.save_checkpoint({"global_step": step, "w": torch.full((1000,), float(step))}, run / "last.ckpt")
            wait_until(lambda: _value_at(url, "global_step") == step, timeout=60,
                       what=lambda: f"last.ckpt of step {step} on the mirror (status: {daemon.status()['mirror']})")
    finally:
        io.teardown()
    restored = io.load_checkpoint(run / "last.ckpt")
    assert torch.equal(ckptd.load(url)["w"], restored["w"]) and restored["global_step"] == 3
    assert daemon.status()["mirror"]["failed"] == 0


def _value_at(url: str, key: str) -> int | None:
    """``key`` of the checkpoint at ``url``, or None while there is none (an upload replacing it)."""
    try:
        return ckptd.load(url)[key]
    except (FileNotFoundError, ckptd.InvalidCheckpoint):
        return None


def test_keep_last_trims_local_copies_once_they_are_uploaded(s3, bucket, daemon_factory, client_factory,
                                                             root) -> None:
    run = root / "run"
    run.mkdir()
    daemon = daemon_factory("--mirror", f"{run}=s3://{bucket}/mirror")
    client = client_factory()
    s3.stop()
    try:
        for step in (1, 2, 3):
            client.save_async(state(seed=step), run / f"step-{step}", step=step, keep_last=1).result(30)
        retention_has_run(client, root)
        assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-2", "step-3"]  # none is uploaded
    finally:
        s3.start()
    wait_until(lambda: mirrored(s3, bucket) == ["step-1", "step-2", "step-3"], timeout=90,
               what=lambda: f"all three on the mirror (status: {daemon.status()['mirror']})")
    wait_until(lambda: sorted(p.name for p in run.iterdir()) == ["step-3"], timeout=60,
               what="keep_last=1 applied once the uploads are done")


def test_a_restart_does_not_upload_again_what_mirror_keep_deleted(s3, bucket, daemon_factory, client_factory,
                                                                 root, run_dir) -> None:
    run = root / "run"
    run.mkdir()
    args = ("--mirror", f"{run}=s3://{bucket}/mirror", "--mirror-keep", "1")
    daemon = daemon_factory(*args)
    client = client_factory()
    for step in (1, 2, 3):
        client.save_async(state(seed=step), run / f"step-{step}", step=step).result(30)
    wait_until(lambda: daemon.status()["mirror"]["uploads"] == [] and mirrored(s3, bucket) == ["step-3"],
               timeout=60, what=lambda: f"the uploads and --mirror-keep 1 (status: {daemon.status()['mirror']})")
    client.close()
    assert daemon.stop(60) == 0
    daemon = daemon_factory(*args)
    client = client_factory()
    client.save_async(state(seed=4), run / "step-4", step=4).result(30)
    wait_until(lambda: daemon.status()["mirror"]["uploads"] == [] and mirrored(s3, bucket) == ["step-4"],
               timeout=60, what=lambda: f"step-4 on the mirror (status: {daemon.status()['mirror']})")
    assert daemon.status()["mirror"]["uploaded"] == 1  # step-1 and step-2 were not uploaded again
    assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-2", "step-3", "step-4"]  # no local --keep


def test_a_checkpoint_deleted_before_its_upload_is_skipped_not_reported_unmirrored(s3, bucket, daemon_factory,
                                                                                   client_factory, root) -> None:
    """ModelCheckpoint's top-k deletes checkpoints as it goes: one gone before its turn needs no upload."""
    run = root / "run"
    run.mkdir()
    daemon = daemon_factory("--mirror", f"{run}=s3://{bucket}/mirror")
    client = client_factory()
    s3.stop()  # the uploads wait for the store
    try:
        client.save_async(state(seed=1), run / "step-1", step=1).result(30)
        wait_until(lambda: daemon.status()["mirror"]["retries"] >= 1, timeout=60, what="a failed upload attempt")
        shutil.rmtree(run / "step-1")  # the user's own retention (a committed checkpoint holds only ckptd's files)
    finally:
        s3.start()
    wait_until(lambda: daemon.status()["mirror"]["skipped"] == 1, timeout=90,
               what=lambda: f"the deleted checkpoint skipped (status: {daemon.status()['mirror']})")
    mirror = daemon.status()["mirror"]
    assert mirror["failed"] == 0 and mirror["unmirrored"] == [] and mirror["uploads"] == []
    assert "reason=deleted_locally" in (daemon.run_dir / LOG_NAME).read_text()
