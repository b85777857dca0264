"""``CkptdTrainer``: the Hugging Face ``transformers.Trainer``'s checkpoints, saved by ckptd.

The one-line switch is the class::

    from ckptd.integrations.hf import CkptdTrainer
    trainer = CkptdTrainer(model=model, args=args, train_dataset=dataset)   # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)

(``CkptdTrainerMixin`` gives the same to a ``Trainer`` subclass of your own:
``class MyTrainer(CkptdTrainerMixin, SFTTrainer)``.)

Every checkpoint the ``Trainer`` saves (``save_steps``, ``save_strategy``)
goes through the node's ckptd daemon: each process copies its state into
shared memory and goes back to training; the daemon writes, fsyncs and
renames ``checkpoint-N.incomplete`` to ``checkpoint-N`` once every process's
shard is durable. ``checkpoint-N`` keeps the ``Trainer``'s name, so
``transformers.trainer_utils.get_last_checkpoint`` finds it, and it never
finds a save in flight or one a crash interrupted (``checkpoint-N.incomplete``
does not match its pattern).

What ``checkpoint-N`` holds. It is a ckptd checkpoint (``ckptd.json`` and one
``rank-*.safetensors`` shard per process), whose state is what the
``Trainer``'s own files hold, under these keys: ``model`` (the model's state
dict), ``optimizer``, ``scheduler``, ``scaler`` (with mixed precision),
``rng`` (this process's Python, numpy, torch and CUDA generators),
``trainer_state`` (the text of ``trainer_state.json``), ``config`` (the
model's ``config.json`` text) and ``transformers_version``. Under torchrun
``model`` and ``optimizer`` are the same on every process (DDP) and written
once (``replicated=``); ``rng`` is each process's own. ``save_only_model``
saves ``model``, ``config`` and ``trainer_state`` only.

What it does not hold: the ``Trainer``'s files themselves. ``from_pretrained``
reads ``config.json`` and ``model.safetensors``, which a ckptd checkpoint
does not have (a checkpoint holds ckptd's files alone, or retention and
``overwrite`` would refuse to touch it). One command writes them::

    python -m ckptd.integrations.hf export output/checkpoint-500 model-500/

writes ``config.json``, ``model.safetensors`` and ``trainer_state.json``
(``export_pretrained`` in Python), and
``AutoModelForCausalLM.from_pretrained("model-500")`` then gives the model.

Resuming. ``train(resume_from_checkpoint=True)`` resumes from the newest
checkpoint of ``output_dir`` (``ckptd.latest``: collective under torchrun,
and a held memory snapshot counts), ``resume_from_checkpoint=PATH`` from
that one; either restores everything the ``Trainer``'s own resume does
(model, optimizer, scheduler, scaler, RNG states, trainer state and the
position in the data), so a resumed run continues bitwise as the
uninterrupted one would have. The ``Trainer`` reads ``trainer_state.json``
from the path it resumes from: it is given a private directory holding that
file alone (made from the checkpoint, removed when ``train`` returns), and
every load in it is answered from the ckptd checkpoint.

Retention. ``save_total_limit=K`` is the daemon's retention
(``keep_last=K``, applied after each commit: a save in flight is never
deleted). Where the ``Trainer`` tracks a best checkpoint
(``metric_for_best_model``, ``load_best_model_at_end``) the daemon's
retention does not know it, so this class applies the ``Trainer``'s rule
itself after each commit (the newest K, the best one always kept) and
deletes through the daemon (``Client.delete``: only committed checkpoints,
never one in flight); ``load_best_model_at_end`` loads the best checkpoint
from ckptd.

Memory snapshots. ``CkptdTrainer(..., memory_steps=N)`` adds a memory
snapshot every N steps between the checkpoints ``save_steps`` persists: the
same state under the same ``checkpoint-N`` name, held in node memory by the
daemon instead of written (``docs/memory.md``). ``resume_from_checkpoint=True``
resumes from the newest of either (a trainer killed between two persists
resumes from its last snapshot), and the daemon persists a dead trainer's
newest snapshot (its ``--persist-on-exit``). ``save_total_limit`` counts
persisted checkpoints only.

Supported: transformers 5.25 (``SUPPORTED``), with the ``Trainer``'s own
model wrapping (one process, DDP under torchrun). The ``Trainer``'s checkpoint
seam is private (``_save_checkpoint``, ``_load_from_checkpoint``, ...), so
another version is refused at import, naming it. Not covered: DeepSpeed,
FSDP, XLA/TPU and SageMaker model parallelism (refused at construction),
PEFT adapters saved on their own, ``push_to_hub`` of checkpoints
(``hub_strategy``), and hyperparameter search (``trial``): those keep the
``Trainer``'s own checkpoints (use ``transformers.Trainer``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

try:
    import transformers
    from transformers import Trainer
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint
except ImportError as exc:
    raise ImportError("ckptd.integrations.hf needs transformers 5.25: pip install 'transformers>=5.25,<5.26'") from exc

import torch

import ckptd
from ckptd.client import Client, SaveFuture
from ckptd.client.memory import find_held
from ckptd.integrations import rng
from ckptd.protocol.names import INDEX_NAME

__all__ = ["CkptdTrainer", "CkptdTrainerMixin", "SUPPORTED", "export_pretrained", "require_supported"]

log = logging.getLogger("ckptd.hf")

SUPPORTED = ((5, 25),)
"""The transformers releases (major, minor; any patch) whose ``Trainer`` this module was written against and tested
with: its checkpoint seam is private, so any other is refused."""

TRAINER_STATE_NAME = "trainer_state.json"
CONFIG_NAME = "config.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
"""``get_last_checkpoint``'s pattern: the ``Trainer``'s checkpoint names, and nothing a save in flight is called."""
_REPLICATED = ("model", "optimizer")
"""Keys the same on every process under DDP: written once, by rank 0."""


def require_supported(version: str) -> None:
    """Raise ``ImportError`` naming ``version`` unless it is a transformers release this module supports."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) not in SUPPORTED:
        wanted = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)
        raise ImportError(
            f"ckptd.integrations.hf supports transformers {wanted}, and transformers {version} is installed: the "
            "Trainer's checkpoint methods it replaces are private and change between releases. Install a supported "
            f"release (pip install 'transformers=={SUPPORTED[-1][0]}.{SUPPORTED[-1][1]}.*') or save with "
            "transformers.Trainer's own checkpoints")


