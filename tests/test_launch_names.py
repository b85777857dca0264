"""Two live launches of one script never make one checkpoint, whatever their launcher calls them.

torchrun's static rendezvous (``--master-port``) and its c10d rendezvous
without ``--rdzv-id`` name every launch ``none``, also where several torchruns
share one Slurm step (its job and step ids); two torchruns of one allocation
are often given one ``--rdzv-id``; a Slurm job's batch step has no step id;
a hand-written launcher names nothing. Runs named alike by their launcher must still be told apart: the
ranks agree on a name over torch.distributed (``client/incarnation.py``). Each
test starts two real launches (torchrun forked from the zygote, its ranks
fresh interpreters; or ranks started the way ``srun`` or a hand-written
launcher does), with rank 0 of launch A and rank 1 of launch B saving one
path while both live: B's rank is refused, A commits only its own shards, and
B's rank 0 then finds A's checkpoint there.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

import ckptd
from helpers import REPO, wait_until
from zygote import Script, _RUN_MODULE

RANK = r'''
import json, os, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
os.environ.update(args["env"])
import torch, torch.distributed as dist, ckptd

if args["process_group"]:
    if "RANK" in os.environ:  # torchrun, or a launcher that sets torchrun's variables
        dist.init_process_group("gloo")
    else:  # srun: Slurm's variables
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}",
                                rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]))
client = ckptd.Client(run_dir=args["run_dir"], spawn=False, timeout=60)
out, name, rank = Path(args["out"]), args["name"], client.rank

def say(event, **kw):
    tmp = out / f".{name}-{rank}-{event}"
    tmp.write_text(json.dumps(kw))
    tmp.rename(out / f"{name}-{rank}-{event}.json")

say("ready", job=client.job, pid=os.getpid())
while not (out / f"go-{name}-{rank}").exists():  # the test says when this rank saves
    time.sleep(0.02)
fut = client.save_async({"w": torch.full((256,), args["value"]), "rank": rank}, args["path"], step=7)
try:
    fut.result(timeout=120)
    say("result", outcome="done")
except Exception as exc:
    say("result", outcome=type(exc).__name__, message=str(exc))
client.close()
if dist.is_initialized():
    dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """One launch of a two-rank job: its processes, and what its ranks wrote under ``out``."""

    def __init__(self, form: str, name: str, out: Path, run_dir: Path, path: Path, value: float) -> None:
        self.name, self.out = name, out
        port = free_port()
        script = out / "rank.py"
        script.write_text(RANK)
        args = {"env": {"OMP_NUM_THREADS": "1"}, "process_group": not form.endswith("no-process-group"),
                "run_dir": str(run_dir), "out": str(out), "name": name, "path": str(path), "value": value,
                "port": port}
        if form.startswith("torchrun"):
            c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
            rendezvous = {"torchrun-c10d": c10d, "torchrun-c10d-one-rdzv-id": [*c10d, "--rdzv-id", "4242"]}.get(
                form, ["--master-addr", "127.0.0.1", "--master-port", str(port)])
            env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SLURM"))}
            if form == "torchrun-in-srun-step":  # two torchruns started by one srun step: its ids are both's
                env.update({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "0"})
            self.procs = [Script(_RUN_MODULE, str(REPO), json.dumps(env), "torch.distributed.run",
                                 "--nnodes", "1", "--nproc-per-node", "2", *rendezvous, str(script), json.dumps(args))]
        else:
            self.procs = []
            for rank in (0, 1):
                if form == "slurm-batch":  # srun-less ranks of one batch step: a job id, no step id
                    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2"}
                else:  # a launcher that sets torchrun's variables and names nothing
                    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                self.procs.append(Script("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                                         str(script), json.dumps({**args, "env": {**args["env"], **env}})))

    def said(self, rank: int, event: str) -> dict | None:
        f = self.out / f"{self.name}-{rank}-{event}.json"
        return json.loads(f.read_text()) if f.exists() else None

    def wait(self, rank: int, event: str) -> dict:
        # the process that runs ``rank`` (torchrun runs both): a rank that has its answer exits while the other
        # still saves
        proc = self.procs[rank] if len(self.procs) > 1 else self.procs[0]
        wait_until(lambda: self.said(rank, event) is not None or proc.poll() is not None, 180,
                   f"launch {self.name} rank {rank} says {event}")
        said = self.said(rank, event)
        assert said is not None, f"launch {self.name} exited early: {self.output()}"
        return said

    def go(self, rank: int) -> None:
        (self.out / f"go-{self.name}-{rank}").touch()

    def output(self) -> str:
        return "\n".join(f"exit {p.poll()}: {p.stderr.read()[-4000:]}" for p in self.procs if p.poll() is not None)

    def finish(self) -> None:
        for p in self.procs:
            assert p.wait(120) == 0, self.output()

    def kill(self) -> None:
        for p in self.procs:
            p.kill()


def saving(daemon, path: Path) -> bool:
    """The daemon holds an attempt at ``path`` with one rank durable (or being written)."""
    info = daemon.status()
    return any(s["path"] == str(path) for s in info["saves"]) or any(
        c["path"] == str(path) for c in info["checkpoints"])


FORMS = ["torchrun-static", "torchrun-c10d", "torchrun-c10d-one-rdzv-id", "torchrun-in-srun-step",
         "torchrun-static-no-process-group", "slurm-batch", "no-launcher", "no-launcher-no-process-group"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("form", FORMS)
def test_two_live_launches_named_alike_by_their_launcher_never_mix_one_checkpoint(daemon, root, tmp_path,
                                                                                   form) -> None:
    path = root / "step-7"
    launches = []
    try:
        for name, value in (("a", 1.0), ("b", 2.0)):
            (tmp_path / name).mkdir()
            launches.append(Launch(form, name, tmp_path / name, daemon.run_dir, path, value))
        a, b = launches
        jobs = {(l.name, r): l.wait(r, "ready")["job"] for l in launches for r in (0, 1)}
        assert jobs[("a", 0)] == jobs[("a", 1)] and jobs[("b", 0)] == jobs[("b", 1)], jobs  # one name per launch
        assert jobs[("a", 0)] != jobs[("b", 0)], jobs  # and none shared by two live launches
        a.go(0)
        wait_until(lambda: saving(daemon, path), 60, "launch a's rank 0 is saving")
        b.go(1)
        refused = b.wait(1, "result")
        assert refused["outcome"] == "Conflict" and "another run of the job" in refused["message"], refused
        a.go(1)
        assert a.wait(0, "result") == {"outcome": "done"} and a.wait(1, "result") == {"outcome": "done"}
        b.go(0)
        assert b.wait(0, "result")["outcome"] == "CheckpointExists"
        assert [float(ckptd.load(path, rank=r)["w"][0]) for r in (0, 1)] == [1.0, 1.0]  # launch a's, whole
        for launch in launches:
            launch.finish()
    finally:
        for launch in launches:
            launch.kill()


@pytest.mark.parametrize(("env", "named"), [
    ({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}, ""),
    ({"TORCHELASTIC_RUN_ID": "my-rdzv-id", "TORCHELASTIC_RESTART_COUNT": "2"}, "torchelastic:my-rdzv-id:2"),
    ({"TORCHELASTIC_RUN_ID": "4242", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "10.0.0.7",
      "MASTER_PORT": "29500", "RANK": "3"}, "torchelastic:4242@10.0.0.7:29500:0"),
    ({"SLURM_JOB_ID": "4242"}, ""),
    ({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_RESTART_COUNT": "1"}, "slurm:4242:3:1"),
    ({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "SLURM_JOB_ID": "4242",
      "SLURM_STEP_ID": "0"}, ""),
    ({}, ""),
], ids=["torchrun-none", "torchrun-rdzv-id", "torchrun-rdzv-id-and-master", "slurm-batch-step", "slurm-srun-step", "torchrun-none-in-srun",
        "no-launcher"])
def test_only_launcher_variables_that_name_one_launch_name_the_run(monkeypatch, env, named) -> None:
    from ckptd.client.incarnation import LAUNCHERS, MASTER_VARIABLES, from_launcher

    for key in [*(k for _, keys in LAUNCHERS for k in keys), *MASTER_VARIABLES]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert from_launcher() == named
