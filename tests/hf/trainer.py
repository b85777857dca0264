"""``examples/hf_train.py`` with what tests/hf/ needs around it: the final weights, a death mid-save, an evaluation.

Run as the example is (``python tests/hf/trainer.py ...`` or under torchrun), with these arguments first:

- ``--final FILE``: process 0 writes the trained model's state dict there (``torch.save``);
- ``--die-at-save N`` with ``--die-rank R``: process R dies by SIGKILL in the middle of checkpoint-N's save, after
  writing ``died-R.json`` beside FILE saying where it was. On one process the save was handed to the daemon, which
  the test's fault kills at the shard's write: the process waits for that failure first. On two, the other
  process's shard of checkpoint-N is on disk and this process never hands its own over;
- ``--die-after-snapshot N``: after the memory snapshot of step N is held, process 0 dies by SIGKILL;
- ``--plain``: train with ``transformers.Trainer`` itself (its own checkpoint files), as a run before it switched;
- ``--resume``: ``resume_from_checkpoint=True`` whatever ``ckptd.latest`` finds (the example asks it first);
- ``--best-first``: evaluate at every save with a metric whose best is the first evaluation, keep the best
  checkpoint and load it at the end (``load_best_model_at_end``).
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
import hf_train as example  # noqa: E402

from ckptd.integrations.hf import CkptdTrainer  # noqa: E402


def parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--final", required=True)
    parser.add_argument("--die-at-save", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--die-after-snapshot", type=int, default=-1)
    parser.add_argument("--best-first", action="store_true")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--resume", action="store_true")
    return parser.parse_known_args()


OPTIONS, REST = parse()
OUT = Path(OPTIONS.final).parent


def die(rank: int, facts: dict[str, Any]) -> None:
    (OUT / f"died-{rank}.json").write_text(json.dumps(facts))
    os.kill(os.getpid(), signal.SIGKILL)


class Trainer(CkptdTrainer):
    def _save(self, path: str, *, persist: bool):
        step, rank, world = self.state.global_step, self.args.process_index, self.args.world_size
        incomplete, committed = Path(path + ".incomplete"), Path(path) / "ckptd.json"
        if step == OPTIONS.die_at_save and rank == OPTIONS.die_rank and world > 1:
            other = incomplete / f"rank-{1 - rank:05d}-of-{world:05d}.safetensors"
            deadline = time.monotonic() + 120
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            die(rank, {"step": step, "other_shard_written": other.exists(), "committed": committed.exists()})
        future = super()._save(path, persist=persist)
        if step == OPTIONS.die_at_save and rank == OPTIONS.die_rank:
            error = future.exception(120)  # the daemon dies at the shard's write (the test's fault)
            die(rank, {"step": step, "incomplete": incomplete.is_dir(), "committed": committed.exists(),
                       "error": type(error).__name__})
        if step == OPTIONS.die_after_snapshot and not persist:
            future.result(120)
            die(rank, {"step": step, "held": True, "on_disk": Path(path).exists()})
        return future


def best_first() -> dict[str, Any]:
    calls = []

    def compute_metrics(_: Any) -> dict[str, float]:
        calls.append(1)
        return {"first": -float(len(calls))}

    return {"eval_dataset": example.Sequences(seed=1), "compute_metrics": compute_metrics}


if __name__ == "__main__":
    extra = best_first() if OPTIONS.best_first else {}
    if OPTIONS.best_first:
        parse_arguments = example.arguments

        def arguments(*args: Any, **more: Any):
            return parse_arguments(*args, eval_strategy="steps", eval_steps=more_steps(), load_best_model_at_end=True,
                                   metric_for_best_model="first", greater_is_better=True, **more)

        def more_steps() -> int:
            return int(REST[REST.index("--save-steps") + 1])

        example.arguments = arguments
    trainer_class: type = Trainer
    if OPTIONS.plain:
        import transformers

        class Own(transformers.Trainer):  # the run before the switch: the Trainer's own checkpoint files
            def __init__(self, *args: Any, memory_steps: int = 0, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
        trainer_class = Own
    elif OPTIONS.resume:
        class Resuming(Trainer):
            def train(self, resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
                return super().train(resume_from_checkpoint=True, **kwargs)
        trainer_class = Resuming
    trainer = example.main(trainer_class, REST, **extra)
    if trainer.args.process_index == 0:
        torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, OPTIONS.final)
