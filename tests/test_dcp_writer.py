"""``ckptd.dcp.StorageWriter``: DCP's own ``save`` and ``async_save`` write ckptd checkpoints through a real daemon.

Two gloo ranks save an FSDP2 model with its AdamW state, a DTensor and plain
values with ``dcp.save``, ``dcp.async_save`` (THREAD), ``dcp.async_save``
(PROCESS) and ``dcp.async_save`` with the writer as its own stager (the
state is overwritten as soon as it returns; PROCESS is refused there); each checkpoint is read back in one process (world size 1, so
resharded) by ``ckptd.load``, ``ckptd.load_into``, ``dcp.load`` with
``ckptd.dcp.StorageReader`` and DCP's ``HuggingFaceStorageReader``. A rank
whose write fails leaves nothing pending: the path is free for a retry at once.
"""

from __future__ import annotations

import json
import pickle
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptd
from ckptd.dcp import StorageReader, StorageWriter
from ckptd.protocol.errors import Conflict
from ckptd.protocol.index import ShardRecord, shard_name
from ckptd.protocol.messages import Finalize
from helpers import REPO, equal_states, short_tempdir, start_daemon, torchrun_example, wait_until
from sharded_ranks import fsdp, full, run_rank, run_ranks

MODES = ("save", "thread", "process", "slot")


@pytest.fixture(scope="module")
def daemon_at(tmp_path_factory):
    root, run_dir = tmp_path_factory.mktemp("dcpw") / "ckpts", short_tempdir("ckdcpw-")
    root.mkdir()
    daemon = start_daemon(run_dir, root)
    yield root, run_dir
    daemon.kill()


