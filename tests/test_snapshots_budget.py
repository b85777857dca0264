"""The memory budget: held snapshots stay within it, eviction drops what is safe to drop, and a snapshot that
cannot fit is refused saying what to do."""

from __future__ import annotations

import pytest
import torch

import ckptd

from ckptd.client.memory import held_snapshots

from helpers import SHM, ckptd_cli, segments_of, wait_until
from snapshots import full, held_paths


def test_the_budget_evicts_persisted_snapshots_then_refuses_saying_what_to_do(
    daemon_factory, client_factory, root, run_dir
) -> None:
    daemon = daemon_factory("--memory-budget", "2MiB", "--keep-snapshots", "2")
    client = client_factory()
    small = {"w": torch.ones(200_000)}  # 0.77 MiB each: two fit, three do not
    client.save_async(small, root / "a", step=1, persist=False).result(30)
    client.save_async(small, root / "b", step=2, persist=False).result(30)
    client.persist(root / "a")
    client.save_async(small, root / "c", step=3, persist=False).result(30)  # evicts a: it is on disk
    held = [s["path"] for s in daemon.status()["memory"]["snapshots"]]
    assert held == [str(root / "b"), str(root / "c")]
    with pytest.raises(ckptd.NoSpace) as refused:
        client.save_async(small, root / "d", step=4, persist=False).result(30)
    message = str(refused.value)
    assert "memory budget is 2.0 MiB" in message and "1.5 MiB hold snapshots (2 held" in message
    assert "--memory-budget" in message and "persist" in message
    assert [s["path"] for s in daemon.status()["memory"]["snapshots"]] == held  # nothing newest was dropped
    daemon.stop()


def test_a_snapshot_refused_for_the_budget_evicts_nothing_and_every_slot_the_daemon_holds_stays_counted(
    daemon_factory, client_factory, root, run_dir
) -> None:
    """Eviction is decided before it is done: one that would still leave no room evicts nothing. It evicted the
    persisted snapshot from the books and then refused, so that snapshot's slot stayed mapped under the daemon's
    name, outside the budget, with no SnapshotDropped (issue 38, case 8a)."""
    daemon = daemon_factory("--memory-budget", "2MiB", "--keep-snapshots", "2")
    client = client_factory()
    small = {"w": torch.ones(200_000)}  # 0.77 MiB each: two fit, and evicting one leaves no room for a 1.5 MiB one
    client.save_async(small, root / "a", step=1, persist=False).result(30)
    client.save_async(small, root / "b", step=2, persist=False).result(30)
    client.persist(root / "a")
    with pytest.raises(ckptd.NoSpace, match="memory budget is 2.0 MiB"):
        client.save_async({"w": torch.ones(400_000)}, root / "big", step=3, persist=False).result(30)
    assert held_paths(run_dir) == {str(root / "a"), str(root / "b")}  # a stays: evicting it would not have helped
    listed = {shard[1] for snap in held_snapshots(run_dir) for shard in snap["shards"]}
    assert segments_of(daemon.proc.pid) == sorted(listed)  # no slot held that no snapshot counts
    memory = daemon.status()["memory"]
    assert memory["held_bytes"] == sum(s["bytes"] for s in memory["snapshots"])
    client.save_async(small, root / "c", step=4, persist=False).result(30)  # this one fits once a is evicted
    assert held_paths(run_dir) == {str(root / "b"), str(root / "c")}
    wait_until(lambda: len(segments_of(daemon.proc.pid)) == 2, 10, lambda: f"a's slot released by the daemon: "
               f"it names {segments_of(daemon.proc.pid)}")
    daemon.stop()


def test_a_snapshot_larger_than_the_budget_is_refused_and_later_small_ones_are_held(
    daemon_factory, client_factory, root, run_dir
) -> None:
    daemon = daemon_factory("--memory-budget", "2MiB")
    client = client_factory()
    with pytest.raises(ckptd.NoSpace, match="memory budget is 2.0 MiB"):
        client.save_async({"w": torch.ones(1_000_000)}, root / "big", step=1, persist=False).result(30)
    assert max(SHM.joinpath(n).stat().st_size for n in client.slot_names) > 2 * 2**20  # the slot grew
    for step in range(2, 6):  # staged into that grown slot, or the next: the budget counts the bytes, not the slot
        small = {"w": torch.full((50_000,), float(step))}
        client.save_async(small, root / f"s{step}", step=step, persist=False).result(30)
        assert ckptd.load(root / f"s{step}", run_dir=run_dir)["w"].equal(small["w"])
    memory = daemon.status()["memory"]
    assert [s["path"] for s in memory["snapshots"]] == [str(root / "s5")]
    assert memory["held_bytes"] == memory["snapshots"][0]["bytes"] < 2**20
    daemon.stop()


