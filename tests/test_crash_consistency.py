"""A daemon that dies at any point of a save leaves nothing half-visible, and the node recovers.

The daemon is started with a ``kill`` fault (``CKPTD_FAULTS``, read by
``tests/faults.py``, the storage loaded with ``--storage``): it SIGKILLs itself at exactly one point of the commit sequence
(shard write, shard fsync, index write, directory fsync, rename), of an
overwrite (marking the old checkpoint, the exchange, removing the old one) or
of retention (marking the victim, renaming it aside, removing it). Each test
first proves the daemon died there: exit by SIGKILL, and the fault's
``event=fault`` log line names the call. Whatever the point, the checkpoint path is either absent or a whole, loadable
checkpoint; checkpoints committed before are bitwise intact; a daemon
restarted on the same run directory sweeps the dead one's leftovers and the
same client (``spawn=False``) saves again.

Also here: how a client sees its daemon die or freeze (pending futures fail
in bounded time, ``save_async`` never blocks forever, ``spawn=True``
respawns), and disks that fail or fill up (injected ENOSPC/EIO, and a real
tmpfs that runs out of space in the middle of a write).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

import ckptd

from crashes import KILL_POINTS, NAME, assert_whole, digests, leftovers, make_state
from helpers import MiB, status, tmpfs, wait_until

CHUNK = 8 * 2**20
"""The daemon's write size: a shard bigger than this is written in several calls."""


# -- helpers -------------------------------------------------------------------


def assert_killed_at(daemon, fault: dict) -> None:
    """The daemon died of SIGKILL, and its log shows the injected fault that killed it."""
    assert daemon.proc.wait(30) == -signal.SIGKILL, "the daemon did not die of SIGKILL"
    lines = [line for line in (daemon.run_dir / "ckptd.log").read_text().splitlines() if "event=fault " in line]
    assert lines, "the daemon died, but no injected fault acted"
    last = lines[-1]
    want = f"op={fault['op']} after={fault.get('after', False)} action=kill"
    assert want in last and fault["match"] in last.partition(" path=")[2], (
        f"the daemon died at another call than {want} on {fault['match']!r}: {last}")


def killer(daemon_factory, client_factory, fault: dict):
    """A daemon that SIGKILLs itself at ``fault``, and a client that notices its death quickly."""
    return daemon_factory(faults=[{**fault, "kill": True, "errno": 0}]), client_factory(heartbeat=0.2, timeout=5.0)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# -- kill points ------------------------------------------------------------

# The kill points of a save are in crashes.py (KILL_POINTS), shared with the soak variant.


@pytest.mark.timeout(90)
@pytest.mark.parametrize("point,fault,outcome", KILL_POINTS, ids=[k[0] for k in KILL_POINTS])
def test_a_daemon_killed_at_any_point_of_a_save_leaves_the_path_absent_or_whole_and_a_restart_recovers(
    daemon_factory, client_factory, root, point, fault, outcome
) -> None:
    daemon, client = killer(daemon_factory, client_factory, fault)
    earlier = make_state(1)
    client.save_async(earlier, root / "earlier", step=1).result(30)
    earlier_bytes = digests(root / "earlier")

    doomed = make_state(2, mib=24)  # three write calls: "mid-shard" is after the first
    assert doomed["model"]["w"].nbytes > 2 * CHUNK
    fut = client.save_async(doomed, root / NAME, step=2)
    assert_killed_at(daemon, fault)
    # the pending save fails because the client saw the death, not after its 5 s silence timeout
    with pytest.raises(ckptd.DaemonUnavailable, match="died"):
        fut.result(15)

    # on disk: never a final directory that fails to load
    final = root / NAME
    if outcome == "absent":
        assert not final.exists(), f"killed at {point}, {final} appeared"
    else:
        assert_whole(final, {0: doomed})
    assert ckptd.latest(root) in (root / "earlier", final)
    assert digests(root / "earlier") == earlier_bytes, "a committed checkpoint changed"
    assert_whole(root / "earlier", {0: earlier})

    # restart on the same run dir: the same client reconnects by itself
    daemon_factory()
    later = make_state(3)
    client.save_async(later, root / "after-restart", step=3).result(30)
    assert_whole(root / "after-restart", {0: later})
    wait_until(lambda: not leftovers(root), 60,
               lambda: f"the start-up sweep removes the dead daemon's leftovers; still there: {leftovers(root)}")
    # and the save that was cut short can be made again
    retry = make_state(4)
    client.save_async(retry, final, step=4, overwrite=final.exists()).result(30)
    assert_whole(final, {0: retry})
    assert sorted(p.name for p in root.iterdir()) == sorted(["earlier", "after-restart", NAME])


