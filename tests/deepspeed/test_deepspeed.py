"""ckptd's DeepSpeed checkpoint engine against a real DeepSpeed engine (0.19.8) on CPU, ZeRO stages 1 and 2.

Collected only by ``make test-deepspeed`` (its venv has DeepSpeed). The runs are ``tests/deepspeed/trainer.py``
(``examples/deepspeed_train.py``) on two processes under DeepSpeed's own launcher (``deepspeed --num_gpus 2``, its CPU
accelerator, gloo), against the test's daemon. A run killed in the middle of a save, resumed from ``latest``, must
see the same losses as the run never interrupted and end with its parameters and optimizer state, bit for bit. The
misuse tests build a one-process engine in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: no CUDA here

import pytest
import torch

import ckptd
from ckptd.integrations.deepspeed import LATEST, require_supported

from helpers import REPO, free_port, wait_until

TRAINER = REPO / "tests" / "deepspeed" / "trainer.py"
DEEPSPEED = Path(sys.executable).with_name("deepspeed")


def launch(daemon, out: Path, save_dir: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    """``tests/deepspeed/trainer.py`` on two processes (``deepspeed --num_gpus 2``), saving into ``save_dir``."""
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return subprocess.run([str(DEEPSPEED), "--master_port", str(free_port()), "--num_gpus", "2", str(TRAINER),
                           "--final", str(out), "--save-dir", str(save_dir), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def losses(stdout: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> the loss that rank printed at that step, as printed (``repr``: every bit)."""
    return {(int(r), int(s)): loss for r, s, loss in re.findall(r"^rank (\d) step (\d+) loss (\S+)$", stdout, re.M)}


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two saved states differ: tensors bit for bit (dtype included), containers item by item, any other
    object by its attributes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return differences(vars(a), vars(b), f"{where}.")
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_only_the_supported_deepspeed_release_is_accepted_and_another_is_named() -> None:
    require_supported("0.19.8")
    require_supported("0.19.0")
    for version in ("0.18.9", "0.20.0", "1.19.8", "main"):
        with pytest.raises(ImportError, match=rf"supports DeepSpeed 0\.19\.x, and DeepSpeed {version} is installed"):
            require_supported(version)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_killed_mid_save_resumes_from_the_last_whole_tag_bitwise(
        daemon, root: Path, tmp_path: Path, stage: int) -> None:
    """ZeRO stage ``stage`` on two ranks, saving every 3 steps to step 6. The uninterrupted run saves blocking on
    stage 2 (each tag committed and named by ``latest`` before ``save_checkpoint`` returns) and decoupled on stage 1.
    A second run dies at global_step6: rank 1 by SIGKILL once the daemon has written rank 0's shard into
    ``global_step6.incomplete`` and before it hands over its own. The tag is never committed and ``latest`` still
    names global_step3; a third run resumes from it and prints the uninterrupted run's losses for steps 4 to 6 and
    ends with its parameters, optimizer and scheduler state, bit for bit. The committed tag exports to DeepSpeed's
    own files, which hold the same model."""
    common = ("--steps", "6", "--save-every", "3", "--stage", str(stage))
    ref_out, killed_out, resumed_out = (tmp_path / name for name in ("ref", "killed", "resumed"))
    for folder in (ref_out, killed_out, resumed_out):
        folder.mkdir()
    ref, killed = root / "ref", root / "killed"
    done = ok(launch(daemon, ref_out, ref, *common, *(["--blocking"] if stage == 2 else [])))
    if stage == 2:
        assert done.count("committed global_step") == 2, done
    wait_until(lambda: (ref / LATEST).is_file() and (ref / LATEST).read_text() == "global_step6", timeout=60,
               what=lambda: f"latest naming global_step6 in {sorted(p.name for p in ref.iterdir())}")
    index = ckptd.read_index(ref / "global_step6")
    assert index.world_size == 2 and index.step == 6
    rank0 = ckptd.load(ref / "global_step6", rank=0)
    assert sorted(rank0["files"]) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert rank0["holders"] == {"mp_rank_00_model_states.pt": 0, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 0,
                                "zero_pp_rank_1_mp_rank_00_optim_states.pt": 1}

    died = launch(daemon, killed_out, killed, *common, "--die-at-save", "6", "--die-rank", "1")
    assert died.returncode != 0, died.stdout[-3000:]
    facts = json.loads((killed_out / "died-1.json").read_text())
    assert facts == {"step": 6, "other_shard_written": True, "committed": False, "latest": "global_step3"}, facts
    assert not (killed / "global_step6").exists() and (killed / LATEST).read_text() == "global_step3"
    assert ckptd.latest(killed, run_dir=daemon.run_dir) == killed / "global_step3"

    resumed = ok(launch(daemon, resumed_out, killed, *common))
    assert "rank 0: trained to step 6" in resumed and "rank 1: trained to step 6" in resumed
    expected, seen = losses(done), losses(resumed)
    assert sorted(seen) == [(r, s) for r in (0, 1) for s in (4, 5, 6)], resumed[-3000:]
    assert {key: expected[key] for key in seen} == seen
    for rank in (0, 1):
        assert differences(torch.load(ref_out / f"final-{rank}.pt", weights_only=False),
                           torch.load(resumed_out / f"final-{rank}.pt", weights_only=False)) == []
    assert (killed / LATEST).read_text() == "global_step6"

    exported = tmp_path / "exported" / "global_step6"  # the one command docs/integrations.md gives
    ok(subprocess.run([sys.executable, "-m", "ckptd.integrations.deepspeed", "export", str(ref / "global_step6"),
                       str(exported)], cwd=REPO, capture_output=True, text=True, timeout=120))
    assert sorted(p.name for p in exported.iterdir()) == sorted(rank0["holders"])
    model_states = torch.load(exported / "mp_rank_00_model_states.pt", weights_only=False)
    final = torch.load(ref_out / "final-0.pt", weights_only=False)
    assert model_states["global_steps"] == 6 and differences(model_states["module"], final["module"]) == []


