"""Retention around the mirror never deletes what it should keep: ``--mirror-keep`` counts only what is on the
store, and local retention deferred for an upload catches up after a restart, with the save's own ``keep_last``.
A real daemon uploading to a real S3 endpoint on localhost (moto's server, ``tests/s3server.py``)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from helpers import mirrored, seeded_state as state, wait_until

import ckptd
from ckptd.protocol.endpoint import LOG_NAME

pytestmark = pytest.mark.usefixtures("bucket")


def local(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir())


def saved_in_an_outage_then_killed(s3, daemon_factory, client_factory, args: tuple[str, ...], run: Path,
                                   steps: tuple[int, ...], keep_last: int | None = None):
    """Save ``run/step-N`` for ``steps`` in that order while the store is down, SIGKILL the daemon (proven by its
    exit status) before any upload, bring the store back and start a daemon with the same ``args``: returned."""
    daemon = daemon_factory(*args)
    client = client_factory()
    s3.stop()
    try:
        for step in steps:
            client.save_async(state(seed=step), run / f"step-{step}", step=step, keep_last=keep_last).result(30)
        client.close()
        daemon.proc.send_signal(signal.SIGKILL)
        assert daemon.proc.wait(10) == -signal.SIGKILL
        assert local(run) == sorted(f"step-{step}" for step in steps)  # none could be uploaded, none trimmed
    finally:
        s3.start()
    return daemon_factory(*args)


def mirrored_with_keep(root: Path, bucket: str, keep: int = 1) -> tuple[Path, Path, tuple[str, ...]]:
    """``run`` mirrored with ``--mirror-keep keep``, and ``other`` mirrored beside it (``mirror_has_run`` saves
    there): the two directories and the daemon's arguments."""
    run, other = root / "run", root / "other"
    run.mkdir()
    other.mkdir()
    return run, other, ("--mirror", f"{run}=s3://{bucket}/mirror", "--mirror", f"{other}=s3://{bucket}/other",
                        "--mirror-keep", str(keep))


def mirror_has_run(client, s3, bucket: str, other: Path, name: str) -> None:
    """Uploads run one at a time, each with the mirror's retention after it: once ``other/name`` (saved now,
    under the rule ``other=s3://bucket/other``) is on the store, all that was queued before it has run."""
    client.save_async(state(seed=2), other / name, step=2).result(30)
    wait_until(lambda: name in mirrored(s3, bucket, "other"), timeout=60, what=f"other/{name} on the mirror")


@pytest.mark.parametrize("keep", [1, 2])
def test_an_older_checkpoint_mirror_keep_skips_never_costs_the_store_a_newer_one(
        keep, s3, bucket, daemon_factory, client_factory, root, run_dir) -> None:
    """The skipped checkpoint is not on the store: it must not take one of the ``--mirror-keep`` places."""
    run, other, args = mirrored_with_keep(root, bucket, keep)
    daemon = daemon_factory(*args)
    client = client_factory()
    newer = [f"step-{10 * (i + 1)}" for i in range(keep)]
    for name in newer:
        client.save_async(state(seed=int(name[5:])), run / name, step=int(name[5:])).result(30)
    wait_until(lambda: mirrored(s3, bucket) == newer, timeout=60,
               what=lambda: f"{newer} on the mirror (status: {daemon.status()['mirror']})")
    client.save_async(state(seed=1), run / "step-1", step=1).result(30)  # older than the `keep` on the store
    wait_until(lambda: daemon.status()["mirror"]["skipped"] == 1, timeout=60, what="step-1 skipped")
    mirror_has_run(client, s3, bucket, other, "a")
    assert "reason=older_than_mirror_keep" in (run_dir / LOG_NAME).read_text()
    assert mirrored(s3, bucket) == newer
    assert torch.equal(ckptd.load(f"s3://{bucket}/mirror/{newer[-1]}")["w"], state(seed=int(newer[-1][5:]))["w"])
    assert local(run) == ["step-1", *newer]  # no local retention asked for


