"""``load_into``: restore a checkpoint into tensors that already exist.

Loading a checkpoint as a new state dict and then copying it into a model
holds two copies at the peak. ``load_into`` maps the shard (no copy) and
copies each saved tensor straight into the existing tensor with the same key,
so the extra memory is about one tensor's pages of the mapping at a time,
and those are page cache, not process memory.

Everything is checked before a byte is copied: missing keys, unexpected
keys, shape and dtype mismatches, regions no saved chunk covers are reported
together in one error, and on error the target is untouched. The checksum
is the exception: it is computed in the same pass as the copy (the file is
read once, not once to check and once to copy), so a shard whose bytes
changed on disk is reported after the target took them. A second
``load_into`` of the same unchanged files checks them no more.

Sharded checkpoints reshard on the way in: a target DTensor (any mesh, any
``Shard``/``Replicate`` placements, any world size) gets only the region of
each global tensor its local shard holds, read from the chunks that overlap
it, straight into ``to_local()``; a plain target tensor gets the whole
tensor. A plain saved tensor loads into a DTensor target the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.objects import display

from .checks import check_bool, check_limit, check_load_rank, check_path
from .lease import load_lease
from .load import load_rank
from .memory import open_checkpoint
from .ranks import detect_ranks
from .reshard import ChunkFiles, GlobalRef, plan_region, read_full, region
from .sharding import is_dtensor, target_region


@dataclass
class LoadReport:
    """What ``load_into`` did; with ``strict=False`` the lists may be non-empty."""

    copied: int = 0
    """Tensors copied in place."""
    missing: list[str] = field(default_factory=list)
    """Keys of the target the checkpoint does not hold."""
    unexpected: list[str] = field(default_factory=list)
    """Keys of the checkpoint the target does not hold."""


@dataclass
class _Plan:
    files: ChunkFiles
    """Where global tensors' chunks are read from."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    filled: int = 0
    """Target tensors the copies fill."""
    assigns: list[tuple[Any, Any, Any]] = field(default_factory=list)
    """(container, key, value) for plain values."""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)


TARGETS = (dict, list, torch.Tensor, torch.nn.Module, torch.optim.Optimizer)
"""What ``load_into`` copies into in place (a list or tensor: the part of the checkpoint ``key`` selects)."""


def load_into(
    target: Any,
    path: str | os.PathLike,
    *,
    rank: int | None = None,
    key: str | None = None,
    strict: bool = True,
    verify: bool = True,
    max_concurrent_per_node: int | None = None,
    run_dir: str | os.PathLike | None = None,
) -> LoadReport:
    """Copy the checkpoint at ``path`` into ``target`` in place.

    ``target`` is a (nested) state dict, a ``torch.nn.Module`` or a
    ``torch.optim.Optimizer``. ``key`` selects a part of the saved state
    (``key="model"`` when the checkpoint is ``{"model": ..., "optimizer": ...}``).
    With ``strict`` (default) missing or unexpected keys are an error; shape
    and dtype mismatches always are. An optimizer that has no state yet
    (before its first step) is restored with its own ``load_state_dict``.
    """
    if not isinstance(target, TARGETS):
        raise TypeError(f"target must be a state dict, a torch.nn.Module or a torch.optim.Optimizer, "
                        f"got {type(target).__name__}")
    path = Path(check_path("path", path))
    rank = check_load_rank(rank, allow_all=False)
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a str or None, got {type(key).__name__}")
    check_bool("strict", strict)
    check_bool("verify", verify)
    limit = check_limit(max_concurrent_per_node)
    if run_dir is not None:
        check_path("run_dir", run_dir)
    files = open_checkpoint(path, verify=verify, run_dir=run_dir, defer=True)  # the daemon's memory when it holds path
    try:
        index = files.index
        if rank is not None and rank >= index.world_size:
            raise InvalidCheckpoint(f"checkpoint {display(path)} has no rank {rank}; it holds ranks "
                                    f"0..{index.world_size - 1}")
        if rank is None:
            rank = detect_ranks().rank if index.world_size > 1 else 0
            if rank >= index.world_size:  # a larger world: per-rank state only where every saved rank agrees
                difference = _difference_between_saved_ranks(files, key, target)
                if difference is not None:
                    raise InvalidCheckpoint(
                        f"checkpoint {display(path)} was saved by ranks 0..{index.world_size - 1}; this process is "
                        f"rank {rank}, and the per-rank state (everything but DTensors and replicated= keys) differs "
                        f"between the saved ranks ({difference}), so loading it here would give rank {rank} another "
                        f"rank's state (a data loader position, an RNG state). Pass rank=0 (or another saved rank) "
                        f"to take that rank's per-rank state on purpose")
                rank = 0
        with load_lease(limit, run_dir=run_dir):
            # Views of a mapping: no second copy of the checkpoint. Nothing holds
            # them past this call, so the mapping goes when it returns. A fresh
            # optimizer keeps what its load_state_dict is given (``.to`` does not
            # copy), so it gets tensors that own their memory instead.
            fresh_optimizer = isinstance(target, torch.optim.Optimizer) and not target.state
            saved = load_rank(files, rank, None, files.ref, mmap=not fresh_optimizer)
            if key is not None:
                if not isinstance(saved, dict) or key not in saved:
                    raise InvalidCheckpoint(f"checkpoint {display(path)} (rank {rank}) holds no top-level key {key!r}")
                saved = saved[key]
            if fresh_optimizer:
                saved = _read_globals(saved, files)
                files.copy([])  # checks what the reads above left unchecked
                target.load_state_dict(saved)
                return LoadReport(copied=sum(1 for _ in _tensors(saved)))
            return _apply(target, saved, strict, f"checkpoint {display(path)}", files)
    finally:
        files.close()  # a held snapshot's reader lease ends: the daemon may drop it now


