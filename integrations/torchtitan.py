"""``CheckpointManager``: torchtitan's checkpoints, saved by ckptd.

Select it in your own torchtitan config where the trainer takes its
checkpoint manager::

    from ckptd.integrations.torchtitan import CheckpointManager
    config.checkpoint = CheckpointManager.Config(enable=True, async_mode="async", interval=500)

It is torchtitan's own ``CheckpointManager`` (same ``Config`` fields, same
``step-N`` folders, same flattened state: the model's keys at the top level
beside ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``), with
``dcp.save`` / ``dcp.load`` replaced by the node's ckptd daemon: every rank
copies only its DTensor chunks into shared memory and goes back to training,
and ``step-N`` appears, committed, once every rank's shard is durable.

``async_mode`` maps onto ckptd:

- ``"disabled"``: ``save()`` returns once the checkpoint is committed.
- ``"async"``: ``save()`` returns once this rank's tensors are copied; the
  commit is ``save_future`` (torchtitan waits on it before the next save).
- ``"async_with_pinned_mem"``: the copy runs on the client's thread
  (``background_staging``); ``save()`` returns at once and the trainer's
  ``maybe_wait_for_staging()`` before ``optimizer.step()`` waits for the copy.

Loads read each rank's regions straight into its tensors (``ckptd.load_into``:
any world size, any mesh); the step to resume is the newest committed
checkpoint in ``folder`` by its ``ckptd.json`` (``ckptd.latest``). A save
to a step that has a checkpoint replaces it atomically, as torchtitan's DCP
writer overwrites: a run rolled back by ``load_step`` trains on past its
later steps. A run
that switches keeps going: DCP checkpoints torchtitan's own manager saved
in ``folder`` count too (a newer one is loaded through DCP), as does an
``initial_load_path`` to a DCP or Hugging Face checkpoint. ckptd's retention
never deletes those (they hold no ``ckptd.json``). The way back is not
symmetric: torchtitan's own manager sees no ``ckptd.json``, resumes from its
own newest step and writes its DCP files into the ``step-N`` folders ckptd
committed after it; a folder holding both runs' checkpoints is refused, never
loaded. torchtitan's ``ParallelAwareDataloader`` keeps its state per
data-parallel rank and cannot take it to another data-parallel degree
(torchtitan's own limit): there, name it in ``exclude_from_loading``.

Retention is ckptd's: ``keep_latest_k`` becomes the daemon's ``keep_last``,
applied after each commit, and torchtitan's purge thread is never started
(it would delete by folder name, racing the daemon and a save in flight).
A remote ``folder`` (``s3://``) is refused: save locally and let the daemon
upload what commits (``ckptd start --mirror DIR=s3://BUCKET/PREFIX``).

``memory_interval`` adds ckptd's memory tier beside torchtitan's ``interval``:
between two persisted checkpoints, a memory snapshot every ``memory_interval``
steps, held in node memory by the daemon instead of written (the same
``step-N`` name; ``docs/memory.md``). A run resumes from the newest of either,
so a trainer killed between two persists resumes from its last snapshot, read
from memory; ``keep_latest_k`` counts persisted checkpoints only (snapshots
follow the daemon's ``--keep-snapshots``), and the daemon persists a dead
trainer's newest snapshot (``--persist-on-exit``).

``last_save_in_hf`` keeps working as torchtitan does it: the last step's
model-only export is written by DCP's ``HuggingFaceStorageWriter`` into
``step-N`` (synchronously; it is an export for inference, not a ckptd
checkpoint, so ``ckptd.latest`` never resumes from it).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

try:
    from torchtitan.components.checkpointer import AsyncMode, CheckpointManager as DCPCheckpointManager
    from torchtitan.components.checkpointer.base import DATALOADER, MODEL
    from torchtitan.tools.filesystem import is_remote
    from torchtitan.tools.logging import logger
except ImportError as exc:
    raise ImportError("ckptd.integrations.torchtitan needs torchtitan 0.3: pip install torchtitan==0.3.0") from exc

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.stateful import Stateful

import ckptd
from ckptd.client import Client, load_into
from ckptd.client.memory import find_held
from ckptd.protocol.names import INDEX_NAME

__all__ = ["CheckpointManager"]

_STEP_NAME = re.compile(r"step-(\d+)")
"""torchtitan's checkpoint folder name (``_create_checkpoint_id``), read back as the checkpoint's step."""
_PER_RANK = "dp_rank_"
"""How torchtitan's ``ParallelAwareDataloader`` names its state's entries, one per data-parallel rank."""
DCP_METADATA = ".metadata"
"""The file that makes a directory a DCP checkpoint (``torch.distributed.checkpoint``'s metadata)."""


def _check_one_run(checkpoint: str) -> None:
    """Refuse the ckptd checkpoint ``checkpoint`` when a DCP checkpoint was written into the same folder.

    torchtitan's own manager sees no ``ckptd.json``: switched back to, it
    resumes from its own newest step and writes its DCP files into the
    ``step-N`` folders ckptd committed after it. The folder then holds two
    runs' checkpoints (ckptd's index still checks out), and which one a load
    restores would depend on the manager: refuse rather than guess.
    """
    if not os.path.isfile(os.path.join(checkpoint, DCP_METADATA)):
        return
    data = sum(name.endswith(DEFAULT_SUFFIX) for name in os.listdir(checkpoint))
    raise ValueError(
        f"checkpoint {checkpoint} holds two runs' checkpoints: ckptd's ({INDEX_NAME} and the shards it lists) and a "
        f"DCP checkpoint ckptd did not write ({DCP_METADATA} and {data} *{DEFAULT_SUFFIX} files), as torchtitan's "
        f"own CheckpointManager leaves when it saves into a folder of ckptd's checkpoints; ckptd will not guess which "
        f"to load. Move the files of the run you do not want out of {checkpoint}, or resume from another step "
        "(checkpoint.load_step)")


def _newest_dcp_step(folder: str) -> int:
    """The highest N of the DCP checkpoints ``folder/step-N`` (torchtitan's own manager's), or -1."""
    steps = [int(m.group(1)) for name in os.listdir(folder) if (m := _STEP_NAME.fullmatch(name))
             and os.path.isfile(os.path.join(folder, name, DCP_METADATA))]
    return max(steps, default=-1)


def state_dicts(states: dict[str, Any]) -> dict[str, Any]:
    """``states`` with each ``Stateful`` replaced by its ``state_dict()``: what ``dcp.save`` would save."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}


def load_stateful(states: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Hand each ``Stateful`` of ``states`` its loaded state dict, as ``dcp.load`` does."""
    for k, v in states.items():
        if isinstance(v, Stateful):
            v.load_state_dict(loaded[k])


class CheckpointManager(DCPCheckpointManager):
    """torchtitan's ``CheckpointManager`` whose saves and loads go through the node's ckptd daemon."""

    @dataclass(kw_only=True, slots=True)
    class Config(DCPCheckpointManager.Config):
        run_dir: str | None = None
        """The ckptd daemon's run directory (``ckptd.Client(run_dir=...)``); default: ``$CKPTD_RUN_DIR`` or the
        per-user one. A daemon is spawned when none answers."""

        commit_timeout: float = 600.0
        """Seconds every rank has to hand its shard over before the save fails on every rank (``RanksMissing``)."""

        memory_interval: int = 0
        """Memory snapshot interval in steps, between the checkpoints ``interval`` persists: held in node memory by
        the ckptd daemon instead of written, and resumed from when it is the newest (0: none)."""

        def __post_init__(self) -> None:
            super(CheckpointManager.Config, self).__post_init__()
            if isinstance(self.memory_interval, bool) or not isinstance(self.memory_interval, int):
                raise ValueError(f"memory_interval must be a whole number of steps, got {self.memory_interval!r}")
            if self.memory_interval < 0:
                raise ValueError(f"memory_interval cannot be negative, got {self.memory_interval} (0: no snapshots)")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        """torchtitan's arguments (``dataloader``, ``model_parts``, ``optimizers``, ...), as ``config.build`` passes.

        torchtitan's own set-up runs with retention and async off, so it starts
        neither its purge thread nor the gloo group its async saves use: the
        daemon keeps ``keep_latest_k`` and the ckptd client does the rest.
        """
        folder = os.path.join(kwargs.get("base_folder", ""), config.folder)
        if config.enable and is_remote(folder):
            raise ValueError(f"checkpoint.folder {folder} is remote: ckptd's torchtitan CheckpointManager saves to a "
                             "local folder; to have the daemon upload each committed checkpoint to an object store, "
                             "start it with --mirror DIR=s3://BUCKET/PREFIX")
        super().__init__(replace(config, keep_latest_k=0, async_mode=AsyncMode.DISABLED.value), **kwargs)
        if not self.enable:
            return
        self.async_mode = AsyncMode(config.async_mode)
        self.keep_latest_k = config.keep_latest_k
        self.run_dir = config.run_dir
        self.commit_timeout = config.commit_timeout
        self.memory_interval = config.memory_interval
        self._client: Client | None = None

    def _ckptd_client(self) -> Client:
        """The client that saves, made at the first save (a load-only run never starts a daemon)."""
        if self._client is None:
            self._client = Client(run_dir=self.run_dir, commit_timeout=self.commit_timeout,
                                  keep_last=self.keep_latest_k or None,
                                  background_staging=self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM)
        return self._client

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False, *, persist: bool = True
                 ) -> Future | None:
        """Save ``state_dict`` as the ckptd checkpoint ``checkpoint_id``; the save's future unless ``DISABLED``.
        ``persist=False``: a memory snapshot (``memory_interval``), held by the daemon instead of written.

        A checkpoint already at ``checkpoint_id`` is replaced, as torchtitan's
        DCP writer overwrites it: a run rolled back by ``load_step`` saves
        over the later steps it trains past. The replacement is ckptd's
        ``overwrite=True``: the old checkpoint stays whole until the new one
        commits, and only a ckptd checkpoint is ever replaced (a folder of
        torchtitan's own DCP files is refused, naming them).
        ``to_hf`` (the last step's Hugging Face export) is torchtitan's own DCP write.
        """
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, AsyncMode.DISABLED, enable_garbage_collection, to_hf)
        match = _STEP_NAME.fullmatch(os.path.basename(checkpoint_id))
        future = self._ckptd_client().save_async(state_dicts(state_dict), checkpoint_id,
                                                 step=int(match.group(1)) if match else None, overwrite=True,
                                                 persist=persist)
        if async_mode == AsyncMode.DISABLED:
            future.result()
            return None
        return future

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """torchtitan's save policy (interval, first step, last step), and between those a memory snapshot every
        ``memory_interval`` steps; each is one ckptd save."""
        persist = self._should_save(curr_step, last_step)
        if not persist and not self._should_snapshot(curr_step):
            return False
        self.maybe_wait_for_saving()
        if last_step and persist:
            self._save_last_step(curr_step)
            return True
        future = self.dcp_save(self._flattened_model_states_sd(), self._create_checkpoint_id(curr_step),
                               self.async_mode, persist=persist)
        if future is not None:
            self.save_future = future
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                self.staging_future = future.staged
        return True

    def _should_snapshot(self, curr_step: int) -> bool:
        return (self.enable and not self.load_only and self.memory_interval > 0 and curr_step > 0
                and curr_step % self.memory_interval == 0)

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: the daemon applies ``keep_latest_k`` (``keep_last``) after each commit."""

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step in ``folder``: a committed ckptd checkpoint (by its ``ckptd.json``), or one torchtitan's
        DCP manager saved there before the switch (by its ``.metadata``, loaded through DCP); -1 if none.

        Collective under torch.distributed: the ranks agree on one ckptd checkpoint.
        """
        folder = folder or self.folder
        ours = self._newest_ckptd_step(folder)  # collective; a folder of snapshots alone need not exist on disk
        return max(ours, _newest_dcp_step(folder)) if os.path.isdir(folder) else ours

    def load(self, step: int = -1) -> bool:
        """torchtitan's load, and a load of a memory snapshot (the newest, or ``load_step``'s), which has no
        ``step-N`` folder on disk for torchtitan's own load to find."""
        if not self.enable:
            return super().load(step)
        target = self._find_load_step() if step == -1 else step
        checkpoint_id = self._create_checkpoint_id(target) if target >= 0 else ""
        if (target < 0 or os.path.isdir(checkpoint_id)
                or find_held(Path(checkpoint_id), self.run_dir) is None):
            return super().load(target)
        logger.info(f"Loading the memory snapshot {checkpoint_id} from the ckptd daemon.")
        self.dcp_load(self._states_to_load(target == 0), checkpoint_id=checkpoint_id, from_hf=False,
                      from_quantized=False)
        return True

    def _newest_ckptd_step(self, folder: str) -> int:
        newest = ckptd.latest(folder, run_dir=self.run_dir)
        if newest is None:
            return -1
        held = None if os.path.isdir(newest) else find_held(Path(newest), self.run_dir)
        step = held["step"] if held is not None else ckptd.read_index(newest).step
        if step is None or os.path.realpath(newest) != os.path.realpath(self._create_checkpoint_id(step, folder)):
            raise ValueError(f"the newest checkpoint in checkpoint.folder {folder} is {newest}, which is not "
                             f"torchtitan's step-N checkpoint of its step ({step}); move it out of the folder")
        return step

    @torch.no_grad()
    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load the ckptd checkpoint ``checkpoint_id`` into ``state_dict`` in place (resharding as needed).

        A checkpoint without ``ckptd.json`` (an ``initial_load_path`` to a DCP
        or Hugging Face checkpoint) is torchtitan's DCP load. Keys the
        checkpoint holds beyond ``state_dict`` are left (``exclude_from_loading``,
        a model-only load), as DCP does; keys it lacks are an error. A ckptd
        checkpoint folder that also holds a DCP checkpoint is refused.
        """
        if from_hf or not (os.path.isfile(os.path.join(checkpoint_id, INDEX_NAME))
                           or find_held(Path(checkpoint_id), self.run_dir) is not None):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        _check_one_run(checkpoint_id)
        target = state_dicts(state_dict)
        self._check_data_parallel_degree(target, checkpoint_id)
        report = load_into(target, checkpoint_id, strict=False, run_dir=self.run_dir)
        if report.missing:
            raise ValueError(self._missing_message(checkpoint_id, report.missing))
        load_stateful(state_dict, target)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(target)

    def _check_data_parallel_degree(self, target: dict[str, Any], checkpoint_id: str) -> None:
        """Refuse, on every rank and before anything is loaded, a per-rank dataloader saved at another degree.

        torchtitan's ``ParallelAwareDataloader`` saves ``{"dp_rank_N": ...,
        "world_size": D}``, D its data-parallel degree, and cannot load at
        another one: a rank whose ``dp_rank_N`` was never saved would find it
        missing, the others would fail in torchtitan's own check after the
        model was loaded. Only the dataloader's plain values are read here.
        """
        ours = target.get(DATALOADER)
        if not (isinstance(ours, dict) and "world_size" in ours
                and any(isinstance(k, str) and k.startswith(_PER_RANK) for k in ours)):
            return
        saved = {DATALOADER: dict(ours)}
        load_into(saved, checkpoint_id, strict=False, run_dir=self.run_dir)
        degree = saved[DATALOADER].get("world_size")
        if degree == ours["world_size"]:
            return
        raise ValueError(
            f"checkpoint {checkpoint_id} was saved at a data-parallel degree of {degree} "
            f"({ckptd.read_index(checkpoint_id).world_size} ranks) and this run's is {ours['world_size']} "
            f"({torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1} ranks): torchtitan's "
            "ParallelAwareDataloader keeps its state per data-parallel rank and cannot move it to another degree; to "
            f'resume the rest on this world size, name it in checkpoint.exclude_from_loading (["{DATALOADER}"])')

    def _missing_message(self, checkpoint_id: str, missing: list[str]) -> str:
        """Why ``checkpoint_id`` cannot restore this run: the model alone (torchtitan's default last step), or the
        state it lacks."""
        lacking = {name.split(".", 1)[0] for name in missing}
        wanted = {k for k in self.states if k != MODEL and k not in self.exclude_from_loading}
        if wanted and lacking == wanted:  # every state but the model's
            return (f"checkpoint {checkpoint_id} holds the model alone, as torchtitan's last step does with "
                    "last_save_model_only=True (its default), so it cannot resume training "
                    f"({', '.join(sorted(wanted))} not saved): resume from an earlier step (checkpoint.load_step=N), "
                    "and set last_save_model_only=False in runs you mean to continue")
        return (f"checkpoint {checkpoint_id} holds no {', '.join(sorted(missing))}, so it cannot restore this run's "
                "state; checkpoint.exclude_from_loading names state not to load")

    def _close(self) -> None:
        """Wait for the saves in flight (a failed one raises here), then torchtitan's close."""
        try:
            if self._client is not None:
                self._client.close()
                self._client = None
        finally:
            super()._close()
