"""The parts of docs/ that follow from the code, rendered from it: the CLI's options (from the parser in
``ckptd/cli.py``, whose ``start`` options come from ``ckptd/tools/options.py``) and the Prometheus metrics (what
``ckptd/core/metrics.py`` serves for a real daemon's status), plus the key paths of a ``status --json`` document.

A page holds each rendered table between ``<!-- begin: NAME -->`` and ``<!-- end: NAME -->``;
``tests/test_docs.py`` checks that the checked-in tables equal these, so a new option or metric cannot go
undocumented and a removed one cannot linger. ``python tests/docs_reference.py`` rewrites them (it starts
a daemon for the metrics).
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path
from typing import Any

from ckptd.cli import _parser

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
CLI_PAGE = DOCS / "cli.md"
METRICS_PAGE = DOCS / "metrics.md"
REGION = re.compile(r"<!-- begin: (?P<name>[^>]+?) -->\n(?P<body>.*?)<!-- end: (?P=name) -->", re.S)


def regions(text: str) -> dict[str, str]:
    """Every ``<!-- begin: NAME -->`` ... ``<!-- end: NAME -->`` region of a page, by name."""
    return {m["name"]: m["body"] for m in REGION.finditer(text)}


def with_regions(text: str, bodies: dict[str, str]) -> str:
    """``text`` with each named region's body replaced (regions not in ``bodies`` are left as they are)."""
    return REGION.sub(lambda m: f"<!-- begin: {m['name']} -->\n{bodies.get(m['name'], m['body'])}"
                                f"<!-- end: {m['name']} -->", text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _usage(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.dest.upper()
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return flag
    if action.choices is not None:
        return f"{flag} {{{','.join(map(str, action.choices))}}}"
    return f"{flag} {action.metavar or action.dest.upper()}"


def _meaning(action: argparse.Action) -> str:
    meaning = action.help or ""
    default = action.default
    if action.nargs != 0 and default not in (None, "", argparse.SUPPRESS) and "default" not in meaning:
        meaning += f" (default {default:g})" if isinstance(default, float) else f" (default {default})"
    if isinstance(action, argparse._AppendAction):
        meaning += "; repeatable" if "repeatable" not in meaning else ""
    return meaning


def cli_tables() -> dict[str, str]:
    """One table per ``ckptd`` subcommand: its arguments and options, as the parser defines them."""
    subcommands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    tables: dict[str, str] = {}
    for name, sub in subcommands.choices.items():
        rows = [f"| `{_cell(_usage(a))}` | {_cell(_meaning(a))} |" for a in sub._actions
                if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        tables[f"ckptd {name}"] = "| argument | meaning |\n| --- | --- |\n" + "\n".join(rows) + "\n"
    return tables


def metrics_table(status: dict[str, Any]) -> str:
    """The metrics a daemon with ``status`` serves: name (with labels), type and help, in exposition order."""
    from prometheus_client import generate_latest

    from ckptd.core.metrics import Metrics

    metrics = Metrics(port=None, addr="", textfile=None)
    metrics.update(status)
    text = generate_latest(metrics.registry).decode()
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    rows = []
    for family, kind in types.items():
        labels = sorted(set(re.findall(rf"^{re.escape(family)}\{{(\w+)=", text, re.M)))
        name = family + (f"{{{','.join(labels)}}}" if labels else "")
        rows.append(f"| `{name}` | {kind} | {_cell(helps[family])} |")
    return "| metric | type | meaning |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"


def status_paths(doc: Any, prefix: str = "") -> set[str]:
    """Every key path of a status document: ``daemon.pid``, ``saves[].state`` for a list's entries.
    A dict keyed by data (``mirror.rules``: directory to prefix) counts as a leaf."""
    paths: set[str] = set()
    if isinstance(doc, dict) and not any(k.startswith("/") for k in doc):
        for key, value in doc.items():
            path = f"{prefix}.{key}" if prefix else key
            paths |= {path} | status_paths(value, path)
    elif isinstance(doc, list):
        for entry in doc:
            if isinstance(entry, dict):
                paths |= status_paths(entry, prefix + "[]")
    return paths


def main() -> None:
    from helpers import short_tempdir, start_daemon  # beside this file, so on the path when it runs as a script

    run_dir, root = short_tempdir("ckdocs-"), short_tempdir("ckdocs-root-")
    daemon = start_daemon(run_dir, root)
    try:
        status = daemon.status()
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    for page, bodies in ((CLI_PAGE, cli_tables()), (METRICS_PAGE, {"metrics": metrics_table(status)})):
        page.write_text(with_regions(page.read_text(), bodies))
        print(f"{page.relative_to(REPO)}: {', '.join(bodies)}")


if __name__ == "__main__":
    main()
