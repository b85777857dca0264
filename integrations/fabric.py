"""Lightning Fabric with ckptd: ``fabric.save``/``fabric.load`` through the node's daemon.

Single device and DDP: ``Fabric(plugins=[CkptdCheckpointIO()])``. Fabric's
strategies that use a ``CheckpointIO`` save on rank 0 only; the plugin is
the same one the Trainer takes (``ckptd.integrations.lightning``), so paths,
what may be saved and what loads back are as described there. ``fabric.save``
returns once the state is copied into shared memory; a later ``fabric.save``
or ``fabric.load`` of the same path on that rank waits for it. Another rank
does not know about it: before every rank loads a checkpoint just saved, call
``fabric.strategy.checkpoint_io.wait(path)`` on the saving rank and then
``fabric.barrier()``. Call ``fabric.strategy.checkpoint_io.teardown()`` before
the process exits (Fabric has no end-of-run hook): it waits for the saves in
flight and raises one that failed.

Sharded (FSDP2, tensor parallel): ``Fabric(strategy=CkptdFabricModelParallelStrategy(parallelize_fn))``
where you would use Fabric's ``ModelParallelStrategy``. Every rank stages only
its DTensor chunks; ``fabric.load`` restores the model and optimizers in
place with ``ckptd.load_into`` (any world size) and returns the rest, as
Fabric's own strategy does.
"""

from __future__ import annotations

import os
from typing import Any, Callable

try:
    from lightning.fabric.strategies import ModelParallelStrategy
    from lightning.fabric.utilities.types import _Stateful
except ImportError as exc:
    raise ImportError("ckptd.integrations.fabric needs Lightning 2.4 or newer: pip install 'ckptd[lightning]'") from exc

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from .lightning import CkptdCheckpointIO
from .lightning_sharded import WithCkptdCheckpointIO, check_sharded_over_every_rank, restore_module, restore_optimizers

__all__ = ["CkptdCheckpointIO", "CkptdFabricModelParallelStrategy"]


def _sharded_module(state: dict[str, Any], action: str) -> tuple[str, Module]:
    """The one module of ``state`` with DTensor parameters, and its key (Fabric's rule for sharded checkpoints)."""
    modules = [(k, m) for k, m in state.items()
               if isinstance(m, Module) and any(isinstance(p, DTensor) for p in m.parameters())]
    if len(modules) != 1:
        found = "none" if not modules else ", ".join(repr(k) for k, _ in modules)
        raise ValueError(f"{action} a sharded checkpoint needs exactly one model set up by the strategy in the state, "
                         f"like state={{'model': model, ...}}; found {found}")
    return modules[0]


class CkptdFabricModelParallelStrategy(WithCkptdCheckpointIO, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` whose checkpoints are asynchronous sharded ckptd saves."""

    def __init__(self, parallelize_fn: Callable[..., Any], *args: Any,
                 checkpoint_io: CkptdCheckpointIO | None = None, **kwargs: Any) -> None:
        """
        Args:
            parallelize_fn, *args, **kwargs: Fabric's ``ModelParallelStrategy``'s.
            checkpoint_io: how to reach the daemon (default ``CkptdCheckpointIO()``);
                every rank saves its own shard.

        ``save_distributed_checkpoint=False`` is refused, as by
        ``CkptdModelParallelStrategy``: it gathers the model on rank 0.
        """
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ValueError("CkptdFabricModelParallelStrategy saves sharded checkpoints only; drop "
                             "save_distributed_checkpoint=False (ckptd.load(path) gives the full state of a sharded "
                             "checkpoint in one process)")
        super().__init__(parallelize_fn, *args, **kwargs)
        if checkpoint_io is not None:  # else one from Trainer/Fabric(plugins=[...]), or the default
            self.checkpoint_io = checkpoint_io

    def save_checkpoint(self, path: str | os.PathLike, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Every rank stages its shard of ``state`` (the model's and optimizers' DTensors, the rest as is)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options; got {storage_options!r}")
        if filter is not None:
            raise ValueError(f"{type(self).__name__} saves whole sharded states: filter= is not supported (a "
                             "filtered sharded checkpoint could not be loaded back)")
        module_key, module = _sharded_module(state, "saving")
        options = StateDictOptions(cpu_offload=True)
        converted: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                converted[key] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, Optimizer):
                converted[key] = get_optimizer_state_dict(module, obj, options=options)
            else:
                converted[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        check_sharded_over_every_rank(converted[module_key], f"state[{module_key!r}]")
        self.checkpoint_io.save_checkpoint(converted, self.broadcast(path))

    def load_checkpoint(self, path: str | os.PathLike, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers in ``state`` in place, and its other entries; what was not asked for.

        ``weights_only`` has nothing to do: ckptd never unpickles.
        """
        if not isinstance(state, dict) or not state:
            raise ValueError(f"{type(self).__name__}.load_checkpoint needs state={{'model': model, ...}} with the "
                             f"model set up by the strategy; got state={state!r}")
        path = self.broadcast(path)
        module_key, module = _sharded_module(state, "loading")
        optimizers = {k: o for k, o in state.items() if isinstance(o, Optimizer)}
        io = self.checkpoint_io
        rest = io.load_checkpoint(path, rank=0, exclude=(module_key, *optimizers))  # waits for a save in flight first
        requested = [k for k in state if k != module_key and k not in optimizers]
        missing = [k for k in requested if k not in rest]
        if strict and missing:
            raise KeyError(f"the checkpoint at {path} holds no {', '.join(map(repr, missing))}; "
                           "load with strict=False to leave them as they are")
        restore_module(module, path, module_key, strict=strict, run_dir=io.run_dir)
        for key, opt in optimizers.items():
            restore_optimizers(module, opt, path, key, run_dir=io.run_dir)
        for key in requested:
            if key not in rest:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest

    def teardown(self) -> None:
        """Wait for every save in flight, raising one that failed, then Fabric's teardown."""
        try:
            self.checkpoint_io.teardown()
        finally:
            super().teardown()
