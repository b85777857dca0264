"""``CkptdCheckpointIO``: Lightning's checkpoints, saved asynchronously by ckptd.

Use it as ``Trainer(plugins=[CkptdCheckpointIO()])``. ``ModelCheckpoint``,
``trainer.save_checkpoint`` and ``trainer.fit(ckpt_path=...)`` then go through
the node's ckptd daemon: the training step waits only for the copy into
shared memory, and the daemon writes, fsyncs and commits.

Paths. Lightning names checkpoints like ``dirpath/epoch=1-step=10.ckpt``. A
ckptd checkpoint is a directory, so that name becomes the checkpoint's
directory (``epoch=1-step=10.ckpt/rank-00000-of-00001.safetensors`` and
``ckptd.json``), written as ``epoch=1-step=10.ckpt.incomplete`` until it is
committed. Keeping Lightning's name unchanged is what lets ``ModelCheckpoint``
(top-k bookkeeping, ``best_model_path``, ``ckpt_path="best"``/``"last"``)
work unmodified. ``ckptd.latest(dirpath)`` works on such a directory too: the
save's ``step`` is Lightning's ``global_step``. ``save_last="link"`` makes
``last.ckpt`` a symlink to a checkpoint directory; a later save to
``last.ckpt`` replaces the link, never its target. ``s3://`` URLs load like
paths (``fit(ckpt_path="s3://...")``).

Ranks. Lightning's strategies that use a ``CheckpointIO`` (single device,
DDP) hand it one full checkpoint on global rank 0 only, so the plugin's client
is rank 0 of a world of 1 unless ``rank``/``world_size`` are given: a
checkpoint has one shard, and every rank can load it. Lightning's sharded
strategies never ask a ``CheckpointIO``; ``ckptd.integrations.lightning_sharded``
has ckptd versions of them, which save through this plugin on every rank.

What the checkpoint may hold. ckptd stores tensors and plain values and never
pickles. Lightning's own entries (``epoch``, ``global_step``,
``pytorch-lightning_version``, ``state_dict``, ``loops``, ``callbacks``,
``optimizer_states``, ``lr_schedulers``, precision-plugin state,
``hparams_name``) are all of those. What is not comes from two places, and
``to_plain`` handles exactly these, everywhere in the checkpoint:

* ``hyper_parameters`` (and ``datamodule_hyper_parameters``) is
  ``dict(model.hparams)``: whatever the user passed to ``__init__``.
  Common harmless values are saved as plain ones, with a warning naming each
  key path, because they load as the plain value: ``pathlib`` paths as
  ``str``, ``argparse.Namespace`` as ``dict``, enum members as their
  ``.value``, numpy scalars as Python numbers.
* With OmegaConf hparams, Lightning stores the ``DictConfig`` itself and
  ``hparams_type``, the class object. The container is saved as a plain
  container (interpolations resolved) and the class as its dotted name;
  ``load_checkpoint`` turns both back into OmegaConf objects, so nothing is
  lost. (Without OmegaConf at load time the name stays a string, which
  Lightning reads as "use ``AttributeDict``".)

Anything else ckptd refuses raises ``TypeError`` from ``save_checkpoint``,
naming the key path; convert it in ``LightningModule.on_save_checkpoint`` or
use Lightning's ``TorchCheckpointIO`` for that model.

What loading gives back. The same structure with the same Python types,
except that dict subclasses (``OrderedDict`` state dicts) load as ``dict``
and the conversions above. Tensors are views of a copy-on-write mapping of
the shard (see ``ckptd.load``).

Memory snapshots. ``CkptdSnapshots(every_n_train_steps=N)`` beside a
``ModelCheckpoint(..., save_last=True)`` takes a memory snapshot every N
steps between the checkpoints ``ModelCheckpoint`` persists: the whole
checkpoint, held in node memory by the daemon instead of written, under
``ModelCheckpoint``'s ``last.ckpt`` name. Why that shape: a second callback
keeps the two numbers apart (snapshot every N, persist every M) and keeps
snapshots out of ``ModelCheckpoint``'s top-k bookkeeping, which counts
persisted checkpoints only; and a snapshot named ``last.ckpt`` is what
``fit(ckpt_path="last")`` loads, since a load reads a held snapshot before
the disk (``ckptd.load``): after a crash between two persists the run resumes
from the newest snapshot, and ``last.ckpt`` persisted by ``ModelCheckpoint``
replaces (drops) the snapshot whenever it is newer. Lightning resolves
``"last"`` only to a file it finds on disk, so a run resumes from memory once
``ModelCheckpoint`` has persisted a ``last.ckpt``. With Fabric, or by hand:
``with checkpoint_io.in_memory(): fabric.save(path, state)`` (or
``trainer.save_checkpoint(path)``) takes that save as a snapshot, and
``fabric.load(path, state)`` reads a held snapshot from memory.

Not covered. ``LightningModule.load_from_checkpoint(path)`` never asks the
trainer's ``CheckpointIO``: it calls ``torch.load`` on ``path`` and fails on a
directory. Load through the plugin instead (``trainer.fit/validate/test(
ckpt_path=...)`` do), or by hand::

    ckpt = CkptdCheckpointIO().load_checkpoint(path)   # or ckptd.load(path)
    model = MyModel(**ckpt["hyper_parameters"])
    model.load_state_dict(ckpt["state_dict"])
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import enum
import inspect
import logging
import os
import pathlib
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

try:
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.core.datamodule import LightningDataModule
    from lightning.pytorch.core.module import LightningModule
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # only the older standalone package is installed
    try:
        from pytorch_lightning.callbacks import Callback, ModelCheckpoint
        from pytorch_lightning.core.datamodule import LightningDataModule
        from pytorch_lightning.core.module import LightningModule
        from pytorch_lightning.plugins.io import CheckpointIO
    except ImportError as exc:
        raise ImportError(
            "ckptd.integrations.lightning needs Lightning 2.x: pip install 'ckptd[lightning]' (or lightning)"
        ) from exc

from ckptd.client import Client, SaveFuture, load
from ckptd.client.memory import find_held
from ckptd.protocol.errors import CkptdError, InvalidCheckpoint
from ckptd.protocol.objects import absolute, canonical, display
from ckptd.protocol.reading import files_for

__all__ = ["CkptdCheckpointIO", "CkptdSnapshots", "to_plain"]

log = logging.getLogger("ckptd.lightning")

_HPARAMS_PAIRS = (
    (LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE),
    (LightningDataModule.CHECKPOINT_HYPER_PARAMS_KEY, LightningDataModule.CHECKPOINT_HYPER_PARAMS_TYPE),
)
"""(hparams key, hparams type key) as Lightning writes them for the module and the datamodule."""

_OMEGACONF_TYPES = ("omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig")


def _describe(path: list[Any]) -> str:
    return "checkpoint" + "".join(f"[{p!r}]" for p in path)


def to_plain(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``checkpoint`` with the known harmless non-plain values replaced by plain ones.

    Returns the converted checkpoint and, for each lossy conversion, a line
    naming its key path and original type. Containers are rebuilt only where
    something inside them changed, so tensors are never copied and the
    checkpoint is returned as is when nothing needed converting (the usual
    case). Types not listed here are left alone for ckptd to refuse by key
    path: silently saving them some other way would hide what loads back.
    """
    lossy: list[str] = []
    reversible = {type_key for _, type_key in _HPARAMS_PAIRS}

    def walk(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, dict):
            out = {k: walk(v, path + [k]) for k, v in obj.items()}
            return obj if all(out[k] is v for k, v in obj.items()) else out
        if isinstance(obj, list):
            items = [walk(v, path + [i]) for i, v in enumerate(obj)]
            return obj if all(a is b for a, b in zip(items, obj)) else items
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            items = [walk(v, path + [i]) for i, v in enumerate(obj)]
            return obj if all(a is b for a, b in zip(items, obj)) else tuple(items)
        if isinstance(obj, type) and len(path) == 1 and path[0] in reversible:
            return f"{obj.__module__}.{obj.__qualname__}"  # Lightning's hparams_type; reversed on load
        if _is_omegaconf_container(obj):
            from omegaconf import OmegaConf

            if not (len(path) == 1 and any(path[0] == key for key, _ in _HPARAMS_PAIRS)):
                lossy.append(f"{_describe(path)}: {type(obj).__qualname__} -> plain container")
            return walk(OmegaConf.to_container(obj, resolve=True), path)
        converted = _plain_scalar(obj)
        if converted is not obj:
            lossy.append(f"{_describe(path)}: {type(obj).__module__}.{type(obj).__qualname__} -> "
                         f"{type(converted).__name__}")
            return walk(converted, path)
        return obj

    return walk(checkpoint, []), lossy


