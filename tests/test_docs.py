"""The reference pages in docs/ say what the code does: the CLI's options, the metrics, the status keys.

The CLI and metrics tables are rendered from the code (``docs_reference.py``) and must equal the checked-in
ones; the status keys are written by hand and checked against a real daemon's status. (That every fenced
block of docs/*.md runs is ``test_readme.py``'s.)
"""

from __future__ import annotations

import re

import pytest
import torch

from ckptd.protocol.errors import PathNotAllowed
from docs_reference import CLI_PAGE, DOCS, METRICS_PAGE, REPO, cli_tables, metrics_table, regions, status_paths
from helpers import free_port, wait_until

STATUS_PAGE = DOCS / "status.md"
REGENERATE = "run `python tests/docs_reference.py` to rewrite it"


def test_the_cli_reference_is_the_parsers() -> None:
    """Every subcommand has its table, and each table lists exactly the parser's arguments, help and defaults."""
    assert regions(CLI_PAGE.read_text()) == cli_tables(), f"docs/cli.md differs from the parser: {REGENERATE}"


def test_the_metrics_reference_is_what_a_daemon_serves(daemon) -> None:
    body = regions(METRICS_PAGE.read_text()).get("metrics")
    assert body == metrics_table(daemon.status()), f"docs/metrics.md differs from ckptd/core/metrics.py: {REGENERATE}"


def _expand(path: str) -> set[str]:
    """``a.{b,c}.d`` -> ``{a.b.d, a.c.d}``."""
    braces = re.search(r"\{([^}]*)\}", path)
    if braces is None:
        return {path}
    return {p for choice in braces[1].split(",") for p in _expand(path[:braces.start()] + choice + path[braces.end():])}


def documented_status_paths() -> set[str]:
    """The key paths docs/status.md's table names (first column)."""
    rows = re.findall(r"^\| `([^`]+)` \|", STATUS_PAGE.read_text(), re.M)
    assert rows, "docs/status.md has no key table"
    return {p for row in rows for p in _expand(row)}


def _parent(path: str) -> str:
    return re.sub(r"(\[\])?\.?[^.\[\]]+$", "", path) if "." in path else ""


@pytest.mark.timeout(300)
def test_the_status_reference_names_every_key_of_a_real_status_and_no_other(
        daemon_factory, client_factory, root, bucket) -> None:
    """A daemon with every part of its status filled (a shard in flight, a snapshot held, an error, an s3://
    root, a mirror upload) reports exactly the keys docs/status.md names; a list or value it left empty
    (no load lease, no replica held for a peer: ``test_node_loss.py`` checks those) cannot show its keys, so
    those are only checked when present."""
    mirrored = root / "mirrored"
    mirrored.mkdir()
    keys = root / "peer-keys"  # peers on: the status shows them (and no peer is trusted)
    keys.write_text("")
    daemon = daemon_factory("--root", f"s3://{bucket}/direct", "--mirror", f"{mirrored}=s3://{bucket}/mirror",
                            "--peer-keys", str(keys), "--peer-listen", f"tcp://127.0.0.1:{free_port()}",
                            faults=[{"op": "fsync", "match": "slow", "errno": 0, "delay": 5.0}])
    client = client_factory(max_inflight=4)
    state = {"w": torch.ones(1000)}
    client.save_async(state, root / "snap", step=1, persist=False).result(60)
    client.save_async(state, mirrored / "step-1", step=1).result(60)
    with pytest.raises(PathNotAllowed):
        client.save_async(state, root.parent / "outside", step=1).result(60)
    slow = client.save_async(state, root / "slow", step=2)
    wait_until(lambda: daemon.status()["saves"], timeout=60, what="the slow shard in flight")
    observed = status_paths(daemon.status())
    slow.result(120)
    wait_until(lambda: daemon.status()["mirror"]["uploaded"] == 1, timeout=60, what="the mirror upload")
    observed |= status_paths(daemon.status())  # the finished upload's entry in mirror.recent

    documented = documented_status_paths()
    assert not observed - documented, f"docs/status.md lacks {sorted(observed - documented)}"
    filled = {_parent(p) for p in observed}
    stale = {p for p in documented - observed if _parent(p) in filled}
    assert not stale, f"docs/status.md names {sorted(stale)}, which a daemon's status does not hold"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_reaches_a_file_and_a_heading() -> None:
    """The README, docs/ and deploy/'s READMEs link to each other's sections: a renamed heading or moved page breaks
    no link."""
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md")), *sorted((REPO / "deploy").glob("*/README.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} does not exist")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(REPO)}: {target}#{anchor} names no heading there")
    assert not broken, "\n".join(broken)


EPHEMERAL = range(32768, 61000)
"""Linux's default ``net.ipv4.ip_local_port_range``: an outgoing connection may hold any of these ports, so a
daemon told to listen on one may find it taken."""
PORTS = re.compile(r"tcp://[^\s:/`'\"]+:(\d+)|[Pp]ort:\s*\"?(\d+)|PEER_PORT\D{0,12}(\d{4,5})|ports? (\d{4,5})")


def test_every_example_port_and_its_data_port_lie_below_the_ephemeral_range() -> None:
    """The peer ports the docs and deployment files give (and each one's data port, the peer port + 1) are ports a
    user copies: each must be free to listen on, never one the kernel hands to outgoing connections."""
    pages = [REPO / "README.md", *DOCS.glob("*.md"), *(p for p in (REPO / "deploy").rglob("*") if p.is_file())]
    found = {(page.relative_to(REPO).as_posix(), int(port)) for page in pages
             for match in PORTS.finditer(page.read_text(errors="replace")) for port in match.groups() if port}
    assert found, "no example port found: the pattern no longer matches the docs"
    assert not [(page, port) for page, port in sorted(found) if {port, port + 1} & set(EPHEMERAL)], sorted(found)
