"""``CkptdCheckpointEngine``: a DeepSpeed engine's checkpoints, saved by ckptd.

The one-line switch comes after ``deepspeed.initialize``::

    import deepspeed
    from ckptd.integrations.deepspeed import install

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    install(engine)
    engine.load_checkpoint("/ckpts/run")          # resumes from the tag `latest` names, if any
    ...
    engine.save_checkpoint("/ckpts/run")          # returns once this rank's state is in shared memory

Every ``engine.save_checkpoint(save_dir, tag)`` then goes through the node's
ckptd daemon: DeepSpeed hands its files (``mp_rank_00_model_states.pt``,
``zero_pp_rank_R_mp_rank_00_optim_states.pt``, ...) to this checkpoint
engine, which copies each rank's into shared memory as one ckptd save of
``save_dir/tag``; the daemon writes, fsyncs and renames
``tag.incomplete`` to ``tag`` once every rank's shard is durable, and only
then does rank 0 replace ``save_dir/latest`` (written whole, fsync'd and
renamed) with the tag. So a tag is visible only complete, and ``latest``
only ever names a complete tag: a job killed in the middle of a save
resumes from the tag before it.

By default ``save_checkpoint`` returns once the copy is done and training
goes on while the daemon writes (DeepSpeed's "decoupled" engine contract:
``is_decoupled()`` is true); the next ``save_checkpoint`` waits for the
previous commit, a failed save raises at the next ``engine.step()`` (or at
the next save, ``load_checkpoint``, :func:`wait` or ``engine.destroy()``),
and ``engine.destroy()`` or :func:`wait` waits for the last one.
``install(engine, blocking=True)`` makes ``save_checkpoint`` return only
once the tag is committed, through DeepSpeed's own ``commit`` call.

``engine.load_checkpoint(load_dir, tag=None)`` reads a ckptd tag: DeepSpeed
looks its files up on disk (``glob``, ``os.path.exists``), which a ckptd
checkpoint does not hold (it holds ``ckptd.json`` and one
``rank-*.safetensors`` shard per rank), so it is given a private directory of
empty stand-ins for the files the tag holds, and every read of one is answered
from the ckptd checkpoint (this rank's shard, and rank 0's where the model
states are). A tag of DeepSpeed's own files (a run switched over to ckptd)
loads as before.

What a tag holds: per rank, the files DeepSpeed saved, by name, each the
state DeepSpeed gave (``module``, ``optimizer``, ``lr_scheduler``,
``global_steps``, the ZeRO partition ``optimizer_state_dict``, your
``client_state``, ...). Tensors are stored as tensors; plain values as
values; any other object (DeepSpeed's ``LossScaler``, an enum, a named tuple,
a numpy value) is pickled into bytes in its place, as ``torch.save`` would
pickle it, and unpickled on load (so, as with DeepSpeed's own files, load
only checkpoints you trust).

Supported: DeepSpeed 0.19 (``SUPPORTED``; tested with 0.19.8), ZeRO stages
0, 1 and 2, one or several ranks. The engine's order of calls (``create``,
``makedirs`` of the tag, ``save`` per file, ``commit``) is DeepSpeed's own
and changes between releases, so another release is refused at import,
naming it. Refused by :func:`install`: ZeRO stage 3, NVMe offload of the
optimizer, pipeline engines and MoE layers (untested here: their files are
not all written through the checkpoint engine, or are read back by other
paths). ``save_16bit_model`` and other calls outside ``save_checkpoint`` keep
DeepSpeed's own files (``torch.save``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import pickle
import re
import shutil
import sys
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
except ImportError as exc:
    raise ImportError("ckptd.integrations.deepspeed needs DeepSpeed 0.19: pip install 'deepspeed>=0.19,<0.20'") \
        from exc

import torch
import torch.distributed as dist

import ckptd
from ckptd.client import Client, SaveFuture
from ckptd.client.checks import check_seconds
from ckptd.protocol.messages import MAX_TIMEOUT
from ckptd.protocol.names import INDEX_NAME

__all__ = ["CkptdCheckpointEngine", "SUPPORTED", "export_deepspeed", "install", "require_supported", "wait"]

log = logging.getLogger("ckptd.deepspeed")

SUPPORTED = ((0, 19),)
"""The DeepSpeed releases (major, minor; any patch) whose checkpoint calls this module was written against and tested
with (0.19.8): the order of ``create``, ``makedirs``, ``save`` and ``commit`` it relies on is DeepSpeed's own."""

