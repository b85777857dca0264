"""Every pool completion has a failure path to whoever waits: a defect injected into the loop-thread completion of
each kind of work (``tests/faults.py``'s ``then``, by pool: a status, a stream to the buddy, the buddy's offer and
fetch, a restore) is answered as an error at once, never left to a timeout, and the daemon goes on serving.

Each fault is armed by a file only once what must pass before it has passed, and each test reads the daemon's log
for the fault's own line, so none can pass without its fault firing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.protocol.endpoint import LOG_NAME
from test_peers import _pair, _replace_origin

LOG = LOG_NAME


def _defect(pool: str, arm: Path) -> list[dict]:
    """A defect in the completion of every piece of ``pool``'s work once ``arm`` exists."""
    return [{"op": "then", "match": pool, "exact": True, "armed_by": str(arm)}]


def _fired(run_dir: Path, pool: str) -> bool:
    return f"event=fault op=then after=False action=defect path={pool}\n" in (run_dir / LOG).read_text()


@pytest.mark.timeout(120)
def test_a_defect_in_a_status_completion_is_an_error_reply_and_the_next_status_is_answered(daemon_factory,
                                                                                           root) -> None:
    arm = root.parent / "arm-status"
    daemon = daemon_factory(faults=_defect("status", arm))
    arm.touch()
    failed = daemon.cli("status")
    assert failed.returncode != 0 and "internal error" in failed.stderr, failed.stderr
    assert _fired(daemon.run_dir, "status")
    arm.unlink()
    assert daemon.status()["daemon"]["pid"] == daemon.proc.pid  # it went on serving


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["origin-stream", "buddy-offer"])
def test_a_defect_in_replications_completions_fails_the_copy_at_once_and_the_next_one_goes(root, tmp_path,
                                                                                            where) -> None:
    """``origin-stream``: the completion of the origin's stream to its buddy (the ``peer`` pool); ``buddy-offer``:
    the completion of the buddy's work on the offer (the ``replica`` pool). ``wait_replicated`` raises saying the
    copy failed, within the peer timeout (the test's 60 s is far above it), and once disarmed the next snapshot
    is replicated."""
    arm = tmp_path / "arm"
    pool = "peer" if where == "origin-stream" else "replica"
    faults = _defect(pool, arm)
    pair = _pair(root, tmp_path, origin_faults=faults if where == "origin-stream" else None,
                 buddy_faults=faults if where == "buddy-offer" else None)
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        arm.touch()
        fut = client.save_async({"w": torch.ones(50_000)}, root / "run" / "s-1", step=1, persist=False)
        fut.result(60)
        with pytest.raises(ckptd.InvalidCheckpoint, match="not replicated"):
            fut.wait_replicated(60)
        assert _fired(pair.origin_dir if where == "origin-stream" else pair.buddy_dir, pool)
        arm.unlink()
        client.save_async({"w": torch.full((50_000,), 2.0)}, root / "run" / "s-2", step=2,
                          persist=False).wait_replicated(60)
        client.close()
        for daemon in (pair.origin, pair.buddy):
            assert daemon.proc.poll() is None
    finally:
        pair.kill()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["buddy-fetch", "replacement-restore"])
def test_a_defect_in_a_restores_completions_fails_that_restore_at_once_and_a_retry_restores(root, tmp_path,
                                                                                            where) -> None:
    """``buddy-fetch``: the completion of the buddy's work on a fetch (``replica`` pool, armed after the copy is
    held); ``replacement-restore``: that of the replacement node's own restore (``peer_ask`` pool, its listing
    and its read-back). ``latest()`` on the replacement finds nothing it can read back (no disk copy) rather
    than hanging; disarmed, the next ``latest()`` restores the snapshot bitwise."""
    arm = tmp_path / "arm"
    state = {"w": torch.randn(50_000)}
    path = root / "run" / "s-1"
    pair = _pair(root, tmp_path, buddy_faults=_defect("replica", arm) if where == "buddy-fetch" else None)
    try:
        client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
        client.save_async(state, path, step=1, persist=False).wait_replicated(60)
        client.close()
        faults = _defect("peer_ask", arm) if where == "replacement-restore" else None
        new_dir = _replace_origin(pair, faults=faults)
        arm.touch()
        assert ckptd.latest(root / "run", run_dir=new_dir) is None
        assert _fired(pair.buddy_dir if where == "buddy-fetch" else new_dir,
                      "replica" if where == "buddy-fetch" else "peer_ask")
        arm.unlink()
        assert ckptd.latest(root / "run", run_dir=new_dir) == path
        assert torch.equal(ckptd.load(path, run_dir=new_dir)["w"], state["w"])
    finally:
        pair.kill()