def _difference_between_saved_ranks(files: ChunkFiles, key: str | None, target: Any) -> str | None:
    """Where the saved ranks' per-rank state (under ``key``) that ``target`` takes first differs, or None if every
    saved rank holds the same: then a rank beyond the saved world may take it, as it takes its share of the global
    tensors. State the target leaves (``strict=False``: a data loader's position it does not restore) may differ."""
    first: Any = None
    for r in range(files.index.world_size):
        saved = load_rank(files, r, None, files.ref, mmap=True)
        if key is not None:
            saved = saved.get(key) if isinstance(saved, dict) else None
        saved = _taken(saved, target)
        if r == 0:
            first = saved
        elif (where := _first_difference(first, saved, [key] if key is not None else [])) is not None:
            return f"ranks 0 and {r} differ at {where}"
    return None


def _taken(saved: Any, target: Any) -> Any:
    """What of ``saved`` a load into ``target`` reads: of each dict, the entries the target's dict holds too."""
    if isinstance(saved, dict) and isinstance(target, dict):
        return {k: _taken(v, target[k]) for k, v in saved.items() if k in target}
    return saved


def _first_difference(a: Any, b: Any, path: list[Any]) -> str | None:
    """The key path where two trees first differ (containers and keys, tensors' dtype, shape and bytes, values)."""
    here = "state_dict" + "".join(f"[{p!r}]" for p in path)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return None if same else here
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return next((d for k in a if (d := _first_difference(a[k], b[k], path + [k])) is not None), None)
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_difference(x, y, path + [i])) is not None),
                    None)
    return None if type(a) is type(b) and not isinstance(a, (dict, list, tuple)) and a == b else here


def _read_globals(obj: Any, files: ChunkFiles) -> Any:
    """``obj`` with every global tensor read whole (for ``load_state_dict``, which wants tensors)."""
    if isinstance(obj, GlobalRef):
        return read_full(files, obj)
    if isinstance(obj, dict):
        return {k: _read_globals(v, files) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_read_globals(v, files) for v in obj)
    return obj


def _apply(target: Any, saved: Any, strict: bool, where: str, files: ChunkFiles) -> LoadReport:
    plan = _Plan(files)
    if isinstance(target, torch.nn.Module):
        _match(target.state_dict(), saved, "", plan)
    elif isinstance(target, torch.optim.Optimizer):
        _match(target.state_dict(), saved, "", plan)
        plan.assigns = []  # its state_dict() is a copy; hyperparameters are applied below
    else:
        _match(target, saved, "", plan)
    problems = [f"shape/dtype mismatch: {m}" for m in plan.mismatched]
    problems += [f"not covered by any saved chunk: {u}" for u in plan.uncovered]
    if strict:
        problems += [f"missing from the checkpoint: {k}" for k in plan.missing]
        problems += [f"not in the target: {k}" for k in plan.unexpected]
    if problems:
        raise InvalidCheckpoint(f"cannot load {where} into the target ({len(problems)} problems, nothing changed):\n  "
                                + "\n  ".join(problems))
    with torch.no_grad():
        try:
            files.copy(plan.copies)
        except InvalidCheckpoint as exc:
            raise InvalidCheckpoint(f"{exc.message}; the target holds partly copied values now, load it again "
                                    "from an intact checkpoint") from None
    for container, k, value in plan.assigns:
        container[k] = value
    if isinstance(target, torch.optim.Optimizer):
        for group, saved_group in zip(target.param_groups, saved.get("param_groups", [])):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
    return LoadReport(plan.filled, plan.missing, plan.unexpected)