# An overwrite marks the old checkpoint as this daemon's (touch of an owner
# marker in <root>/ckpt-under-fire), swaps old and new in one exchange (its
# path is the final name), fsyncs the parent and removes the old one (now at
# <root>/ckpt-under-fire.incomplete).
OVERWRITE_KILL_POINTS = [
    ("after-old-marked", {"op": "touch", "match": f"/{NAME}/.ckptd-owner-", "after": True}, 5),
    ("before-exchange", {"op": "exchange", "match": f"/{NAME}"}, 5),
    ("after-exchange", {"op": "exchange", "match": f"/{NAME}", "after": True}, 6),
    ("while-removing-the-old", {"op": "remove_tree", "match": f"/{NAME}.incomplete"}, 6),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point,fault,step", OVERWRITE_KILL_POINTS, ids=[k[0] for k in OVERWRITE_KILL_POINTS])
def test_a_daemon_killed_while_overwriting_leaves_the_old_or_the_new_checkpoint_loadable_at_the_path(
    daemon_factory, client_factory, root, point, fault, step
) -> None:
    daemon, client = killer(daemon_factory, client_factory, fault)
    old, new = make_state(5), make_state(6)
    client.save_async(old, root / NAME, step=5).result(30)
    fut = client.save_async(new, root / NAME, step=6, overwrite=True)
    assert_killed_at(daemon, fault)
    with pytest.raises(ckptd.DaemonUnavailable):
        fut.result(15)
    final = root / NAME
    on_disk = sorted(p.name for p in root.iterdir())
    assert final.is_dir(), f"killed {point} of an overwrite, {final} is gone ({on_disk})"
    assert ckptd.read_index(final).step == step, f"killed {point}, the path holds step {ckptd.read_index(final).step}"
    assert_whole(final, {0: old if step == 5 else new})
    assert ckptd.latest(root) == final

    daemon_factory()
    wait_until(lambda: not leftovers(root) and not markers(final), 60,
               lambda: f"the start-up sweep removes the dead daemon's leftovers; still there: "
                       f"{leftovers(root)}, markers {markers(final)}")
    newer = make_state(7)
    client.save_async(newer, root / NAME, step=7, overwrite=True).result(30)
    assert_whole(final, {0: newer})


def markers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith(".ckptd-owner-"))