def _plain_scalar(obj: Any) -> Any:
    """The plain value for a known harmless type, or ``obj`` itself."""
    if isinstance(obj, enum.Enum):  # before int/str: IntEnum and StrEnum members are ints and strs
        return obj.value
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    numpy = sys.modules.get("numpy")  # a numpy value implies numpy is imported; never import it here
    if numpy is not None and isinstance(obj, numpy.generic):
        return obj.item()
    return obj


def _is_omegaconf_container(obj: Any) -> bool:
    omegaconf = sys.modules.get("omegaconf")
    return omegaconf is not None and isinstance(obj, omegaconf.Container)


def _restore_hparams_types(checkpoint: dict[str, Any]) -> None:
    """Undo ``to_plain``'s reversible step: OmegaConf hparams and their ``hparams_type``."""
    for key, type_key in _HPARAMS_PAIRS:
        name = checkpoint.get(type_key)
        if name not in _OMEGACONF_TYPES:
            continue
        try:
            from omegaconf import OmegaConf
        except ImportError:
            continue  # Lightning reads a string hparams_type as AttributeDict
        if key in checkpoint:
            checkpoint[key] = OmegaConf.create(checkpoint[key])
        checkpoint[type_key] = type(checkpoint[key]) if key in checkpoint else name


MapLocation = str | torch.device | int | dict | Callable[..., Any] | None


