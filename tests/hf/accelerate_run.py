"""``examples/accelerate_train.py`` with what tests/hf/ needs around it: what each step saw, the end state, a death
mid-save.

Run as the example is (``python tests/hf/accelerate_run.py ...`` or under ``accelerate launch``), with these
arguments first:

- ``--out DIR``: each process writes ``steps-R.json`` there (per step: the loss as ``float.hex`` and a digest of
  the batch's inputs), and process 0 writes ``final.pt`` (the model's and optimizer's state dicts, ``torch.save``);
- ``--die-at-save N`` with ``--die-rank R``: process R dies by SIGKILL in the middle of the save named
  ``checkpoint_N``, after writing ``died-R.json`` in DIR saying where it was. On one process the save was handed to
  the daemon, which the test's fault kills at the shard's write: the process waits for that failure first. On two,
  the other process's shard of ``checkpoint_N`` is on disk and this process never hands its own over.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import accelerate_train as example  # noqa: E402

from ckptd.integrations.accelerate import CkptdAccelerator  # noqa: E402


def parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--die-at-save", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=0)
    return parser.parse_known_args()


OPTIONS, REST = parse()
OUT = Path(OPTIONS.out)


def die(rank: int, facts: dict[str, Any]) -> None:
    (OUT / f"died-{rank}.json").write_text(json.dumps(facts))
    os.kill(os.getpid(), signal.SIGKILL)


class Accelerator(CkptdAccelerator):
    def save_state(self, output_dir: Any = None, *args: Any, **kwargs: Any) -> Path:
        number, rank, world = self.save_iteration, self.process_index, self.num_processes
        path = os.path.join(self.project_dir, "checkpoints", f"checkpoint_{number}")
        incomplete, committed = Path(path + ".incomplete"), Path(path) / "ckptd.json"
        dying = number == OPTIONS.die_at_save and rank == OPTIONS.die_rank
        if dying and world > 1:
            other = incomplete / f"rank-{1 - rank:05d}-of-{world:05d}.safetensors"
            deadline = time.monotonic() + 120
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            die(rank, {"save": number, "other_shard_written": other.exists(), "committed": committed.exists()})
        saved = super().save_state(output_dir, *args, **kwargs)
        if dying:
            error = self._pending.exception(120)  # the daemon dies at the shard's write (the test's fault)
            die(rank, {"save": number, "incomplete": incomplete.is_dir(), "committed": committed.exists(),
                       "error": type(error).__name__})
        return saved


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    seen: dict[int, dict[str, str]] = {}

    def on_step(step: int, x: torch.Tensor, loss: torch.Tensor) -> None:
        seen[step] = {"loss": float(loss.detach()).hex(),
                      "batch": hashlib.sha256(x.detach().contiguous().numpy().tobytes()).hexdigest()[:16]}

    accelerator, model, optimizer = example.main(Accelerator, REST, on_step=on_step)
    rank = accelerator.process_index
    (OUT / f"steps-{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save({"model": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
                    "optimizer": optimizer.state_dict()}, OUT / "final.pt")
