"""deploy/slurm/ against a real Slurm (Debian's slurmctld and slurmd, ``make test-slurm``): one slurmctld and four
slurmd on this host (nodes n1-n4, each slurmd on a port of its own, ``slurmd -N``), deploy/slurm's scripts installed
as its Prolog, Epilog and TaskProlog with a ckptd.conf that gives each node a run directory and peer port of its own
on 127.0.0.1, and deploy/slurm/example.sbatch submitted as a user would.

A job on n1-n3 snapshots each node's state in memory, replicated to its buddy (the next node); n2 is then lost whole
(its slurmd, job step, trainer and daemon killed); Slurm ends the job, the epilog of n2's buddy persists n2's
snapshot from its replica, and the next job, on n1, n3 and n4 (the replacement), resumes every node's state
bitwise, n2's included, from disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest

from helpers import REPO, free_port, short_tempdir, wait_until

DEPLOY = REPO / "deploy" / "slurm"
NODES = ("n1", "n2", "n3", "n4")
INSTALLED = ("ckptd-prolog.sh", "ckptd-epilog.sh", "ckptd-task-prolog.sh", "ckptd-common.sh", "ckptd.conf")

SLURM_CONF = """\
ClusterName=ckptdtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={ctld_port_plus}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmdPidFile={base}/spool/slurmd-%n.pid
SlurmctldPidFile={base}/slurmctld.pid
SlurmdLogFile={base}/log/slurmd-%n.log
SlurmctldLogFile={base}/log/slurmctld.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/linear
MpiDefault=none
ReturnToService=2
SlurmdTimeout=5
MessageTimeout=5
KillWait=5
JobRequeue=0
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
Prolog={etc}/ckptd-prolog.sh
Epilog={etc}/ckptd-epilog.sh
TaskProlog={etc}/ckptd-task-prolog.sh
PrologFlags=Alloc
PrologEpilogTimeout=400
{nodes}
PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP
"""

TEST_CONF = """
# tests/slurm/test_slurm.py: four nodes on one host, each with a run directory and peer port of its own
export SLURM_CONF={slurm_conf} PYTHONPATH={repo}
CKPTD="{python} -m ckptd"
CKPTD_ROOTS={ckpts}
CKPTD_RUN_BASE={base}/run/$SLURMD_NODENAME
CKPTD_JOBS_DIR={base}/jobs
CKPTD_PEER_HOST=127.0.0.1
case "$SLURMD_NODENAME" in
{ports}
esac
"""


@dataclass
class Cluster:
    base: Path
    env: dict[str, str]
    ckpts: Path
    work: Path
    slurmd: dict[str, int] = field(default_factory=dict)

    def run(self, *cmd: str, timeout: float = 60) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        return done.stdout

    def job_state(self, job: str) -> str:
        return self.run("scontrol", "show", "job", job).split("JobState=")[1].split()[0]

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").strip()

    def submit(self, nodes: str, *args: str) -> str:
        return self.run("sbatch", "--parsable", f"--nodelist={nodes}", f"--chdir={self.work}",
                        str(DEPLOY / "example.sbatch"), *args).strip()

    def log(self, name: str) -> str:
        path = self.base / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """Every slurm log and job output, for a failure's message."""
        parts = [f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.base / "log").iterdir())]
        parts += [f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.work.glob("*.out"))]
        return "\n".join(parts)