def _state(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    m, optim = fsdp(world)
    msd, osd = get_state_dict(m, optim)
    grid = torch.arange(6 * 5, dtype=torch.float64).reshape(6, 5)
    return {"model": msd, "optim": osd, "epoch": 3, "note": "first run", "sizes": [1, 2, 3],
            "grid": distribute_tensor(grid, init_device_mesh("cpu", (world,)), [Shard(1)])}


def _save_every_way(rank: int, world: int, init: str, run_dir: str, root: str, out: str) -> None:
    def body() -> dict:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        state = _state(rank, world)
        reference = full(state)  # a collective: every rank takes part
        if rank == 0:
            torch.save(reference, Path(out) / "reference.pt")
        writer = StorageWriter(Path(root, "save"), run_dir=run_dir, step=1, commit_timeout=120)
        try:
            dcp.save(state, storage_writer=writer)
            thread = dcp.async_save(state, storage_writer=StorageWriter(Path(root, "thread"), client=writer.client,
                                                                        step=2))
            thread.result(120)
            process = dcp.async_save(state, storage_writer=StorageWriter(Path(root, "process"), client=writer.client,
                                                                         step=3),
                                     async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            process.result(300)
            # Its own stager: async_save returns once the planned items are in the slot; changes after that
            # are not in the checkpoint.
            slot = dcp.async_save(state, storage_writer=StorageWriter(Path(root, "slot"), client=writer.client,
                                                                      step=4, stage_in_slot=True))
            _scribble(state)
            slot.result(120)
            try:
                dcp.async_save(state, storage_writer=StorageWriter(Path(root, "refused"), client=writer.client,
                                                                   stage_in_slot=True),
                               async_checkpointer_type=AsyncCheckpointerType.PROCESS)
                refused = "saved"
            except ValueError as exc:
                refused = str(exc)
        finally:
            writer.close()
        return {"refused": refused}

    run_rank(rank, world, init, out, "save", body)


def _scribble(state: object) -> None:
    """Overwrite every tensor of ``state`` in place (a DTensor's local shard)."""
    if isinstance(state, dict):
        for v in state.values():
            _scribble(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            _scribble(v)
    elif isinstance(state, torch.Tensor):
        with torch.no_grad():
            getattr(state, "_local_tensor", state).fill_(-1)


@pytest.fixture(scope="module")
def saved(daemon_at, tmp_path_factory) -> tuple[Path, dict]:
    root, run_dir = daemon_at
    out = tmp_path_factory.mktemp("dcpw-out")
    logs = run_ranks(_save_every_way, 2, out, "save", str(run_dir), str(root), str(out))
    assert all("THREAD executor only" in log["refused"] for log in logs), logs
    assert not (root / "refused").exists()
    return root, torch.load(out / "reference.pt")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", MODES)
def test_each_way_of_saving_commits_a_checkpoint_ckptd_load_reads_whole(saved, mode: str):
    root, reference = saved
    index = ckptd.read_index(root / mode)
    assert index.world_size == 2 and index.step == MODES.index(mode) + 1
    assert not list(root.glob("*.incomplete"))
    loaded = ckptd.load(root / mode)
    assert equal_states(loaded, reference), mode
    assert ckptd.verify_checkpoint(root / mode).ok


@pytest.mark.parametrize("mode", MODES)
def test_dcp_load_with_ckptd_reader_reshards_onto_one_process(saved, mode: str):
    root, reference = saved
    state = {"model": {k: torch.zeros_like(v) for k, v in reference["model"].items()},
             "grid": torch.zeros(6, 5, dtype=torch.float64), "epoch": 0, "note": ""}
    dcp.load(state, storage_reader=StorageReader(root / mode))
    assert equal_states(state, {k: reference[k] for k in state})


def test_load_into_and_dcps_safetensors_reader_read_it_too(saved):
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    root, reference = saved
    target = {k: torch.zeros_like(v) for k, v in reference["model"].items()}
    ckptd.load_into(target, root / "save", key="model")
    assert equal_states(target, reference["model"])
    want = {"model.0.weight": reference["model"]["0.weight"], "grid": reference["grid"],
            "optim.state.0.weight.exp_avg": reference["optim"]["state"]["0.weight"]["exp_avg"]}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=HuggingFaceStorageReader(str(root / "process")))
    assert equal_states(got, want)


def _fail_then_retry(rank: int, world: int, init: str, run_dir: str, path: str, out: str) -> None:
    def body() -> dict:
        import torch.distributed as dist

        writer = StorageWriter(path, run_dir=run_dir, commit_timeout=600)  # far longer than this test waits
        log: dict = {}
        try:
            bad = {"w": torch.full((4,), float(rank)), "extra": object() if rank == 1 else 1}
            try:
                dcp.save(bad, storage_writer=writer)
                log["first"] = "saved"
            except CheckpointException as exc:
                log["first"] = str(exc)
            # Nothing of the failed attempt may stay pending: its directory goes, and the path is free.
            wait_until(lambda: not list(Path(path).parent.glob("*.incomplete")), timeout=60,
                       what="the failed attempt's directory to go")
            dist.barrier()
            dcp.save({"w": torch.full((4,), 7.0), "extra": 1}, storage_writer=writer)
            log["retry"] = "saved"
        finally:
            writer.close()
        return log

    run_rank(rank, world, init, out, "fail", body)


@pytest.mark.timeout(600)
def test_a_rank_whose_write_fails_aborts_the_attempt_and_the_retry_commits(daemon_at, tmp_path: Path):
    root, run_dir = daemon_at
    path = root / "failing" / "ckpt"
    path.parent.mkdir()
    logs = run_ranks(_fail_then_retry, 2, tmp_path, "fail", str(run_dir), str(path), str(tmp_path))
    assert all(log["first"] != "saved" for log in logs), logs
    assert "state_dict['extra']" in logs[1]["first"], logs[1]  # the refusal names the key
    assert all(log["retry"] == "saved" for log in logs), logs
    assert torch.equal(ckptd.load(path)["w"], torch.full((4,), 7.0))


def test_the_writer_pickles_without_its_client_and_checks_its_arguments(daemon_at):
    root, run_dir = daemon_at
    with ckptd.Client(run_dir=run_dir, spawn=False) as client:
        writer = StorageWriter(root / "p", client=client, step=4)
        copy = pickle.loads(pickle.dumps(writer))
        assert copy._client is None and copy.path == str(root / "p") and copy.step == 4
        assert copy.run_dir == str(run_dir)
        with pytest.raises(TypeError, match="client"):
            StorageWriter(root / "p", client="me")
        with pytest.raises(ValueError, match="step"):
            StorageWriter(root / "p", client=client, step=-1)
        with pytest.raises(TypeError, match="overwrite"):
            StorageWriter(root / "p", client=client, overwrite="yes")
        with pytest.raises(TypeError, match="stage_in_slot"):
            StorageWriter(root / "p", client=client, stage_in_slot="yes")
        assert not hasattr(writer, "stage")  # not a stager: DCP's own stages a copy for either executor
        assert hasattr(StorageWriter(root / "p", client=client, stage_in_slot=True), "stage")
        assert StorageWriter.validate_checkpoint_id(root / "p") and not StorageWriter.validate_checkpoint_id(5)


def test_a_value_msgpack_cannot_hold_is_refused_naming_its_key(daemon_at):
    root, run_dir = daemon_at
    with ckptd.Client(run_dir=run_dir, spawn=False) as client:
        with pytest.raises(CheckpointException, match=r"state_dict\['opt'\]\['fn'\]"):
            dcp.save({"w": torch.ones(2), "opt": {"fn": len}}, storage_writer=StorageWriter(root / "refused",
                                                                                           client=client))
    assert not (root / "refused").exists()
    wait_until(lambda: not list(root.glob("refused*")), timeout=60, what="the refused attempt's directory to go")


EXAMPLE = REPO / "examples" / "dcp_train.py"


def _run_example(daemon, ckpt_dir: Path, procs: int, steps: int) -> str:
    return torchrun_example(EXAMPLE, daemon, ckpt_dir, procs, "--steps", str(steps), "--save-every", "3", timeout=150)


@pytest.mark.timeout(400)
def test_the_dcp_example_trains_on_two_ranks_and_resumes_on_three(daemon, root: Path) -> None:
    ckpt_dir = root / "dcp"
    first = _run_example(daemon, ckpt_dir, 2, 6)
    assert f"no checkpoint under {ckpt_dir}; starting from step 0 on 2 ranks" in first
    assert "committed steps [3, 6]" in first and "rank 1: trained to step 6" in first
    six = ckpt_dir / "step-000006"
    assert ckptd.read_index(six).world_size == 2 and ckptd.read_index(six).step == 6

    second = _run_example(daemon, ckpt_dir, 3, 9)
    match = re.search(r"resumed from step 6 on 3 ranks \((.*)\), weights digest (\S+)", second)
    assert match and match.group(1) == str(six), second
    saved = ckptd.load(six)
    assert saved["step"] == 6
    assert float(match.group(2)) == sum(t.double().sum().item() for t in saved["model"].values())
    assert "committed steps [9]" in second and "rank 2: trained to step 9" in second
    assert ckptd.read_index(ckpt_dir / "step-000009").world_size == 3


def _rank_of_a_run(rank: int, world: int, init: str, run_dir: str, path: str, out: str, run: str) -> None:
    """Rank ``rank`` of run ``run`` ("A" or "B", a launch of its own) saves two tensors filled with the run's value
    to ``path`` through DCP (each rank writes one: DCP's de-duplication). A's rank 0 touches ``out/A0-durable``
    once its shard is durable; A's rank 1 is late: it writes only once ``out/B-ended`` exists; B's ranks write only
    once A's rank 0 is durable."""
    def body() -> dict:
        import ckptd.client.dcp_writer as dcp_writer

        signals = Path(out)
        if run == "A" and rank == 0:  # the agreement follows the Durable reply: a sign that the shard is durable
            agree = dcp_writer.all_gather_msgpack

            def agree_once_durable(value, group):
                (signals / "A0-durable").touch()
                return agree(value, group)

            dcp_writer.all_gather_msgpack = agree_once_durable
        gate = "B-ended" if run == "A" else "A0-durable"

        class Gated(StorageWriter):
            def write_data(self, plan, planner):
                if (run, rank) != ("A", 0):
                    wait_until(lambda: (signals / gate).exists(), timeout=240, what=gate)
                return super().write_data(plan, planner)

        client = ckptd.Client(run_dir=run_dir, spawn=False, commit_timeout=240, job=f"run-{run}")
        try:
            value = 1.0 if run == "A" else 2.0
            dcp.save({"a": torch.full((1 << 16,), value), "b": torch.full((1 << 16,), value)},
                     storage_writer=Gated(path, client=client))
            return {"outcome": "saved"}
        except CheckpointException as exc:
            return {"outcome": str(exc)}
        finally:
            client.close()

    run_rank(rank, world, init, out, run, body)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launch", ["after A's first shard is durable", "at once"])
def test_a_second_run_saving_the_same_path_is_refused_and_the_first_commits_its_own_data(daemon_at, tmp_path: Path,
                                                                                        launch: str):
    """Run B (another launch: another run name) saves the path run A is saving, while A's rank 0 is durable
    and A's rank 1 is late: B's ranks get Conflict, the Abort B's writer then sends ends nothing of A's, a
    Finalize of B's is refused, and A commits with A's data."""
    from helpers import join_ranks
    from zygote import start_ranks

    root, run_dir = daemon_at
    path = root / "two-runs" / launch.replace(" ", "-").replace("'", "")
    runs = {}
    for run in ("A", "B"):
        if run == "B" and launch != "at once":
            wait_until(lambda: (tmp_path / "A0-durable").exists(), timeout=240, what="A's rank 0 to be durable")
        runs[run] = start_ranks(_rank_of_a_run, (2, str(tmp_path / f"init-{run}"), str(run_dir), str(path),
                                                 str(tmp_path), run), 2)
    try:
        join_ranks(runs["B"], time.monotonic() + 300, "run B did not end")
        with ckptd.Client(run_dir=run_dir, spawn=False, job="run-B") as intruder:  # nor may B publish A's shards
            conn, files = intruder._conn, tuple(ShardRecord(shard_name(r, 2), r, 4096, 0, 1) for r in range(2))
            with pytest.raises(Conflict, match="is being saved by another run of the job"):
                conn.call(Finalize(conn.next_id(), str(path), 2, None, False, None, files, "run-B"))
        (tmp_path / "B-ended").touch()
        join_ranks(runs["A"], time.monotonic() + 300, "run A did not end")
    finally:
        for ctx in runs.values():
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
    logs = {(run, r): json.loads((tmp_path / f"{run}-{r}.json").read_text()) for run in "AB" for r in range(2)}
    assert all("crash" not in log for log in logs.values()), logs
    assert all("is being saved by another run of the job" in logs["B", r]["outcome"] for r in range(2)), logs
    assert logs["A", 0]["outcome"] == logs["A", 1]["outcome"] == "saved", logs
    assert [f.tensors for f in ckptd.read_index(path).files] == [1, 1]  # both ranks' shards
    loaded = ckptd.load(path)
    assert set(loaded) == {"a", "b"} and all(torch.equal(t, torch.full((1 << 16,), 1.0)) for t in loaded.values())
    logged = (Path(run_dir) / "ckptd.log").read_text()
    assert f"event=abort_of_other_run path={path} job='run-B' attempt_job='run-A'" in logged  # B did abort


def _rank_on_a_node_of_its_own(rank: int, world: int, init: str, run_dirs: list[str], path: str, out: str) -> None:
    """Rank ``rank`` saves through its own node's daemon (``run_dirs[rank]``), twice to one path, then stays alive
    until ``out/checked`` exists."""
    def body() -> dict:
        client = ckptd.Client(run_dir=run_dirs[rank], spawn=False, commit_timeout=120)
        outcome = "saved"
        try:
            dcp.save({"a": torch.ones(16), "b": torch.ones(16)}, storage_writer=StorageWriter(path, client=client))
            # at once again: node 1's daemon may not have seen the first attempt published yet
            dcp.save({"a": torch.full((16,), 2.0), "b": torch.full((16,), 2.0)},
                     storage_writer=StorageWriter(path, client=client, overwrite=True))
        except CheckpointException as exc:
            outcome = f"{exc} {exc.failures!r:.2000}"
        try:
            (Path(out) / f"saved-{rank}").write_text(outcome)
            wait_until(lambda: (Path(out) / "checked").exists(), timeout=240, what="the test's check")
        finally:
            client.close()
        return {}

    run_rank(rank, world, init, out, "node", body)


@pytest.mark.timeout(600)
def test_another_nodes_daemon_lets_go_of_its_shards_once_global_rank_0s_daemon_published_them(tmp_path: Path):
    """A coordinated attempt is kept on each node until it ends; on a node whose daemon does not publish it, it
    ends when its directory is gone (not only when its ranks die), or when a rank of its run saves the path
    again (the run agreed on the save before)."""
    from helpers import join_ranks, wait_for_ranks
    from zygote import start_ranks

    root, run_dirs = tmp_path / "ckpts", [short_tempdir("ckn0-"), short_tempdir("ckn1-")]
    root.mkdir()
    daemons = [start_daemon(run_dir, root) for run_dir in run_dirs]
    ctx = start_ranks(_rank_on_a_node_of_its_own, (2, str(tmp_path / "init"), [str(d) for d in run_dirs],
                                                   str(root / "ckpt"), str(tmp_path)), 2)
    try:
        deadline = time.monotonic() + 300
        wait_for_ranks(tmp_path, "saved", 2, ctx, deadline, "the saves did not end")
        assert [(tmp_path / f"saved-{r}").read_text() for r in range(2)] == ["saved", "saved"]
        assert ckptd.read_index(root / "ckpt").world_size == 2
        assert all(torch.equal(t, torch.full((16,), 2.0)) for t in ckptd.load(root / "ckpt").values())
        assert daemons[0].status()["completed"]["count"] == 2 and daemons[1].status()["completed"]["count"] == 0
        wait_until(lambda: not daemons[1].status()["checkpoints"], timeout=120,
                   what="node 1's daemon to let go of the attempt node 0's published")
        assert all(p.is_alive() for p in ctx.processes)  # let go because it was published, not because they died
        (tmp_path / "checked").touch()
        join_ranks(ctx, deadline)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for daemon in daemons:
            daemon.kill()