def test_a_restart_that_uploads_the_newest_first_leaves_it_on_the_mirror(s3, bucket, daemon_factory,
                                                                        client_factory, root) -> None:
    """After an outage the queued uploads need not go in step order (here the restart's scan queues both at once,
    and step-10 goes first): the older one, skipped, must not cost the store the newer one."""
    run, other, args = mirrored_with_keep(root, bucket)
    daemon = saved_in_an_outage_then_killed(s3, daemon_factory, client_factory, args, run, (9, 10))
    wait_until(lambda: daemon.status()["mirror"]["skipped"] == 1, timeout=60,
               what=lambda: f"step-9 skipped (status: {daemon.status()['mirror']})")
    mirror_has_run(client_factory(), s3, bucket, other, "a")
    assert "reason=older_than_mirror_keep" in (daemon.run_dir / LOG_NAME).read_text()
    assert mirrored(s3, bucket) == ["step-10"]
    assert ckptd.load(f"s3://{bucket}/mirror/step-10")["step"] == 10


@pytest.mark.parametrize("rule", [(), ("--keep", "{run}=3")], ids=["no_keep_rule", "keep_rule_of_3"])
def test_keep_last_trims_local_copies_once_a_restart_has_uploaded_them(rule, s3, bucket, daemon_factory,
                                                                      client_factory, root) -> None:
    """The saves asked ``keep_last=2``; the daemon that took them died before the store came back. Its restart
    uploads them and then trims as those saves asked (over the directory's ``--keep``, as it would have)."""
    run = root / "run"
    run.mkdir()
    args = ("--mirror", f"{run}=s3://{bucket}/mirror", *(a.format(run=run) for a in rule))
    daemon = saved_in_an_outage_then_killed(s3, daemon_factory, client_factory, args, run, (1, 2, 3, 4), keep_last=2)
    wait_until(lambda: mirrored(s3, bucket) == ["step-1", "step-2", "step-3", "step-4"], timeout=90,
               what=lambda: f"all four on the mirror (status: {daemon.status()['mirror']})")
    wait_until(lambda: local(run) == ["step-3", "step-4"], timeout=60,
               what=lambda: f"keep_last=2 applied after the restart's uploads, not {local(run)}")
    assert ckptd.load(run / "step-4")["step"] == 4


def test_mirror_keep_trims_an_older_step_saved_after_the_newest_once_both_are_on_the_store(
        s3, bucket, daemon_factory, client_factory, root) -> None:
    """Saved during an outage, ``step-3`` then ``step-2`` (a rollback: created later, older by step), and the
    daemon killed: its restart uploads ``step-2`` first (the scan queues both at once) and ``step-3`` after.
    ``--mirror-keep 1`` keeps ``step-3``, the newest in retention's order, and deletes ``step-2`` however late it
    was created (it was kept for good when the store's retention spared checkpoints created after the newest)."""
    run, other, args = mirrored_with_keep(root, bucket)
    daemon = saved_in_an_outage_then_killed(s3, daemon_factory, client_factory, args, run, (3, 2))
    wait_until(lambda: daemon.status()["mirror"]["uploaded"] == 2, timeout=90,
               what=lambda: f"both uploaded (status: {daemon.status()['mirror']})")
    mirror_has_run(client_factory(), s3, bucket, other, "a")
    assert mirrored(s3, bucket) == ["step-3"]
    assert ckptd.load(f"s3://{bucket}/mirror/step-3")["step"] == 3


def test_keep_last_deferred_for_the_mirror_keeps_the_rollback_its_commit_kept(s3, bucket, daemon_factory,
                                                                              client_factory, root) -> None:
    """``step-3`` then ``step-2`` (a rollback) saved with ``keep_last=1`` during an outage: ``step-2``'s commit
    keeps ``step-2`` and would delete ``step-3``, which waits for the mirror. Once a restart has uploaded both,
    the deferred retention is that commit's: ``step-3`` goes locally (it is on the mirror), ``step-2`` stays."""
    run = root / "run"
    run.mkdir()
    args = ("--mirror", f"{run}=s3://{bucket}/mirror")
    daemon = saved_in_an_outage_then_killed(s3, daemon_factory, client_factory, args, run, (3, 2), keep_last=1)
    wait_until(lambda: mirrored(s3, bucket) == ["step-2", "step-3"], timeout=90,
               what=lambda: f"both on the mirror (status: {daemon.status()['mirror']})")
    wait_until(lambda: local(run) == ["step-2"], timeout=60,
               what=lambda: f"keep_last=1 of step-2's save applied after the uploads, not {local(run)}")
    assert ckptd.load(run / "step-2")["step"] == 2
