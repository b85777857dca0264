"""Memory snapshots: held by the node's daemon, restored from memory, persisted when their trainer dies.

Real daemons, real trainer processes: a trainer snapshots every step and is
SIGKILLed; a fresh process resumes from the newest snapshot, bitwise, read
from the daemon's memory (its disk copy moved away to prove it), and the
copy the daemon persisted survives a daemon restart. Snapshots are held, not
written; ``ckptd list`` and ``status`` show them; a snapshot that could never
be persisted is refused when saved. (The budget, persisting, reading, ranks and
the segments a daemon holds each have their own ``test_snapshots_*.py``.)
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.client.memory import held_snapshots

from helpers import SHM, equal_states, segments_of, wait_until
from snapshots import STATE_SRC, full, held, held_paths, state_at
from zygote import Script


TRAINER = STATE_SRC + r'''
import json, os, signal, sys
import ckptd
run_dir, root, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = ckptd.Client(run_dir=run_dir, spawn=False)
for step in range(1, steps + 1):
    client.save_async(state_at(step), f"{root}/step-{step}", step=step, persist=False).result()
print(json.dumps({"pid": os.getpid(), "slots": client.slot_names, "lent": client._slots.lent_names}), flush=True)
signal.pause()  # until the test kills us
'''

RESUMER = STATE_SRC + r'''
import json, sys, torch, ckptd
run_dir, root = sys.argv[1], sys.argv[2]
path = ckptd.latest(root, run_dir=run_dir)
loaded = ckptd.load(path, run_dir=run_dir)
want = state_at(loaded["step"])
target = {"w": torch.zeros(300_000), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
ckptd.load_into(target, path, run_dir=run_dir)
print(json.dumps({"path": str(path), "step": loaded["step"],
                  "bitwise": all(torch.equal(loaded[k], want[k]) and torch.equal(target[k], want[k]) for k in "wb")}))
'''


def resume(run_dir: Path, root: Path) -> dict:
    """What a fresh process resuming from ``ckptd.latest`` read. Forked from the zygote (no torch import to wait
    through) and waited for until it exits, however long a loaded node takes: the test's timeout bounds it."""
    proc = Script(RESUMER, str(run_dir), str(root))
    try:
        out, err = proc.communicate()
    finally:
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.timeout(600)  # what bounds the waits on its processes below, none of which has a budget of its own
def test_a_killed_trainer_resumes_bitwise_from_memory_and_its_persisted_snapshot_survives_a_restart(
    daemon_factory, root, run_dir, tmp_path
) -> None:
    daemon = daemon_factory()
    trainer = Script(TRAINER, str(run_dir), str(root), "3")
    line = trainer.stdout.readline()  # once its three snapshots are held, or at its death
    assert line, trainer.stderr.read()[-3000:]
    info = json.loads(line)
    assert len(info["lent"]) == 1 and len(info["slots"]) == 2  # one slot held, one to stage the next snapshot
    trainer.kill()
    assert trainer.wait() == -signal.SIGKILL  # the trainer died, it did not exit
    trainer.stdout.close()
    trainer.stderr.close()

    # the daemon persists the dead trainer's newest snapshot; its other slots go, the held one stays
    persisted = lambda: [(s["path"], s["step"], s["persisted"]) for s in daemon.status()["memory"]["snapshots"]]  # noqa: E731
    wait_until(lambda: persisted() == [(str(root / "step-3"), 3, True)], 60,
               lambda: f"the daemon persists the newest snapshot of a dead trainer; it holds {persisted()}")
    assert sorted(os.listdir(root)) == ["step-3"]  # steps 1 and 2 were dropped from memory, never written
    # the held slot was renamed to the daemon's own (no sweep of dead clients' slots takes it): the others go
    wait_until(lambda: segments_of(info["pid"]) == [], 60, lambda: f"dead trainer's slots: {segments_of(info['pid'])}")
    (held_slot,) = [shard[1] for shard in held_snapshots(run_dir)[0]["shards"]]
    assert held_slot in segments_of(daemon.proc.pid)

    # from memory: with the disk copy moved away, a new process still resumes, bitwise
    os.rename(root / "step-3", tmp_path / "aside")
    assert resume(run_dir, root) == {"path": str(root / "step-3"), "step": 3, "bitwise": True}
    os.rename(tmp_path / "aside", root / "step-3")

    daemon.stop()
    assert not (SHM / held_slot).exists(), "a stopped daemon leaves none of the snapshots it held in /dev/shm"
    daemon_factory()
    assert held_snapshots(run_dir) == []
    assert resume(run_dir, root) == {"path": str(root / "step-3"), "step": 3, "bitwise": True}