require_supported(transformers.__version__)


def _step_of(path: str | os.PathLike) -> int | None:
    found = _CHECKPOINT.match(os.path.basename(os.fspath(path)))
    return int(found.group(1)) if found else None


class CkptdTrainerMixin:
    """The ``Trainer``'s checkpoints through ckptd; put it before ``Trainer`` (or a subclass of it) in the bases
    (a class that puts it after is refused when it is defined: the ``Trainer``'s own methods would win, and its
    checkpoints would silently be the ``Trainer``'s files).

    Keyword arguments beyond the ``Trainer``'s: ``memory_steps`` (a memory
    snapshot every N steps between persisted checkpoints; 0: none),
    ``ckptd_run_dir`` (the daemon's run directory; default as ``ckptd.Client``)
    and ``commit_timeout`` (seconds every process has to hand its shard over).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Trainer in mro and mro.index(CkptdTrainerMixin) > mro.index(Trainer):
            raise TypeError(f"{cls.__name__}: put CkptdTrainerMixin before the Trainer class among its bases "
                            f"(class {cls.__name__}(CkptdTrainerMixin, ...)); after it, the Trainer's own checkpoint "
                            f"methods win and nothing is saved through ckptd")

    def __init__(self, *args: Any, memory_steps: int = 0, ckptd_run_dir: str | os.PathLike | None = None,
                 commit_timeout: float = 600.0, **kwargs: Any) -> None:
        if isinstance(memory_steps, bool) or not isinstance(memory_steps, int) or memory_steps < 0:
            raise ValueError(f"memory_steps must be a whole number of steps, 0 or more, got {memory_steps!r}")
        super().__init__(*args, **kwargs)
        for what, on in (("DeepSpeed", self.is_deepspeed_enabled), ("FSDP", self.is_fsdp_enabled)):
            if on:
                raise ValueError(f"{type(self).__name__} does not cover {what}: its checkpoints are the Trainer's "
                                 "own (use transformers.Trainer)")
        self.memory_steps = memory_steps
        self.ckptd_run_dir = ckptd_run_dir
        self.commit_timeout = commit_timeout
        self._ckptd: Client | None = None
        self._pending: SaveFuture | None = None
        self._resume: tuple[str, str, dict[str, Any]] | None = None
        """While ``train`` resumes: (the private directory the Trainer was given, the checkpoint, its state)."""
        self._snapshotted_step = -1

    # -- saving ---------------------------------------------------------------

    def _client(self) -> Client:
        """The client that saves, made at the first save on every process (a collective under torchrun)."""
        if self._ckptd is None:
            self._ckptd = Client(run_dir=self.ckptd_run_dir, commit_timeout=self.commit_timeout)
        return self._ckptd

    def _tracks_best(self) -> bool:
        return self.args.metric_for_best_model is not None

    def _state_to_save(self) -> dict[str, Any]:
        """What the Trainer's own checkpoint files hold, as one state (keys: the module docstring)."""
        self._export_callback_states()
        state: dict[str, Any] = {"model": self.model.state_dict(),
                                 "trainer_state": json.dumps(asdict(self.state), indent=2, sort_keys=True) + "\n",
                                 "transformers_version": transformers.__version__}
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            state["config"] = config.to_json_string()
        if not self.args.save_only_model:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = rng.capture()
        return state

    def _export_callback_states(self) -> None:
        """``TrainerState.stateful_callbacks``, brought up to date as the Trainer's ``_save_checkpoint`` does."""
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()

    def _save(self, path: str, *, persist: bool) -> SaveFuture:
        """One ckptd save of the whole state at ``path``; returns once this process's tensors are copied."""
        client = self._client()
        if self._pending is not None:  # the daemon's max_inflight (1) would wait for it too; its failure shows here
            self._pending.result()
            self._pending = None
            if self._tracks_best():
                self._rotate()
        keep = self.args.save_total_limit if persist and not self._tracks_best() else None
        world = self.args.world_size
        self._pending = client.save_async(self._state_to_save(), path, step=self.state.global_step,
                                          overwrite=True, keep_last=keep or None, persist=persist,
                                          replicated=_REPLICATED if world > 1 else ())
        return self._pending

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint at ``save_steps``, as one ckptd save of ``output_dir/checkpoint-N``."""
        if trial is not None:
            raise ValueError(f"{type(self).__name__} does not cover hyperparameter search (trial={trial!r}): its "
                             "checkpoints are the Trainer's own (use transformers.Trainer)")
        if self.hp_search_backend is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if os.path.isdir(output_dir) and not os.path.isfile(os.path.join(output_dir, INDEX_NAME)):
            raise FileExistsError(
                f"{output_dir} exists and is not a ckptd checkpoint (the Trainer's own files?): ckptd never replaces "
                f"what it did not write. Move it away, or train into a new output_dir; a run switched from "
                f"transformers.Trainer resumes from its newest own checkpoint (resume_from_checkpoint=True) and "
                f"saves its later steps through ckptd")
        if (self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
                and self.state.best_global_step):
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.isdir(best):
                self.state.best_model_checkpoint = best  # this save, or one committed earlier
        self._save(output_dir, persist=True)
        self._snapshotted_step = self.state.global_step

    def _settle(self) -> None:
        """The save in flight, once it ended (asked every step, never waited for): a failure is raised now, at
        the step after it (a save the daemon refused, or a daemon that died, stops the run then, not one
        ``save_steps`` later), and where a best checkpoint is tracked ``save_total_limit`` is applied right after
        the commit, as the ``Trainer`` applies it after its own save."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            pending.result()
            if self._tracks_best():
                self._rotate()

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, evaluation and save, then a memory snapshot every ``memory_steps`` steps that
        persisted nothing."""
        self._settle()
        super()._maybe_log_save_evaluate(*args, **kwargs)
        step = self.state.global_step
        if self.memory_steps and step > 0 and step % self.memory_steps == 0 and self._snapshotted_step != step:
            self.store_flos()
            self._save(os.path.join(self._get_output_dir(None), f"{PREFIX_CHECKPOINT_DIR}-{step}"), persist=False)
            self._snapshotted_step = step

    def _rotate(self) -> None:
        """``save_total_limit`` where a best checkpoint is tracked: the Trainer's rule (the newest K, the newest and
        the best always kept), applied to committed checkpoints and deleted through the daemon (process 0)."""
        limit = self.args.save_total_limit
        if not limit or limit <= 0 or not self.args.should_save:
            return
        run_dir = self._get_output_dir(None)
        found = sorted((step, os.path.join(run_dir, name)) for name in os.listdir(run_dir)
                       if (step := _step_of(name)) is not None and os.path.isfile(os.path.join(run_dir, name,
                                                                                              INDEX_NAME)))
        paths = [p for _, p in found]
        if len(paths) <= limit:
            return
        protected = {paths[-1]}
        if self.state.best_model_checkpoint is not None:
            protected.add(str(Path(self.state.best_model_checkpoint)))
        remaining, keep = len(paths), max(limit, len(protected))
        for path in paths:
            if remaining <= keep:
                break
            if path not in protected:
                log.info("deleting %s (save_total_limit=%d)", path, limit)
                self._client().delete(path)
                remaining -= 1

    def wait_for_checkpoints(self) -> None:
        """Wait until every checkpoint saved so far is committed (a failed save raises here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
            if self._tracks_best():
                self._rotate()

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """Every checkpoint committed (and the best one loadable) before the Trainer's end of training, whose
        ``save_total_limit=1`` clean-up then finds nothing but the best checkpoint to keep."""
        self.wait_for_checkpoints()
        limit, best = self.args.save_total_limit, self.state.best_model_checkpoint
        if self.args.should_save and best is not None and limit == 1:
            run_dir = self._get_output_dir(None)
            for name in os.listdir(run_dir):
                path = os.path.join(run_dir, name)
                if _step_of(name) is not None and os.path.isfile(os.path.join(path, INDEX_NAME)) \
                        and os.path.abspath(path) != os.path.abspath(best):
                    self._client().delete(path)
        return super()._finalize_training(*args, **kwargs)

    # -- resuming -------------------------------------------------------------

    def _is_ckptd(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, INDEX_NAME)) or find_held(Path(path), self.ckptd_run_dir) is not None

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        """The Trainer's ``train``; a resume from a ckptd checkpoint is answered from it (``True``: the newest in
        ``output_dir``, on disk or held in memory)."""
        if resume_from_checkpoint is True:
            newest = ckptd.latest(self.args.output_dir, run_dir=self.ckptd_run_dir) \
                if os.path.isdir(self.args.output_dir) or self.memory_steps else None
            own = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if own is not None and not self._is_ckptd(own) and (
                    newest is None or (_step_of(own) or -1) > (_step_of(newest) or -1)):
                log.info("resuming from %s, the Trainer's own checkpoint (newer than any ckptd one here)", own)
                newest = own  # a run switched from transformers.Trainer: its own loaders read it
            if newest is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            resume_from_checkpoint = os.fspath(newest)
        if not (isinstance(resume_from_checkpoint, (str, os.PathLike))
                and self._is_ckptd(os.fspath(resume_from_checkpoint))):
            return self._finishing(super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                                 **kwargs))
        checkpoint = os.fspath(resume_from_checkpoint)
        state = ckptd.load(checkpoint, run_dir=self.ckptd_run_dir)
        view = tempfile.mkdtemp(prefix="ckptd-hf-resume-")
        try:
            Path(view, TRAINER_STATE_NAME).write_text(state["trainer_state"])
            self._resume = (view, checkpoint, state)
            log.info("resuming from the ckptd checkpoint %s", checkpoint)
            return self._finishing(super().train(resume_from_checkpoint=view, trial=trial, **kwargs))
        finally:
            self._resume = None
            shutil.rmtree(view, ignore_errors=True)

    def _finishing(self, result: Any) -> Any:
        """``result``, once every save is committed and the client closed (its shared memory freed; the daemon
        persists the newest memory snapshot a closing trainer leaves, by its ``--persist-on-exit``). A failed
        ``train`` leaves the client to the process's exit, so the failure is what propagates."""
        self.wait_for_checkpoints()
        if self._ckptd is not None:
            client, self._ckptd = self._ckptd, None
            client.close()
        return result

    def _resumed(self, checkpoint: str | None) -> dict[str, Any] | None:
        """The loaded state when ``checkpoint`` is the directory ``train`` gave the Trainer for a ckptd checkpoint."""
        if checkpoint is None or self._resume is None or os.fspath(checkpoint) != self._resume[0]:
            return None
        return self._resume[2]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        state = self._resumed(resume_from_checkpoint)
        if state is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        log.info("loading the model from %s", self._resume[1])
        self._issue_warnings_after_load((model or self.model).load_state_dict(state["model"], False))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        state = self._resumed(checkpoint)
        if state is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        state = self._resumed(checkpoint)
        if state is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        state = self._resumed(checkpoint)
        if state is None:
            return super()._load_rng_state(checkpoint)
        if "rng" in state:
            rng.restore(state["rng"])

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not self._is_ckptd(best):
            return super()._load_best_model()
        log.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        report = ckptd.load_into(self.model, best, key="model", strict=False, run_dir=self.ckptd_run_dir)
        if report.missing:
            log.warning("the best checkpoint %s lacks %s", best, report.missing)