@pytest.mark.parametrize("budget, says", [("lots", "expected a number of bytes"), ("0", "at least 1048576 (1 MiB)"),
                                          ("1024", "at least 1048576 (1 MiB)"), ("1PiB", "expected a number of bytes"),
                                          ("1000TiB", "at most the size of")])
def test_a_memory_budget_out_of_range_is_refused_at_start(run_dir, root, budget, says) -> None:
    out = ckptd_cli("start", "--foreground", "--run-dir", str(run_dir), "--root", str(root),
                    "--memory-budget", budget)
    assert out.returncode == 2
    assert "memory" in out.stderr and says in out.stderr, out.stderr


def test_eviction_keeps_each_jobs_newest_by_step_and_never_another_jobs(daemon, client_factory, root,
                                                                        run_dir) -> None:
    job_a, job_b = client_factory(), client_factory()
    job_a.save_async(full(1), root / "a-1", step=1, persist=False).result(30)
    job_b.save_async(full(5), root / "b-5", step=5, persist=False).result(30)
    assert held_paths(run_dir) == {str(root / "a-1"), str(root / "b-5")}
    job_a.save_async(full(20), root / "a-20", step=20, persist=False).result(30)
    job_a.save_async(full(0), root / "a-stepless", persist=False).result(30)
    assert held_paths(run_dir) == {str(root / "b-5"), str(root / "a-20"), str(root / "a-stepless")}
    job_a.save_async(full(0), root / "a-stepless-2", persist=False).result(30)  # still bounded
    assert held_paths(run_dir) == {str(root / "b-5"), str(root / "a-20"), str(root / "a-stepless-2")}
    assert ckptd.latest(root, run_dir=run_dir) == root / "a-20"
    daemon.stop()


def test_a_small_snapshot_left_in_a_grown_slot_by_a_gone_trainer_gives_the_rest_of_the_slot_back(
    daemon_factory, client_factory, root, run_dir
) -> None:
    """A slot only grows: a small snapshot staged into a slot grown for a larger state would keep all of that
    slot in /dev/shm for as long as it is held, while the budget counts only its shard (a new-user pass: 1.2 GB
    pinned by a 4 KB snapshot after a Ctrl-C). Once its trainer is gone, the slot shrinks to the shard."""
    daemon = daemon_factory("--keep-snapshots", "1")
    client = client_factory()
    big, small = {"w": torch.ones(8 << 20)}, {"w": torch.ones(1000)}  # 32 MiB, 4 KB
    client.save_async(big, root / "s-1", step=1, persist=False).result(30)
    client.save_async(small, root / "s-2", step=2, persist=False).result(30)  # drops s-1: its slot comes back
    client.save_async(small, root / "s-3", step=3, persist=False).result(30)  # into s-1's slot, the one free

    def newest() -> dict:
        (snap,) = [s for s in daemon.status()["memory"]["snapshots"] if s["path"] == str(root / "s-3")]
        return snap
    assert newest()["held_bytes"] >= 32 << 20, newest()  # what the fix is for: the small one is in the big slot
    ((_, slot, *_),) = [snap["shards"] for snap in held_snapshots(run_dir) if snap["path"] == str(root / "s-3")][0]
    client.close()  # the trainer goes; its newest snapshot is persisted and stays held
    wait_until(lambda: newest()["held_bytes"] < 1 << 20, 30, lambda: f"the slot trimmed: {newest()}")
    assert (SHM / slot).stat().st_size < 1 << 20
    wait_until(lambda: newest()["persisted"], 30, "s-3 persisted on exit")
    assert torch.equal(ckptd.load(root / "s-3", run_dir=run_dir)["w"], small["w"])  # read from the trimmed slot
    daemon.stop()
