"""examples/fsdp2_train.py under torchrun: two FSDP2 ranks train and save, three ranks resume.

The resumed run prints a digest of the full weights it loaded; this process
computes the same digest from the checkpoint with ``ckptd.load`` (no process
group), so the resharded restore is checked against what was saved. The
last checkpoint is then exported and loads into a plain model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ckptd
from ckptd.tools.export import export_checkpoint

from helpers import REPO, torchrun_example

EXAMPLE = REPO / "examples" / "fsdp2_train.py"


def run_example(daemon, ckpt_dir: Path, procs: int, steps: int) -> str:
    return torchrun_example(EXAMPLE, daemon, ckpt_dir, procs, "--steps", str(steps), "--save-every", "3", timeout=150)


@pytest.mark.timeout(400)
def test_fsdp2_example_trains_on_two_ranks_and_resumes_on_three(daemon, root: Path, tmp_path: Path) -> None:
    ckpt_dir = root / "fsdp"
    first = run_example(daemon, ckpt_dir, 2, 6)
    assert f"no checkpoint under {ckpt_dir}; starting from step 0 on 2 ranks" in first
    assert "committed steps [3, 6]" in first and "rank 1: trained to step 6" in first
    six = ckpt_dir / "step-000006"
    assert ckptd.read_index(six).world_size == 2 and "model.0.weight" in ckptd.read_index(six).tensors

    second = run_example(daemon, ckpt_dir, 3, 9)
    match = re.search(r"resumed from step 6 on 3 ranks \((.*)\), weights digest (\S+)", second)
    assert match and match.group(1) == str(six), second
    saved = ckptd.load(six)
    assert float(match.group(2)) == sum(t.double().sum().item() for t in saved["model"].values())
    assert "committed steps [9]" in second and "rank 2: trained to step 9" in second
    nine = ckpt_dir / "step-000009"
    assert ckptd.read_index(nine).world_size == 3 and ckptd.load(nine)["step"] == 9

    export_checkpoint(nine, tmp_path / "hf", prefix="model.")
    plain = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    plain.load_state_dict(load_file(tmp_path / "hf" / "model.safetensors"), strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, ckptd.load(nine)["model"][k]), k
