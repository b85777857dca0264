"""A Hugging Face ``Trainer`` whose checkpoints go through ckptd (``make test-hf`` runs it).

A 2-layer GPT-2 built from a config (nothing downloaded) learns a fixed set
of random token sequences on CPU. ``CkptdTrainer`` is the only change from
``transformers.Trainer``: every ``--save-steps`` checkpoint is written by
the node's ckptd daemon as ``OUTPUT/checkpoint-N`` while training goes on,
and a second run with the same arguments resumes from the newest one::

    python examples/hf_train.py --output-dir /ckpts/hf --max-steps 6
    python examples/hf_train.py --output-dir /ckpts/hf --max-steps 9   # resumes at 6
    torchrun --nproc-per-node 2 examples/hf_train.py --output-dir /ckpts/hf2 --max-steps 9

``python -m ckptd.integrations.hf export OUTPUT/checkpoint-9 model/`` then
writes what ``GPT2LMHeadModel.from_pretrained("model")`` reads.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import ckptd
from ckptd.integrations.hf import CkptdTrainer

VOCAB, LENGTH, SAMPLES = 64, 16, 64


class Sequences(torch.utils.data.Dataset):
    """``SAMPLES`` random token sequences, the same in every process and run; each is its own label."""

    def __init__(self, seed: int = 0) -> None:
        self.tokens = torch.randint(VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def arguments(output_dir: str, max_steps: int, save_steps: int, **more: Any) -> TrainingArguments:
    return TrainingArguments(output_dir=output_dir, max_steps=max_steps, save_steps=save_steps,
                             per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=2, seed=0,
                             use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1, **more)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=9)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--memory-steps", type=int, default=0, help="a memory snapshot every N steps (0: none)")
    return parser.parse_args(argv)


def main(trainer_class: type = CkptdTrainer, argv: list[str] | None = None, **extra: Any) -> Any:
    args = parse(argv)
    trainer = trainer_class(model=model(), train_dataset=Sequences(), memory_steps=args.memory_steps,
                            args=arguments(args.output_dir, args.max_steps, args.save_steps,
                                           save_total_limit=args.save_total_limit), **extra)
    # the newest checkpoint-N on disk or held in node memory (collective under torchrun), if any
    resume = ckptd.latest(args.output_dir) is not None
    trainer.train(resume_from_checkpoint=resume)
    print(f"rank {trainer.args.process_index}: trained to step {trainer.state.global_step}", flush=True)
    return trainer


if __name__ == "__main__":
    main()
