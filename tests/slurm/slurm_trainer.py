"""The training script of tests/slurm/test_slurm.py, run by deploy/slurm/example.sbatch on each node of a job.

``snapshot``: each node's trainer keeps its node's state (one rank of its own: a per-node checkpoint directory) as a
memory snapshot through the daemon the prolog started, waits until its buddy node holds the replica, says so, and
trains on until the job ends. ``resume``: each node's trainer resumes its node's state from what the last job left
and says whether it is bitwise what was saved.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ckptd


def state(node: int, step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(node * 1000 + step)
    return {"w": torch.randn(512, 512, generator=gen), "step": step}


def main(mode: str, root: str, out: str) -> None:
    node = int(os.environ["SLURM_NODEID"])
    where = Path(root) / f"node-{node}"
    said: dict[str, Any] = {"host": os.environ["SLURMD_NODENAME"], "run_dir": os.environ.get("CKPTD_RUN_DIR"),
                            "pid": os.getpid()}
    client = ckptd.Client(spawn=False, rank=0, world_size=1)  # the prolog's daemon, found by CKPTD_RUN_DIR
    said["daemon_pid"] = int((Path(os.environ["CKPTD_RUN_DIR"]) / "ckptd.pid").read_text())
    if mode == "snapshot":
        client.save_async(state(node, 1), where / "step-1", step=1, persist=False).wait_replicated(120)
        said["replicated"] = True
    else:
        resumed = ckptd.latest(where)
        said["resumed"] = None if resumed is None else str(resumed)
        if resumed is not None:
            into = {"w": torch.zeros(512, 512), "step": -1}
            ckptd.load_into(into, resumed)
            want = state(node, into["step"])
            said["step"], said["bitwise"] = into["step"], torch.equal(into["w"], want["w"])
    tmp = Path(out) / f".{node}.json"
    tmp.write_text(json.dumps(said))
    tmp.rename(Path(out) / f"{node}.json")
    if mode == "snapshot":
        while True:  # training on, until the job ends (or the node is lost)
            time.sleep(1)
    client.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