def _map_tensors(obj: Any, map_location: dict | Callable[..., Any]) -> Any:
    """Apply a dict or callable ``map_location`` to every tensor, keeping one object per tied tensor.

    Devices are not handled here: ``ckptd.load`` copies each tensor straight
    from the file to a device, without a CPU copy first.
    """
    done: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            if callable(map_location):
                # torch.load passes (storage, location); here it is (tensor, "cpu"), and a
                # non-tensor answer (e.g. a storage) keeps the tensor where it is
                moved = map_location(t, "cpu")
                done[id(t)] = moved if isinstance(moved, torch.Tensor) else t
            elif isinstance(map_location, dict):
                target = map_location.get(str(t.device))
                done[id(t)] = t if target is None else t.to(target)
            else:
                raise TypeError(f"map_location must be a device, a dict or a callable, not {map_location!r}")
        return done[id(t)]

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return move(o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        return o

    return walk(obj)


class CkptdCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose saves are asynchronous ckptd saves.

    ``save_checkpoint`` returns once the checkpoint is copied into shared
    memory; the daemon makes it durable. ``remove_checkpoint`` and
    ``load_checkpoint`` first wait for a save still in flight to the same
    path, and a second save to a path waits for the first, so Lightning sees
    the order it asked for. A save that fails in the background is raised by
    the next ``save_checkpoint`` or by ``teardown`` (or by ``load_checkpoint``
    of that path), never lost.
    """

    def __init__(
        self,
        *,
        run_dir: str | os.PathLike | None = None,
        spawn: bool = True,
        max_inflight: int = 1,
        background_staging: bool = False,
        **client_kwargs: Any,
    ) -> None:
        """
        Args:
            run_dir, spawn, max_inflight, background_staging, **client_kwargs:
                passed to ``ckptd.Client``, which is created on the first save
                (so ranks that never save never connect). ``rank`` and
                ``world_size`` default to 0 and 1: see the module docstring.
                ``background_staging`` moves the copy to the client's thread,
                but ``save_checkpoint`` still waits for it, because Lightning
                changes the weights and optimizer state as soon as it returns
                and ``CheckpointIO`` has no later hook to wait in.

        ``keep_last`` is refused: ckptd's retention keeps the newest by step,
        which would delete checkpoints that ``ModelCheckpoint(save_top_k=...)``
        keeps by score. Let ``ModelCheckpoint`` decide what to remove.
        """
        super().__init__()
        if "keep_last" in client_kwargs:
            raise ValueError("CkptdCheckpointIO does not take keep_last: ModelCheckpoint(save_top_k=...) "
                             "decides which checkpoints to remove, and ckptd's retention would fight it")
        kwargs: dict[str, Any] = dict(run_dir=run_dir, spawn=spawn, max_inflight=max_inflight,
                                      background_staging=background_staging, **client_kwargs)
        self._ranks_given = "rank" in kwargs or "world_size" in kwargs
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("world_size", 1)
        inspect.signature(Client).bind(**kwargs)  # a misspelt option fails here, not at the first save
        self._client_kwargs = kwargs
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, SaveFuture] = {}
        """The newest save to each path (keyed by ``_key``), until its outcome is reported."""
        self._unreported: list[tuple[str, SaveFuture]] = []
        """Every save whose failure would not yet have been raised to the caller."""
        self._warned: set[str] = set()
        self._in_memory = threading.local()

    @contextlib.contextmanager
    def in_memory(self) -> Iterator[None]:
        """Make this thread's saves through the plugin memory snapshots (``persist=False``) while it lasts:
        ``with io.in_memory(): fabric.save(path, state)``. Held by the node's daemon instead of written; loaded
        from memory by ``load_checkpoint``; persisted by ``client.persist(path)``, or by the daemon when the
        trainer closes or dies (``--persist-on-exit``)."""
        before = getattr(self._in_memory, "on", False)
        self._in_memory.on = True
        try:
            yield
        finally:
            self._in_memory.on = before

    @property
    def client(self) -> Client:
        """The ckptd client, created on first use (and again after ``teardown``)."""
        with self._lock:
            if self._client is None:
                self._client = Client(**self._client_kwargs)
            return self._client

    @property
    def run_dir(self) -> str | os.PathLike | None:
        """The daemon's run directory this plugin saves and loads through (None: the default)."""
        return self._client_kwargs["run_dir"]

    def wait(self, path: str | os.PathLike | None = None) -> None:
        """Wait until the save in flight to ``path`` (None: every save) is committed; raise if it failed.

        Saves are asynchronous: where another process reads a checkpoint
        this one has just saved (Fabric's ``fabric.save`` on rank 0, then
        ``fabric.load`` on every rank), call this on the saving rank, then
        ``fabric.barrier()``.
        """
        if path is None:
            self._raise_failed(wait=True)
            return
        key = self._key(path)
        failed = self._wait_for(key)
        if failed is not None:
            with self._lock:  # raised now, so not again by the next save
                self._unreported = [(k, f) for k, f in self._unreported if k != key]
            raise failed

    def save_every_rank(self) -> None:
        """Make every rank save its own shard of each checkpoint (what a sharded strategy needs).

        The client then takes its rank and world size from torch.distributed
        instead of being rank 0 of 1. Called by the sharded strategies on the
        plugin they are given, before its first save.
        """
        if self._ranks_given and (self._client_kwargs["rank"], self._client_kwargs["world_size"]) != (None, None):
            raise ValueError("a CkptdCheckpointIO for a sharded strategy takes no rank/world_size: every rank saves "
                             "its own shard, with its rank from torch.distributed")
        with self._lock:
            if self._client is not None:
                raise RuntimeError("this CkptdCheckpointIO has saved as one rank already; give the sharded strategy "
                                   "a new one")
            self._client_kwargs["rank"] = self._client_kwargs["world_size"] = None

    @staticmethod
    def _key(path: str | os.PathLike) -> str:
        """One name per checkpoint: a ``save_last="link"`` symlink and its target share it; an object's URL."""
        return canonical(path)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as the ckptd checkpoint directory ``path``; returns once staged.

        An existing checkpoint at ``path`` is replaced (``overwrite=True``),
        as Lightning's own ``TorchCheckpointIO`` does: ``ModelCheckpoint``
        re-saves ``last.ckpt`` under one name. A symlink at ``path`` (what
        ``save_last="link"`` made) is replaced by the checkpoint, its target
        left alone, as ``TorchCheckpointIO`` replaces it with the file. A
        local parent directory is made before this returns, as
        ``TorchCheckpointIO`` makes it: ``save_last="link"`` links
        ``last.ckpt`` beside the checkpoint at once, before the daemon has
        written anything.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options; got {storage_options!r}")
        self._raise_failed(wait=False)
        files = files_for(os.fspath(path))
        files.unlink_link(Path(path))  # a save_last="link" link: the checkpoint replaces the link, never its target
        files.make_parent(Path(path))
        key = self._key(path)
        self._wait_for(key)  # an earlier save to this path commits first; its failure is raised later
        plain, lossy = to_plain(checkpoint)
        self._warn_lossy(lossy)
        step = checkpoint.get("global_step")
        try:
            fut = self.client.save_async(plain, path, step=step if type(step) is int else None, overwrite=True,
                                         persist=not getattr(self._in_memory, "on", False))
        except TypeError as exc:
            raise TypeError(f"{exc}. CkptdCheckpointIO converts only paths, argparse.Namespace, enums, numpy "
                            "scalars and OmegaConf containers; convert this value in "
                            "LightningModule.on_save_checkpoint, or use TorchCheckpointIO") from exc
        fut.wait_staged()  # raises here if staging failed; the future then fails with the same error
        with self._lock:
            self._pending[key] = fut
            self._unreported.append((key, fut))

    def load_checkpoint(self, path: str | os.PathLike, map_location: MapLocation = None,
                        weights_only: bool | None = None, *, rank: int | None = None,
                        exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``, after any save in flight to it commits.

        ``rank`` and ``exclude`` are for the sharded strategies (see
        ``ckptd.load``): they read rank 0's dict, as Lightning keeps rank 0's
        metadata, without the keys they restore in place with
        ``ckptd.load_into``.

        ``weights_only`` is accepted for Lightning's signature and has nothing
        to do: ckptd never unpickles, so every load is as safe as
        ``weights_only=True``. ``map_location`` may be a device (string, int
        or ``torch.device``), a dict mapping ``"cpu"`` to a device, or a
        callable called as ``f(tensor, "cpu")`` whose tensor result replaces
        the tensor. The load goes through the plugin's ``run_dir``, so a
        daemon that limits concurrent loads per node is the one asked.
        ``path`` may be an ``s3://`` URL.
        """
        self.wait(path)
        if (files_for(os.fspath(path)).surely_absent(Path(path))
                and find_held(Path(absolute(path)), self.run_dir) is None):
            raise FileNotFoundError(f"Checkpoint not found (neither on disk nor held in node memory): {path}")
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        if isinstance(map_location, int):
            device = torch.device(map_location)  # as torch.load reads an int: that accelerator index
        checkpoint = load(path, rank=rank, map_location=device, run_dir=self.run_dir, exclude=exclude)
        if not isinstance(checkpoint, dict):
            raise InvalidCheckpoint(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict")
        _restore_hparams_types(checkpoint)
        if map_location is not None and device is None:
            checkpoint = _map_tensors(checkpoint, map_location)
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path`` once no save to it is in flight; absent is fine.

        A committed ckptd checkpoint is deleted by the daemon (``Client.delete``),
        as its retention deletes one: under its publish lock, set aside first
        (so no reader, and no ``ckptd.latest``, sees it half deleted), on disk
        or under an ``s3://`` URL (``ModelCheckpoint(dirpath="s3://...")``'s
        top-k). A symlink (``save_last="link"``) is unlinked here: the link,
        never its target. Anything else at ``path`` is left alone with a
        warning saying why: it is not ours. What a failed save left is the
        daemon's to remove, and it does.
        """
        self._wait_for(self._key(path))
        target = absolute(path)
        if files_for(target).unlink_link(Path(target)):
            return
        try:
            self.client.delete(target)
        except InvalidCheckpoint as exc:
            warnings.warn(f"CkptdCheckpointIO left {display(target)} in place: it is not a ckptd checkpoint the "
                          f"daemon may delete ({exc.message})", stacklevel=2)
        else:
            log.debug("removed checkpoint %s", display(target))

    def teardown(self) -> None:
        """Wait for every pending save, close the client, then raise the first failed save."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()  # waits for pending saves, unlinks the shared-memory slots
        self._raise_failed(wait=True)

    def _wait_for(self, key: str) -> BaseException | None:
        """Wait for the save in flight to ``key``, if any; its error, or None."""
        with self._lock:
            fut = self._pending.get(key)
        if fut is None:
            return None
        concurrent.futures.wait([fut])
        with self._lock:
            if self._pending.get(key) is fut:
                del self._pending[key]
        return fut.exception()

    def _raise_failed(self, *, wait: bool) -> None:
        """Raise the first failed save not yet reported; forget the settled ones."""
        with self._lock:
            entries = list(self._unreported)
        if wait:
            concurrent.futures.wait([f for _, f in entries])
        failed = [(k, f) for k, f in entries if f.done() and f.exception() is not None]
        with self._lock:
            self._unreported = [(k, f) for k, f in self._unreported if not f.done()]
            self._pending = {k: f for k, f in self._pending.items() if not f.done()}
        if failed:
            key, fut = failed[0]
            exc = fut.exception()
            assert exc is not None
            more = f" (and {len(failed) - 1} more failed saves)" if len(failed) > 1 else ""
            if isinstance(exc, CkptdError):  # same type, so callers can still catch e.g. WriteFailed
                raise type(exc)(f"checkpoint {key} failed in the background: {exc}{more}") from exc
            raise exc

    def _warn_lossy(self, lossy: list[str]) -> None:
        """Warn once per converted key path: its type does not come back on load."""
        new = [line for line in lossy if line not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn("CkptdCheckpointIO saved these values as plain ones; they load as such: " + "; ".join(new),
                          stacklevel=3)


class CkptdSnapshots(Callback):
    """A memory snapshot of the whole checkpoint every ``every_n_train_steps`` steps, as ``last.ckpt`` (see the
    module docstring): ``Trainer(plugins=[CkptdCheckpointIO()], callbacks=[ModelCheckpoint(...,
    save_last=True), CkptdSnapshots(every_n_train_steps=N)])``."""

    def __init__(self, every_n_train_steps: int) -> None:
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) \
                or every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be a whole number of steps >= 1, got {every_n_train_steps!r}")
        self.every_n_train_steps = every_n_train_steps
        self._warned = False

    def _parts(self, trainer: Any) -> tuple[CkptdCheckpointIO, ModelCheckpoint]:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if not isinstance(io, CkptdCheckpointIO):
            raise ValueError(f"CkptdSnapshots needs Trainer(plugins=[CkptdCheckpointIO()]); the trainer's checkpoint "
                             f"IO is {type(io).__name__}")
        keepers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.save_last]
        if len(keepers) > 1:
            raise ValueError(f"CkptdSnapshots snapshots one ModelCheckpoint's last.ckpt, and this trainer has "
                             f"{len(keepers)} with save_last ({', '.join(str(k.dirpath) for k in keepers)}): "
                             "fit(ckpt_path='last') would resume from the newest of their last.ckpt files on disk "
                             "and pass the snapshot by; keep save_last on one of them")
        keeper = trainer.checkpoint_callback
        if not isinstance(keeper, ModelCheckpoint) or keeper.save_last is not True:
            raise ValueError("CkptdSnapshots needs a ModelCheckpoint(save_last=True) (not save_last='link': a "
                             "snapshot would replace the link, and a crash would leave no last.ckpt on disk for "
                             "fit(ckpt_path='last') to find): its snapshots are that callback's last.ckpt; this "
                             "trainer has " + ("no ModelCheckpoint" if not isinstance(keeper, ModelCheckpoint)
                                               else f"ModelCheckpoint(save_last={keeper.save_last!r})"))
        return io, keeper

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._parts(trainer)  # refused at once, not at the first snapshot

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_train_steps or trainer.sanity_checking:
            return
        io, keeper = self._parts(trainer)
        path = os.path.join(keeper.dirpath, keeper.CHECKPOINT_NAME_LAST + keeper.FILE_EXTENSION)
        if not self._warned and trainer.is_global_zero and files_for(path).surely_absent(Path(path)):
            self._warned = True
            warnings.warn(f"CkptdSnapshots holds {path} in node memory, and ModelCheckpoint has persisted no "
                          f"last.ckpt there yet: fit(ckpt_path='last') resolves only to a file on disk, so a crash "
                          f"before its first persist resumes from nothing (the daemon persists a dead trainer's "
                          f"newest snapshot unless --persist-on-exit never)", stacklevel=2)
        with io.in_memory():
            trainer.save_checkpoint(path)
