"""``CkptdAccelerator``: Hugging Face accelerate's ``save_state`` / ``load_state``, saved by ckptd.

The one-line switch is the class::

    from ckptd.integrations.accelerate import CkptdAccelerator
    accelerator = CkptdAccelerator(project_config=config)   # was: Accelerator(project_config=config)

Everything else stays accelerate's: ``prepare``, ``register_for_checkpointing``,
``save_state()``, ``load_state()``. Each ``save_state`` is one ckptd save:
every process copies its state into shared memory and goes back to training;
the node's daemon writes, fsyncs and renames ``<dir>.incomplete`` to ``<dir>``
once every process's shard is durable, so the folder appears whole or not at
all (accelerate's own writes its files into the final folder one by one).

Why a subclass, not accelerate's hooks. ``register_save_state_pre_hook`` runs
before accelerate writes its files, and a hook can only take model weights off
the list: the optimizer, scheduler, sampler, RNG and custom-object files are
written by ``save_accelerator_state`` and ``save_custom_state`` whatever the
hook does, one ``torch.save`` after another, while the step waits. So this
class replaces ``save_state`` and ``load_state`` themselves; the hooks of
either are refused by name (they write or read files of the folder, which a
ckptd checkpoint does not have).

What a checkpoint holds (one ckptd checkpoint, ``ckptd.json`` and one
``rank-*.safetensors`` shard per process), under these keys: ``models`` (each
prepared model's state dict, as accelerate saves it), ``optimizers``,
``schedulers``, ``dataloaders`` (per prepared dataloader: its epoch,
``iteration``; a ``SeedableRandomSampler``'s ``epoch`` and ``initial_seed``;
a stateful dataloader's ``state_dict()``), ``custom`` (the ``state_dict()``
of each object given to ``register_for_checkpointing``), ``scaler`` (mixed
precision), ``rng`` (this process's Python, numpy, torch and accelerator
generators), ``step`` (``Accelerator.step``), ``iteration`` (the save's
number, ``project_configuration.iteration``) and ``accelerate_version``.
With several processes (DDP) ``models`` and ``optimizers`` are the same on
every process and written once (``replicated=``); the rest is each process's
own.

Names and retention. With ``ProjectConfiguration(automatic_checkpoint_naming=True)``
a save goes to ``project_dir/checkpoints/checkpoint_<iteration>`` as
accelerate names it (an existing one is refused as accelerate refuses it),
and ``total_limit=K`` is the daemon's retention (``keep_last=K``, applied
after each commit: a save in flight is never deleted, and accelerate's own
deletion before the save does not happen). Otherwise ``save_state(dir)``
saves to ``dir``, replacing an earlier ckptd checkpoint there; a ``dir``
holding anything else (accelerate's own files) is refused with
``FileExistsError`` naming it.

Loading. ``load_state()`` under automatic naming loads the newest complete
checkpoint of ``project_dir/checkpoints`` (``ckptd.latest``: never a save in
flight or one a crash cut short; a memory snapshot counts), ``load_state(dir)``
that one; both restore everything above, so a resumed run continues bitwise as
the uninterrupted one (given the same position in the data: accelerate saves
none, ``skip_first_batches`` with a step count kept in a registered object
does it). Under automatic naming the next save's number continues after the
loaded one's (accelerate's own ``load_state`` leaves that to the caller). A
folder of accelerate's own files is loaded by accelerate's own ``load_state``,
so a run switched to this class resumes from its last own checkpoint.

Memory snapshots. ``save_state(..., persist=False)`` holds the checkpoint in
node memory instead of writing it (``docs/memory.md``); ``load_state()``
finds it as the newest; ``total_limit`` counts persisted checkpoints only.

Failures. A save the daemon refused, or a daemon that died, raises at the
next ``backward``, ``save_state``, ``wait_for_checkpoints()`` or
``end_training()``; ``end_training()`` waits for the last save. A script that
ends without either still has its last save committed (it is the daemon's once
staged), but never learns whether it failed.

Supported: accelerate 1.16 (``SUPPORTED``; ``save_state`` and ``load_state`` read
the ``Accelerator``'s private lists of what it prepared, so another release is
refused at import, naming it), on one process or DDP (``NO``, ``MULTI_CPU``,
``MULTI_GPU``) on CPU or CUDA. Not covered (refused at construction):
DeepSpeed, FSDP, Megatron-LM, XLA and other devices, tensor, context and
sequence parallelism (``ParallelismConfig``).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.data_loader import SeedableRandomSampler
    from accelerate.utils import DistributedType
    from accelerate.utils.constants import (MODEL_NAME, OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_MODEL_NAME,
                                            SAMPLER_NAME, SCALER_NAME, SCHEDULER_NAME)
except ImportError as exc:
    raise ImportError("ckptd.integrations.accelerate needs accelerate 1.16: pip install 'accelerate>=1.16,<1.17'") \
        from exc

import ckptd
from ckptd.client import Client, SaveFuture
from ckptd.client.memory import find_held
from ckptd.integrations import rng
from ckptd.protocol.names import INDEX_NAME

__all__ = ["CkptdAccelerator", "SUPPORTED", "require_supported"]

log = logging.getLogger("ckptd.accelerate")

SUPPORTED = ((1, 16),)
"""The accelerate releases (major, minor; any patch) this module was written against and tested with."""

_AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")
"""accelerate's automatic checkpoint names (``checkpoint_<iteration>``); a save in flight is never called that."""
_THEIRS = (MODEL_NAME, SAFE_MODEL_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, RNG_STATE_NAME, SAMPLER_NAME, SCALER_NAME,
           "custom_checkpoint_", "dl_state_dict")
