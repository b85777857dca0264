"""``ckptd status`` as a person reads it."""

from __future__ import annotations

import time
from typing import Any


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def printable(text: str) -> str:
    """``text`` with control characters (newline, escape...) and undecodable bytes escaped.

    A file name may hold any byte but ``/`` and NUL; printed raw, a newline
    would fake a row of ``ckptd list`` and an escape sequence would rewrite
    the terminal.
    """
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def progress_bar(fraction: float, width: int = 24) -> str:
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def render_status(info: dict[str, Any]) -> str:
    d = info["daemon"]
    lines = [
        f"ckptd {d['version']}  pid {d['pid']}  up {d['uptime_s']:.0f} s  rss {human_bytes(d['rss_bytes'])}"
        f"  cpu {d['cpu_percent']:.0f}%{'  DRAINING' if d['draining'] else ''}",
        f"endpoint {d['endpoint']}",
        f"clients {len(info['clients'])}: " + (", ".join(
            f"pid {c['pid']} ({c['saves']} saves, waited {c['waited_s']:.2f} s)" for c in info["clients"]) or "none"),
        f"writes: {info['writes']['writing']} writing, {info['writes']['queued']} queued "
        f"(max {info['writes']['max_concurrent']})   shared memory mapped {human_bytes(info['shm_mapped_bytes'])}",
    ]
    if info["checkpoints"]:
        lines.append("in progress:")
        for c in info["checkpoints"]:
            lines.append(
                f"  {printable(c['path'])}  step {c['step']}  {c['state']}  ranks durable {c['ranks_durable']}/{c['world_size']}"
                f"  {c['elapsed_s']:.1f} s"
            )
            for s in (s for s in info["saves"] if s["path"] == c["path"]):
                frac = s["written"] / s["bytes"] if s["bytes"] else 1.0
                lines.append(
                    f"    rank {s['rank']:<5} {s['state']:<8} {progress_bar(frac)} {100 * frac:5.1f}% of "
                    f"{human_bytes(s['bytes'])}  waited {s['waited_s']:.2f} s"
                )
        rate = info["writes"].get("throughput_bps")
        if rate:
            lines.append(f"  writing at {rate / 1e9:.2f} GB/s")
    else:
        lines.append("in progress: nothing")
    mirror = info.get("mirror")
    if mirror:
        lines.append(f"mirror: {mirror['uploaded']} uploaded, {mirror['failed']} failed, {mirror['retries']} retries")
        for u in mirror["uploads"]:
            frac = u["sent"] / u["total"] if u["total"] else 0.0
            lines.append(f"  {printable(u['source'])} -> {printable(u['dest'])}  {u['state']} (attempt {u['attempts']})  "
                         f"{progress_bar(frac)} {100 * frac:5.1f}%  {u['throughput_bps'] / 1e6:.0f} MB/s"
                         + (f"  last error: {printable(u['error'])}" if u["error"] else ""))
        for u in mirror.get("unmirrored", []):
            lines.append(f"  UNMIRRORED {printable(u['source'])} -> {printable(u['dest'])}  failed: "
                         f"{printable(u['error'] or '?')} (kept locally; retried at the next start)")
    loads = info.get("loads") or {}
    if loads.get("held") or loads.get("waiting"):
        lines.append(f"loads: {len(loads['held'])} holding a lease, {len(loads['waiting'])} waiting"
                     f" (default limit {loads['default_limit']})")
    mem = info.get("memory")
    if mem:
        lines.append(f"memory snapshots: {human_bytes(mem['held_bytes'])} held of a {human_bytes(mem['budget_bytes'])}"
                     f" budget (keep {mem['keep_snapshots']} per directory)"
                     + (f"; {mem['failed_total']} failed" if mem.get("failed_total") else ""))
        for s in mem["snapshots"]:
            where = "memory + disk" if s["persisted"] else ("persisting" if s["persisting"] else "memory only")
            replica = "" if s.get("replication", "off") == "off" else f"  replica: {s['replication']}"
            if s.get("replication_lag_s") is not None:
                replica += f" (lag {s['replication_lag_s']:.2f} s)"
            lines.append(f"  {printable(s['path'])}  step {s['step']}  {human_bytes(s['bytes'])}  ranks held "
                         f"{len(s['ranks_held'])}/{s['world_size']}  {where}{replica}")
    peers = info.get("peers")
    if peers:
        held = peers["replicas_held"]
        lines.append(f"peers: listening on {peers['listen'] or 'nothing'}, buddy {peers['buddy'] or 'none'}; "
                     f"replicas held for others: {len(held['held'])} ({human_bytes(held['bytes'])}), "
                     f"{held['receiving']} arriving"
                     + (f"; spare files {human_bytes(held['spare_bytes'])}" if held.get("spare_bytes") else ""))
        if "replicated_total" in peers:
            lines.append(f"  replicated: {peers['replicated_total']} snapshots "
                         f"({human_bytes(peers['replicated_bytes_total'])}), "
                         f"{peers['replication_failures_total']} failed")
        for link in peers.get("links", []):
            lines.append(f"  {'buddy' if link['buddy'] else 'peer '} {printable(link['endpoint'])}  "
                         f"{_link_state(link)}"
                         + (f"  {human_bytes(link['bytes_per_second'])}/s" if link["bytes_per_second"] else "")
                         + (f"  lag {link['lag_s']:.2f} s" if link["lag_s"] is not None else "")
                         + (f"  last error: {printable(link['last_error'])}" if link["last_error"]
                            and not link["connected"] else ""))
        for r in held["held"]:
            lines.append(f"  {printable(r['path'])}  step {r['step']}  {human_bytes(r['bytes'])}  ranks "
                         f"{r['ranks_held']}  from {printable(r.get('origin_endpoint') or r['origin'][:8] + '…')}")
    done = info["completed"]
    last = done["last"]
    lines.append(f"completed: {done['count']} checkpoints, {human_bytes(done['bytes'])}"
                 + (f"; {done['failed']} failed" if done.get("failed") else ""))
    if last:
        rate = f"{last['gbps']:.2f} GB/s" if last["gbps"] else "?"
        lines.append(f"  last: {printable(last['path'])} step {last['step']}  {human_bytes(last['bytes'])} in {last['seconds']:.2f} s ({rate})")
    for r in info["roots"]:
        lines.append(f"root {r['path']}: " + ("object store (free space: not applicable)" if r.get("object_store") else
                                               f"{human_bytes(r['free_bytes'])} free of {human_bytes(r['total_bytes'])}"))
    shm = info.get("shm")
    if shm:
        lines.append(f"shared memory {shm['dir']}: {human_bytes(shm['free_bytes'])} free of "
                     f"{human_bytes(shm['total_bytes'])}")
    if info["errors"]:
        lines.append("recent errors:")
        for e in info["errors"][-5:]:
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {printable(e['message'])}")
    return "\n".join(lines)


def _link_state(link: dict[str, Any]) -> str:
    """A peer link's state in words: never asked, answering (and so authenticated), or not answering."""
    if link["connected"] is None:
        return "not contacted yet"
    if link["connected"]:
        return "connected, authenticated"
    return "NOT ANSWERING" + (" (answered before)" if link["authenticated"] else "")