def test_snapshots_are_held_not_written_and_the_pool_reuses_released_slots(daemon, client, root, run_dir) -> None:
    for step in range(1, 5):
        result = client.save_async(state_at(step), root / f"s{step}", step=step, persist=False).result(30)
        assert result.path == root / f"s{step}"
    assert os.listdir(root) == []  # no disk I/O at all
    assert len(client.slot_names) == 2  # one held, one to stage the next snapshot into
    assert ckptd.latest(root, run_dir=run_dir) == root / "s4"
    assert equal_states(ckptd.load(root / "s4", run_dir=run_dir), state_at(4))
    listing = daemon.cli("list", str(root))
    assert listing.returncode == 0 and "memory" in listing.stdout.splitlines()[1], listing.stdout
    assert client.persist(root / "s4") == root / "s4"
    assert equal_states(ckptd.load(root / "s4"), state_at(4))  # no run_dir: read from disk
    rows = json.loads(daemon.cli("list", str(root), "--json").stdout)
    assert [(r["name"], r["state"], r["in_memory"]) for r in rows] == [("s4", "committed", True)]
    with pytest.raises(ckptd.InvalidCheckpoint, match="holds no snapshot"):
        client.persist(root / "s1")  # dropped when s2 was held
    daemon.stop()


def test_status_text_and_prometheus_metrics_show_the_snapshots_and_the_budget(
    daemon_factory, client_factory, root, run_dir, tmp_path
) -> None:
    metrics = tmp_path / "ckptd.prom"
    daemon = daemon_factory("--metrics-textfile", str(metrics), "--memory-budget", "64MiB")
    client = client_factory()
    client.save_async(state_at(8), root / "s8", step=8, persist=False).result(30)
    text = daemon.cli("status").stdout
    assert "memory snapshots: 1.1 MiB held of a 64.0 MiB budget" in text, text  # its bytes, not its 2 MiB slot
    assert f"{root / 's8'}  step 8" in text and "ranks held 1/1  memory only" in text, text

    def scraped() -> dict[str, float]:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return {k: float(v) for k, v in (line.split() for line in lines if line.startswith("ckptd_memory_"))}
    nbytes = daemon.status()["memory"]["snapshots"][0]["bytes"]
    want = {"ckptd_memory_budget_bytes": 64 * 2**20, "ckptd_memory_held_bytes": nbytes,
            "ckptd_memory_snapshots": 1, "ckptd_memory_snapshots_unpersisted": 1,
            "ckptd_memory_snapshots_held_total": 1, "ckptd_memory_snapshots_dropped_total": 0,
            "ckptd_memory_snapshots_failed_total": 0}
    wait_until(lambda: scraped() == want, 60, lambda: f"the metrics say {scraped()}")
    client.save_async(state_at(9), root / "s9", step=9, persist=False).result(30)  # keeps 1: s8 is dropped
    want.update({"ckptd_memory_snapshots_held_total": 2, "ckptd_memory_snapshots_dropped_total": 1})
    wait_until(lambda: {k: scraped().get(k) for k in want if k.endswith("_total")}
               == {k: v for k, v in want.items() if k.endswith("_total")}, 60, lambda: f"the metrics say {scraped()}")
    status = daemon.status()["memory"]
    assert (status["held_total"], status["dropped_total"]) == (2, 1), status
    daemon.stop()


def test_a_snapshot_under_a_regular_file_is_refused_when_saved(daemon, client_factory, root, run_dir) -> None:
    (root / "a-file").write_text("not a directory")
    client = client_factory()
    for path in (root / "a-file" / "s1", root / "a-file" / "sub" / "s1"):
        with pytest.raises(ckptd.PathNotAllowed, match=f"could never be persisted: {root / 'a-file'} is not a dir"):
            client.save_async(full(1), path, step=1, persist=False).result(30)
    client.save_async(full(1), root / "new-dir" / "s1", step=1, persist=False).result(30)  # made when persisted
    assert held_paths(run_dir) == {str(root / "new-dir" / "s1")}
    daemon.stop()


def test_ckptd_list_shows_a_directory_only_memory_holds(daemon, client_factory, root) -> None:
    client = client_factory()
    client.save_async(full(1), root / "only-in-memory" / "s1", step=1, persist=False).result(30)
    listed = daemon.cli("list", str(root / "only-in-memory"))
    assert listed.returncode == 0, listed.stderr
    assert "s1" in listed.stdout and "memory" in listed.stdout
    missing = daemon.cli("list", str(root / "nothing-here"))
    assert missing.returncode != 0 and "holds no snapshots under it" in missing.stderr
    daemon.stop()


def test_ckptd_list_shows_the_held_version_where_memory_holds_a_newer_one_than_the_disk(daemon, client_factory,
                                                                                       root) -> None:
    """last.ckpt persisted at step 4, then snapshotted at step 6 (``CkptdSnapshots``): a load reads step 6, and
    the listing says so, with the disk's step beside it (it showed 4)."""
    client = client_factory()
    client.save_async(full(4), root / "last", step=4).result(30)
    client.save_async(full(6), root / "last", step=6, persist=False, overwrite=True).result(30)
    listed = daemon.cli("list", "--json", str(root))
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert (row["state"], row["in_memory"], row["step"], row["disk_step"]) == ("committed", True, 6, 4), row



