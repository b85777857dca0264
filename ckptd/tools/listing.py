"""``ckptd list ROOT``: what lies under a checkpoint directory, read from disk.

No daemon needed. Each entry is ``committed`` (a valid index and every shard
file present, regular and of the size the index records), ``damaged`` (a
valid index but a shard missing, not a regular file or of the wrong size:
``latest()`` skips it and ``load`` refuses it), ``incomplete`` (a
``.incomplete`` directory: a save in progress or one that died; never
loaded), ``memory`` (a snapshot the node's daemon holds in memory only, not
on disk), or ``foreign`` (anything else: not ours, never touched by retention).
Entries the daemon also holds in memory say so (``in_memory``).
The check is cheap (no data read); ``ckptd verify`` reads every byte.
"""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Any, Iterable

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import INCOMPLETE_SUFFIX, missing_or_truncated, read_index
from ckptd.protocol.objects import canonical, display

from ckptd.core.render import human_bytes, printable
from ckptd.storage.backends import load_storage
from ckptd.storage.contract import Files, Kind, tree_bytes


class EntryState(str, Enum):
    """What ``ckptd list`` says an entry is (the order is the listing's order)."""

    COMMITTED = "committed"
    DAMAGED = "damaged"
    INCOMPLETE = "incomplete"
    MEMORY = "memory"
    FOREIGN = "foreign"


def list_checkpoints(root: Path, storage: Files | None = None) -> list[dict[str, Any]]:
    """One dict per entry under ``root``, committed ones ordered by step."""
    storage = storage if storage is not None else load_storage(None).files
    out = []
    for entry in sorted(storage.scandir(root), key=lambda e: e.name):
        path = entry.path
        row: dict[str, Any] = {"name": entry.name, "path": display(path), "step": None, "bytes": None,
                               "ranks": None, "world_size": None, "time": None}
        if entry.name.endswith(INCOMPLETE_SUFFIX) and entry.kind is Kind.DIR:
            shards = [e for e in storage.scandir(path) if e.name.endswith(".safetensors")]
            st = storage.stat(path)
            row.update(state=EntryState.INCOMPLETE.value, bytes=tree_bytes(storage, path), ranks=len(shards),
                       time=st.mtime if st else None)
        else:
            try:
                index = read_index(path, storage)
            except InvalidCheckpoint:
                row.update(state=EntryState.FOREIGN.value)
            else:
                problem = missing_or_truncated(path, index, storage)
                state = EntryState.DAMAGED if problem else EntryState.COMMITTED
                row.update(state=state.value, step=index.step, bytes=index.total_bytes, ranks=len(index.files),
                           world_size=index.world_size, time=index.created)
                if problem:
                    row["problem"] = problem
        out.append(row)
    order = {s.value: i for i, s in enumerate(EntryState)}
    return sorted(out, key=lambda r: (order[r["state"]], r["step"] if r["step"] is not None else -1, r["name"]))


def add_memory(rows: list[dict[str, Any]], snapshots: Iterable[dict[str, Any]], root: Path) -> list[dict[str, Any]]:
    """Mark the rows the daemon holds in memory; add its snapshots under ``root`` that are not on disk."""
    by_path = {r["path"]: r for r in rows}
    for r in rows:
        r["in_memory"] = False
    for s in snapshots:
        held = Path(s["path"])
        name = held.name
        if canonical(held.parent) != canonical(root) or not s["complete"]:
            continue
        row = by_path.get(display(root / name)) or by_path.get(display(held))
        if row is not None and row["state"] == EntryState.COMMITTED.value:
            row["in_memory"] = True
            if not s.get("persisted"):  # another version than the disk's: what a load reads (memory first)
                row.update(disk_step=row["step"], step=s["step"], bytes=s["bytes"], time=s["created"])
        elif row is None:
            rows.append({"name": name, "path": display(root / name), "step": s["step"], "bytes": s["bytes"],
                         "ranks": len(s["ranks_held"]), "world_size": s["world_size"], "time": s["created"],
                         "state": EntryState.MEMORY.value, "in_memory": True})
    order = {st.value: i for i, st in enumerate(EntryState)}
    return sorted(rows, key=lambda r: (order[r["state"]], r["step"] if r["step"] is not None else -1, r["name"]))


def render_listing(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no checkpoints"
    lines = [f"{'NAME':<32} {'STATE':<14} {'STEP':>8} {'SIZE':>10} {'RANKS':>7}  TIME"]
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if r["time"] else "-"
        ranks = "-" if r["ranks"] is None else (f"{r['ranks']}/{r['world_size']}" if r["world_size"] else str(r["ranks"]))
        size = "-" if r["bytes"] is None else human_bytes(r["bytes"])
        step = "-" if r["step"] is None else str(r["step"])
        state = f"{r['state']}+mem" if r.get("in_memory") and r["state"] != EntryState.MEMORY.value else r["state"]
        lines.append(f"{printable(r['name']):<32} {state:<14} {step:>8} {size:>10} {ranks:>7}  {when}")
        if r.get("problem"):
            lines.append(f"  {printable(r['problem'])}")
    return "\n".join(lines)
