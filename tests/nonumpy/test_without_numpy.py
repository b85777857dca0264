"""The client's saves and loads where numpy is not installed, as ckptd and torch allow.

ckptd requires no numpy and the torch wheel runs without it, but torch's
numpy bridge (``Tensor.numpy()``, ``torch.from_numpy``) then raises
"Numpy is not available". ``make test`` cannot see such a use: Lightning
brings numpy into ``.venv``. Collected only by ``make test-nonumpy``, which
builds ``.venv-nonumpy`` from torch, ckptd's own requirements and the test
runner, and runs this module there with the client's save and load modules
(the Makefile names them). The first test checks that numpy is truly absent,
so the rest cannot pass by running where it is installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from helpers import equal_states


def _stepped(seed: int, batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and an Adam optimizer one step in, so the optimizer has state (step counts, moments)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(batch, 8)).sum().backward()
    optim.step()
    return model, optim


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return _stepped(0, 5)


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same architecture with other weights and an optimizer that has stepped too (so state to overwrite)."""
    return _stepped(1, 3)


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """A training state with every kind of leaf a save takes: several dtypes, an empty and a strided tensor."""
    return {"model": model.state_dict(), "optimizer": optim.state_dict(), "step": 7, "note": "no numpy",
            "extra": {"bf16": torch.arange(12, dtype=torch.bfloat16), "ids": torch.arange(5, dtype=torch.int64),
                      "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 3),
                      "strided": torch.arange(20.0).reshape(4, 5).t()}}


def test_numpy_is_not_installed_in_this_environment() -> None:
    """Without this, the module would pass where numpy is installed and prove nothing about where it is not."""
    assert importlib.util.find_spec("numpy") is None, f"numpy is importable in {sys.prefix}: run make test-nonumpy"
    result = subprocess.run([sys.executable, "-c", "import numpy"], capture_output=True, text=True, timeout=60)
    assert "No module named 'numpy'" in result.stderr
    with pytest.raises(RuntimeError, match="Numpy is not available"):
        torch.zeros(1).numpy()


def test_a_saved_training_state_loads_copied_mapped_and_in_place(daemon, client_factory, root) -> None:
    model, optim = _trained()
    state = _state(model, optim)
    client_factory().save_async(state, root / "step-7", step=7).result(60)
    assert ckptd.verify_checkpoint(root / "step-7").ok
    assert equal_states(ckptd.load(root / "step-7"), state)
    assert equal_states(ckptd.load(root / "step-7", mmap=True), state)
    assert equal_states(ckptd.load(root / "step-7", rank="all"), [state])
    target, target_optim = _fresh()
    ckptd.load_into(target, root / "step-7", key="model")
    ckptd.load_into(target_optim, root / "step-7", key="optimizer")
    assert equal_states(target.state_dict(), model.state_dict())
    assert equal_states(target_optim.state_dict(), optim.state_dict())
    into = _state(*_fresh())
    ckptd.load_into(into, root / "step-7")
    assert equal_states(into, state)


def test_a_memory_snapshot_is_found_loaded_restored_and_persisted(daemon, client_factory, root, run_dir) -> None:
    model, optim = _trained()
    state = _state(model, optim)
    client = client_factory()
    client.save_async(state, root / "step-3", step=3, persist=False).result(60)
    assert ckptd.latest(root, run_dir=run_dir) == root / "step-3"
    assert not (root / "step-3").exists()  # held in memory only
    assert equal_states(ckptd.load(root / "step-3", run_dir=run_dir), state)
    assert equal_states(ckptd.load(root / "step-3", run_dir=run_dir, mmap=True), state)
    target, target_optim = _fresh()
    ckptd.load_into(target, root / "step-3", key="model", run_dir=run_dir)
    ckptd.load_into(target_optim, root / "step-3", key="optimizer", run_dir=run_dir)
    assert equal_states(target.state_dict(), model.state_dict())
    assert equal_states(target_optim.state_dict(), optim.state_dict())
    client.persist(root / "step-3")
    client.close()
    daemon.stop()  # what is read now comes from the disk
    assert equal_states(ckptd.load(root / "step-3", run_dir=run_dir), state)


def test_dcp_saves_through_the_writer_and_loads_through_the_reader(daemon, client_factory, root: Path) -> None:
    """One process, no process group (torch's object collectives, which a multi-rank DCP plan exchange uses,
    need numpy themselves); DCP plans, ckptd writes and reads."""
    model, optim = _trained()
    state = {"model": model.state_dict(), "optimizer": optim.state_dict(), "epoch": 2}
    client = client_factory()
    dcp.save(state, storage_writer=ckptd.dcp.StorageWriter(root / "dcp", client=client))
    target, target_optim = _fresh()
    loaded = {"model": target.state_dict(), "optimizer": target_optim.state_dict(), "epoch": 0}
    dcp.load(loaded, storage_reader=ckptd.dcp.StorageReader(root / "dcp"))
    assert equal_states(loaded, state)
    saved = _state(model, optim)  # a checkpoint ckptd saved itself, read by DCP
    client.save_async(saved, root / "own", step=1).result(60)
    into = _state(*_fresh())
    dcp.load(into, storage_reader=ckptd.dcp.StorageReader(root / "own"))
    assert equal_states(into, saved)
