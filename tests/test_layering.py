"""The layers stay apart: the protocol depends on nothing of ours, the daemon never loads torch, the client
never reaches into the daemon.

Read from the source (every ``import`` statement, at any depth, so a
function-level import counts too), and checked once in a fresh interpreter
for the daemon's torch-free start.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import REPO

DAEMON_SIDE = frozenset({"integrations", "dcp"})
"""Modules under ``ckptd/`` that are the client's (torch-side), not the daemon's."""


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved against its package)."""
    package = {"protocol": "ckptd.protocol", "client": "ckptd.client"}.get(path.parent.name, "ckptd")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            found.update(f"{module}.{alias.name}" for alias in node.names)  # ``from ckptd import commit``
    return found


def _sources(layer: str) -> list[Path]:
    return sorted((REPO / layer).glob("*.py"))


def test_the_protocol_imports_neither_the_daemon_nor_the_client_nor_torch() -> None:
    bad = {f"{p.name}: {m}" for p in _sources("protocol") for m in _imports(p)
           if m == "torch" or m.startswith("torch.") or (m.startswith("ckptd") and not m.startswith("ckptd.protocol"))}
    assert not bad, f"protocol/ must depend on msgpack, its optional store client and the standard library: {bad}"


def test_the_daemon_never_imports_torch_or_the_client() -> None:
    daemon = [p for p in _sources("ckptd") if p.stem not in DAEMON_SIDE]
    bad = {f"{p.name}: {m}" for p in daemon for m in _imports(p)
           if m == "torch" or m.startswith("torch.") or m.startswith("ckptd.client") or m == "lightning"}
    assert not bad, f"the daemon must stay torch-free: {bad}"


def test_the_client_never_imports_daemon_internals() -> None:
    bad = {f"{p.name}: {m}" for p in _sources("client") for m in _imports(p)
           if m.startswith("ckptd.") and not m.startswith(("ckptd.protocol", "ckptd.client"))}
    assert not bad, f"client/ may use ckptd.protocol only: {bad}"


BACKEND_BLIND = ("writer", "retention", "admission", "holding", "snapshots", "saves", "sweep", "mirror")
"""Daemon modules that speak to storage in checkpoint operations only (``ckptd.storage.Checkpoints``)."""


def test_the_checkpoint_lifecycle_never_asks_which_backend_a_name_is_on() -> None:
    """Only the storage implementations (``ckptd/routed.py`` and what it routes to), path parsing and messages
    ask whether a name is on an object store; what writes, publishes and deletes checkpoints does not."""
    blind = [p for p in _sources("ckptd") if p.stem in BACKEND_BLIND]
    asking = {f"{p.name}: {m}" for p in blind for m in _imports(p) if m.endswith(".is_object_path")}
    asking |= {p.name for p in [*_sources("ckptd"), *_sources("ckptd/integrations")] if "can_rename" in p.read_text()}
    assert not asking, f"checkpoint operations, not backend checks: {asking}"


def test_the_storage_contract_imports_no_implementation_of_it() -> None:
    """``ckptd/storage.py`` is the contract the implementations build on: importing one back is a cycle."""
    ours = {m for m in _imports(REPO / "ckptd" / "storage.py")
            if m.startswith("ckptd.") and not m.startswith("ckptd.protocol")}
    assert not ours, f"ckptd/storage.py must not import {ours}"


def test_starting_the_daemons_modules_loads_no_torch() -> None:
    code = ("import sys, ckptd.server, ckptd.cli, ckptd.daemon; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


REACTIONS = ("ckptd.mirror", "ckptd.retention", "ckptd.holding", "ckptd.metrics", "ckptd.stats")
"""Modules that react to a commit (they subscribe to ``ckptd/events.py``)."""


def test_the_modules_that_commit_import_none_of_the_modules_that_react_to_a_commit() -> None:
    committing = [REPO / "ckptd" / f"{name}.py" for name in ("saves", "commit", "writer", "admission")]
    bad = {f"{p.name}: {m}" for p in committing for m in _imports(p) if m.startswith(REACTIONS)}
    assert not bad, f"a reaction to a commit subscribes to its event instead of being called by the pipeline: {bad}"
