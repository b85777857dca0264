"""The states the benchmark saves: a transformer plus its real AdamW state, or many small tensors.

Cost depends on the number of tensors as well as bytes, so the main state looks like a real one: hundreds of tensors,
from 0-dim AdamW ``step`` scalars to a large embedding. Gradients are a thousandth of the weights, not from a backward
pass: the same optimizer tensors, in seconds, not a minute.
"""
from __future__ import annotations
from dataclasses import dataclass
from typing import Any, Iterator
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

VOCAB = 32000
LAYERS = 12
WIDTH_STEP = 16
BYTES_PER_PARAM = 12
"""float32 parameter + exp_avg + exp_avg_sq."""

class Block(nn.Module):
    """One pre-norm transformer block: attention projections and an MLP."""
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

class TinyTransformer(nn.Module):
    """Embedding, ``LAYERS`` blocks, final norm and an untied output head."""
    def __init__(self, d: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

def param_count(d: int) -> int:
    """Parameters of ``TinyTransformer(d)``, without building it."""
    per_block = 2 * (2 * d) + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return 2 * VOCAB * d + LAYERS * per_block + 2 * d

def pick_width(target_bytes: int) -> int:
    """The width (a multiple of ``WIDTH_STEP``) whose state comes closest to ``target_bytes``."""
    return min(range(WIDTH_STEP, 1 << 16, WIDTH_STEP),
               key=lambda d: abs(param_count(d) * BYTES_PER_PARAM - target_bytes))

@dataclass
class BenchState:
    """A state dict, its tensors in flattening order, and (for the transformer) its model and optimizer."""
    state: dict[str, Any]
    tensors: list[torch.Tensor]
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
    def describe(self) -> dict:
        """What the report says about the state."""
        return {"nbytes": self.nbytes, "tensors": len(self.tensors), "device": str(self.tensors[0].device),
                "largest": max(t.numel() * t.element_size() for t in self.tensors),
                **({"gpu": torch.cuda.get_device_name(self.tensors[0].device)} if self.tensors[0].is_cuda else {})}

def iter_tensors(obj: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Tensors of a nested dict/list/tuple, depth first, each object once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor) and id(obj) not in seen:
        seen.add(id(obj))
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from iter_tensors(v, seen)

def build(name: str, size_gib: float, *, device: str = "cpu", seed: int = 0, fsdp: bool = False) -> BenchState:
    """``transformer``: a ``{"model", "optimizer", "step"}`` state of about ``size_gib`` GiB on ``device``; or
    ``small``: 1,000 float32 tensors of 256 B (fixed costs dominate). ``fsdp``: the transformer sharded over every
    rank (``fully_shard``, built on the meta device: no rank holds it all), ``tensors`` this rank's shards."""
    torch.manual_seed(seed)
    if name == "small":
        state = {f"t{i:05d}": torch.randn(64, device=device) for i in range(1000)}
        return BenchState(state, list(state.values()))
    with torch.device("meta" if fsdp else device):
        model = TinyTransformer(pick_width(int(size_gib * (1 << 30))))
    if fsdp:
        fully_shard(model, mesh=init_device_mesh(device, (dist.get_world_size(),)))
        model.to_empty(device=device)
    # foreach: the single-tensor CPU step takes ~7 s for 1 GiB on two cores; over DTensors, foreach is 4× slower.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=not fsdp)
    with torch.no_grad():
        for p in model.parameters():
            if fsdp:
                p.to_local().normal_(0, 0.02)  # to_empty left it as it found the memory
            p.grad = p.detach() * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt) if fsdp else (model.state_dict(), opt.state_dict())
    state = {"model": msd, "optimizer": osd, "step": 1000}
    return BenchState(state, [t.to_local() if isinstance(t, DTensor) else t for t in iter_tensors(state)], model, opt)

def tensor_sum(tensors: Any) -> float:
    """Sum of every element of every tensor: touches every byte (float32 sums, added in Python)."""
    return float(sum(float(t.float().sum()) for t in tensors if t.numel()))
