"""Two runs of ``examples/deepspeed_train.py``'s engine that race rank 0's rewrite of ``latest``, for tests/deepspeed/.

Run under DeepSpeed's launcher (``deepspeed --num_gpus 2 tests/deepspeed/races.py MODE SAVE_DIR``):

- ``rollback``: three times, two steps, ``save_checkpoint``, ``wait`` and at once ``load_checkpoint`` (a rollback to
  the tag just saved); each rank prints ``rank R loaded TAG at step N``;
- ``die``: ``keep_last=1``; a save at step 2, waited for, then one at step 4, after which rank 0 dies by SIGKILL as
  soon as both ranks' ``save_checkpoint`` returned (before it could see the commit and rewrite ``latest``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import deepspeed_train as example  # noqa: E402

from ckptd.integrations.deepspeed import install, wait  # noqa: E402


def steps(engine, count: int) -> None:
    for _ in range(count):
        x, y = example.batch(engine.global_rank, engine.global_steps + 1)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def main() -> None:
    mode, save_dir = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]  # the launcher's first
    engine = example.engine_for(example.parse(["--save-dir", save_dir]))
    rank = engine.global_rank
    if mode == "rollback":
        install(engine)
        for _ in range(3):
            steps(engine, 2)
            engine.save_checkpoint(save_dir)
            wait(engine)
            path, _ = engine.load_checkpoint(save_dir)
            tag = os.path.relpath(path, save_dir).split(os.sep)[0]
            example.say(f"rank {rank} loaded {tag} at step {engine.global_steps}")
    else:
        install(engine, keep_last=1)
        steps(engine, 2)
        engine.save_checkpoint(save_dir)
        wait(engine)
        steps(engine, 2)
        engine.save_checkpoint(save_dir)
        torch.distributed.barrier()  # both ranks handed their shards of global_step4 over: the daemon commits it
        if rank == 0:
            example.say("rank 0 dies")
            os.kill(os.getpid(), signal.SIGKILL)
        wait(engine)
        example.say("rank 1 waited")
    engine.destroy()


if __name__ == "__main__":
    main()
