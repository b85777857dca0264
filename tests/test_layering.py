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

DAEMON_SIDE = frozenset({"dcp"})
"""Modules under ``ckptd/`` that are the client's (torch-side), not the daemon's."""
FACE = ("__init__", "dcp")
"""The package face under ``ckptd/``: what ``import ckptd`` and ``ckptd.dcp`` give, the client's and the protocol's."""


PACKAGES = {"protocol": "ckptd.protocol", "client": "ckptd.client", "integrations": "ckptd.integrations"}
"""Source folders at the top of the repository that import under another name (``setup.cfg``'s package_dir)."""


def _package(path: Path) -> str:
    """The dotted package ``path`` (a module) belongs to."""
    parts = path.relative_to(REPO).parent.parts
    return ".".join([PACKAGES.get(parts[0], parts[0]), *parts[1:]])


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved against its package)."""
    return _imports_of(ast.parse(path.read_text(), str(path)), _package(path))


def _sources(layer: str) -> list[Path]:
    return sorted((REPO / layer).glob("*.py"))


def _daemon() -> list[Path]:
    """Every module of the daemon's package, its role folders included."""
    return sorted((REPO / "ckptd").rglob("*.py"))


def _by_stem(name: str) -> Path:
    (path,) = [p for p in _daemon() if p.stem == name]
    return path


def _dotted(path: Path) -> str:
    return path.stem if path.stem == "__init__" else f"{_package(path)}.{path.stem}"


def test_the_protocol_imports_neither_the_daemon_nor_the_client_nor_torch() -> None:
    bad = {f"{p.name}: {m}" for p in _sources("protocol") for m in _imports(p)
           if m == "torch" or m.startswith("torch.") or (m.startswith("ckptd") and not m.startswith("ckptd.protocol"))}
    assert not bad, f"protocol/ must depend on msgpack, its optional store client and the standard library: {bad}"


def test_the_daemon_never_imports_torch_or_the_client() -> None:
    daemon = [p for p in _daemon() if p.stem not in DAEMON_SIDE]
    bad = {f"{p.name}: {m}" for p in daemon for m in _imports(p)
           if m == "torch" or m.startswith("torch.") or m.startswith("ckptd.client") or m == "lightning"}
    assert not bad, f"the daemon must stay torch-free: {bad}"


def test_the_client_never_imports_daemon_internals() -> None:
    bad = {f"{p.name}: {m}" for p in _sources("client") for m in _imports(p)
           if m.startswith("ckptd.") and not m.startswith(("ckptd.protocol", "ckptd.client"))}
    assert not bad, f"client/ may use ckptd.protocol only: {bad}"


def test_the_integrations_and_the_package_face_reach_only_the_client_and_the_protocol() -> None:
    """Torch-side adapters (``integrations/``, imported as ``ckptd.integrations``) and the package face use the
    client and the protocol, never the daemon's modules: what they need of the daemon (deleting a checkpoint,
    say) is a request to it (``Client.delete``), so it runs under the daemon's own locks."""
    allowed = ("ckptd.protocol", "ckptd.client", "ckptd.integrations")
    sources = [*_sources("integrations"), *(REPO / "ckptd" / f"{name}.py" for name in FACE)]
    assert len(sources) > len(FACE), "integrations/ holds no module"
    bad = {f"{p.relative_to(REPO)}: {m}" for p in sources for m in _imports(p)
           if m.startswith("ckptd.") and not m.startswith(allowed)}
    assert not bad, f"integrations/ and the package face may use ckptd.client and ckptd.protocol only: {bad}"


def test_the_checkpoint_lifecycle_never_asks_which_backend_a_name_is_on() -> None:
    """Only the storage implementations (``ckptd/storage/``: ``backends.py`` and the backends it chooses between,
    whose ``check_stores`` also checks a start's buckets), path parsing (``protocol/``, and the flags' own in
    ``core/config.py``) and messages ask whether a name is on an object store; no other daemon module (the lifecycle,
    upkeep, the loop, the peers, the tools) nor an integration does."""
    asking = {str(p.relative_to(REPO)) for p in [*_daemon(), *_sources("integrations")]
              if p.parent.name != "storage" and p != _by_stem("config")
              and any(m.endswith(".is_object_path") for m in _imports(p))}
    asking |= {p.name for p in [*_daemon(), *_sources("integrations")] if "can_rename" in p.read_text()}
    assert not asking, f"checkpoint operations, not backend checks: {asking}"


