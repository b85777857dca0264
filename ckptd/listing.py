"""``ckptd list ROOT``: what lies under a checkpoint directory, read from disk.

No daemon needed. Each entry is ``committed`` (a valid index and every shard
file present, regular and of the size the index records), ``damaged`` (a
valid index but a shard missing, not a regular file or of the wrong size:
``latest()`` skips it and ``load`` refuses it), ``incomplete`` (a
``.incomplete`` directory: a save in progress or one that died; never
loaded), or ``foreign`` (anything else: not ours, never touched by retention).
The check is cheap (no data read); ``ckptd verify`` reads every byte.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import INCOMPLETE_SUFFIX, missing_or_truncated, read_index

from .render import human_bytes, printable


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def list_checkpoints(root: Path) -> list[dict[str, Any]]:
    """One dict per entry under ``root``, committed ones ordered by step."""
    out = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        row: dict[str, Any] = {"name": entry.name, "path": str(path), "step": None, "bytes": None,
                               "ranks": None, "world_size": None, "time": None}
        if entry.name.endswith(INCOMPLETE_SUFFIX) and entry.is_dir(follow_symlinks=False):
            shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
            row.update(state="incomplete", bytes=_dir_bytes(path), ranks=len(shards),
                       time=entry.stat(follow_symlinks=False).st_mtime)
        else:
            try:
                index = read_index(path)
            except InvalidCheckpoint:
                row.update(state="foreign")
            else:
                problem = missing_or_truncated(path, index)
                row.update(state="damaged" if problem else "committed", step=index.step,
                           bytes=index.total_bytes, ranks=len(index.files), world_size=index.world_size,
                           time=index.created)
                if problem:
                    row["problem"] = problem
        out.append(row)
    order = {"committed": 0, "damaged": 1, "incomplete": 2, "foreign": 3}
    return sorted(out, key=lambda r: (order[r["state"]], r["step"] if r["step"] is not None else -1, r["name"]))


def render_listing(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no checkpoints"
    lines = [f"{'NAME':<32} {'STATE':<10} {'STEP':>8} {'SIZE':>10} {'RANKS':>7}  TIME"]
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if r["time"] else "-"
        ranks = "-" if r["ranks"] is None else (f"{r['ranks']}/{r['world_size']}" if r["world_size"] else str(r["ranks"]))
        size = "-" if r["bytes"] is None else human_bytes(r["bytes"])
        step = "-" if r["step"] is None else str(r["step"])
        lines.append(f"{printable(r['name']):<32} {r['state']:<10} {step:>8} {size:>10} {ranks:>7}  {when}")
        if r.get("problem"):
            lines.append(f"  {printable(r['problem'])}")
    return "\n".join(lines)