def test_a_snapshot_over_a_held_one_is_refused_as_existing_and_replaces_it_with_overwrite(
    daemon, client_factory, root, run_dir
) -> None:
    """A held snapshot is checkpoint ``path`` (docs/memory.md): another snapshot of that path is refused with
    ``CheckpointExists`` as a disk save would be, and with ``overwrite=True`` replaces it, held or persisted; the
    held one serves until its replacement is completely held, so one that fails leaves it (both used to get
    ``Conflict``: "already held in memory", found by the stateful soak, ``kills_inside``)."""
    path = root / "snap"
    ranks = [client_factory(rank=r, world_size=2, commit_timeout=10) for r in (0, 1)]

    def states(step: int) -> list[dict]:
        return [{"r": torch.full((1000,), 10 * step + r), "step": step} for r in (0, 1)]

    def holds(where: Path, step: int, world: int = 2) -> bool:
        return all(equal_states(ckptd.load(where, rank=r, run_dir=run_dir), states(step)[r]) for r in range(world))

    futures = [c.save_async(s, path, step=1, persist=False) for c, s in zip(ranks, states(1))]
    assert [f.result(30).path for f in futures] == [path] * 2
    for future in [c.save_async(s, path, step=2, persist=False) for c, s in zip(ranks, states(2))]:
        with pytest.raises(ckptd.CheckpointExists, match="already held in memory; pass overwrite=True"):
            future.result(30)
    assert holds(path, 1)
    lonely = ranks[0].save_async(states(3)[0], path, step=3, persist=False, overwrite=True)
    wait_until(lambda: "snap" in str(daemon.status()["saves"]) or lonely.done(), 30, "rank 0's replacement seen")
    assert holds(path, 1)  # the replacement is not complete: the held one serves
    with pytest.raises(ckptd.RanksMissing, match=r"ranks \[1\] of 2"):
        lonely.result(30)
    assert holds(path, 1)
    for client in ranks:
        client.close()
    wait_until(lambda: (path / "ckptd.json").exists(), 30, "the held one persisted on exit")
    assert all(equal_states(ckptd.load(path, rank=r), states(1)[r]) for r in (0, 1))

    # One rank, one client in this process: the daemon tells slots and exits apart by pid
    solo, one = client_factory(), root / "solo"
    solo.save_async(states(4)[0], one, step=4, persist=False).result(30)
    assert solo.save_async(states(5)[0], one, step=5, persist=False, overwrite=True).result(30).path == one
    assert holds(one, 5, world=1)
    assert solo.persist(one) == one and ckptd.read_index(one).step == 5
    assert solo.save_async(states(6)[0], one, step=6, persist=False, overwrite=True).result(30).path == one
    assert holds(one, 6, world=1) and ckptd.read_index(one).step == 5  # over a persisted one: memory first
    assert [s["step"] for s in daemon.status()["memory"]["snapshots"] if s["path"] == str(one)] == [6]
    assert len(solo.slot_names) == 2  # the replaced one's slot came back: the pool alternates, as ever
    solo.close()
    wait_until(lambda: ckptd.read_index(one).step == 6, 30, "the replacement persisted on exit")
    assert equal_states(ckptd.load(one), states(6)[0])
    assert daemon.stop() == 0


def test_a_defect_in_a_replacements_checksum_completion_fails_its_rank_at_once_and_the_held_one_serves(
    daemon_factory, client_factory, root, run_dir
) -> None:
    """A completion that raises fails its snapshot on every rank at once (``Workers.submit``'s ``failed``); for a
    replacement (``overwrite=True``) it looked the snapshot up in the held book, found the one it replaces, and
    did nothing: the rank waited with no end (a snapshot whose ranks are all in is never overdue), and its client's
    close with it (issue 38, case 8b)."""
    path = root / "snap"
    daemon = daemon_factory(faults=[{"op": "checksummed", "match": str(path), "skip": 1}])  # the held one passes
    client = client_factory(commit_timeout=600)
    client.save_async(full(1), path, step=1, persist=False).result(30)
    replacement = client.save_async(full(2), path, step=2, persist=False, overwrite=True)
    with pytest.raises(ckptd.InternalError, match="injected defect in the checksummed"):
        replacement.result(30)
    assert held(daemon, path)["step"] == 1
    assert ckptd.load(path, run_dir=run_dir)["w"].equal(full(1)["w"])
    listed = {shard[1] for snap in held_snapshots(run_dir) for shard in snap["shards"]}
    wait_until(lambda: segments_of(daemon.proc.pid) == sorted(listed), 10,
               lambda: f"the replacement's slot given back: the daemon names {segments_of(daemon.proc.pid)}")
    assert daemon.stop() == 0  # the drain persists the held one
    assert ckptd.read_index(path).step == 1