"""How the files accelerate's own ``save_state`` writes begin: a folder with none is no checkpoint of either kind
(``load_state`` of it would load nothing and say nothing)."""
_REPLICATED = ("models", "optimizers")
"""Keys the same on every process under DDP: written once, by process 0."""
_COVERED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
_DEVICES = ("cpu", "cuda")
_LISTS = ("models", "optimizers", "schedulers", "dataloaders", "custom")
"""The keys that hold one entry per prepared (or registered) object, in the order accelerate keeps them."""
_WHAT = {"models": "prepared models", "optimizers": "prepared optimizers", "schedulers": "prepared schedulers",
         "dataloaders": "prepared dataloaders", "custom": "objects registered with register_for_checkpointing"}


def require_supported(version: str) -> None:
    """Raise ``ImportError`` naming ``version`` unless it is an accelerate release this module supports."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) not in SUPPORTED:
        wanted = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)
        raise ImportError(
            f"ckptd.integrations.accelerate supports accelerate {wanted}, and accelerate {version} is installed: "
            "save_state and load_state are replaced using the Accelerator's private lists of what it prepared, which "
            f"change between releases. Install a supported release (pip install "
            f"'accelerate=={SUPPORTED[-1][0]}.{SUPPORTED[-1][1]}.*') or save with accelerate.Accelerator's own "
            "save_state")


require_supported(accelerate.__version__)


def _number(path: str | os.PathLike) -> int:
    """The iteration an automatic name carries (-1 for any other name)."""
    found = _AUTOMATIC.match(os.path.basename(os.fspath(path)))
    return int(found.group(1)) if found else -1


def _loader_state(loader: Any) -> dict[str, Any]:
    """What a prepared dataloader needs to yield the same batches again: its epoch (``DataLoaderShard.iteration``,
    which seeds a ``SeedableRandomSampler``), the sampler's own seed and epoch, and a stateful dataloader's state."""
    state: dict[str, Any] = {}
    if isinstance(getattr(loader, "iteration", None), int):
        state["iteration"] = loader.iteration
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if isinstance(sampler, SeedableRandomSampler):
        state["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    if getattr(loader, "use_stateful_dataloader", False):
        state["stateful"] = loader.state_dict()
    return state


def _load_loader(loader: Any, state: dict[str, Any]) -> None:
    if "iteration" in state:
        loader.iteration = state["iteration"]
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if "sampler" in state and isinstance(sampler, SeedableRandomSampler):
        sampler.initial_seed = state["sampler"]["initial_seed"]
        sampler.set_epoch(state["sampler"]["epoch"])
    if "stateful" in state and getattr(loader, "use_stateful_dataloader", False):
        loader.load_state_dict(state["stateful"])


class CkptdAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose ``save_state`` / ``load_state`` go through the node's ckptd daemon (module
    docstring).

    Keyword arguments beyond the ``Accelerator``'s: ``ckptd_run_dir`` (the
    daemon's run directory; default as ``ckptd.Client``) and
    ``commit_timeout`` (seconds every process has to hand its shard over).
    """

    def __init__(self, *args: Any, ckptd_run_dir: str | os.PathLike | None = None, commit_timeout: float = 600.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name = type(self).__name__
        if self.distributed_type not in _COVERED:
            raise ValueError(f"{name} does not cover {self.distributed_type.value}: its checkpoints are accelerate's "
                             f"own (use accelerate.Accelerator)")
        if self.device.type not in _DEVICES:
            raise ValueError(f"{name} covers CPU and CUDA devices, not {self.device.type!r} (use "
                             f"accelerate.Accelerator)")
        config = self.parallelism_config
        if config is not None and (config.tp_enabled or config.cp_enabled or config.sp_enabled
                                   or config.dp_shard_enabled):
            raise ValueError(f"{name} does not cover tensor, context, sequence or sharded data parallelism "
                             f"({config!r}; use accelerate.Accelerator)")
        self.ckptd_run_dir = ckptd_run_dir
        self.commit_timeout = commit_timeout
        self._ckptd: Client | None = None
        self._pending: SaveFuture | None = None

    # -- saving ---------------------------------------------------------------

    def _client(self) -> Client:
        """The client that saves, made at the first save on every process (a collective under DDP)."""
        if self._ckptd is None:
            self._ckptd = Client(run_dir=self.ckptd_run_dir, commit_timeout=self.commit_timeout)
        return self._ckptd

    def _is_ckptd(self, path: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(path, INDEX_NAME)) or find_held(Path(path), self.ckptd_run_dir) is not None

    def _refuse_hooks(self, hooks: dict[int, Callable[..., None]], register: str) -> None:
        if hooks:
            raise ValueError(
                f"{type(self).__name__} does not run hooks given to {register}: accelerate passes them the "
                f"checkpoint folder to write or read files of their own there, and a ckptd checkpoint holds ckptd's "
                f"files alone. Remove them (handle.remove()) and register what they save with "
                f"register_for_checkpointing, or use accelerate.Accelerator")

    def _save_path(self, output_dir: str | os.PathLike | None, persist: bool) -> tuple[str, int | None]:
        """Where this save goes, and its ``keep_last`` (``total_limit`` under automatic naming)."""
        project = self.project_configuration
        if project.automatic_checkpoint_naming:
            folder = os.path.join(os.path.abspath(self.project_dir), "checkpoints")
            path = os.path.join(folder, f"checkpoint_{self.save_iteration}")
            if os.path.lexists(path) or find_held(Path(path), self.ckptd_run_dir) is not None:
                raise ValueError(f"Checkpoint directory {path} ({self.save_iteration}) already exists. Please "
                                 f"manually override `self.save_iteration` with what iteration to start with.")
            keep = max(project.total_limit, 1) if persist and project.total_limit is not None else None
            return path, keep
        if output_dir is None:
            raise ValueError("save_state needs output_dir unless the Accelerator's ProjectConfiguration has "
                             "automatic_checkpoint_naming=True")
        path = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
        if os.path.lexists(path) and not os.path.isdir(path):
            raise FileExistsError(f"{path} is a file: save_state writes a checkpoint folder there, and ckptd never "
                                  f"replaces what it did not write. Name a new folder")
        if os.path.lexists(path) and not self._is_ckptd(path):
            raise FileExistsError(
                f"{path} exists and is not a ckptd checkpoint (accelerate's own files?): ckptd never replaces what "
                f"it did not write. Save to a new folder, or move it away")
        return path, None

    def _state_to_save(self) -> dict[str, Any]:
        """What accelerate's own files hold, as one state (keys: the module docstring)."""
        state: dict[str, Any] = {
            "models": [self.get_state_dict(model, unwrap=False) for model in self._models],
            "optimizers": [optimizer.state_dict() for optimizer in self._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in self._schedulers],
            "dataloaders": [_loader_state(loader) for loader in self._dataloaders],
            "custom": [obj.state_dict() for obj in self._custom_objects],
            "rng": rng.capture(self.device.type),
            "step": self.step,
            "iteration": self.save_iteration,
            "accelerate_version": accelerate.__version__}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, *,
                   persist: bool = True, **save_model_func_kwargs: Any) -> Path:
        """accelerate's ``save_state`` as one ckptd save; returns the checkpoint's path once this process's state
        is copied (the daemon commits it while training goes on). ``persist=False``: a memory snapshot.
        ``safe_serialization`` is accepted for accelerate's signature (a ckptd shard is safetensors either way)."""
        if save_model_func_kwargs:
            raise TypeError(f"{type(self).__name__}.save_state got {sorted(save_model_func_kwargs)}: those are "
                            f"DeepSpeed's save_checkpoint options, which a ckptd save does not take")
        if not isinstance(persist, bool):
            raise TypeError(f"persist must be True or False, got {persist!r}")
        self._refuse_hooks(self._save_model_state_pre_hook, "register_save_state_pre_hook")
        path, keep = self._save_path(output_dir, persist)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        client = self._client()
        self.wait_for_checkpoints()  # the daemon's max_inflight (1) would wait for it too; its failure shows here
        log.info("saving the accelerator's state to %s through ckptd", path)
        self._pending = client.save_async(self._state_to_save(), path, step=self.save_iteration, overwrite=True,
                                          keep_last=keep, persist=persist,
                                          replicated=_REPLICATED if self.num_processes > 1 else ())
        self.project_configuration.iteration += 1
        return Path(path)

    def wait_for_checkpoints(self) -> None:
        """Wait until every checkpoint saved so far is committed (a failed save raises here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _settle(self) -> None:
        """The save in flight, once it ended (asked, never waited for): a failure is raised now."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            pending.result()

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """accelerate's ``backward``, after raising the failure of a save that ended since the last step (a save
        the daemon refused, or a daemon that died, stops the run at the next step)."""
        self._settle()
        return super().backward(loss, **kwargs)

    def end_training(self) -> None:
        """Every save committed and the client closed (its shared memory freed), then accelerate's end of training
        (which destroys the process group the client agreed over)."""
        self.wait_for_checkpoints()
        if self._ckptd is not None:
            client, self._ckptd = self._ckptd, None
            client.close()
        super().end_training()

    # -- loading --------------------------------------------------------------

    def _newest(self) -> str:
        """``load_state()``'s choice under automatic naming: the newest complete ckptd checkpoint of
        ``project_dir/checkpoints`` (on disk or held in memory; collective under DDP), or accelerate's own newest
        folder there where it is newer (a run switched to this class)."""
        folder = os.path.join(os.path.abspath(self.project_dir), "checkpoints")
        if not os.path.isdir(folder):
            raise ValueError(f"load_state() found no checkpoint to load: {folder} does not exist (nothing was saved "
                             f"under this project_dir yet)")
        newest = ckptd.latest(folder, run_dir=self.ckptd_run_dir)
        own = [os.path.join(folder, name) for name in os.listdir(folder)
               if _AUTOMATIC.match(name) and os.path.isdir(os.path.join(folder, name))
               and not self._is_ckptd(os.path.join(folder, name))]
        own_newest = max(own, key=_number, default=None)
        if own_newest is not None and (newest is None or _number(own_newest) > _number(newest)):
            return own_newest
        if newest is None:
            raise ValueError(f"load_state() found no complete checkpoint in {folder}")
        return os.fspath(newest)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """accelerate's ``load_state`` from a ckptd checkpoint (``None`` under automatic naming: the newest
        complete one); a folder of accelerate's own files is loaded by accelerate's own ``load_state``."""
        if input_dir is not None:
            path = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
            if path.endswith(".incomplete"):
                raise ValueError(f"{path} is a ckptd save that never completed (in flight, or cut short by a crash): "
                                 f"load a complete checkpoint (load_state() takes the newest under automatic "
                                 f"naming; ckptd.latest finds it otherwise)")
        elif self.project_configuration.automatic_checkpoint_naming:
            path = self._newest()
        else:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        if not self._is_ckptd(path):
            if os.path.lexists(path) and not os.path.isdir(path):
                raise ValueError(f"{path} is a file, not a checkpoint folder: load_state takes the folder a "
                                 f"save_state wrote")
            if not os.path.isdir(path):
                raise ValueError(f"Tried to find {path} but folder does not exist (nor is a ckptd memory snapshot "
                                 f"held there)")
            if not any(name.startswith(_THEIRS) for name in os.listdir(path)):
                raise ValueError(f"{path} holds no checkpoint: neither ckptd's ({INDEX_NAME}, or a memory snapshot "
                                 f"of it held by the daemon) nor accelerate's own files; load_state takes the folder "
                                 f"a save_state wrote")
            log.info("loading %s with accelerate's own load_state (not a ckptd checkpoint)", path)
            super().load_state(path, load_kwargs, **load_model_func_kwargs)
            self._continue_numbering(_number(path))
            return
        self._refuse_hooks(self._load_model_state_pre_hook, "register_load_state_pre_hook")
        strict = load_model_func_kwargs.pop("strict", True)
        map_location = load_model_func_kwargs.pop("map_location", None)
        if map_location not in (None, "cpu", "on_device"):
            raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or "
                            "`'on_device'`")
        if load_kwargs or load_model_func_kwargs:
            given = sorted({**(load_kwargs or {}), **load_model_func_kwargs})
            raise TypeError(f"{type(self).__name__}.load_state got {given}: those are options of torch.load or "
                            f"DeepSpeed's load_checkpoint, which a ckptd checkpoint does not take (strict= and "
                            f"map_location= it does)")
        log.info("loading the accelerator's state from the ckptd checkpoint %s", path)
        state = ckptd.load(path, run_dir=self.ckptd_run_dir)
        self._check_matches(state, path)
        for model, weights in zip(self._models, state["models"]):
            model.load_state_dict(weights, strict=strict)  # copied into the model's own tensors, on its device
        for optimizer, saved in zip(self._optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)  # moved to each parameter's device by the optimizer
        for scheduler, saved in zip(self._schedulers, state["schedulers"]):
            scheduler.load_state_dict(saved)
        for loader, saved in zip(self._dataloaders, state["dataloaders"]):
            _load_loader(loader, saved)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        rng.restore(state["rng"])
        self.step = state["step"]
        for obj, saved in zip(self._custom_objects, state["custom"]):
            obj.load_state_dict(saved)
        self._continue_numbering(state["iteration"])

    def _continue_numbering(self, loaded: int) -> None:
        """Under automatic naming the next save is numbered after the one loaded (accelerate's own leaves
        ``project_configuration.iteration`` to the caller, and its next save would clash with a kept folder)."""
        if self.project_configuration.automatic_checkpoint_naming and loaded >= 0:
            self.project_configuration.iteration = loaded + 1

    def _check_matches(self, state: dict[str, Any], path: str) -> None:
        """Refuse, before anything is changed, a checkpoint whose saved objects do not match what was prepared
        and registered now (accelerate's own fails part-way through its files, or on the custom objects last)."""
        problems = [f"{len(state.get(key, []))} {_WHAT[key]} saved, {len(mine)} now"
                    for key, mine in zip(_LISTS, (self._models, self._optimizers, self._schedulers,
                                                  self._dataloaders, self._custom_objects))
                    if len(state.get(key, [])) != len(mine)]
        if self.scaler is not None and "scaler" not in state:
            problems.append("a gradient scaler now (mixed precision), none saved")
        if "rng" not in state or "step" not in state:
            problems.append("no random states or step saved (not a checkpoint of CkptdAccelerator?)")
        if problems:
            raise ValueError(f"{path} does not match this accelerator: {'; '.join(problems)}. Load it with the same "
                             f"models, optimizers, schedulers, dataloaders and registered objects it was saved with")
