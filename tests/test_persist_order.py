"""A persisted snapshot never outranks a checkpoint committed after it (issue 38, case 2).

A snapshot of step 15 held in memory, then a disk save of step 20 in the same
directory with ``keep_last=1``: however the snapshot reaches disk afterwards
(its trainer's ``close()``, an explicit ``persist``, a drain), step 20 stays
committed and ``latest``. Retention orders a directory by step (then by the
time a save was acknowledged), never by the time a persist happened to run.
"""

from __future__ import annotations

import pytest

import ckptd

from helpers import wait_until
from snapshots import full


def _held_then_saved(client, directory):
    client.save_async(full(15), directory / "step-15", step=15, persist=False, keep_last=1).result(30)
    client.save_async(full(20), directory / "step-20", step=20, keep_last=1).result(30)
    assert (directory / "step-20" / "ckptd.json").exists()


@pytest.mark.parametrize("how", ["close", "persist", "drain"])
def test_persisting_an_older_snapshot_never_deletes_a_newer_committed_checkpoint(how, daemon, client_factory, root,
                                                                                run_dir) -> None:
    directory = root / "run"
    client = client_factory()
    _held_then_saved(client, directory)
    if how == "close":
        client.close()
        wait_until(lambda: daemon.status()["clients"] == [], 30, "the client is gone")
    elif how == "persist":
        with pytest.raises(ckptd.CheckpointExists, match="step-20"):
            client.persist(directory / "step-15")
    assert daemon.stop(timeout=60) == 0
    assert (directory / "step-20" / "ckptd.json").exists(), sorted(p.name for p in directory.iterdir())
    assert ckptd.latest(directory) == directory / "step-20"
    assert ckptd.load(directory / "step-20")["w"].equal(full(20)["w"])
    assert not (directory / "step-15").exists()
    log = (run_dir / "ckptd.log").read_text()
    if how != "persist":
        assert f"event=snapshot_not_persisted path={directory / 'step-15'} step=15 reason=newer_on_disk" in log, log


def test_a_directory_kept_by_keep_spares_the_newer_checkpoint_when_an_older_snapshot_persists(
        daemon_factory, client_factory, root, run_dir) -> None:
    directory = root / "kept"
    directory.mkdir()
    daemon = daemon_factory("--keep", f"{directory}=1")
    client = client_factory()
    client.save_async(full(15), directory / "step-15", step=15, persist=False).result(30)
    client.save_async(full(20), directory / "step-20", step=20).result(30)
    client.close()
    assert daemon.stop(timeout=60) == 0
    assert sorted(p.name for p in directory.iterdir()) == ["step-20"]
