"""``CkptdModelParallelStrategy`` and ``CkptdFSDPStrategy``: Lightning's sharded checkpoints, saved by ckptd.

Use it as ``Trainer(strategy=CkptdModelParallelStrategy())`` where you would
write ``Trainer(strategy=ModelParallelStrategy())``. Lightning's own strategy
saves its sharded state with ``torch.distributed.checkpoint`` and never asks a
``CheckpointIO``; this one hands each rank's part of the checkpoint to the
node's ckptd daemon instead: every rank copies only the DTensor chunks it
owns into shared memory and goes back to training, and the checkpoint
directory appears, committed, once every rank's shard is durable.

What is saved. Lightning's checkpoint dict, unchanged in shape: ``state_dict``
and ``optimizer_states`` hold DTensors (saved as chunks of the global
tensors, nothing gathered), and the rest (loops, callbacks, ``global_step``,
hyperparameters) is plain. ``ckptd.load(path)`` in one plain process
therefore gives a whole, consolidated Lightning checkpoint.

What loads it. ``fit/validate/test(ckpt_path=...)`` restore the model and
optimizers in place with ``ckptd.load_into``, which reads into each rank's
DTensors only the byte ranges its shards hold, so a checkpoint resumes on
another number of ranks or another mesh. The rest of the dict is rank 0's,
as with Lightning's own sharded checkpoints.

Paths, ``ModelCheckpoint`` top-k and ``save_last`` (files or links) behave
as with ``CkptdCheckpointIO`` (see ``ckptd.integrations.lightning``):
checkpoints keep Lightning's names and are directories, and
``ModelCheckpoint`` removes them through this strategy's ``CkptdCheckpointIO``,
which waits for a save still in flight first. A ``CkptdCheckpointIO`` in
``Trainer(plugins=[...])`` configures it; any other ``CheckpointIO`` is refused.

``CkptdFSDPStrategy`` does the same for Lightning's ``FSDPStrategy`` (FSDP1,
GPUs only in Lightning): ``strategy=CkptdFSDPStrategy(...)`` for
``strategy=FSDPStrategy(...)``.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
except ImportError:
    try:
        from pytorch_lightning.core.optimizer import LightningOptimizer
        from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
    except ImportError as exc:
        raise ImportError(
            "ckptd.integrations.lightning_sharded needs Lightning 2.4 or newer: pip install 'ckptd[lightning]'"
        ) from exc

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from ckptd.client import load_into

from .lightning import CkptdCheckpointIO

__all__ = ["CkptdFSDPStrategy", "CkptdModelParallelStrategy", "check_sharded_over_every_rank", "restore_module", "restore_optimizers"]

SHARDED_KEYS = ("state_dict", "optimizer_states")
"""Lightning's checkpoint entries that hold DTensors: restored in place, never read whole."""


def check_sharded_over_every_rank(state: dict[str, Any], where: str) -> None:
    """Refuse a model whose DTensors live on a sub-mesh: every rank outside it holds the same chunks.

    ckptd would refuse those duplicate chunks only at commit, in the
    background; this names the cause while the save is being made. The
    ranks that save are torch.distributed's, as the ckptd client's are.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    for key, value in state.items():
        if isinstance(value, DTensor) and value.device_mesh.size() != world_size:
            raise ValueError(
                f"{where}[{key!r}] is sharded over {value.device_mesh.size()} of the {world_size} ranks, so the "
                "other ranks hold copies of the same chunks, which a ckptd checkpoint cannot take. Shard the model "
                "over every rank (without tensor parallelism: data_parallel_size=<world size>, "
                "tensor_parallel_size=1)")


def restore_module(module: Module, path: str | os.PathLike, key: str, *, strict: bool,
                   run_dir: str | os.PathLike | None) -> None:
    """Copy the model state saved under ``key`` into ``module``'s DTensors in place (any mesh, any world size)."""
    state = get_model_state_dict(module)
    load_into(state, path, key=key, strict=strict, run_dir=run_dir)
    set_model_state_dict(module, state, options=StateDictOptions(strict=strict))


def restore_optimizers(module: Module, optimizers: Optimizer | list[Optimizer], path: str | os.PathLike, key: str, *,
                       run_dir: str | os.PathLike | None) -> None:
    """Copy the optimizer state saved under ``key`` into ``optimizers`` (of ``module``) in place.

    A list of optimizers reads a saved list (Lightning's ``optimizer_states``);
    one optimizer reads one saved state dict (Fabric's ``state["optimizer"]``).
    ``get_optimizer_state_dict`` creates the moments of an optimizer that has
    not stepped yet, so there is a DTensor to copy each saved one into.
    """
    listed = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    if not listed:
        return
    states = [get_optimizer_state_dict(module, opt) for opt in listed]
    load_into(states[0] if isinstance(optimizers, Optimizer) else states, path, key=key, run_dir=run_dir)
    for opt, state in zip(listed, states):
        set_optimizer_state_dict(module, opt, optim_state_dict=state)


class WithCkptdCheckpointIO:
    """A strategy (Trainer's or Fabric's) whose checkpoint I/O is a ``CkptdCheckpointIO`` saving on every rank."""

    _checkpoint_io: Any

    @property
    def checkpoint_io(self) -> CkptdCheckpointIO:
        """The plugin that reaches the daemon; also what ``ModelCheckpoint`` removes checkpoints through."""
        if self._checkpoint_io is None:
            self.checkpoint_io = CkptdCheckpointIO()
        assert isinstance(self._checkpoint_io, CkptdCheckpointIO)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CkptdCheckpointIO) -> None:
        """Also reached by ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``; any other plugin is refused."""
        if not isinstance(io, CkptdCheckpointIO):
            raise TypeError(f"{type(self).__name__} saves through a CkptdCheckpointIO, not a {type(io).__name__}: "
                            "its sharded checkpoints are ckptd checkpoints")
        io.save_every_rank()
        self._checkpoint_io = io


