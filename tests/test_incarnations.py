"""A checkpoint is only ever made of one run's shards, and its ranks agree on what they share.

A job whose rank died mid-save is restarted by its launcher and saves the
same path again: the new run must never complete the dead run's attempt
(three quarters old state, one quarter new, verifying fine). Ranks run as
real processes forked from the zygote, with their own ``ckptd.Client``;
"dying" is a SIGKILL whose exit status each test checks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ckptd
from ckptd.protocol.errors import CheckpointExists, Conflict
from helpers import status, wait_until
from zygote import Script

RANK = r'''
import json, os, sys, time
env, run_dir, path, rank, world, value, mode = json.loads(sys.argv[1]), *sys.argv[2:8]
os.environ.update(env)
import torch, ckptd
rank, world, value = int(rank), int(world), float(value)

def say(**kw):
    print(json.dumps(kw), flush=True)

client = ckptd.Client(run_dir=run_dir, spawn=False, rank=rank, world_size=world, timeout=60)
if mode == "connect-only":
    say(event="connected", pid=os.getpid())
    time.sleep(600)  # the test kills this rank before it ever saves
state = {"w": torch.full((1024,), value), "extra": {"seen": torch.zeros(4)} if mode.startswith("extra") else {},
         "rank": rank}
fut = client.save_async(state, path, step=int(env.get("STEP", "7")), persist=not mode.endswith("memory"),
                        replicated=("extra",) if mode.startswith("extra") or mode.startswith("repl") else ())
fut.staged.result()
say(event="staged", pid=os.getpid(), job=client.job)
if mode.startswith("hold"):
    time.sleep(600)  # the test kills this run
try:
    fut.result(timeout=120)
    say(event="done")
except Exception as exc:
    say(event="failed", kind=type(exc).__name__, message=str(exc))
client.close()
'''

RUN_1 = {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "0"}
RUN_2 = {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "1"}


class Rank:
    """One rank process: starts saving at once; ``event()`` reads its next JSON line."""

    def __init__(self, env: dict, run_dir: Path, path: Path, rank: int, world: int, value: float, mode: str) -> None:
        self.proc = Script(RANK, json.dumps(env), str(run_dir), str(path), str(rank), str(world), str(value), mode)

    def event(self, timeout: float = 120) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"rank exited early ({self.proc.wait(timeout)}): {self.proc.stderr.read()[-3000:]}"
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        assert self.proc.wait(30) == -signal.SIGKILL  # it died where the test said, not by itself


def ranks_values(path: Path) -> list[float]:
    return [float(ckptd.load(path, rank=r)["w"][0]) for r in range(ckptd.read_index(path).world_size)]


@pytest.mark.parametrize("launcher", [RUN_1, {}], ids=["torchrun-named", "unnamed"])
def test_a_restarted_job_never_completes_the_dead_jobs_checkpoint(daemon, root, launcher) -> None:
    """Run 1's rank 0 is durable, its rank 1 never saves, the launcher kills it and starts run 2, whose rank 1
    saves first. Unnamed runs are told apart by their processes alone."""
    path = root / "step-7"
    first = Rank(launcher, daemon.run_dir, path, 0, 2, 1.0, "hold")
    assert first.event()["event"] == "staged"
    first.kill()
    restart = RUN_2 if launcher else {}
    late = Rank(restart, daemon.run_dir, path, 1, 2, 2.0, "wait")
    assert late.event()["event"] == "staged"
    early = Rank(restart, daemon.run_dir, path, 0, 2, 2.0, "wait")
    assert early.event()["event"] == "staged"
    assert early.event() == {"event": "done"}
    assert late.event() == {"event": "done"}
    assert ranks_values(path) == [2.0, 2.0]  # never run 1's rank 0 beside run 2's rank 1
    assert not path.with_name("step-7.incomplete").exists()


@pytest.mark.parametrize("launcher", [RUN_1, {}], ids=["torchrun-named", "unnamed"])
def test_a_killed_rank_its_launcher_has_not_reaped_yet_counts_as_dead(daemon, root, launcher) -> None:
    """A SIGKILLed process stays a zombie until its parent waits for it, and ``kill(pid, 0)`` still succeeds on
    it: the dead run's rank must not look alive (which joined it to the new run, or refused the new run)."""
    path = root / "step-7"
    first = subprocess.Popen([sys.executable, "-c", RANK, json.dumps(launcher), str(daemon.run_dir), str(path), "0",
                              "2", "1.0", "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(first.stdout.readline())["event"] == "staged"
        os.kill(first.pid, signal.SIGKILL)  # not reaped: a zombie until first.wait()
        wait_until(lambda: Path(f"/proc/{first.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z", 30,
                   "the killed rank is a zombie")
        restart = RUN_2 if launcher else {}
        ranks = [Rank(restart, daemon.run_dir, path, r, 2, 2.0, "wait") for r in (1, 0)]
        for r in ranks:
            assert r.event()["event"] == "staged"
        for r in ranks:
            assert r.event() == {"event": "done"}
        assert ranks_values(path) == [2.0, 2.0]
    finally:
        first.kill()
        assert first.wait(30) == -signal.SIGKILL


def test_a_second_live_run_saving_the_same_path_is_refused_and_the_first_one_commits(daemon, root) -> None:
    path = root / "step-7"
    first = Rank(RUN_1, daemon.run_dir, path, 0, 2, 1.0, "wait")
    assert first.event()["event"] == "staged"
    intruder = Rank(RUN_2, daemon.run_dir, path, 1, 2, 2.0, "wait")
    assert intruder.event()["event"] == "staged"
    refused = intruder.event()
    assert refused["event"] == "failed" and refused["kind"] == Conflict.__name__, refused
    assert "another run of the job" in refused["message"] and "job-a:1" in refused["message"]
    own = Rank(RUN_1, daemon.run_dir, path, 1, 2, 1.0, "wait")
    assert own.event()["event"] == "staged"
    assert own.event() == {"event": "done"}
    assert first.event() == {"event": "done"}
    assert ranks_values(path) == [1.0, 1.0]


def test_an_attempt_whose_ranks_died_is_abandoned_at_once_not_after_the_commit_timeout(daemon, root) -> None:
    path = root / "step-7"
    rank = Rank({}, daemon.run_dir, path, 0, 2, 1.0, "hold")  # the client's commit timeout: 600 s
    pid = rank.event()["pid"]
    wait_until(lambda: path.with_name("step-7.incomplete").exists(), 60, "rank 0's attempt started")
    rank.kill()
    wait_until(lambda: not status(daemon.run_dir)["checkpoints"] and not path.with_name("step-7.incomplete").exists(),
               60, lambda: f"the dead run's attempt is still pending: {status(daemon.run_dir)['checkpoints']}")
    errors = " ".join(e["message"] for e in status(daemon.run_dir)["errors"])
    assert f"rank(s) 0 (pid {pid}) died" in errors and "abandoned" in errors
    assert not path.exists()


def test_a_restarted_job_never_joins_the_dead_jobs_snapshot(daemon, root) -> None:
    """Run 1 snapshots step 10 on both ranks and step 20 on rank 0 only, then dies; run 2's rank 1 snapshots
    step 20 first. The committed step 20 is run 2's alone, and step 10 was never dropped for a mix."""
    env10, env20 = {**RUN_1, "STEP": "10"}, {**RUN_1, "STEP": "20"}
    a = [Rank(env10, daemon.run_dir, root / "step-10", r, 2, 1.0, "wait-memory") for r in range(2)]
    for r in a:
        assert r.event()["event"] == "staged"
        assert r.event() == {"event": "done"}
    b = Rank(env20, daemon.run_dir, root / "step-20", 0, 2, 1.0, "hold-memory")
    assert b.event()["event"] == "staged"
    b.kill()
    assert ckptd.latest(root, run_dir=daemon.run_dir) == root / "step-10"
    again = {**RUN_2, "STEP": "20"}
    late = Rank(again, daemon.run_dir, root / "step-20", 1, 2, 2.0, "wait-memory")
    assert late.event()["event"] == "staged"
    assert ckptd.latest(root, run_dir=daemon.run_dir) == root / "step-10"  # step 20 is not complete yet
    early = Rank(again, daemon.run_dir, root / "step-20", 0, 2, 2.0, "wait-memory")
    assert early.event()["event"] == "staged"
    assert early.event() == {"event": "done"}
    assert late.event() == {"event": "done"}
    assert ckptd.latest(root, run_dir=daemon.run_dir) == root / "step-20"
    assert [float(ckptd.load(root / "step-20", rank=r, run_dir=daemon.run_dir)["w"][0]) for r in range(2)] == [2.0, 2.0]


@pytest.mark.parametrize("persist", [True, False], ids=["disk", "memory"])
def test_ranks_that_disagree_on_a_replicated_key_fail_the_save_on_every_rank(daemon, root, persist) -> None:
    """Rank 1 holds an extra tensor under ``replicated=("extra",)``: both ranks are told, naming the key."""
    path = root / "step-7"
    mode = ("extra" if persist else "extra-memory"), ("repl" if persist else "repl-memory")
    ranks = [Rank({}, daemon.run_dir, path, 0, 2, 1.0, mode[1]), Rank({}, daemon.run_dir, path, 1, 2, 1.0, mode[0])]
    for r in ranks:
        assert r.event()["event"] == "staged"
    for outcome in [r.event() for r in ranks]:
        assert outcome["event"] == "failed" and outcome["kind"] == Conflict.__name__, outcome
        assert "'extra'" in outcome["message"] and "ranks 0 and 1" in outcome["message"]
    assert not path.exists()
    wait_until(lambda: not path.with_name("step-7.incomplete").exists(), 60, "the failed attempt's directory went")
    assert ckptd.latest(root, run_dir=daemon.run_dir) is None


def test_ranks_with_equal_replicated_structure_commit_it_once(daemon, root) -> None:
    path = root / "step-7"
    ranks = [Rank({}, daemon.run_dir, path, r, 2, 1.0 + r, "extra") for r in range(2)]
    for r in ranks:
        assert r.event()["event"] == "staged"
    for r in ranks:
        assert r.event() == {"event": "done"}
    assert ranks_values(path) == [1.0, 2.0]
    assert [int(ckptd.load(path, rank=r)["rank"]) for r in range(2)] == [0, 1]


def test_a_job_name_must_be_printable_text(daemon, client_factory) -> None:
    with pytest.raises(ValueError, match="job must be 1 to 256 printable characters"):
        client_factory(job="bad\nname")
    with pytest.raises(TypeError, match="job must be a str"):
        client_factory(job=7)
    assert client_factory(job="my-run-3").job == "my-run-3"
    with pytest.raises(ValueError, match="not all spaces"):
        client_factory(job="  ")


@pytest.mark.parametrize("run_id", ["x" * 300, "line\nbreak"], ids=["long", "newline"])
def test_a_launcher_run_id_of_any_text_names_the_run_by_its_digest(daemon, client_factory, monkeypatch,
                                                                     run_id) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = client_factory().job
    assert first.startswith("torchelastic:") and len(first) <= 256 and first.isprintable()
    assert client_factory().job == first  # every rank of the run computes the same name
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert client_factory().job != first  # and a restart another one


def test_an_existing_checkpoint_is_never_joined_by_a_restart(daemon, root) -> None:
    """A committed checkpoint stays what its run saved: a restarted run saving it again is told it exists."""
    path = root / "step-7"
    ranks = [Rank(RUN_1, daemon.run_dir, path, r, 2, 1.0, "wait") for r in range(2)]
    for r in ranks:
        assert r.event()["event"] == "staged"
    for r in ranks:
        assert r.event() == {"event": "done"}
    again = Rank(RUN_2, daemon.run_dir, path, 1, 2, 2.0, "wait")
    assert again.event()["event"] == "staged"
    outcome = again.event()
    assert outcome["event"] == "failed" and outcome["kind"] == CheckpointExists.__name__, outcome
    assert ranks_values(path) == [1.0, 1.0]


@pytest.mark.parametrize("mode", ["wait", "wait-memory"], ids=["disk", "memory"])
def test_ranks_of_one_run_that_disagree_on_the_world_fail_the_save_on_every_rank_at_once(daemon, root, mode) -> None:
    """Rank 0 says two ranks, rank 1 says three: the run's save is broken, and rank 0 is told now, not after the
    commit timeout (600 s here) while it waits for a rank 1 of a two-rank world that already came."""
    path = root / "step-7"
    first = Rank(RUN_1, daemon.run_dir, path, 0, 2, 1.0, mode)
    assert first.event()["event"] == "staged"
    second = Rank(RUN_1, daemon.run_dir, path, 1, 3, 1.0, mode)
    assert second.event()["event"] == "staged"
    for outcome in (second.event(), first.event()):
        assert outcome["event"] == "failed" and outcome["kind"] == Conflict.__name__, outcome
        assert "rank 1 says world size 3" in outcome["message"] and "said world size 2" in outcome["message"]
    assert not path.exists()


@pytest.mark.parametrize("mode", ["wait", "wait-memory"], ids=["disk", "memory"])
def test_a_rank_of_a_named_run_that_dies_before_it_saves_fails_its_runs_save_at_once(daemon, root, mode) -> None:
    """Rank 1 connected (its hello names its run and rank) and was killed before it saved: rank 0's save can
    never complete, and is failed when the daemon sees rank 1 die, not after the 600 s commit timeout."""
    path = root / "step-7"
    doomed = Rank(RUN_1, daemon.run_dir, path, 1, 2, 1.0, "connect-only")
    pid = doomed.event()["pid"]
    first = Rank(RUN_1, daemon.run_dir, path, 0, 2, 1.0, mode)
    assert first.event()["event"] == "staged"
    doomed.kill()
    outcome = first.event()
    assert outcome["event"] == "failed" and outcome["kind"] == "RanksMissing", outcome
    assert f"its rank 1 (pid {pid}) died before that rank saved" in outcome["message"], outcome
    wait_until(lambda: not path.with_name("step-7.incomplete").exists(), 60, "the attempt's directory removed")
