"""The node state on its own: no daemon, no socket, no slot files (fake slots)."""

from __future__ import annotations

from pathlib import Path

import os
import pytest

from ckptd.core.config import DaemonConfig
from ckptd.lifecycle.attempt import AttemptState
from ckptd.lifecycle.budget import MemoryBudget
from ckptd.protocol.errors import Conflict, InternalError, RanksMissing, UnknownClient
from ckptd.protocol.index import ShardRecord
from ckptd.protocol.layout import TensorEntry
from ckptd.protocol.messages import WriteShard, Error, Snapshot
from ckptd.lifecycle.snapshots import SnapshotBook
from ckptd.lifecycle.state import NodeState
from ckptd.lifecycle.writer import ShardWrite
from ckptd.storage.contract import LocalStorage

SHARD = 8192
TENSORS = (TensorEntry("w", "U8", (4096,), 0, 4096),)


class FakeSlot:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeSlots:
    """Records what the state asks of the slot mappings."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.forgotten: list[int] = []
        self.mapped_bytes = 0
        self.shm_dir = Path("/nonexistent-shm")

    def release(self, slot: FakeSlot) -> None:
        self.released.append(slot.name)

    def forget_pid(self, pid: int) -> None:
        self.forgotten.append(pid)


@pytest.fixture
def state(tmp_path: Path) -> NodeState:
    config = DaemonConfig(run_dir=tmp_path / "run", roots=(tmp_path,))
    return NodeState(config, LocalStorage(), slots=FakeSlots())  # type: ignore[arg-type]


def commit(rid: int, *, rank: int = 0, world_size: int = 1, path: str = "/ckpts/a", step: int | None = 1,
           staged: int = SHARD) -> WriteShard:
    return WriteShard(rid, slot=f"ckptd-0-1-{rid}", nbytes=SHARD, header_len=4096, tensors=TENSORS, path=path, rank=rank,
                  world_size=world_size, step=step, overwrite=False, coordinated=False, keep_last=None,
                  timeout=600.0, waited=0.25, staged=staged)


def test_an_unknown_client_is_refused_until_it_says_hello(state) -> None:
    with pytest.raises(UnknownClient, match="send hello first"):
        state.client(b"a")
    state.hello(b"a", 1234)
    assert state.client(b"a").pid == 1234


def test_teardown_fails_staging_frees_leases_and_forgets_slots_the_same_for_bye_and_death(state) -> None:
    for ident, pid in ((b"leaver", 10), (b"waiter", 11), (b"late", 12)):
        state.hello(ident, pid)
    client = state.client(b"leaver")
    staging = state.begin_save(b"leaver", client, commit(1, staged=4096), deadline=1e18)
    done = state.begin_save(b"leaver", client, commit(2), deadline=1e18)
    assert state.leases.request(b"leaver", 5, 10, 1)  # granted at once
    assert state.leases.request(b"waiter", 6, 11, 1) == []  # queued behind it
    assert state.leases.request(b"late", 7, 12, 1) == []  # and another behind that

    gone, grants = state.teardown(b"leaver", "the client closed before it finished staging")

    assert gone is not None and gone.pid == 10 and b"leaver" not in state.clients
    assert staging.failure == "the client closed before it finished staging"
    assert done.failure is None, "a save staged in full still completes"
    assert [(g.client, g.request_id) for g in grants] == [(b"waiter", 6)]
    assert state.teardown(b"late", "died")[1] == [] and list(state.leases.queue) == []  # queued requests go too
    assert state.slots.forgotten == [10, 12]
    assert state.teardown(b"leaver", "again") == (None, [])  # a second Bye is harmless


def test_a_save_counts_for_its_client_and_ends_with_its_write(state) -> None:
    client = state.hello(b"a", 1)
    progress = state.begin_save(b"a", client, commit(1), deadline=1e18)
    assert (client.saves, client.waited_s, client.last_waited_s) == (1, 0.25, 0.25)
    assert state.staging[(b"a", 1)] is progress and state.busy
    job = ShardWrite(b"a", commit(1), FakeSlot("ckptd-0-1-1"), Path("/ckpts/a.incomplete/r"), Path("/ckpts/a"),
                   progress, device=7)
    state.writes.append(job)
    state.finish_write(job)
    assert state.writes == [] and state.staging == {} and state.slots.released == ["ckptd-0-1-1"]
    assert job.finished_at is not None
    assert not state.busy


def test_reserved_bytes_are_what_is_admitted_and_not_yet_written_per_device(state) -> None:
    client = state.hello(b"a", 1)
    for rid, device, written in ((1, 7, 0), (2, 7, 1000), (3, 8, 0)):
        progress = state.begin_save(b"a", client, commit(rid), deadline=1e18)
        job = ShardWrite(b"a", commit(rid), FakeSlot(str(rid)), Path("/x"), Path("/y"), progress, device=device)
        job.written = written
        state.writes.append(job)
    assert state.reserved_on(7) == 2 * SHARD - 1000
    assert state.reserved_on(8) == SHARD
    assert state.reserved_on(9) == 0


def test_ranks_join_one_pending_checkpoint_until_it_is_complete(state, tmp_path) -> None:
    final = tmp_path / "two"
    first, dest = state.commits.admit(commit(1, rank=0, world_size=2), b"a", final, os.getpid(), state.commits.storage)
    assert first.state is AttemptState.PREPARING and dest == tmp_path / "two.incomplete/rank-00000-of-00002.safetensors"
    second, _ = state.commits.admit(commit(2, rank=1, world_size=2), b"b", final, os.getpid(), state.commits.storage)
    assert second is first and first.writing == 2 and first.missing == []
    with pytest.raises(Conflict, match="rank 1 .* is already in it"):
        state.commits.admit(commit(3, rank=1, world_size=2), b"b", final, os.getpid(), state.commits.storage)
    with pytest.raises(Conflict, match="world size 2"):
        state.commits.admit(commit(4, rank=0, world_size=3), b"c", final, os.getpid(), state.commits.storage)
    state.attempts.move(first, AttemptState.WRITING)
    assert not state.commits.shard_done(first, ShardRecord("rank-00000-of-00002.safetensors", 0, SHARD, 1, 0))
    assert state.commits.shard_done(first, ShardRecord("rank-00001-of-00002.safetensors", 1, SHARD, 1, 0))
    assert first.state is AttemptState.COMMITTING
    assert [c for c in state.checkpoints] == [first]


def test_a_failed_checkpoint_fails_its_late_ranks_the_same_way_and_a_retry_starts_afresh(state, tmp_path) -> None:
    final = tmp_path / "lonely"
    pending, _ = state.commits.admit(commit(1, rank=0, world_size=2), b"a", final, os.getpid(), state.commits.storage)
    failure = RanksMissing("ranks [1] never came")
    state.attempts.end(pending, AttemptState.FAILED, failure)
    state.commits.failed_with(pending, failure)  # what the save pipeline's end of a failed attempt does
    assert pending.state is AttemptState.FAILED and final not in state.commits.pending
    with pytest.raises(RanksMissing, match="ranks \\[1\\] never came"):
        state.commits.admit(commit(2, rank=1, world_size=2), b"b", final, os.getpid(), state.commits.storage)
    retry, _ = state.commits.admit(commit(3, rank=0, world_size=2), b"a", final, os.getpid(), state.commits.storage)
    assert retry is not pending and retry.state is AttemptState.PREPARING


def test_a_checkpoint_moves_only_forward_and_ends_once(state, tmp_path) -> None:
    pending, _ = state.commits.admit(commit(1), b"a", tmp_path / "once", os.getpid(), state.commits.storage)
    with pytest.raises(InternalError, match="cannot go from preparing to committing"):
        state.attempts.move(pending, AttemptState.COMMITTING)  # no shard is written before its directory exists
    state.attempts.move(pending, AttemptState.WRITING)
    with pytest.raises(InternalError, match="ends through Registry.end"):
        state.attempts.move(pending, AttemptState.FAILED)  # an end answers its ranks and releases what it holds
    state.attempts.end(pending, AttemptState.FAILED, RanksMissing("gone"))
    with pytest.raises(InternalError, match="cannot go from failed to failed"):
        state.attempts.end(pending, AttemptState.FAILED, RanksMissing("twice"))  # each rank is told once
    with pytest.raises(InternalError, match="cannot go from failed to committed"):
        state.attempts.end(pending, AttemptState.COMMITTED)


def test_disk_and_memory_attempts_share_one_set_of_rules_for_their_ranks(state, tmp_path) -> None:
    """Joining, overdue ranks and failing every waiting rank behave alike on disk and in memory."""
    final = tmp_path / "both"
    pending, _ = state.commits.admit(commit(1, world_size=2, path=str(final)), b"a", final, os.getpid(),
                                     state.commits.storage)
    snaps = SnapshotBook(MemoryBudget(1 << 30), keep=1, registry=state.attempts)
    shot = Snapshot(**{**commit(1, world_size=2, path=str(final)).__dict__})
    snap = snaps.admit(shot, final, state.commits.storage, FakeSlot("s"), os.getpid(), b"a")  # type: ignore[arg-type]
    for attempt, kind in ((pending, "checkpoint"), (snap, "snapshot")):
        with pytest.raises(Conflict, match=f"rank 0 of {kind} .* already"):
            attempt.check_join(commit(2, world_size=2, path=str(final)))
        assert attempt.missing == [1] and attempt.overdue(attempt.started_at + 1) is None
        late = attempt.overdue(attempt.started_at + attempt.timeout + 1)
        assert isinstance(late, RanksMissing) and f"{kind} {final}: ranks [1] of 2 never" in late.message
        sent: list[tuple[bytes, Error]] = []
        attempt.tell_failed(lambda client, msg: sent.append((client, msg)), late)
        assert sent == [(b"a", Error(1, late.code, late.message))] and attempt.waiting == []


def test_the_status_view_reads_the_state_without_a_server(state) -> None:
    state.hello(b"a", 42)
    info = state.stats.status(state)
    assert [c["pid"] for c in info["clients"]] == [42]
    assert info["writes"] == {"max_concurrent": 2, "writing": 0, "queued": 0, "throughput_bps": 0}
    assert info["daemon"]["draining"] is False and info["checkpoints"] == []