def test_only_the_registry_moves_an_attempt() -> None:
    """Every change of an attempt's state (disk or memory) goes through ``lifecycle/registry.Registry`` (``move``,
    ``end``), which keeps the books: no other module of the daemon calls ``Attempt.move_to``."""
    movers = {p.relative_to(REPO).as_posix() for p in _daemon() for node in ast.walk(ast.parse(p.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "move_to"}
    assert movers == {"ckptd/lifecycle/registry.py"}, f"attempts moved outside the registry: {sorted(movers)}"


REGISTRY_CALLS = frozenset({"move", "end", "end_orphaned", "open", "promote"})
"""What changes an attempt's state or a book: ``lifecycle/registry.Registry``'s methods."""
BOOKS = frozenset({"pending", "current", "held", "replacing", "incoming"})
"""The registry's books (``Commits.pending``, ``SnapshotBook.current`` and ``.replacing``, ``ReplicaBook.incoming`` and
``.held``), written by the registry only."""
PIPELINES = frozenset({"ckptd/lifecycle/commit.py", "ckptd/lifecycle/saves.py", "ckptd/lifecycle/holding.py",
                       "ckptd/lifecycle/snapshots.py", "ckptd/peers/replicas.py"})
"""The modules of the registry's pipelines: disk saves, memory snapshots, and the replicas held for peers."""


def _registry_callers(path: Path) -> set[str]:
    """The registry methods ``path`` calls (on ``…attempts`` or ``…registry``: the registry's names)."""
    return {node.func.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REGISTRY_CALLS
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in ("attempts", "registry")}


def test_only_the_pipelines_end_an_attempt_and_only_through_the_registry() -> None:
    """An attempt (a replica held for a peer too) moves and ends through ``Registry.move``/``end`` only (``end``
    answers its ranks and releases what it held through its pipeline's hook), called by the pipelines' own modules:
    the loop, replication and the upkeep ask the pipelines, never the registry, to change one."""
    callers = {p.relative_to(REPO).as_posix() for p in _daemon() if _registry_callers(p)}
    assert callers <= PIPELINES, callers
    for pipeline in ("saves", "holding", "replicas"):
        assert {"end"} <= _registry_callers(_by_stem(pipeline)), pipeline
    assert {"open", "promote", "move"} <= _registry_callers(_by_stem("replicas"))


LIFE_CALLS = frozenset({"move", "end", "end_orphaned", "promote"})
"""The registry's methods that change an attempt's life, by names no other object of the daemon uses for a method,
so a call of one on anything else is a second way to move or end an attempt."""
OTHER_RECEIVERS = frozenset({("holding.py", "self.snapshots.promote")})
"""Calls of those names on another object, each of which hands its attempt to the registry (``SnapshotBook.promote``
calls ``Registry.promote``)."""


def test_no_attempt_moves_or_ends_but_through_an_object_named_for_the_registry() -> None:
    """``test_only_the_pipelines_end_an_attempt_and_only_through_the_registry`` looks at calls on ``…registry`` or
    ``…attempts``; this one finds every call of the registry's life methods, whatever it is called on, so a
    pipeline that kept the registry under another name, or grew a ``move``/``end`` of its own, fails here."""
    found = {(p.name, f"{ast.unparse(node.func.value)}.{node.func.attr}") for p in _daemon() if p.name != "registry.py"
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LIFE_CALLS
             and not ast.unparse(node.func.value).endswith(("registry", "attempts"))}
    assert found == OTHER_RECEIVERS, f"moved or ended elsewhere than on the registry: {sorted(found - OTHER_RECEIVERS)}"


def test_no_module_but_the_registry_writes_an_attempts_book() -> None:
    """No item of a book is set or deleted, and no book is cleared or popped, outside ``Registry`` (a book is a
    read-only mapping to the rest: ``registry.Book``), the buddy's replicas' included."""
    def written(tree: ast.AST) -> list[str]:
        found = []
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            found += [t.value.attr for t in targets if isinstance(t, ast.Subscript)
                      and isinstance(t.value, ast.Attribute) and t.value.attr in BOOKS]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("clear", "pop", "popitem", "setdefault", "update")
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in BOOKS):
                found.append(node.func.value.attr)
        return found
    writers = {f"{p.relative_to(REPO).as_posix()}: {w}" for p in _daemon()
               if p.name != "registry.py" for w in written(ast.parse(p.read_text()))}
    assert not writers, f"books written outside the registry: {sorted(writers)}"


def test_only_the_registry_moves_a_snapshots_replication() -> None:
    """A held snapshot's second track (its copy on a peer, ``lifecycle.attempt.PeerCopy``, whose states are
    ``protocol.messages.ReplicationState``) moves along ``NEXT_REPLICATION`` through ``Registry.replicate`` only:
    no other module of the daemon assigns it (a snapshot starts with one: ``restored`` or ``adopted``)."""
    def assigned(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        return [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    movers = {p.relative_to(REPO).as_posix() for p in _daemon() for node in ast.walk(ast.parse(p.read_text()))
              for t in assigned(node) if isinstance(t, ast.Attribute) and t.attr == "copy"
              and not (isinstance(t.value, ast.Name) and t.value.id == "self")}
    assert movers == {"ckptd/lifecycle/registry.py"}, f"replication moved outside the registry: {sorted(movers)}"


READERS = ("export", "listing")
"""Daemon-side modules that read committed checkpoints through ``protocol/reading.py``."""
CHOOSERS = ("objects", "reading")
"""Protocol modules that tell a name on a store from a local one: the parser, and the reader stack's one choice."""


def _storage(node: ast.expr) -> bool:
    """Whether ``node`` names the daemon's ``Backends`` (``storage``, ``self.storage``)."""
    return (isinstance(node, ast.Name) and node.id == "storage"
            or isinstance(node, ast.Attribute) and node.attr == "storage")


def _binds(path: Path) -> list[str]:
    """Where ``path`` asks ``Backends`` for one backend (``bind``) or reaches through one to its ``files``
    (``….bind(p).files``, ``….backend.files``); ``Backends``' own ``files`` (each call on the backend its name is
    on) is neither."""
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and (
                node.attr == "bind" and _storage(node.value)
                or node.attr == "files" and (
                    isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                    and node.value.func.attr == "bind"
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "backend"))]


def test_an_attempt_is_bound_to_its_backend_once_where_it_is_made() -> None:
    """The lifecycle asks which backend a path is on only where an attempt is made (a rank's admission, a
    Finalize or Abort of ranks all on other nodes, a snapshot read back from a peer): the attempt keeps it
    (``Attempt.backend``), and its writes, commit, discard and removal go through that, never through
    ``Backends.bind`` again nor a backend's ``files``."""
    def asks(path: Path) -> list[str]:
        return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and (node.attr == "bind" or node.attr == "files"
                and not (isinstance(node.value, ast.Name) and node.value.id == "msg"))]
    found = sorted(a for p in sorted((REPO / "ckptd" / "lifecycle").glob("*.py")) for a in asks(p))
    assert [a.split(":")[0] for a in found] == ["admission.py", "commit.py", "holding.py", "saves.py"], found


def test_nothing_outside_storage_and_the_lifecycle_picks_a_backend() -> None:
    """Retention, the mirror, the sweep, listing, status and a buddy's drain call checkpoint operations on
    ``Backends`` and read through ``Backends.files``, which send each call to the backend its name is on: none
    of them binds one (``Backends.bind``) or reaches through one to its ``files``."""
    outside = [p for p in _daemon() if p.parent.name not in ("storage", "lifecycle")]
    found = sorted(a for p in outside for a in _binds(p))
    assert not found, f"a backend picked outside storage/ and the lifecycle's attempts: {found}"


def test_readers_never_ask_which_backend_a_name_is_on() -> None:
    """Loads, ``ckptd export`` and listings open shards and indexes through ``protocol/reading.py``
    (``files_for``, ``shard_reader``), which alone picks a local file or an object; a reader that asks
    ``is_object_path`` itself is a second, diverging read path."""
    readers = [*_sources("client"), *(_by_stem(name) for name in READERS),
               *(p for p in _sources("protocol") if p.stem not in CHOOSERS)]
    asking = {str(p.relative_to(REPO)) for p in readers if "is_object_path" in p.read_text()}
    assert not asking, f"read through protocol/reading.py instead of asking is_object_path: {sorted(asking)}"


def _runtime_imports(path: Path) -> set[str]:
    """What ``path`` imports when it runs: ``_imports`` less the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    for block in typing_only:
        block.body = []
    return _imports_of(tree, "ckptd.protocol")


def _imports_of(tree: ast.AST, package: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            found.update(f"{module}.{alias.name}" for alias in node.names)  # ``from ckptd import commit``
    return found


def _assert_no_cycle(edges: dict[str, set[str]]) -> None:
    """Fail naming the first import cycle in ``edges`` (module: the modules it imports)."""
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        assert name not in trail, f"import cycle: {' -> '.join(trail[trail.index(name):] + [name])}"
        if name not in done:
            for nxt in sorted(edges[name]):
                visit(nxt, trail + [name])
            done.add(name)

    for name in sorted(edges):
        visit(name, [])


def test_the_protocol_modules_import_one_another_without_a_cycle() -> None:
    """The reader stack sits on the shard readers, which sit on the checks (``protocol/shard_reads.py``), never
    back on the index or inspect modules that read through the stack: a cycle makes import order matter."""
    modules = {p.stem: p for p in _sources("protocol")}
    edges = {name: {m.split(".")[2] for m in _runtime_imports(path)
                    if m.startswith("ckptd.protocol.") and m.split(".")[2] in modules and m.split(".")[2] != name}
             for name, path in modules.items()}
    _assert_no_cycle(edges)


LAYERS = ("storage", "core", "tools", "upkeep", "lifecycle", "peers", "loop")
"""The daemon's role folders from the ground up (``docs/design.md``'s code map): storage (the seam), core (config,
events, replies, workers, stats, the peer keys file), the command line's tools, upkeep (retention, mirrors, sweeps),
the lifecycle (attempts, their pipelines and books), the peers (replicas, replication), and the roof, loop (the
server and the daemon process). A folder imports only folders before it; tools and upkeep share a level."""
LEVEL = {"storage": 0, "core": 1, "tools": 2, "upkeep": 2, "lifecycle": 3, "peers": 4, "loop": 5}
ROLES = LAYERS
MAX_TOP_LEVEL = 10


def test_the_daemon_is_grouped_by_role_without_an_import_cycle_or_a_folder_importing_the_level_above() -> None:
    """A newcomer finds the loop, the lifecycle, the storage, the upkeep and the tools by folder; no module of a
    role folder imports the top level (the face, the CLI), and no module imports itself back through others."""
    top = sorted(p.stem for p in (REPO / "ckptd").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"ckptd/ holds {len(top)} modules at its top level: {top}"
    folders = sorted(p.name for p in (REPO / "ckptd").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(ROLES), folders
    above = {f"ckptd.{name}" for name in top if name != "__init__"}
    bad = {f"{p.relative_to(REPO)}: {m}" for p in _daemon() if p.parent.name in ROLES for m in _imports(p)
           if m in above or m.startswith(tuple(f"{a}." for a in above))}
    assert not bad, f"a role folder imports the level above it: {sorted(bad)}"


def test_no_role_folder_imports_a_folder_above_it_or_beside_it() -> None:
    """The folders form a directed graph, ground to roof (``LAYERS``): every import counts, a function's or one
    under ``TYPE_CHECKING`` too, so a module can be read knowing only the folders below it, and a change to the
    loop cannot break the lifecycle."""
    assert set(LEVEL) == set(LAYERS)
    bad = set()
    for path in _daemon():
        here = path.parent.name
        if here not in LEVEL:
            continue
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == "ckptd" and len(parts) > 2 and parts[1] in LEVEL and parts[1] != here \
                    and LEVEL[parts[1]] >= LEVEL[here]:
                bad.add(f"{path.relative_to(REPO)}: {module}")
    assert not bad, f"a folder imports one above or beside it ({' < '.join(LAYERS)}): {sorted(bad)}"
    modules = {_dotted(p): p for p in _daemon() if p.stem != "__init__"}
    edges = {name: {m for m in modules if m != name and any(i == m or i.startswith(f"{m}.") for i in _imports(p))}
             for name, p in modules.items()}
    _assert_no_cycle(edges)


def test_the_storage_contract_imports_no_implementation_of_it() -> None:
    """``ckptd/storage/contract.py`` is the contract the implementations build on: importing one back is a cycle."""
    ours = {m for m in _imports(REPO / "ckptd" / "storage" / "contract.py")
            if m.startswith("ckptd.") and not m.startswith("ckptd.protocol")}
    assert not ours, f"ckptd/storage/contract.py must not import {ours}"


def test_starting_the_daemons_modules_loads_no_torch() -> None:
    code = ("import sys, ckptd.loop.server, ckptd.cli, ckptd.loop.daemon; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


NEEDS_NUMPY = frozenset({"numpy", "from_numpy", "gather_object", "all_gather_object", "broadcast_object_list",
                         "scatter_object_list", "send_object_list", "recv_object_list"})
"""Attributes whose use needs numpy: ``Tensor.numpy()``, ``torch.from_numpy`` and torch.distributed's object
collectives (they pickle into tensors through ``tensor.numpy()``)."""


def test_no_runtime_module_uses_numpy_which_ckptd_does_not_require() -> None:
    """torch installs and runs without numpy, where ``Tensor.numpy()`` raises "Numpy is not available"; ckptd
    requires no numpy, so none of its code may need it. ``make test`` has numpy (Lightning brings it): this
    reads the source, and ``make test-nonumpy`` runs the client's saves and loads where numpy is absent."""
    found = set()
    for p in [*_sources("client"), *_sources("protocol"), *_daemon(), *_sources("integrations")]:
        where = str(p.relative_to(REPO))
        for node in ast.walk(ast.parse(p.read_text(), where)):
            if isinstance(node, ast.Import):
                found |= {f"{where}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] == "numpy"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "numpy":
                found.add(f"{where}:{node.lineno}: from {node.module} import")
            elif isinstance(node, ast.Attribute) and node.attr in NEEDS_NUMPY:
                found.add(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not found, f"these need numpy, which ckptd does not require: {sorted(found)}"


REACTIONS = ("ckptd.upkeep.mirror", "ckptd.upkeep.retention", "ckptd.lifecycle.holding", "ckptd.core.metrics",
             "ckptd.core.stats")
"""Modules that react to a commit (they subscribe to ``ckptd/core/events.py``)."""


def test_the_modules_that_commit_import_none_of_the_modules_that_react_to_a_commit() -> None:
    committing = [_by_stem(name) for name in ("saves", "commit", "writer", "admission")]
    bad = {f"{p.name}: {m}" for p in committing for m in _imports(p) if m.startswith(REACTIONS)}
    assert not bad, f"a reaction to a commit subscribes to its event instead of being called by the pipeline: {bad}"


def test_every_package_folder_is_installed() -> None:
    """``setup.cfg`` lists every package a non-editable install must carry (``ckptd/peers`` once was missing: the
    editable install of ``make`` found it anyway, ``pip install ckptd`` would not have)."""
    import configparser
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    folders = {_package(p) for root in ("ckptd", *PACKAGES) for p in (REPO / root).rglob("__init__.py")}
    assert folders - listed == set(), f"setup.cfg [options] packages lacks {sorted(folders - listed)}"