class CkptdShardedCheckpoints(WithCkptdCheckpointIO):
    """What the sharded strategies share: every rank saves its shard through a ``CkptdCheckpointIO``.

    Mixed in before a Lightning strategy whose ``lightning_module_state_dict``
    and ``optimizer_state`` give DTensors; ``self.model``, ``self.optimizers``
    and ``self.broadcast`` are the strategy's.
    """

    model: Any
    optimizers: list[Optimizer]
    lightning_module: Any
    broadcast: Any

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Every rank stages its shard of ``checkpoint`` for ``filepath``; returns once staged."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options; got {storage_options!r}")
        check_sharded_over_every_rank(checkpoint.get("state_dict", {}), "state_dict")
        path = self.broadcast(filepath)  # rank 0's name: every rank saves its shard of one checkpoint
        self.checkpoint_io.save_checkpoint(checkpoint, path)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers from ``checkpoint_path`` in place; the rest of the dict.

        ``weights_only`` has nothing to do: ckptd never unpickles.
        """
        path = self.broadcast(checkpoint_path)
        assert self.model is not None and self.lightning_module is not None
        io = self.checkpoint_io
        rest = io.load_checkpoint(path, rank=0, exclude=SHARDED_KEYS)  # waits for a save in flight to path first
        restore_module(self.model, path, "state_dict", strict=self.lightning_module.strict_loading, run_dir=io.run_dir)
        restore_optimizers(self.model, self.optimizers, path, "optimizer_states", run_dir=io.run_dir)
        return rest

    def teardown(self) -> None:
        """Wait for every save in flight (its ranks coordinate the commit), then Lightning's teardown.

        ``ModelParallelStrategy.teardown`` never tears its ``CheckpointIO`` down;
        a rank that exited first would leave the other ranks' commit waiting.
        (A second teardown, as ``FSDPStrategy``'s own, finds nothing to do.)
        A save that failed in the background is raised here.
        """
        try:
            self.checkpoint_io.teardown()
        finally:
            super().teardown()


class CkptdModelParallelStrategy(CkptdShardedCheckpoints, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded checkpoints are asynchronous ckptd saves."""

    def __init__(self, *args: Any, checkpoint_io: CkptdCheckpointIO | None = None, **kwargs: Any) -> None:
        """
        Args:
            *args, **kwargs: ``ModelParallelStrategy``'s (``data_parallel_size``,
                ``tensor_parallel_size``, ``process_group_backend``, ``timeout``).
            checkpoint_io: how to reach the daemon, e.g.
                ``CkptdCheckpointIO(run_dir=..., max_inflight=2)`` (or pass it
                in ``Trainer(plugins=[...])``). Its rank and world size come
                from torch.distributed: every rank saves its own shard.

        ``save_distributed_checkpoint=False`` is refused: it gathers the whole
        model on rank 0, which is what this strategy exists to avoid, and
        ``ckptd.load(path)`` already gives the whole state from a sharded
        checkpoint.
        """
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ValueError("CkptdModelParallelStrategy saves sharded checkpoints only; drop "
                             "save_distributed_checkpoint=False (ckptd.load(path) gives the full state of a sharded "
                             "checkpoint in one process)")
        super().__init__(*args, **kwargs)
        if checkpoint_io is not None:  # else one from Trainer/Fabric(plugins=[...]), or the default
            self.checkpoint_io = checkpoint_io


class CkptdFSDPStrategy(CkptdShardedCheckpoints, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) whose checkpoints are asynchronous sharded ckptd saves.

    FSDP1 gives DTensor state dicts only when it wraps the model with a
    device mesh (else ``ShardedTensor``s, which ckptd does not save), so a
    one-dimensional mesh over every rank is made when none is given; with
    ``FULL_SHARD`` that shards exactly as FSDP's default process group does.
    Lightning allows ``FSDPStrategy`` only on GPUs.
    """

    def __init__(self, *args: Any, checkpoint_io: CkptdCheckpointIO | None = None, **kwargs: Any) -> None:
        """
        Args:
            *args, **kwargs: ``FSDPStrategy``'s.
            checkpoint_io: as for ``CkptdModelParallelStrategy``.

        ``state_dict_type`` is ``"sharded"``; ``"full"`` is refused (it gathers
        the model on rank 0, and ``ckptd.load(path)`` gives the full state of
        a sharded checkpoint anyway).
        """
        if kwargs.setdefault("state_dict_type", "sharded") != "sharded":
            raise ValueError("CkptdFSDPStrategy saves sharded checkpoints only; drop state_dict_type="
                             f"{kwargs['state_dict_type']!r} (ckptd.load(path) gives the full state of a sharded "
                             "checkpoint in one process)")
        super().__init__(*args, **kwargs)
        if checkpoint_io is not None:  # else one from Trainer/Fabric(plugins=[...]), or the default
            self.checkpoint_io = checkpoint_io

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.kwargs.get("device_mesh") is None:
            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, (self.world_size,))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state: DTensors (FSDP1 wrapped with a mesh), on the CPU."""
        assert self.model is not None
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=True))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state, keyed by parameter name as ``load_checkpoint`` restores it."""
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=True))
