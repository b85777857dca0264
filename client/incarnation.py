"""Which run of a job this process belongs to: the ``job`` every commit carries.

The daemon never lets one checkpoint mix shards of two runs of a job (a
restarted job saving the same path as the run that died, or a second launch
of the same script while the first still runs). It tells runs apart by this
name and by the ranks' processes (``ckptd/lifecycle/contributors.py``); the name is what
the ranks of one launch share and no other live launch does:

1. ``Client(job=...)``: the caller's own name for the run.
2. The launcher's, where it names one launch (``LAUNCHERS``): torchrun's
   run id (``--rdzv-id``, or the one ``--standalone`` draws) with its
   rendezvous master (``MASTER_ADDR:MASTER_PORT``) and restart count, or
   Slurm's job and step (``srun``) with its restart count. A run id names a
   job, not a launch: two torchruns of one allocation are often both given
   ``--rdzv-id $SLURM_JOB_ID``, and the master each live launch holds tells
   them apart. torchrun's default run id ``none`` (static rendezvous with
   ``--master-port``, and c10d without ``--rdzv-id``) is every launch's, and
   so is a Slurm job's batch step (no step id): no name. Nor is the Slurm
   step of a process torchrun started: several torchruns may run in one step.
3. With torch.distributed initialized and no name yet: rank 0 draws one at
   random and the ranks agree on it when their ``Client``s start
   (``coordinate.agree_on_places``).
4. Otherwise, the rendezvous master (``MASTER_ADDR`` and ``MASTER_PORT``)
   torchrun gave the ranks, which no two live launches on a host share, with
   its restart count; or the master a hand-written launcher gave them (no
   process holds its port then: two launches given the same one are one run
   to the daemon) (``from_master``). Without either, none (""): the daemon
   tells runs apart by their processes alone, which holds for launchers that
   kill a run before restarting it.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from ckptd.protocol.messages import MAX_JOB

SHARED_RUN_IDS = frozenset({"", "none"})
"""torchrun run ids every launch has (its ``--rdzv-id`` default): they name no launch."""

LAUNCHERS = (
    ("torchelastic", ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")),
    ("slurm", ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")),
)
"""Launchers that name a run, by the environment variables that together do. The variables before the last
must all be set (a Slurm job without a step id is its batch step, which several launches may share). torchrun's
name also holds its rendezvous master (``MASTER_VARIABLES``)."""
MASTER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK")
"""The rendezvous master every rank of a launch is given (``RANK``: by a launcher at all)."""


def _named(launcher: str, values: list[str]) -> str:
    """``launcher:v1:v2...``, or its digest where a commit could not carry it (too long, not printable): the
    same on every rank either way."""
    name = ":".join([launcher, *values])
    if len(name) <= MAX_JOB and name.isprintable():
        return name
    return f"{launcher}:{hashlib.blake2b(name.encode('utf-8', 'surrogatepass'), digest_size=16).hexdigest()}"


def from_launcher() -> str:
    """The run's name from its launcher's environment, or "" if no launcher that names one launch started this
    process (torchrun's run id ``none`` names none).

    Whatever the variables hold (a run id is the user's to choose: long, or
    with a newline), the name is one a commit can carry.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:  # torchrun started it: never named by the Slurm step several torchruns may share
        if run_id.strip() in SHARED_RUN_IDS:
            return ""
        where = _master()
        return _named("torchelastic", [f"{run_id}@{where}" if where else run_id,
                                       os.environ.get("TORCHELASTIC_RESTART_COUNT", "")])
    for launcher, keys in LAUNCHERS[1:]:
        values = [os.environ.get(k, "") for k in keys]
        if all(values[:-1]):
            return _named(launcher, values)
    return ""


def from_master() -> str:
    """torchrun's rendezvous master and restart count (``torchelastic:none@ADDR:PORT:N``), a hand-written
    launcher's master (``master:ADDR:PORT``), or "" where no master was given.

    Only for ranks that cannot agree over torch.distributed: a live launch
    holds its master's port, so no two live launches on one host share it;
    launches one after another may, and their ranks' processes tell them
    apart.
    """
    where = _master()
    if not where:
        return ""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # a launcher that sets torchrun's variables, and no run id
        return _named("master", [where]) if "RANK" in os.environ else ""
    return _named("torchelastic", [f"none@{where}", os.environ.get("TORCHELASTIC_RESTART_COUNT", "")])


def _master() -> str:
    """``ADDR:PORT`` of the rendezvous master every rank of this launch was given, or "" (none)."""
    addr, port = (os.environ.get(k, "") for k in MASTER_VARIABLES[:2])
    return f"{addr}:{port}" if port else ""


def drawn() -> str:
    """A fresh random name (rank 0's, for the ranks to agree on)."""
    return f"run:{uuid.uuid4().hex}"
