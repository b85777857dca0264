"""Reading memory snapshots while their trainer goes on: what a reader loaded never changes under it.

The trainer's next save reuses the slot of a snapshot the daemon dropped:
what a reader loaded must not change under it; a reader pins what it reads,
so a drop waits for it, and one that cannot pin (a daemon that predates it)
says the drop overtook it (or reads the persisted copy); a reader that dies
gives its pins back. ``load_into`` from memory copies straight into the targets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.client.memory import HeldFiles, find_held, open_checkpoint

from helpers import segments_of, start_daemon, wait_until
from snapshots import full, held_paths
from test_peers import _node, _pair


def test_tensors_loaded_from_memory_stay_as_verified_when_the_trainer_reuses_the_slot(
    daemon, client_factory, root, run_dir
) -> None:
    client = client_factory()
    client.save_async(full(1), root / "s1", step=1, persist=False).result(30)
    views = ckptd.load(root / "s1", run_dir=run_dir, mmap=True)
    copies = ckptd.load(root / "s1", run_dir=run_dir)
    client.save_async(full(2), root / "s2", step=2, persist=False).result(30)  # drops s1: its slot goes back
    client.save_async(full(3), root / "s3", step=3, persist=False).result(30)  # staged into s1's old slot
    assert views["w"].equal(full(1)["w"]) and copies["w"].equal(full(1)["w"])
    daemon.stop()


def test_a_snapshot_dropped_while_an_unpinned_reader_reads_it_says_so_or_is_read_from_its_disk_copy(
    daemon, client_factory, root, run_dir
) -> None:
    def unpinned(path: Path) -> HeldFiles:  # what a reader gets from a daemon that predates reader leases
        return HeldFiles(path, find_held(path, run_dir), verify=True, run_dir=run_dir)
    client = client_factory()
    client.save_async(full(1), root / "mem-only", step=1, persist=False).result(30)
    lost = unpinned(root / "mem-only")
    client.save_async(full(2), root / "kept", step=2, persist=False).result(30)
    client.persist(root / "kept")
    kept = unpinned(root / "kept")
    for step in (3, 4):  # each drops the one before; step 4 is staged into the slot "kept" was read from
        client.save_async(full(step), root / f"s{step}", step=step, persist=False).result(30)
    with pytest.raises(ckptd.InvalidCheckpoint, match="was dropped by the daemon while rank 0 was being read"):
        lost.read(lost.index.shard(0), copy=True)
    _, tensors = kept.read(kept.index.shard(0), copy=True)
    assert tensors["w"].equal(full(2)["w"])  # the persisted copy, same checksum
    with pytest.raises(ckptd.InvalidCheckpoint, match="nor does the daemon of run directory .* hold a memory snapshot"):
        ckptd.load(root / "mem-only", run_dir=run_dir)
    daemon.stop()


def test_a_read_asks_the_daemon_its_run_dir_names_and_says_which_it_asked_when_the_snapshot_is_not_there(
    daemon, client_factory, root, run_dir, tmp_path, monkeypatch
) -> None:
    """``load``/``load_into`` ask the daemon of ``run_dir`` (else the default one), never a live ``Client``'s own:
    a snapshot held by a daemon of another run directory is named as not asked, not as lost."""
    client = client_factory()
    client.save_async(full(1), root / "mem-only", step=1, persist=False).result(30)
    elsewhere = tmp_path / "no-daemon-here"
    monkeypatch.setenv("CKPTD_RUN_DIR", str(elsewhere))
    with pytest.raises(ckptd.InvalidCheckpoint, match=f"none answers at run directory {elsewhere}; pass run_dir="):
        ckptd.load(root / "mem-only")
    target = {"w": torch.zeros(50_000)}
    with pytest.raises(ckptd.InvalidCheckpoint, match=f"none answers at run directory {elsewhere}"):
        ckptd.load_into(target, root / "mem-only")
    assert not target["w"].any()
    ckptd.load_into(target, root / "mem-only", run_dir=run_dir)
    assert target["w"].equal(full(1)["w"]) and ckptd.load(root / "mem-only", run_dir=run_dir)["w"].equal(full(1)["w"])
    daemon.stop()


def test_latest_with_no_daemon_at_its_run_dir_still_answers_from_disk_and_warns_naming_the_run_dir(
    daemon, client_factory, root, run_dir, tmp_path, caplog
) -> None:
    """``latest`` with no daemon at ``run_dir`` keeps its answer (the disk's newest, or None: nothing to resume
    from), and says why a snapshot held elsewhere was not considered, where it said nothing."""
    client = client_factory()
    client.save_async(full(1), root / "step-1", step=1).result(30)
    client.save_async(full(2), root / "step-2", step=2, persist=False).result(30)
    elsewhere = tmp_path / "no-daemon-here"
    with caplog.at_level("WARNING", logger="ckptd"):
        assert ckptd.latest(root, run_dir=elsewhere) == root / "step-1"
        assert ckptd.latest(tmp_path, run_dir=elsewhere) is None
    said = [r.getMessage() for r in caplog.records if r.name == "ckptd" and r.levelname == "WARNING"]
    assert len(said) == 2 and all(f"no daemon answers at run directory {elsewhere}" in m for m in said), said
    assert "only checkpoints on disk" in said[0] and str(root) in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckptd"):
        assert ckptd.latest(root, run_dir=run_dir) == root / "step-2"  # a daemon answers: nothing to say
    assert not [r for r in caplog.records if r.name == "ckptd"], caplog.records
    daemon.stop()


def test_a_snapshot_dropped_while_a_reader_pins_it_stays_readable_until_the_reader_is_done(
    daemon, client_factory, root, run_dir
) -> None:
    client = client_factory()
    client.save_async(full(1), root / "s1", step=1, persist=False).result(30)
    reader = open_checkpoint(root / "s1", verify=True, run_dir=run_dir, defer=True)  # pins it
    slot = reader.index.shard(0).file
    for step in (2, 3):  # s2 drops s1, and s3 is staged into another slot: s1's is not given back while pinned
        client.save_async(full(step), root / f"s{step}", step=step, persist=False).result(30)
    assert held_paths(run_dir) == {str(root / "s3")}  # dropped: no longer listed
    assert "event=snapshot_drop_deferred" in (run_dir / "ckptd.log").read_text()
    target = {"w": torch.zeros(50_000)}
    _, saved = reader.read(reader.index.shard(0), copy=False)
    reader.copy([(target["w"], saved["w"])])  # straight out of the pinned slot, checksummed as it goes
    assert target["w"].equal(full(1)["w"])
    assert slot in segments_of(daemon.proc.pid)
    reader.close()
    wait_until(lambda: slot not in segments_of(daemon.proc.pid), 10, "the slot is released once unpinned")
    client.save_async(full(4), root / "s4", step=4, persist=False).result(30)
    assert ckptd.load(root / "s4", run_dir=run_dir)["w"].equal(full(4)["w"])
    daemon.stop()


RESTORER = r'''
import json, resource, sys, torch, ckptd
run_dir, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = {"w": torch.zeros(n)}  # touched: a trainer's tensors exist before it restores into them
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ckptd.load_into(target, path, run_dir=run_dir)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(json.dumps({"grew": grew, "restored": bool(target["w"].equal(torch.full((n,), 7.0)))}))
'''


def test_load_into_from_memory_copies_straight_into_the_targets_without_a_copy_of_the_snapshot(
    daemon, client_factory, root, run_dir
) -> None:
    n = 50_000_000  # 200 MB
    client = client_factory()
    client.save_async({"w": torch.full((n,), 7.0)}, root / "s1", step=1, persist=False).result(60)
    out = subprocess.run([sys.executable, "-c", RESTORER, str(run_dir), str(root / "s1"), str(n)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["restored"]
    assert report["grew"] < n * 4 // 4, f"the restore's peak memory grew by {report['grew']} bytes"
    daemon.stop()


PINNER = r'''
import sys, time
from pathlib import Path
from ckptd.client.memory import open_checkpoint
files = open_checkpoint(Path(sys.argv[2]), verify=True, run_dir=sys.argv[1], defer=True)  # pins it
print(files.index.shard(0).file, flush=True)
time.sleep(120)  # the test kills us mid-read
'''


def test_the_pins_of_a_reader_that_dies_end_and_its_snapshot_is_released(daemon, client_factory, root,
                                                                         run_dir) -> None:
    client = client_factory()
    client.save_async(full(1), root / "s1", step=1, persist=False).result(30)
    reader = subprocess.Popen([sys.executable, "-c", PINNER, str(run_dir), str(root / "s1")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        slot = reader.stdout.readline().strip()
        assert slot, reader.stderr.read()[-3000:]
        client.save_async(full(2), root / "s2", step=2, persist=False).result(30)  # drops s1: deferred, pinned
        wait_until(lambda: "event=snapshot_drop_deferred" in (run_dir / "ckptd.log").read_text(), 10,
                   "the drop waits for the reader")
        assert slot in segments_of(daemon.proc.pid)
    finally:
        reader.kill()
        reader.wait(10)
    wait_until(lambda: slot not in segments_of(daemon.proc.pid), 30, "the dead reader's pin ends, the slot goes")
    assert held_paths(run_dir) == {str(root / "s2")}
    daemon.stop()


RNG_RESUMER = r"""
import json, os, sys, torch, ckptd
root, run_dir, saved = sys.argv[1], sys.argv[2], sys.argv[3]
path = ckptd.latest(root, run_dir=run_dir)
state = ckptd.load(path, run_dir=run_dir)
torch.set_rng_state(state["rng"])  # a plain resume, as a training script does it
storage = {k: [t.untyped_storage().nbytes(), t.nbytes, t.storage_offset()]
           for k, t in state.items() if isinstance(t, torch.Tensor)}