class CkptdTrainer(CkptdTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through the node's ckptd daemon (module docstring)."""


def export_pretrained(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write ``checkpoint``'s model as ``from_pretrained`` reads it: ``config.json``, ``model.safetensors`` (by
    ``ckptd export --prefix model.``) and ``trainer_state.json``, in the new directory ``out_dir``."""
    import subprocess

    checkpoint, out = Path(checkpoint), Path(out_dir)
    if not (checkpoint / INDEX_NAME).is_file() and find_held(checkpoint, None) is not None:
        raise ckptd.InvalidCheckpoint(f"{checkpoint} is held in node memory only (a memory_steps snapshot): persist "
                                      f"it first (ckptd.Client().persist({str(checkpoint)!r})), then export it")
    state = ckptd.load(checkpoint, mmap=True)  # for its plain values: the tensors are never read
    subprocess.run([sys.executable, "-m", "ckptd", "export", str(checkpoint), str(out), "--prefix", "model."],
                   check=True)
    if "config" in state:
        (out / CONFIG_NAME).write_text(state["config"])
    (out / TRAINER_STATE_NAME).write_text(state["trainer_state"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptd.integrations.hf",
                                     description="Hugging Face files from a CkptdTrainer checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="config.json, model.safetensors and trainer_state.json for "
                                           "from_pretrained")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    args = parser.parse_args(argv)
    import subprocess

    try:
        print(export_pretrained(args.checkpoint, args.out_dir))
    except ckptd.CkptdError as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:  # ``ckptd export`` said why on stderr already
        return exc.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
