"""The benchmark's state dict: a small transformer plus its real AdamW state.

Checkpoint cost depends on the number of bytes *and* on the number of
tensors (flattening, header layout and one ``copy_`` per tensor), so the
state has to look like a real training state: hundreds of tensors, from
0-dim AdamW ``step`` scalars and norm biases to a large embedding, shaped as
``{"model": ..., "optimizer": ..., "step": n}``. The width of the model is
chosen so the whole state (parameters, ``exp_avg``, ``exp_avg_sq``) comes as
close as a multiple of 16 allows to the requested size.

Gradients are set with ``randn_like`` instead of running a forward/backward
pass: the optimizer state has exactly the tensors a real step produces, and
building 1 GiB of state takes seconds instead of a minute on two cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

VOCAB = 32000
LAYERS = 12
WIDTH_STEP = 16
BYTES_PER_PARAM = 12
"""float32 parameter + exp_avg + exp_avg_sq."""


class Block(nn.Module):
    """One pre-norm transformer block: attention projections and an MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)


class TinyTransformer(nn.Module):
    """Embedding, ``LAYERS`` blocks, final norm and an untied output head."""

    def __init__(self, d: int, layers: int = LAYERS, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)


def param_count(d: int, layers: int = LAYERS, vocab: int = VOCAB) -> int:
    """Parameters of ``TinyTransformer(d)``, without building it."""
    per_block = 2 * (2 * d) + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return 2 * vocab * d + layers * per_block + 2 * d


def pick_width(target_bytes: int) -> int:
    """The width (multiple of ``WIDTH_STEP``) whose state is closest to ``target_bytes``."""
    best, d = WIDTH_STEP, WIDTH_STEP
    while True:
        size = param_count(d) * BYTES_PER_PARAM
        if abs(size - target_bytes) < abs(param_count(best) * BYTES_PER_PARAM - target_bytes):
            best = d
        if size > target_bytes:
            return best
        d += WIDTH_STEP


@dataclass
class BenchState:
    """The state dict and what the report says about it."""

    state: dict[str, Any]
    width: int
    layers: int
    params: int
    tensors: list[torch.Tensor]
    """Every tensor of ``state`` once, in flattening order."""
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    """The objects ``state`` was taken from (its tensors are theirs): targets for ``load_into``."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def largest(self) -> int:
        return max(t.numel() * t.element_size() for t in self.tensors)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors of a nested dict/list/tuple, depth first, each object once."""
    seen: set[int] = set()

    def walk(o: Any) -> Iterator[torch.Tensor]:
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                yield o
        elif isinstance(o, dict):
            for v in o.values():
                yield from walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                yield from walk(v)

    return walk(obj)


def build_state(size_gib: float, *, seed: int = 0, step: int = 1000) -> BenchState:
    """A ``{"model", "optimizer", "step"}`` state of about ``size_gib`` GiB."""
    torch.manual_seed(seed)
    d = pick_width(int(size_gib * (1 << 30)))
    model = TinyTransformer(d)
    # foreach: the default single-tensor CPU step takes ~7 s for 1 GiB here.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
    params = sum(p.numel() for p in model.parameters())
    return BenchState(state, d, LAYERS, params, list(iter_tensors(state)), model, opt)


def describe(bench: BenchState) -> dict:
    """What the report says about the state, as JSON."""
    return {"nbytes": bench.nbytes, "tensors": len(bench.tensors), "largest": bench.largest,
            "layers": bench.layers, "width": bench.width, "params": bench.params}


def tensor_sum(tensors: Any) -> float:
    """Sum of every element of every tensor (float32 sums, added in Python): touches every byte."""
    return float(sum(float(t.sum()) for t in tensors if t.numel()))
