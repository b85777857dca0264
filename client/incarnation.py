"""Which run of a job this process belongs to: the ``job`` every commit carries.

The daemon never lets one checkpoint mix shards of two runs of a job (a
restarted job saving the same path as the run that died). It tells runs
apart by this name and by the ranks' processes (``ckptd/contributors.py``);
the name is what the ranks of one run share and a restarted run does not:

1. ``Client(job=...)``: the caller's own name for the run.
2. The launcher's: torchrun/torchelastic (run id and restart count) or
   Slurm (job, step and restart count).
3. With torch.distributed initialized and no launcher name: rank 0 draws
   one at random and the ranks agree on it when their ``Client``s start
   (``coordinate.agree_on_places``).
4. Otherwise none (""): the daemon then tells runs apart by their processes
   alone, which holds for launchers that kill a run before restarting it.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from ckptd.protocol.messages import MAX_JOB

LAUNCHERS = (
    ("torchelastic", ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")),
    ("slurm", ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")),
)
"""Launchers that name a run, by the environment variables that together do (the first must be set)."""


def from_launcher() -> str:
    """The run's name from its launcher's environment, or "" if no known launcher started this process.

    Whatever the variables hold (a run id is the user's to choose: long, or
    with a newline), the name is one a commit can carry: a name that is too
    long or not printable is replaced by its digest, the same on every rank.
    """
    for launcher, keys in LAUNCHERS:
        if os.environ.get(keys[0]):
            name = ":".join([launcher, *(os.environ.get(k, "") for k in keys)])
            if len(name) <= MAX_JOB and name.isprintable():
                return name
            return f"{launcher}:{hashlib.blake2b(name.encode('utf-8', 'surrogatepass'), digest_size=16).hexdigest()}"
    return ""


def drawn() -> str:
    """A fresh random name (rank 0's, for the ranks to agree on)."""
    return f"run:{uuid.uuid4().hex}"