RACES = REPO / "tests" / "deepspeed" / "races.py"


def races(daemon, mode: str, save_dir: Path) -> subprocess.CompletedProcess:
    """``tests/deepspeed/races.py MODE SAVE_DIR`` on two processes under DeepSpeed's launcher."""
    env = dict(os.environ, CKPTD_RUN_DIR=str(daemon.run_dir), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return subprocess.run([str(DEEPSPEED), "--master_port", str(free_port()), "--num_gpus", "2", str(RACES), mode,
                           str(save_dir)], env=env, cwd=REPO, capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(600)
def test_a_load_right_after_a_save_loads_the_same_tag_on_every_rank(daemon, root: Path) -> None:
    """Save, ``wait`` and load at once, three times on two ranks: rank 0 rewrites ``latest`` as the save commits, so
    rank 1 read the tag before it and loaded another step than rank 0, and the next save waited for ever for shards
    of two tags. Every rank loads the tag rank 0's ``latest`` names."""
    done = ok(races(daemon, "rollback", root / "rollback"))
    loaded = re.findall(r"^rank (\d) loaded (\S+) at step (\d+)$", done, re.M)
    assert sorted(loaded) == sorted((str(r), f"global_step{s}", str(s)) for r in (0, 1) for s in (2, 4, 6)), done


@pytest.mark.timeout(900)
def test_keep_last_1_with_rank_0_killed_right_after_a_save_leaves_latest_naming_a_whole_tag(
        daemon, root: Path, tmp_path: Path) -> None:
    """``keep_last=1``: global_step4 is handed over by both ranks and rank 0 dies before it sees the commit, so
    ``latest`` still names global_step2. The daemon's retention used to delete global_step2 at global_step4's
    commit, and every restart then failed on a ``latest`` naming a deleted tag; rank 0 deletes beyond K only once
    ``latest`` names the new tag, so global_step2 stays, and the next run resumes from it."""
    save_dir = root / "die"
    died = races(daemon, "die", save_dir)
    assert died.returncode != 0 and "rank 0 dies" in died.stdout, died.stdout[-3000:]
    wait_until(lambda: (save_dir / "global_step4" / "ckptd.json").is_file(), timeout=120,
               what="global_step4 committed (both ranks handed it over)")
    assert (save_dir / LATEST).read_text() == "global_step2"
    assert (save_dir / "global_step2" / "ckptd.json").is_file()
    out = tmp_path / "resumed"
    out.mkdir()
    resumed = ok(launch(daemon, out, save_dir, "--steps", "6", "--save-every", "2"))
    assert sorted(s for r, s in losses(resumed) if r == 0) == [3, 4, 5, 6], resumed[-3000:]


# -- misuse, on a one-process engine in this process ----------------------------

@pytest.fixture(scope="module")
def one_process() -> None:
    """torch.distributed on one process (gloo), as DeepSpeed's launcher would set it up, for this module."""
    import deepspeed
    import deepspeed.ops

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the example does: no compiled op
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()


def engine_for(stage: int = 1) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return train(engine, 1)


def train(engine: Any, steps: int) -> Any:
    for _ in range(steps):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(engine.global_steps))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return engine


def test_install_refuses_what_it_does_not_cover_and_a_second_install(one_process, daemon) -> None:
    from ckptd.integrations.deepspeed import install, wait

    with pytest.raises(TypeError, match="needs the engine deepspeed.initialize returned, got Sequential"):
        install(torch.nn.Sequential())
    engine = engine_for()
    with pytest.raises(TypeError, match="ckptd is not installed on DeepSpeedEngine"):
        wait(engine)
    with pytest.raises(ValueError, match="keep_last must be a whole number of tags, 1 or more"):
        install(engine, keep_last=0)
    with pytest.raises(TypeError, match="blocking must be True or False, got 'yes'"):
        install(engine, blocking="yes")
    for bad in (0, -5):  # refused here, not at every save_checkpoint after
        with pytest.raises(ValueError, match=f"commit_timeout must be a finite number of seconds above 0 .*got {bad}"):
            install(engine, commit_timeout=bad)
    installed = install(engine, run_dir=daemon.run_dir)
    assert engine.checkpoint_engine is installed
    with pytest.raises(RuntimeError, match="already installed on this engine"):
        install(engine, run_dir=daemon.run_dir)
    installed.cleanup()
    with pytest.raises(ValueError, match="does not cover ZeRO stage 3"):
        install(engine_for(stage=3))


def test_a_save_the_daemon_refuses_raises_at_wait_and_latest_never_names_it(
        one_process, daemon, root: Path, tmp_path: Path) -> None:
    """A ``save_dir`` outside the daemon's roots (``PathNotAllowed``, at the next step once the daemon answered, or
    at ``wait``), and a tag whose directory holds DeepSpeed's own
    files (``CheckpointExists``: ckptd never replaces what it did not write; the files stay as they were)."""
    from ckptd.integrations.deepspeed import install, wait

    engine = engine_for()
    installed = install(engine, run_dir=daemon.run_dir)
    try:
        outside = tmp_path / "outside"
        engine.save_checkpoint(str(outside), tag="t1")
        wait_until(lambda: installed._pending.future.done(), timeout=60, what="the daemon's answer")
        with pytest.raises(ckptd.PathNotAllowed):
            train(engine, 1)  # the engine asks at every step
        engine.save_checkpoint(str(outside), tag="t1")
        with pytest.raises(ckptd.PathNotAllowed):
            wait(engine)
        assert not (outside / LATEST).exists() and not (outside / "t1").exists()

        own = root / "own"
        own_engine = engine_for()
        own_engine.save_checkpoint(str(own), tag="t2")  # DeepSpeed's own engine: its own files
        before = sorted(p.name for p in (own / "t2").iterdir())
        engine.save_checkpoint(str(own), tag="t2")
        with pytest.raises(ckptd.CheckpointExists):
            wait(engine)
        assert sorted(p.name for p in (own / "t2").iterdir()) == before
    finally:
        installed.cleanup()


@pytest.mark.parametrize("stage", [0, 1])
def test_a_tag_of_deepspeeds_own_files_resumes_and_later_tags_go_through_ckptd(
        one_process, daemon, root: Path, stage: int) -> None:
    """A run switched over: the tag ``latest`` names holds DeepSpeed's own files, which the installed engine loads as
    DeepSpeed would; its next save is a ckptd tag, which ``latest`` then names, and which loads into a new engine
    with its parameters (two steps ahead of the new engine's) and optimizer state; ZeRO stage 0 (no ZeRO optimizer:
    rank 0's model states file holds the optimizer) and 1."""
    from ckptd.integrations.deepspeed import install

    folder = root / "switched"
    before = engine_for(stage)
    before.save_checkpoint(str(folder), tag="own1")
    engine = engine_for(stage)
    installed = install(engine, run_dir=daemon.run_dir, blocking=True)
    try:
        load_path, _ = engine.load_checkpoint(str(folder))
        assert load_path == str(folder / "own1" / "mp_rank_00_model_states.pt")
        train(engine, 2)
        engine.save_checkpoint(str(folder), tag="ckptd2")
        assert (folder / LATEST).read_text() == "ckptd2" and (folder / "ckptd2" / "ckptd.json").is_file()
        after = engine_for(stage)
        install(after, run_dir=daemon.run_dir)
        assert differences(after.module.state_dict(), engine.module.state_dict()) != []
        load_path, _ = after.load_checkpoint(str(folder))
        assert load_path == str(folder / "ckptd2" / "mp_rank_00_model_states.pt")
        assert differences(after.module.state_dict(), engine.module.state_dict()) == []
        assert differences(after.optimizer.state_dict(), engine.optimizer.state_dict()) == []
        assert after.global_steps == engine.global_steps == 3
        after.checkpoint_engine.cleanup()
    finally:
        installed.cleanup()