LATEST = "latest"
"""The file in ``save_dir`` naming the tag ``load_checkpoint`` resumes from, as DeepSpeed writes it."""
_PICKLED = "__ckptd_deepspeed_pickled__"
"""The one key of a dict standing in for an object ckptd stores no other way (its pickle, as bytes)."""
_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.Size)
"""Values ckptd stores as themselves (exact types: an ``IntEnum`` or ``numpy.float64`` is pickled, so it loads back
as what it was)."""


def require_supported(version: str) -> None:
    """Raise ``ImportError`` naming ``version`` unless it is a DeepSpeed release this module supports."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) not in SUPPORTED:
        wanted = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)
        raise ImportError(
            f"ckptd.integrations.deepspeed supports DeepSpeed {wanted}, and DeepSpeed {version} is installed: the "
            "order in which its engine calls a checkpoint engine changes between releases. Install a supported "
            f"release (pip install 'deepspeed=={SUPPORTED[-1][0]}.{SUPPORTED[-1][1]}.*') or save with DeepSpeed's "
            "own checkpoint engine")


require_supported(deepspeed.__version__)


# -- what a tag holds ---------------------------------------------------------

def encode(value: Any) -> Any:
    """``value`` as ckptd stores it: containers and tensors as they are, any other object pickled in its place."""
    kind = type(value)
    if kind is torch.Tensor or kind in _PLAIN and not (kind is int and not -2**63 <= value < 2**64):
        return value
    if kind in (dict, OrderedDict) and all(type(k) in (str, int) for k in value):
        return kind((k, encode(v)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(encode(v) for v in value)
    return {_PICKLED: pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)}


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    kind = type(value)
    if kind in (dict, OrderedDict):
        if len(value) == 1 and type(value.get(_PICKLED)) is bytes:
            return pickle.loads(value[_PICKLED])
        return kind((k, decode(v)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(decode(v) for v in value)
    return value


def _write_latest(save_dir: str, tag: str) -> None:
    """``save_dir/latest`` := ``tag``, whole or not at all (a temporary file, fsync'd, renamed, the directory
    fsync'd): DeepSpeed's own write truncates it first, so a crash there leaves it empty."""
    final = os.path.join(save_dir, LATEST)
    temporary = f"{final}.ckptd-{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, final)
    directory = os.open(save_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class _Save:
    """One ``save_checkpoint`` of this rank: its tag, the files DeepSpeed gave, and once handed over, the future."""

    def __init__(self, info: CheckpointCommitInfo) -> None:
        self.info = info
        self.path = os.path.abspath(os.path.join(info.save_dir, info.tag))
        self.files: dict[str, Any] = {}
        self.future: SaveFuture | None = None
        self.latest_written = False

    def name_of(self, path: str) -> str | None:
        """``path``'s name inside this tag (``mp_rank_00_model_states.pt``), or ``None`` outside it."""
        relative = os.path.relpath(os.path.abspath(path), self.path)
        return None if relative == os.curdir or relative.startswith(os.pardir) else Path(relative).as_posix()


class _Reading:
    """While ``load_checkpoint`` reads a ckptd tag: the stand-in directory DeepSpeed was given, the tag, and the
    ranks' states read so far."""

    def __init__(self, view: str, checkpoint: Path, run_dir: Any) -> None:
        self.view = view
        self.checkpoint = checkpoint
        self.run_dir = run_dir
        self.states: dict[int, dict[str, Any]] = {}
        world = ckptd.read_index(checkpoint).world_size
        own = _rank()
        self.holders: dict[str, int] = self.state(own if own < world else 0)["holders"]
        """Every file of the tag, and the rank whose shard holds it (each rank's shard names them all)."""

    def state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s saved state (this rank's own read into memory; another's mapped, so only the files read
        from it are read)."""
        if rank not in self.states:
            self.states[rank] = ckptd.load(self.checkpoint, rank=rank, mmap=rank != _rank(), run_dir=self.run_dir)
        return self.states[rank]


class CkptdCheckpointEngine(CheckpointEngine):
    """DeepSpeed's ``CheckpointEngine`` writing through the node's ckptd daemon (module docstring). Made and put in
    place by :func:`install`; a ckptd save only inside ``save_checkpoint``, DeepSpeed's own files elsewhere."""

    def __init__(self, *, blocking: bool = False, keep_last: int | None = None,
                 run_dir: str | os.PathLike | None = None, commit_timeout: float = 600.0) -> None:
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be True or False, got {blocking!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 1):
            raise ValueError(f"keep_last must be a whole number of tags, 1 or more (or None: keep all), "
                             f"got {keep_last!r}")
        check_seconds("commit_timeout", commit_timeout, high=MAX_TIMEOUT)
        super().__init__(None)
        self.name = "CkptdCheckpointEngine"
        self.blocking = blocking
        self.keep_last = keep_last
        self.run_dir = run_dir
        self.commit_timeout = commit_timeout
        self._client: Client | None = None
        self._saving = False
        """Inside ``save_checkpoint``: DeepSpeed's calls are a ckptd save."""
        self._current: _Save | None = None
        self._pending: _Save | None = None
        """The save handed over to the daemon and not yet seen committed."""
        self._reading: _Reading | None = None
        self._latest_lock = threading.Lock()

    # -- DeepSpeed's CheckpointEngine contract ---------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """The start of a save: the one before it finished first (its failure raises here)."""
        if not self._saving:
            return
        self.finish()
        self._current = _Save(info)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """The tag's own directory is the daemon's to make (as ``tag.incomplete``); any other is made here."""
        if self._saving and self._current is not None and (
                os.path.abspath(path) == self._current.path or self._current.name_of(path) is not None):
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """One of DeepSpeed's files: kept by name until the whole tag is handed over (references only: nothing
        changes the tensors before the hand-over at the end of ``save_checkpoint``)."""
        current = self._current if self._saving else None
        name = current.name_of(path) if current is not None else None
        if name is None:
            if current is not None:
                raise ValueError(f"DeepSpeed saved {path} outside the tag it is saving ({current.path}): "
                                 "ckptd.integrations.deepspeed does not cover this engine's checkpoints")
            torch.save(state_dict, path)  # outside save_checkpoint: DeepSpeed's own file (save_16bit_model)
            return
        if name in current.files:
            raise ValueError(f"DeepSpeed saved {name} twice in tag {current.info.tag}")
        current.files[name] = state_dict

    def load(self, path: str, map_location: Any = None) -> Any:
        """One of DeepSpeed's files: from the ckptd tag ``load_checkpoint`` reads, else from disk as DeepSpeed's
        ``TorchCheckpointEngine`` reads it."""
        reading = self._reading
        if reading is not None:
            relative = os.path.relpath(os.path.abspath(path), reading.view)
            if not relative.startswith(os.pardir):
                name = Path(relative).as_posix()
                if name not in reading.holders:
                    raise FileNotFoundError(f"{reading.checkpoint} holds no {name} (it holds "
                                            f"{sorted(reading.holders)})")
                return decode(reading.state(reading.holders[name])["files"][name])
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """``blocking=True``: DeepSpeed calls this at the end of ``save_checkpoint``, before it writes ``latest``;
        the tag is handed over and committed (renamed into place) before it returns."""
        if self._saving and self._current is not None and self.blocking:
            self._hand_over()
            self.finish()
        return True

    def is_decoupled(self) -> bool:
        """Without ``blocking``: DeepSpeed calls no ``commit`` in ``save_checkpoint`` and writes no ``latest``
        itself: the daemon's commit is waited for later, and ``latest`` written once the tag is renamed."""
        return not self.blocking

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """Asked at every optimizer step (decoupled engines): a save that failed in the meantime raises here, so
        the run stops at the step after it; nothing is ever left for DeepSpeed to commit."""
        pending = self._pending
        if pending is not None and pending.future is not None and pending.future.done():
            self.finish()
        return None

    def cleanup(self) -> None:
        """``engine.destroy()``: wait for the save in flight, then release the client's shared memory."""
        try:
            self.finish()
        finally:
            if self._client is not None:
                client, self._client = self._client, None
                client.close()

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed need not clone tensors for this engine (the copy into shared memory is the clone)."""
        return False

    # -- the ckptd save --------------------------------------------------------

    def _hand_over(self) -> None:
        """This rank's files of the tag, as one ckptd save (every rank; returns once they are in shared memory)."""
        current, self._current = self._current, None
        if current is None:
            return
        names = _gather_names(sorted(current.files))
        self._save_async(current, {name: rank for rank, held in enumerate(names) for name in held})

    def _save_async(self, current: _Save, holders: dict[str, int]) -> None:
        """The ckptd save of ``current``, every file's rank in ``holders`` (so a load finds each in its shard)."""
        if self._client is None:  # on every rank at its first save: a collective under torch.distributed
            self._client = Client(run_dir=self.run_dir, commit_timeout=self.commit_timeout)
        state = {"files": {name: encode(sd) for name, sd in current.files.items()}, "holders": holders,
                 "tag": current.info.tag, "deepspeed_version": deepspeed.__version__}
        current.files.clear()
        step = _step_of(current.info.tag)
        current.future = self._client.save_async(state, current.path, step=step, overwrite=True)
        self._pending = current
        if current.info.save_latest and _rank() == 0:
            current.future.add_done_callback(lambda future: self._committed(current, future))

    def _committed(self, save: _Save, future: Any) -> None:
        """Rank 0, once ``save`` ended: ``latest`` names its tag if it was committed (on the client's thread, as soon
        as the daemon renamed it, or in :meth:`finish`, whichever comes first)."""
        if future.cancelled() or future.exception() is not None:
            return
        with self._latest_lock:
            if not save.latest_written:
                save.latest_written = True
                _write_latest(save.info.save_dir, save.info.tag)

    def finish(self) -> None:
        """Wait for the save in flight: its failure raises here; on rank 0 ``latest`` names it once committed."""
        pending, self._pending = self._pending, None
        if pending is None or pending.future is None:
            return
        pending.future.result()
        if _rank() == 0:
            if pending.info.save_latest:
                self._committed(pending, pending.future)
            self._retain(pending)

    def _retain(self, save: _Save) -> None:
        """Rank 0, once ``latest`` names ``save``'s tag (on the training thread: the step after its commit, the next
        save, :func:`wait` or ``engine.destroy()``): the daemon deletes the ckptd tags of its ``save_dir`` beyond the
        newest ``keep_last`` (by the tag's trailing number, then by when it was committed), never ``save``'s own nor
        the one ``latest`` names. Here and not by the daemon at the commit: the daemon's retention ran before rank 0
        could rewrite ``latest``, so a rank 0 killed in between left ``latest`` naming a tag already deleted, and
        every restart failed on it. A tag that cannot be deleted (saved again meanwhile, not ckptd's) is logged and
        kept."""
        if self.keep_last is None or self._client is None:
            return
        save_dir = save.info.save_dir
        named, tags = _read_latest(save_dir), []
        for entry in os.scandir(save_dir):
            index = os.path.join(entry.path, INDEX_NAME)
            if entry.is_dir(follow_symlinks=False) and not entry.name.endswith(".incomplete") \
                    and os.path.isfile(index):
                step = _step_of(entry.name)
                tags.append(((-1 if step is None else step, os.stat(index).st_mtime), entry.name))
        spared = {save.info.tag, named}
        for _, tag in sorted(tags, reverse=True)[self.keep_last:]:
            if tag in spared:
                continue
            try:
                self._client.delete(os.path.join(save_dir, tag))
                log.info("deleted the tag %s of %s (keep_last=%d)", tag, save_dir, self.keep_last)
            except Exception as exc:  # noqa: BLE001 - retention never stops training; said, and kept
                log.warning("kept the tag %s of %s beyond keep_last=%d: %s: %s", tag, save_dir, self.keep_last,
                            type(exc).__name__, exc)

    def at_exit(self) -> None:
        """At the interpreter's exit (registered by :func:`install`): the last save waited for, so ``latest`` names
        it, where the program called neither ``engine.destroy()`` nor :func:`wait`."""
        try:
            self.finish()
        except Exception as exc:  # noqa: BLE001 - at exit there is no caller left to raise to
            log.error("the last checkpoint saved through ckptd failed: %s: %s", type(exc).__name__, exc)

    # -- what install() wraps ---------------------------------------------------

    def save_checkpoint(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``engine.save_checkpoint`` with this engine's calls made a ckptd save, handed over at its end."""
        if self._reading is not None:
            raise RuntimeError("save_checkpoint called while load_checkpoint reads a ckptd tag")
        self._saving = True
        try:
            result = original(*args, **kwargs)
            self._hand_over()
            if self.blocking:
                self.finish()
            return result
        finally:
            self._saving = False
            self._current = None

    def load_checkpoint(self, original: Callable[..., Any], load_dir: str, tag: str | None = None,
                        **kwargs: Any) -> Any:
        """``engine.load_checkpoint``: a ckptd tag is read through stand-ins (module docstring); anything else is
        DeepSpeed's own."""
        self.finish()
        if tag is None:
            tag = _agreed(_read_latest(load_dir))
            if tag is None:
                return original(load_dir, tag, **kwargs)  # DeepSpeed warns and loads nothing
        checkpoint = Path(load_dir, str(tag))
        if not (checkpoint / INDEX_NAME).is_file():
            return original(load_dir, tag, **kwargs)
        view = tempfile.mkdtemp(prefix="ckptd-deepspeed-")
        try:
            self._reading = _Reading(os.path.join(view, str(tag)), checkpoint, self.run_dir)
            for name in self._reading.holders:
                stand_in = Path(view, str(tag), name)
                stand_in.parent.mkdir(parents=True, exist_ok=True)
                stand_in.touch()
            log.info("loading the ckptd tag %s", checkpoint)
            load_path, client_state = original(view, tag, **kwargs)
        finally:
            self._reading = None
            shutil.rmtree(view, ignore_errors=True)
        if isinstance(load_path, str) and load_path.startswith(view + os.sep):
            load_path = os.path.join(load_dir, os.path.relpath(load_path, view))
        return load_path, client_state


def _gather_names(names: list[str]) -> list[list[str]]:
    """Every rank's ``names``, by rank (a collective: sizes, then the JSON bytes padded to the longest; no pickle,
    and no numpy, which ``all_gather_object`` needs)."""
    if not dist.is_initialized():
        return [names]
    device = torch.device(get_accelerator().current_device_name())
    data = torch.tensor(list(json.dumps(names).encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [json.loads(bytes(g[:int(size.item())].tolist())) for g, size in zip(gathered, sizes)]


def _read_latest(load_dir: str) -> str | None:
    """The tag ``load_dir/latest`` names (None: no such file)."""
    try:
        with open(os.path.join(load_dir, LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _agreed(tag: str | None) -> str | None:
    """Rank 0's ``tag`` on every rank (a collective, as ``load_checkpoint`` is): rank 0 rewrites ``latest`` once a
    save is committed, so a rank reading it at the same moment could read the tag before and load another step than
    rank 0, and the next save then waited for ever for shards of two different tags."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tag
    chosen = _gather_names([] if tag is None else [tag])[0]
    return chosen[0] if chosen else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _step_of(tag: str) -> int | None:
    """The step a tag names (``global_step300``: 300; any trailing number), for the daemon's retention order."""
    found = re.search(r"(\d+)$", tag)
    return int(found.group(1)) if found and int(found.group(1)) < 2**63 else None


def install(engine: Any, *, blocking: bool = False, keep_last: int | None = None,
            run_dir: str | os.PathLike | None = None, commit_timeout: float = 600.0) -> CkptdCheckpointEngine:
    """Make ``engine`` (what ``deepspeed.initialize`` returned) save and load its checkpoints through ckptd.

    ``blocking``: ``save_checkpoint`` returns once the tag is committed (default: once it is copied).
    ``keep_last``: once ``latest`` names a new tag, rank 0 has the daemon delete the tags of its ``save_dir``
    beyond the newest K (by the tag's trailing number, then commit time), never the one ``latest`` names.
    ``run_dir``: the daemon's run directory (default as ``ckptd.Client``). ``commit_timeout``: seconds every rank
    has to hand its shard over. Returns the checkpoint engine put in place (``engine.checkpoint_engine``).
    """
    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"install needs the engine deepspeed.initialize returned, got {type(engine).__name__}")
    if isinstance(engine.checkpoint_engine, CkptdCheckpointEngine):
        raise RuntimeError("ckptd is already installed on this engine (install it once, after deepspeed.initialize)")
    for what, on in (("ZeRO stage 3", engine.zero_optimization_partition_weights()),
                     ("NVMe offload of the optimizer", engine.zero_nvme_offload_optimizer()),
                     ("pipeline parallelism", type(engine).__name__ == "PipelineEngine"),
                     ("MoE layers", engine.has_moe_layers)):
        if on:
            raise ValueError(f"ckptd.integrations.deepspeed does not cover {what}: its checkpoints are DeepSpeed's "
                             "own (do not install ckptd on this engine)")
    previous = engine.checkpoint_engine
    if previous is not None and previous.is_decoupled():
        previous.cleanup()  # DeepSpeed's decoupled engine: its writer process, and any commit it holds
    checkpoint_engine = CkptdCheckpointEngine(blocking=blocking, keep_last=keep_last, run_dir=run_dir,
                                              commit_timeout=commit_timeout)
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        return checkpoint_engine.save_checkpoint(save, *args, **kwargs)

    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        return checkpoint_engine.load_checkpoint(load, *args, **kwargs)

    for wrapper, original in ((save_checkpoint, save), (load_checkpoint, load)):
        wrapper.__doc__ = original.__doc__
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    engine.checkpoint_engine = checkpoint_engine
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    atexit.register(checkpoint_engine.at_exit)
    return checkpoint_engine


def wait(engine: Any) -> None:
    """Wait until the last ``save_checkpoint`` of ``engine`` is committed (a failed save raises here); on rank 0,
    ``latest`` names it when this returns (rank 0 writes it; ``load_checkpoint`` on every rank reads rank 0's).
    ``engine.destroy()`` does the same and frees the client's shared memory."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if not isinstance(checkpoint_engine, CkptdCheckpointEngine):
        raise TypeError(f"ckptd is not installed on {type(engine).__name__} (call install(engine) first)")
    checkpoint_engine.finish()


def export_deepspeed(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write ``checkpoint``'s files as DeepSpeed's own engine writes them (``torch.save`` each, into the new
    directory ``out_dir``), for tools that read those files (``zero_to_fp32.py``, DeepSpeed without ckptd)."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if not (checkpoint / INDEX_NAME).is_file():
        raise ckptd.InvalidCheckpoint(f"{checkpoint} is no committed ckptd checkpoint (no {INDEX_NAME})")
    if out.exists():
        raise FileExistsError(f"{out} exists: export writes a new directory")
    ranks = ckptd.load(checkpoint, rank="all", mmap=True)
    if not all(isinstance(state, dict) and "files" in state for state in ranks):
        raise ckptd.InvalidCheckpoint(f"{checkpoint} is a ckptd checkpoint, but not one of a DeepSpeed engine")
    out.mkdir(parents=True)
    for state in ranks:
        for name, files_state in state["files"].items():
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save(decode(files_state), target)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptd.integrations.deepspeed",
                                     description="DeepSpeed's own files from a ckptd tag.")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="each rank's files, written with torch.save as DeepSpeed writes them")
    export.add_argument("checkpoint", help="a tag: SAVE_DIR/TAG")
    export.add_argument("out_dir", help="a new directory (name it for the tag, beside a 'latest' naming it, for "
                                        "DeepSpeed's own load_checkpoint)")
    args = parser.parse_args(argv)
    try:
        print(export_deepspeed(args.checkpoint, args.out_dir))
    except (ckptd.CkptdError, FileExistsError) as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