def _match(dst: Any, src: Any, where: str, plan: _Plan) -> None:
    """Pair up ``dst`` and ``src`` leaf by leaf, recording what to copy and what is wrong."""
    if isinstance(src, GlobalRef) or is_dtensor(dst):
        _match_region(dst, src, where, plan)
        return
    if isinstance(dst, torch.Tensor) or isinstance(src, torch.Tensor):
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
            plan.mismatched.append(f"{where or '<root>'}: target holds {type(dst).__name__}, checkpoint {type(src).__name__}")
        elif dst.shape != src.shape or dst.dtype != src.dtype:
            plan.mismatched.append(f"{where}: target {dst.dtype}{list(dst.shape)}, checkpoint {src.dtype}{list(src.shape)}")
        else:
            plan.copies.append((dst, src))
            plan.filled += 1
        return
    if isinstance(dst, dict) and isinstance(src, dict):
        plan.missing += [_join(where, k) for k in dst if k not in src]
        plan.unexpected += [_join(where, k) for k in src if k not in dst]
        for k in dst:
            if k in src:
                _leaf_or_recurse(dst, k, src[k], _join(where, k), plan)
        return
    if isinstance(dst, (list, tuple)) and isinstance(src, (list, tuple)):
        if len(dst) != len(src):
            plan.mismatched.append(f"{where}: target holds {len(dst)} items, checkpoint {len(src)}")
            return
        for i, item in enumerate(src):
            if isinstance(dst, list):
                _leaf_or_recurse(dst, i, item, _join(where, i), plan)
            else:
                _match(dst[i], item, _join(where, i), plan)
        return
    if type(dst) is not type(src) and (isinstance(dst, (dict, list, tuple)) or isinstance(src, (dict, list, tuple))):
        plan.mismatched.append(f"{where}: target holds {type(dst).__name__}, checkpoint {type(src).__name__}")


def _match_region(dst: Any, src: Any, where: str, plan: _Plan) -> None:
    """A global tensor (or a DTensor target): copy the region the target holds, from the chunks overlapping it."""
    kind = src.describe() if isinstance(src, GlobalRef) else type(src).__name__
    if not isinstance(dst, torch.Tensor) or not isinstance(src, (GlobalRef, torch.Tensor)):
        plan.mismatched.append(f"{where or '<root>'}: target holds {type(dst).__name__}, checkpoint {kind}")
        return
    shape = src.record.shape if isinstance(src, GlobalRef) else tuple(src.shape)
    if tuple(dst.shape) != shape or dst.dtype != src.dtype:
        plan.mismatched.append(f"{where}: target {dst.dtype}{list(dst.shape)}, checkpoint {src.dtype}{list(shape)}")
        return
    origin = (0,) * len(shape)
    if is_dtensor(dst):
        try:
            box = target_region(dst, where)
        except (TypeError, ValueError) as exc:
            plan.mismatched.append(str(exc))
            return
        local = dst.to_local()
    else:
        box, local = (origin, shape), dst
    plan.filled += 1
    if isinstance(src, torch.Tensor):  # a whole saved tensor into a target's region of it
        plan.copies.append((local, region(src, box, origin)))
        return
    copies, problem = plan_region(plan.files, src, box, local)
    if problem is not None:
        plan.uncovered.append(f"{where}: {problem}")
    plan.copies += copies


def _leaf_or_recurse(container: Any, k: Any, value: Any, where: str, plan: _Plan) -> None:
    current = container[k]
    tree = (torch.Tensor, GlobalRef, dict, list, tuple)
    if isinstance(current, tree) or isinstance(value, tree):
        _match(current, value, where, plan)
    else:
        plan.assigns.append((container, k, value))


def _join(where: str, k: Any) -> str:
    return f"{where}.{k}" if where else str(k)


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