# Retention marks each victim (touch of an owner marker), renames it aside to
# <name>.deleting.incomplete, then removes that.
RETENTION_KILL_POINTS = [
    ("after-victim-marked", {"op": "touch", "match": "/step-1/.ckptd-owner-", "after": True}, True),
    ("after-victim-renamed-aside", {"op": "rename", "match": "/step-1.deleting.incomplete", "after": True}, False),
    ("while-removing-the-victim", {"op": "remove_tree", "match": "/step-1.deleting.incomplete"}, False),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point,fault,kept", RETENTION_KILL_POINTS, ids=[k[0] for k in RETENTION_KILL_POINTS])
def test_a_daemon_killed_inside_retention_leaves_every_checkpoint_whole_or_gone_and_a_restart_sweeps_the_victim(
    daemon_factory, client_factory, root, point, fault, kept
) -> None:
    daemon, client = killer(daemon_factory, client_factory, fault)
    states = {step: make_state(step) for step in (1, 2)}
    client.save_async(states[1], root / "step-1", step=1).result(30)
    fut = client.save_async(states[2], root / "step-2", step=2, keep_last=1)  # committed, then retention
    assert_killed_at(daemon, fault)
    try:
        assert fut.result(15).path == root / "step-2"
    except ckptd.DaemonUnavailable:
        pass  # retention starts right after Done is queued: the reply may die with the daemon (committed anyway)
    assert_whole(root / "step-2", {0: states[2]})
    assert ckptd.latest(root) == root / "step-2"
    if kept:  # killed before the rename: step-1 is still a whole checkpoint (with a dead marker in it)
        assert_whole(root / "step-1", {0: states[1]})
    else:
        assert not (root / "step-1").exists(), f"killed {point}, the victim is still visible"

    daemon_factory()
    wait_until(lambda: not leftovers(root) and not any(markers(p) for p in root.iterdir()), 60,
               lambda: f"the start-up sweep removes the half-deleted victim; still there: {sorted(os.listdir(root))}")
    client.save_async(make_state(3), root / "step-3", step=3, keep_last=1).result(30)
    wait_until(lambda: sorted(os.listdir(root)) == ["step-3"], 60,
               lambda: f"retention deletes every older checkpoint; there: {sorted(os.listdir(root))}")


# -- the daemon dies or freezes under a client --------------------------------

SLOW = [{"op": "write", "match": "/slow-", "errno": 0, "delay": 30}]


@pytest.mark.timeout(60)
def test_every_pending_save_fails_within_seconds_when_the_daemon_dies_and_save_async_does_not_block(
    daemon_factory, client_factory, root
) -> None:
    daemon = daemon_factory(faults=SLOW)
    client = client_factory(heartbeat=0.2, timeout=5.0, max_inflight=3)
    futures = [client.save_async(make_state(i), root / f"slow-{i}") for i in range(3)]
    wait_until(lambda: len(daemon.status()["saves"]) == 3, 60, "three saves in flight")
    daemon.kill()  # SIGKILL and reap
    for fut in futures:  # "died": seen as a death, not after the 5 s silence timeout
        with pytest.raises(ckptd.DaemonUnavailable, match="died"):
            fut.result(10)
    # no daemon: save_async says so at once instead of blocking (spawn=False)
    t = time.monotonic()
    with pytest.raises(ckptd.DaemonUnavailable, match="no ckptd daemon answers"):
        client.save_async(make_state(9), root / "refused")
    assert time.monotonic() - t < 5
    # a save killed before it made its directory leaves none: any of the three may be missing
    assert {p.name for p in root.iterdir()} <= {f"slow-{i}.incomplete" for i in range(3)}
    # the daemon comes back: the same client saves again, the sweep cleans up
    daemon_factory()
    state = make_state(10)
    client.save_async(state, root / "after", step=10).result(30)
    assert_whole(root / "after", {0: state})
    wait_until(lambda: not leftovers(root), 60, "the sweep removes the killed saves' directories")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_client_that_was_idle_while_its_daemon_restarted_saves_again_at_once(
    daemon_factory, client_factory, root, how
) -> None:
    daemon = daemon_factory()
    client = client_factory(heartbeat=0.2, timeout=5.0)
    client.save_async(make_state(1), root / "before", step=1).result(30)
    if how == "killed":
        daemon.kill()
    else:
        assert daemon.stop() == 0
    daemon_factory()
    state = make_state(2)
    client.save_async(state, root / "after", step=2).result(30)  # no save was pending: nothing to fail
    assert_whole(root / "after", {0: state})


@pytest.mark.timeout(60)
def test_a_frozen_daemon_fails_pending_saves_after_the_timeout_and_save_async_returns(
    daemon_factory, client_factory, root
) -> None:
    daemon = daemon_factory()
    client = client_factory(heartbeat=0.2, timeout=4.0, max_inflight=1)  # 4 s: a loaded machine is slow
    client.save_async(make_state(1), root / "warm").result(30)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        first = client.save_async(make_state(2), root / "frozen-1")
        # the only in-flight place is taken: this call waits, but only until the first fails (the test's
        # timeout catches a call that waits forever); then it finds the daemon alive but silent, and says so
        with pytest.raises(ckptd.DaemonUnavailable, match=rf"\(pid {daemon.proc.pid}\) is running but did not answer"):
            client.save_async(make_state(3), root / "frozen-2")
        assert first.done(), "the second save_async returned while the first still held the only place"
        with pytest.raises(ckptd.DaemonUnavailable, match="not answered"):
            first.result(10)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # thawed, it answers again and the client reconnects; what it did meanwhile is all or nothing.
    # The thawed daemon first works off the commits sent while it was frozen, which on a loaded
    # machine can take longer than the client's timeout: wait until it has none left.
    wait_until(lambda: not daemon.status()["saves"], 30, "the thawed daemon worked off the frozen saves")
    assert daemon.status()["daemon"]["pid"] == daemon.proc.pid
    state = make_state(4)
    client.save_async(state, root / "thawed", step=4).result(30)
    assert_whole(root / "thawed", {0: state})
    if (root / "frozen-1").exists():  # the daemon had it: it may have committed it once thawed
        assert ckptd.read_index(root / "frozen-1").world_size == 1
    assert not (root / "frozen-2").exists()  # refused before it was sent


@pytest.mark.timeout(90)
def test_with_spawn_a_save_after_the_daemon_died_respawns_one_and_succeeds(run_dir, root, monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_ROOTS", str(root))
    monkeypatch.setenv("CKPTD_FAULTS", '[{"op": "write", "match": "/slow-", "errno": 0, "delay": 30}]')
    monkeypatch.setenv("CKPTD_STORAGE", "tests.faults:FaultyStorage")  # the spawned daemon loads it
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    client = ckptd.Client(run_dir=run_dir, spawn=True, heartbeat=0.2, timeout=2.0)
    try:
        first_pid = int((run_dir / "ckptd.pid").read_text())
        fut = client.save_async(make_state(1), root / "slow-1")
        wait_until(lambda: status(run_dir)["saves"], 30, "the save reaches the daemon")
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(ckptd.DaemonUnavailable):
            fut.result(15)  # "died", or (its zombie not reaped yet) "has not answered" after 2 s
        state = make_state(2)
        result = client.save_async(state, root / "respawned", step=2).result(30)
        assert result.path == root / "respawned"
        assert_whole(root / "respawned", {0: state})
        second_pid = int((run_dir / "ckptd.pid").read_text())
        assert second_pid != first_pid and os.getsid(second_pid) != os.getsid(0)
    finally:
        client.close()
        out = subprocess.run([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(run_dir)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    wait_until(lambda: not leftovers(root), 60, "the respawned daemon swept the killed save's directory")


# -- disks that fail or fill up ---------------------------------------------

IO_FAULTS = [
    ("write-ENOSPC", {"op": "write", "errno": errno.ENOSPC}),
    ("write-EIO", {"op": "write", "errno": errno.EIO}),
    ("write-ENOSPC-after-8MiB", {"op": "write", "errno": errno.ENOSPC, "after": True}),
    ("write-EIO-after-8MiB", {"op": "write", "errno": errno.EIO, "after": True}),
    ("fsync-ENOSPC", {"op": "fsync", "errno": errno.ENOSPC}),
    ("fsync-EIO", {"op": "fsync", "errno": errno.EIO}),
    ("index-write-ENOSPC", {"op": "write_file", "errno": errno.ENOSPC}),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,fault", IO_FAULTS, ids=[c[0] for c in IO_FAULTS])
def test_an_io_error_fails_the_save_with_write_failed_removes_its_bytes_and_the_daemon_serves_on(
    daemon_factory, client_factory, root, case, fault
) -> None:
    daemon = daemon_factory(faults=[{**fault, "match": f"/{NAME}.incomplete/"}])
    client = client_factory()
    before = make_state(1)
    client.save_async(before, root / "before").result(30)
    with pytest.raises(ckptd.WriteFailed, match=os.strerror(fault["errno"])):
        client.save_async(make_state(2, mib=20), root / NAME).result(30)
    wait_until(lambda: not leftovers(root), 60, "the failed save's directory is removed")
    assert sorted(p.name for p in root.iterdir()) == ["before"]
    assert any(NAME in e["message"] for e in daemon.status()["errors"])
    after = make_state(3)
    client.save_async(after, root / "after").result(30)
    assert_whole(root / "before", {0: before})
    assert_whole(root / "after", {0: after})


SMALL_FS = 192 * 2**20
MARGIN = 64 * 2**20
"""The daemon's default admission margin (``space_margin_bytes``): it keeps this much free."""


@pytest.fixture
def small_fs(root: Path) -> Iterator[Path]:
    """``root`` on its own 192 MiB tmpfs, so free space is exact and genuinely runs out."""
    with tmpfs(root, SMALL_FS // MiB):
        yield root


def fill(path: Path, nbytes: int) -> None:
    block = b"\xab" * 2**20
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def big_state(nbytes: int) -> dict:
    """One float32 tensor whose shard (4 KiB header included) is about ``nbytes``."""
    return {"w": torch.full(((nbytes - 4096) // 4,), 1.5)}


@pytest.mark.timeout(60)
def test_a_disk_that_fills_up_during_the_write_fails_the_save_cleanly_and_gets_its_space_back(
    small_fs, daemon_factory, client_factory
) -> None:
    root = small_fs
    # admitted, then held at the shard's open for 2 s while another file takes the space
    daemon = daemon_factory(faults=[{"op": "open", "match": "/too-big.incomplete/", "errno": 0, "delay": 2.0}])
    client = client_factory()
    client.save_async(make_state(1), root / "before").result(30)
    free_before = free_bytes(root)
    nbytes = free_before - MARGIN - 2**20  # just under what admission allows
    fut = client.save_async(big_state(nbytes), root / "too-big")
    wait_until(lambda: any("/too-big" in s["path"] for s in daemon.status()["saves"]), 60,
               "the big save is admitted")
    fill(root / "filler", 100 * 2**20)
    free_filled = free_bytes(root)
    assert free_filled < nbytes
    with pytest.raises(ckptd.WriteFailed, match="No space left on device"):
        fut.result(30)
    wait_until(lambda: not leftovers(root), 60, "the partial shard is removed")
    assert not (root / "too-big").exists()
    assert free_bytes(root) == free_filled, "the partial write's space must be given back"
    (root / "filler").unlink()
    assert free_bytes(root) == free_before
    after = make_state(2)
    client.save_async(after, root / "after").result(30)
    assert_whole(root / "after", {0: after})
    assert sorted(p.name for p in root.iterdir()) == ["after", "before"]


@pytest.mark.timeout(60)
def test_a_save_that_no_longer_fits_after_another_file_filled_the_disk_is_refused_with_no_space(
    small_fs, daemon_factory, client_factory
) -> None:
    root = small_fs
    daemon_factory()
    client = client_factory()
    free_before = free_bytes(root)
    nbytes = free_before - MARGIN - 2**20  # would fit on the empty disk
    fill(root / "filler", 100 * 2**20)
    free_filled = free_bytes(root)
    with pytest.raises(ckptd.NoSpace, match="not enough space"):
        client.save_async(big_state(nbytes), root / "too-big").result(30)
    assert sorted(p.name for p in root.iterdir()) == ["filler"]
    assert free_bytes(root) == free_filled
    (root / "filler").unlink()
    state = big_state(nbytes)
    client.save_async(state, root / "fits-again").result(60)
    assert_whole(root / "fits-again", {0: state})
