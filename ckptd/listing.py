"""``ckptd list ROOT``: what lies under a checkpoint directory, read from disk.

No daemon needed. Each entry is ``committed`` (a valid index), ``incomplete``
(a ``.incomplete`` directory: a save in progress or one that died; never
loaded), or ``foreign`` (anything else: not ours, never touched by retention).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ckptd.protocol.errors import InvalidCheckpoint
from ckptd.protocol.index import INCOMPLETE_SUFFIX, read_index

from .render import human_bytes


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
                row.update(state="committed", step=index.step, bytes=index.total_bytes,
                           ranks=len(index.files), world_size=index.world_size, time=index.created)
        out.append(row)
    order = {"committed": 0, "incomplete": 1, "foreign": 2}
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
        lines.append(f"{r['name']:<32} {r['state']:<10} {step:>8} {size:>10} {ranks:>7}  {when}")
    return "\n".join(lines)
