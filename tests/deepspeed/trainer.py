"""``examples/deepspeed_train.py`` with what tests/deepspeed/ needs around it: the final state, a death mid-save.

Run as the example is (``deepspeed --num_gpus 2 tests/deepspeed/trainer.py ...``), with these arguments first:

- ``--final DIR``: each rank writes ``final-R.pt`` there (``torch.save``: the module's state dict, the optimizer's, the
  scheduler's and the step), before ``engine.destroy()``;
- ``--die-at-save N`` with ``--die-rank R``: rank R dies by SIGKILL in the middle of tag ``global_stepN``'s save,
  once the daemon has written the other rank's shard of it into ``global_stepN.incomplete`` and before this rank
  hands its own over, after writing ``died-R.json`` in DIR saying what it saw;
- blocking saves (the example's ``--blocking``) are checked on rank 0: once ``save_checkpoint`` returned, the tag is
  committed and ``latest`` names it (it prints ``committed global_stepN``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import deepspeed_train as example  # noqa: E402

from ckptd.integrations.deepspeed import LATEST, CkptdCheckpointEngine  # noqa: E402


def parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--final", required=True)
    parser.add_argument("--die-at-save", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=1)
    return parser.parse_known_args()


OPTIONS, REST = parse()
OUT = Path(OPTIONS.final)


def rank() -> int:
    return torch.distributed.get_rank()


save_async = CkptdCheckpointEngine._save_async


def dying_save_async(self: CkptdCheckpointEngine, current: Any, holders: dict[str, int]) -> None:
    """The engine's ckptd save, except at ``--die-at-save`` on ``--die-rank``: a SIGKILL there, mid-save."""
    if current.info.tag == f"global_step{OPTIONS.die_at_save}" \
            and rank() == OPTIONS.die_rank:
        world = torch.distributed.get_world_size()
        incomplete = Path(current.path + ".incomplete")
        other = incomplete / f"rank-{1 - rank():05d}-of-{world:05d}.safetensors"
        deadline = time.monotonic() + 120
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        latest = Path(current.info.save_dir, LATEST)
        facts = {"step": OPTIONS.die_at_save, "other_shard_written": other.exists(),
                 "committed": Path(current.path).exists(), "latest": latest.read_text() if latest.exists() else None}
        (OUT / f"died-{rank()}.json").write_text(json.dumps(facts))
        os.kill(os.getpid(), signal.SIGKILL)
    save_async(self, current, holders)


save_checkpoint = CkptdCheckpointEngine.save_checkpoint


def checked_save_checkpoint(self: CkptdCheckpointEngine, *args: Any, **kwargs: Any) -> Any:
    result = save_checkpoint(self, *args, **kwargs)
    if self.blocking and rank() == 0:
        committed = [p.name for p in Path(REST[REST.index("--save-dir") + 1]).iterdir() if (p / "ckptd.json").is_file()]
        latest = Path(REST[REST.index("--save-dir") + 1], LATEST).read_text()
        assert latest in committed, f"save_checkpoint returned with latest={latest!r}, committed: {committed}"
        example.say(f"committed {latest}")
    return result


def final(engine: Any) -> None:
    torch.save({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                "lr_scheduler": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps},
               OUT / f"final-{engine.global_rank}.pt")


if __name__ == "__main__":
    CkptdCheckpointEngine._save_async = dying_save_async  # type: ignore[method-assign]
    CkptdCheckpointEngine.save_checkpoint = checked_save_checkpoint  # type: ignore[method-assign]
    example.main(REST, at_end=final)