def _pid_file(path: Path) -> int:
    """The pid a daemon that went to the background wrote (it may write it a moment after its parent returned)."""
    wait_until(lambda: path.exists() and path.read_text().strip(), timeout=30, what=f"{path} written")
    return int(path.read_text())


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None:
        pytest.fail("slurmctld and slurmd are not installed: `make test-slurm` installs them (Debian's slurmctld, "
                    "slurmd and slurm-client)")
    base = short_tempdir("ckslurm-")
    base.chmod(0o755)
    etc, ckpts, work = base / "etc", base / "ckpts", base / "work"
    for d in (etc, ckpts, work, base / "state", base / "spool", base / "log", base / "run", base / "jobs",
              *(base / "spool" / n for n in NODES)):
        d.mkdir(parents=True)
    (base / "jobs").chmod(0o1777)
    for name in INSTALLED:  # installed as an admin does (README.md): the scripts and ckptd.conf side by side
        shutil.copy2(DEPLOY / name, etc / name)
    ctld = free_port()
    ports = {n: free_port() for n in NODES}
    peers = {n: free_port() for n in NODES}
    nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} CPUs=1 "
                      f"State=UNKNOWN" for n in NODES)
    slurm_conf = etc / "slurm.conf"
    slurm_conf.write_text(SLURM_CONF.format(base=base, etc=etc, ctld_port=ctld, ctld_port_plus=free_port(),
                                            nodes=nodes))
    with (etc / "ckptd.conf").open("a") as conf:  # the shipped settings, then this host's
        conf.write(TEST_CONF.format(slurm_conf=slurm_conf, repo=REPO, python=sys.executable, ckpts=ckpts, base=base,
                                    ports="\n".join(f"    {n}) CKPTD_PEER_PORT={peers[n]} ;;" for n in NODES)))
    env = {**os.environ, "SLURM_CONF": str(slurm_conf), "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for var in [v for v in env if v.startswith(("SLURM_", "CKPTD_")) and v != "SLURM_CONF"]:
        del env[var]  # this test's own environment must not leak into the jobs it submits
    c = Cluster(base, env, ckpts, work)
    started: list[int] = []
    try:
        subprocess.run(["slurmctld", "-i", "-f", str(slurm_conf)], env=env, check=True, timeout=60)
        started.append(_pid_file(base / "slurmctld.pid"))
        for n in NODES:
            subprocess.run(["slurmd", "-f", str(slurm_conf), "-N", n], env=env, check=True, timeout=60)
            c.slurmd[n] = _pid_file(base / "spool" / f"slurmd-{n}.pid")
        wait_until(lambda: c.run("sinfo", "-h", "-o", "%T %D").split() == ["idle", "4"], timeout=60,
                   what=lambda: f"four idle nodes: {c.run('sinfo', '-N')}")
        yield c
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
        for pid in [*c.slurmd.values(), *started]:
            _kill(pid)
        for pidfile in (base / "run").glob("*/*/ckptd.pid"):  # a daemon a failed test left behind
            _kill(int(pidfile.read_text()))
        shutil.rmtree(base, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _while_running(cluster: Cluster, job: str, cond: Callable[[], bool], what: str, timeout: float = 240) -> None:
    """Wait for ``cond`` while ``job`` is pending or running; fail at once, with the logs, if it ended first."""
    deadline = time.monotonic() + timeout
    while not cond():
        state = cluster.job_state(job)
        if state not in ("PENDING", "CONFIGURING", "RUNNING") or time.monotonic() > deadline:
            raise AssertionError(f"job {job} is {state}, and not yet: {what}\n{cluster.logs()}")
        time.sleep(0.5)


def _outputs(out: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("[0-9]*.json")} if out.exists() else {}


def _lose_node(cluster: Cluster, said: dict) -> None:
    """Everything of one node dies at once: its trainer, the job step's slurmstepd above it, its daemon, its slurmd."""
    doomed = [psutil.Process(said["pid"])]
    while "slurmstepd" not in " ".join(doomed[-1].cmdline()):  # up to the step's slurmstepd on that node
        doomed.append(doomed[-1].parent())
    doomed += [psutil.Process(said["daemon_pid"]), psutil.Process(cluster.slurmd[said["host"]])]
    for proc in doomed:
        proc.kill()
    psutil.wait_procs(doomed, timeout=30)
    del cluster.slurmd[said["host"]]


@pytest.mark.timeout(600)
def test_a_node_lost_mid_job_is_persisted_by_its_buddys_epilog_and_the_next_job_resumes_it(cluster: Cluster) -> None:
    out = cluster.work / "snap"
    out.mkdir()
    job = cluster.submit("n[1-3]", str(REPO / "tests" / "slurm" / "slurm_trainer.py"), "snapshot",
                         str(cluster.ckpts), str(out))
    _while_running(cluster, job, lambda: len(_outputs(out)) == 3, "every node's snapshot replicated")
    said = _outputs(out)
    assert [said[i]["host"] for i in range(3)] == ["n1", "n2", "n3"]
    for i, node in enumerate(("n1", "n2", "n3")):
        run_dir = cluster.base / "run" / node / job
        assert said[i]["run_dir"] == str(run_dir)  # the task prolog named the prolog's daemon to the task
        assert int((run_dir / "ckptd.pid").read_text()) == said[i]["daemon_pid"]  # the trainer spawned none
        assert said[i]["replicated"]
    buddy_log = (cluster.base / "run" / "n3" / job / "ckptd.log").read_text()
    assert f"event=replica_held path={cluster.ckpts}/node-1/step-1 " in buddy_log  # n2's buddy is n3

    _lose_node(cluster, said[1])
    wait_until(lambda: cluster.job_state(job) not in ("RUNNING", "COMPLETING"), timeout=180,
               what=lambda: f"the job ended after its node n2 was lost ({cluster.job_state(job)})\n{cluster.logs()}")
    job_dir = cluster.base / "jobs" / job
    wait_until(lambda: all((job_dir / f"{n}.stop").exists() for n in ("n1", "n3")), timeout=120,
               what=lambda: f"the epilogs of n1 and n3 ran\n{cluster.logs()}")
    assert cluster.node_state("n2").startswith("down"), cluster.node_state("n2")  # Slurm saw the node lost
    assert not (job_dir / "n2.stop").exists()  # the lost node ran no epilog
    n3_log = (job_dir / "n3.ckptd.log").read_text()
    assert "event=drain_persist_replica" in n3_log, n3_log[-3000:]  # n2's snapshot, from n3's replica
    for node in ("n1", "n3"):
        assert (job_dir / f"{node}.stop").read_text().startswith("exit 0\n"), (job_dir / f"{node}.stop").read_text()
        assert not (cluster.base / "run" / node / job).exists()  # the epilog removed the run directory
        daemon = said[0 if node == "n1" else 2]["daemon_pid"]
        assert not psutil.pid_exists(daemon) or psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE
        assert not [p for p in Path("/dev/shm").glob(f"ckptd-0-{daemon}-*")]
    assert not list(job_dir.glob("*.key"))  # no stale key line for a requeued job to trust
    assert sorted(p.name for p in cluster.ckpts.iterdir()) == ["node-0", "node-1", "node-2"]
    assert (cluster.ckpts / "node-1" / "step-1" / "ckptd.json").exists()

    out = cluster.work / "resume"
    out.mkdir()
    job2 = cluster.submit("n1,n3,n4", str(REPO / "tests" / "slurm" / "slurm_trainer.py"), "resume",
                          str(cluster.ckpts), str(out))
    wait_until(lambda: cluster.job_state(job2) == "COMPLETED", timeout=240,
               what=lambda: f"the second job completed ({cluster.job_state(job2)})\n{cluster.logs()}")
    said = _outputs(out)
    assert [said[i]["host"] for i in range(3)] == ["n1", "n3", "n4"]
    for i in range(3):  # n4 (the replacement) resumes node 2's state, n3 node 1's: the lost n2's
        assert said[i]["resumed"] == str(cluster.ckpts / f"node-{i}" / "step-1") and said[i]["step"] == 1
        assert said[i]["bitwise"], said[i]
    wait_until(lambda: all((cluster.base / "jobs" / job2 / f"{n}.stop").exists() for n in ("n1", "n3", "n4")),
               timeout=120, what="the second job's epilogs")