torch.save(state["rng"], saved)
print(json.dumps({"path": str(path), "draws": torch.rand(4).tolist(), "storage": storage,
                  "saved_bytes": os.path.getsize(saved)}))
"""


def _rng_state() -> dict[str, Any]:
    """A trainer's state with its RNG's (5 KB) beside a 16 MB tensor, in the same shard."""
    gen = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(4 << 20, generator=gen), "b": torch.arange(7), "rng": gen.get_state(), "step": 3}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["memory", "buddy", "disk", "store"])
def test_a_resume_of_the_rng_from_what_load_returns_works_and_every_tensor_owns_exactly_its_memory(
    source: str, daemon_factory, root: Path, run_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``torch.set_rng_state(ckptd.load(p)["rng"])`` from a snapshot held here, one restored from a buddy, a
    checkpoint on disk and one on an object store: a tensor from memory (or a store) used to view one buffer per
    shard, at an offset, and torch read the generator's state from the buffer's start (SIGSEGV); one small tensor
    kept the whole shard alive, and ``torch.save`` of it wrote the whole shard."""
    state, path, never = _rng_state(), root / "step-3", ("--persist-on-exit", "never")
    pair = None
    if source == "store":
        root = f"s3://{request.getfixturevalue('bucket')}/run"
        path = f"{root}/step-3"
    try:
        if source == "buddy":
            pair = _pair(root, tmp_path, origin_extra=never)
            client = ckptd.Client(run_dir=pair.origin_dir, spawn=False)
            client.save_async(state, path, step=3, persist=False).wait_replicated(60)
            client.close()
            pair.origin.kill()  # the node is lost; its replacement reads the snapshot back from the buddy
            run_dir, _ = _node(pair.keys, pair.lines)
            pair.keys.write_text("".join(pair.lines))
            pair.origin = start_daemon(run_dir, root, "--peer", pair.buddy_ep, "--peer-keys", str(pair.keys), *never)
        else:
            daemon_factory(*never, *(("--root", root) if source == "store" else ()))
            client = ckptd.Client(run_dir=run_dir, spawn=False)
            client.save_async(state, path, step=3, persist=source in ("disk", "store")).result(60)
            client.close()
        out = subprocess.run([sys.executable, "-c", RNG_RESUMER, str(root), str(run_dir), str(tmp_path / "rng.pt")],
                             capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, f"the resumer exited {out.returncode}: {out.stderr[-3000:]}"
        report = json.loads(out.stdout)
        assert report["path"] == str(path)
        if source != "store":
            assert path.exists() == (source == "disk")  # the snapshot was read from memory, never from disk
        if source == "buddy":
            assert "event=snapshot_restored" in (run_dir / "ckptd.log").read_text()
        gen = torch.Generator()
        gen.set_state(state["rng"])
        assert report["draws"] == torch.rand(4, generator=gen).tolist()  # the generator resumed where it was
        for name, (storage, nbytes, offset) in report["storage"].items():
            assert (storage, offset) == (nbytes, 0), f"{name}: {storage} bytes of storage at offset {offset}"
        assert report["saved_bytes"] < 64 << 10, f"torch.save of the RNG state wrote {report['saved_bytes']} bytes"
    finally:
        if pair is not None:
            pair.kill()
