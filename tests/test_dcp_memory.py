"""DCP reaches the memory tier: ``StorageWriter(persist=False)`` snapshots into node memory, ``StorageReader`` reads
a held snapshot from memory, and a DCP training loop killed between two saves resumes from its newest snapshot.

Each save is checked against what a user would see: the snapshot is listed by the daemon and not on disk,
``ckptd.latest`` names it, ``dcp.load`` reads it back bitwise without any file of it existing, and
``client.persist`` turns it into an ordinary checkpoint. The killed run is ``examples/dcp_train.py`` under
torchrun, every process of its tree SIGKILLed once a snapshot past the last disk save is held (and proved dead),
against a daemon started with ``--persist-on-exit never`` so nothing of the snapshot can reach the disk.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import ckptd
from ckptd.dcp import StorageReader, StorageWriter
from helpers import REPO, equal_states, status, torchrun_example, wait_until
from sharded_ranks import fsdp, full, run_rank, run_ranks


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)},
            "step": seed, "note": f"seed {seed}"}


def _blank() -> dict:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": -1, "note": ""}


def _held(run_dir: Path) -> dict[str, dict]:
    return {s["path"]: s for s in status(run_dir)["memory"]["snapshots"] if s["complete"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["save", "thread"])
def test_a_dcp_snapshot_is_held_in_memory_read_back_by_dcp_load_and_persisted_on_request(daemon, root, run_dir,
                                                                                      client_factory, mode,
                                                                                      monkeypatch):
    client = client_factory(commit_timeout=120)
    path = root / mode / "step-5"
    state = _state(5)
    writer = StorageWriter(path, client=client, step=5, persist=False)
    if mode == "save":
        dcp.save(state, storage_writer=writer)
    else:
        dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD).result(240)

    # Held, not written: nothing of it on disk, and the newest checkpoint of its directory all the same.
    assert not path.exists() and not path.with_name("step-5.incomplete").exists()
    wait_until(lambda: str(path) in _held(run_dir), 30, "the daemon to list the snapshot as held")
    assert _held(run_dir)[str(path)]["step"] == 5 and not _held(run_dir)[str(path)]["persisted"]
    assert ckptd.latest(path.parent, run_dir=run_dir) == path

    back = _blank()
    dcp.load(back, storage_reader=StorageReader(path, run_dir=run_dir))
    assert equal_states(back, state), "dcp.load read back other values than the snapshot held"
    monkeypatch.setenv("CKPTD_RUN_DIR", str(run_dir))  # how a classmethod finds the node's daemon
    assert StorageReader.validate_checkpoint_id(path), "DCP would not pick the reader for a held snapshot"
    assert not path.exists(), "reading the snapshot wrote it"

    assert client.persist(path, timeout=120) == path
    assert ckptd.read_index(path).step == 5
    assert equal_states(ckptd.load(path), state)


def _snapshot_through_dcp_process(rank: int, world: int, init: str, run_dir: str, path: str, out: str) -> None:
    """Rank ``rank`` snapshots an FSDP2 state with ``dcp.async_save`` (PROCESS executor: the writer runs in DCP's
    process of its own), then loads it back with ``dcp.load`` into a fresh state of the same shape."""
    def body() -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, optim = fsdp(world)
        msd, osd = get_state_dict(m, optim)
        state = {"model": msd, "optim": osd, "step": 7}
        reference = full(state)
        dcp.async_save(state, storage_writer=StorageWriter(path, run_dir=run_dir, step=7, persist=False,
                                                           commit_timeout=120),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(240)
        on_disk = Path(path).exists()
        fresh_m, fresh_o = fsdp(world)
        for p_ in fresh_m.parameters():
            with torch.no_grad():
                p_._local_tensor.zero_()
        fmsd, fosd = get_state_dict(fresh_m, fresh_o)
        back = {"model": fmsd, "optim": fosd, "step": 0}
        dcp.load(back, storage_reader=StorageReader(path, run_dir=run_dir))
        return {"on_disk": on_disk, "equal": equal_states(full(back), reference), "step": back["step"]}

    run_rank(rank, world, init, out, "process", body)


@pytest.mark.timeout(600)
def test_a_snapshot_through_the_process_executor_is_held_and_loaded_back_on_every_rank(daemon, root, run_dir,
                                                                                     tmp_path):
    path = root / "process" / "step-7"
    logs = run_ranks(_snapshot_through_dcp_process, 2, tmp_path, "process", str(run_dir), str(path), str(tmp_path))
    assert all(not log["on_disk"] for log in logs), logs
    assert all(log["equal"] and log["step"] == 7 for log in logs), logs
    assert str(path) in _held(run_dir)  # on disk too once the ranks' processes ended: persisted on their exit


def _snapshot_with_a_bad_rank(rank: int, world: int, init: str, run_dir: str, path: str, out: str) -> None:
    """Rank 1's state holds a value ckptd cannot keep (a set); rank 0's is fine. Both snapshot through DCP with the
    default commit timeout (600 s), then both retry with good states."""
    def body() -> dict:
        state = {"w": torch.full((64,), float(rank)), **({"bad": {1, 2}} if rank == 1 else {})}
        writer = StorageWriter(path, run_dir=run_dir, step=1, persist=False)
        try:
            dcp.save(state, storage_writer=writer)
            first = "saved"
        except CheckpointException as exc:
            first = str(exc)
        dcp.save({"w": torch.full((64,), float(rank))}, storage_writer=StorageWriter(path, run_dir=run_dir, step=1,
                                                                                     persist=False))
        return {"first": first}

    run_rank(rank, world, init, out, "bad", body)


@pytest.mark.timeout(200)  # the commit timeout is 600 s: waiting for it fails the test
def test_a_rank_whose_snapshot_fails_fails_the_others_at_once_naming_its_error(daemon, root, run_dir, tmp_path):
    path = root / "bad-rank" / "step-1"
    logs = run_ranks(_snapshot_with_a_bad_rank, 2, tmp_path, "bad", str(run_dir), str(path), str(tmp_path))
    assert all("state_dict['bad'] holds a builtins.set" in log["first"] for log in logs), logs
    assert "snapshot" in logs[0]["first"] and "was not held: rank 1: TypeError" in logs[0]["first"], logs[0]
    assert str(path) in _held(run_dir), "the retry with good states is held"


def test_the_reader_says_what_is_missing_when_neither_memory_nor_disk_holds_the_path(daemon, root, run_dir,
                                                                                     monkeypatch):
    monkeypatch.setenv("CKPTD_RUN_DIR", str(run_dir))
    missing = root / "never" / "step-1"
    with pytest.raises(CheckpointException, match="nor does the daemon of run directory .* hold a memory snapshot"):
        dcp.load(_blank(), storage_reader=StorageReader(missing, run_dir=run_dir))
    assert StorageReader.validate_checkpoint_id(missing) is False


EXAMPLE = REPO / "examples" / "dcp_train.py"


def _kill_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGKILL the launcher and every process it started; returns them, each proved gone."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    assert proc.wait(60) == -signal.SIGKILL, "the launcher did not die of the SIGKILL"
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"still running after SIGKILL: {alive}"
    return tree


@pytest.mark.timeout(600)
def test_a_dcp_loop_killed_between_two_saves_resumes_from_its_newest_snapshot_in_memory(daemon_factory, root,
                                                                                        run_dir):
    daemon = daemon_factory("--persist-on-exit", "never")
    ckpt_dir = root / "dcp-memory"
    env = dict(os.environ, CKPTD_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(EXAMPLE),
            "--ckpt-dir", str(ckpt_dir), "--save-every", "10", "--snapshot-every", "1"]
    proc = subprocess.Popen([*argv, "--steps", "200"], env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the state to kill at: a snapshot held after the step-10 save
            seen.append(line)
            if re.match(r"rank \d: step 12 held in memory", line):
                break
        else:
            pytest.fail(f"the run ended before step 12 was held: {''.join(seen)}")
    finally:
        _kill_tree(proc)
    assert not any("trained to step" in line for line in seen)

    persisted = sorted(int(p.name[5:]) for p in ckpt_dir.glob("step-??????") if (p / "ckptd.json").exists())
    assert 10 in persisted, f"the save of step 10 is not on disk: {persisted}"
    newest = ckptd.latest(ckpt_dir, run_dir=run_dir)
    assert newest is not None and newest.name != f"step-{max(persisted):06d}"
    step = int(newest.name[5:])
    assert step > max(persisted) and not newest.exists(), "the newest checkpoint is not a snapshot in memory only"
    held = ckptd.load(newest, run_dir=run_dir)  # from the daemon's memory: the snapshot is on no disk
    assert held["step"] == step

    second = torchrun_example(EXAMPLE, daemon, ckpt_dir, 2, "--steps", str(step + 2), "--save-every", "10",
                              "--snapshot-every", "1", timeout=240)
    match = re.search(r"resumed from step (\d+) on 2 ranks \((.*)\), weights digest (\S+)", second)
    assert match, second
    assert int(match.group(1)) == step and match.group(2) == str(newest), second
    assert float(match.group(3)) == sum(t.double().sum().item() for t in held["model"].values())
    assert f"rank 1: trained to step {step + 2}" in second
