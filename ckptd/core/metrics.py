"""Prometheus metrics, opt-in: an HTTP endpoint or a node-exporter textfile.

The numbers are the ``ckptd status`` snapshot, taken from the node state on
the daemon's loop thread at each housekeeping (``--housekeeping-interval``),
then completed with free space and handed over whole (``update``) on the
status worker, so a scrape never reads the state mid-change. Names follow Prometheus conventions: base
units (bytes, seconds) and ``_total`` for counters.

``prometheus-client`` is only imported when metrics are asked for
(``pip install ckptd[metrics]``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

from ckptd.protocol.errors import CkptdError

log = logging.getLogger("ckptd")


def _peers(s: dict[str, Any]) -> dict[str, Any]:
    """The status's ``peers`` part (empty without ``--peer-keys``: its metrics are 0)."""
    return s.get("peers") or {}


def _buddy(s: dict[str, Any]) -> dict[str, Any]:
    return next((link for link in _peers(s).get("links", []) if link["buddy"]), {})


GAUGES = [
    ("ckptd_up", "1 while the daemon runs.", lambda s: 1),
    ("ckptd_uptime_seconds", "Seconds since the daemon started.", lambda s: s["daemon"]["uptime_s"]),
    ("ckptd_resident_memory_bytes", "Daemon resident memory.", lambda s: s["daemon"]["rss_bytes"]),
    ("ckptd_clients", "Training processes connected.", lambda s: len(s["clients"])),
    ("ckptd_write_slots", "Shard writes allowed at once on this node.", lambda s: s["writes"]["max_concurrent"]),
    ("ckptd_writes_in_progress", "Shards being written now.", lambda s: s["writes"]["writing"]),
    ("ckptd_writes_queued", "Shards waiting for a write slot.", lambda s: s["writes"]["queued"]),
    ("ckptd_write_throughput_bytes_per_second", "Current write rate over the shards being written.",
     lambda s: s["writes"]["throughput_bps"]),
    ("ckptd_checkpoints_in_progress", "Checkpoints not yet committed.", lambda s: len(s["checkpoints"])),
    ("ckptd_shm_mapped_bytes", "Client slot memory the daemon maps.", lambda s: s["shm_mapped_bytes"]),
    ("ckptd_load_leases_held", "Ranks holding a load lease.", lambda s: len(s["loads"]["held"])),
    ("ckptd_load_leases_waiting", "Ranks waiting for a load lease.", lambda s: len(s["loads"]["waiting"])),
    ("ckptd_memory_budget_bytes", "Node memory held snapshots may occupy.",
     lambda s: s["memory"]["budget_bytes"]),
    ("ckptd_memory_held_bytes", "Node memory held snapshots occupy.", lambda s: s["memory"]["held_bytes"]),
    ("ckptd_memory_snapshots", "Snapshots held in node memory.", lambda s: len(s["memory"]["snapshots"])),
    ("ckptd_memory_snapshots_unpersisted", "Snapshots held in node memory and not on disk.",
     lambda s: sum(1 for x in s["memory"]["snapshots"] if not x["persisted"])),
    ("ckptd_peers_connected", "Peers (--peer) whose last exchange was answered in time.",
     lambda s: sum(1 for link in _peers(s).get("links", []) if link["connected"])),
    ("ckptd_replication_lag_seconds", "For the newest snapshot replicated to the buddy, seconds from held here to "
     "held there (0 before the first).", lambda s: _buddy(s).get("lag_s") or 0),
    ("ckptd_replication_throughput_bytes_per_second", "The last stream to the buddy's rate (0 before the first).",
     lambda s: _buddy(s).get("bytes_per_second") or 0),
    ("ckptd_replication_streams_queued", "Snapshots waiting for or in their stream to the buddy.",
     lambda s: _peers(s).get("streams_queued", 0)),
    ("ckptd_replicas_held_bytes", "Node memory the replicas held for peers occupy (counted in the memory budget).",
     lambda s: _peers(s).get("replicas_held", {}).get("bytes", 0)),
    ("ckptd_replicas_held", "Complete replicas held for peers.",
     lambda s: len(_peers(s).get("replicas_held", {}).get("held", []))),
    ("ckptd_last_commit_seconds", "Duration of the last commit (first rank admitted to rename).",
     lambda s: (s["completed"]["last"] or {}).get("seconds", 0)),
    ("ckptd_last_commit_bytes", "Bytes of the last committed checkpoint.",
     lambda s: (s["completed"]["last"] or {}).get("bytes", 0)),
    ("ckptd_last_commit_timestamp_seconds", "Unix time of the last commit.",
     lambda s: (s["completed"]["last"] or {}).get("time", 0)),
]
COUNTERS = [
    ("ckptd_checkpoints_committed", "Checkpoints committed since start.", lambda s: s["completed"]["count"]),
    ("ckptd_written_bytes", "Bytes of committed checkpoints since start.", lambda s: s["completed"]["bytes"]),
    ("ckptd_checkpoints_failed", "Checkpoint attempts that failed since start (their ranks were told why).",
     lambda s: s["completed"]["failed"]),
    ("ckptd_errors", "Errors reported to clients since start.", lambda s: s["errors_total"]),
    ("ckptd_mirror_uploaded", "Checkpoints uploaded to their --mirror since start.",
     lambda s: s.get("mirror", {}).get("uploaded", 0)),
    ("ckptd_mirror_failed", "Mirror uploads that failed for good (a permanent error; the checkpoint stays local).",
     lambda s: s.get("mirror", {}).get("failed", 0)),
    ("ckptd_mirror_retries", "Mirror upload attempts that failed and were retried.",
     lambda s: s.get("mirror", {}).get("retries", 0)),
    ("ckptd_memory_snapshots_held", "Snapshots that became complete in node memory since start.",
     lambda s: s["memory"]["held_total"]),
    ("ckptd_memory_snapshots_dropped", "Held snapshots dropped from node memory since start.",
     lambda s: s["memory"]["dropped_total"]),
    ("ckptd_memory_snapshots_failed", "Snapshots that failed before they were held whole, since start.",
     lambda s: s["memory"]["failed_total"]),
    ("ckptd_replicated_bytes", "Bytes of snapshots replicated to the buddy since start.",
     lambda s: _peers(s).get("replicated_bytes_total", 0)),
    ("ckptd_replicated_sent_bytes", "Of those, bytes that crossed the link (the rest the buddy built from what it held).",
     lambda s: _peers(s).get("replicated_sent_bytes_total", 0)),
    ("ckptd_replicated_snapshots", "Snapshots replicated to the buddy since start.",
     lambda s: _peers(s).get("replicated_total", 0)),
    ("ckptd_replication_failures", "Snapshots whose replication failed since start (refused, or no answer).",
     lambda s: _peers(s).get("replication_failures_total", 0)),
    ("ckptd_replicas_dropped", "Replicas held for peers dropped since start (replaced, forgotten, or not received "
     "whole).", lambda s: _peers(s).get("replicas_held", {}).get("dropped_total", 0)),
    ("ckptd_replicas_adopted", "Replicas held for peers that a drain adopted since start (their origin gone).",
     lambda s: _peers(s).get("replicas_held", {}).get("adopted_total", 0)),
    ("ckptd_client_wait_seconds", "Seconds connected clients blocked on backpressure.",
     lambda s: sum(c["waited_s"] for c in s["clients"])),
]


class Metrics:
    """Serves or writes the latest snapshot; ``update`` runs on the daemon loop."""

    def __init__(self, *, port: int | None, addr: str, textfile: Path | None) -> None:
        """Raises ``CkptdError`` naming the port when it cannot be served (in use, bad address), or the textfile
        when it cannot be written (its directory read-only, or not one files can be made in): found at the start,
        not as a failure each second after it."""
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise CkptdError("metrics need the prometheus-client package: pip install 'ckptd[metrics]'") from None

        self.snapshot: dict[str, Any] | None = None
        self.textfile = textfile
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._unwritten: str | None = None
        """Why the textfile could not be written last time (logged once, until a write succeeds again)."""
        if textfile is not None:
            try:
                self._write(textfile)  # the first, empty until the first snapshot: a probe of the directory
            except OSError as exc:
                raise CkptdError(f"cannot write the metrics textfile {textfile}: {exc.strerror or exc}; choose "
                                 "another --metrics-textfile") from None
        if port is not None:
            try:
                start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                raise CkptdError(f"cannot serve metrics on {addr} port {port}: {exc.strerror or exc}; "
                                 "choose another --metrics-port (or --metrics-addr)") from None

    def update(self, snapshot: dict[str, Any]) -> None:
        """Take ``snapshot`` as the one scrapes read, and write the textfile: a write that fails (its directory
        made read-only or full after the start) is logged when it starts failing and when it writes again, not
        each second."""
        self.snapshot = snapshot
        if self.textfile is None:
            return
        try:
            self._write(self.textfile)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if why != self._unwritten:
                log.warning("event=metrics_textfile_failed path=%s error=%s", self.textfile, why)
            self._unwritten = why
            return
        if self._unwritten is not None:
            log.info("event=metrics_textfile_written path=%s", self.textfile)
            self._unwritten = None

    def _write(self, textfile: Path) -> None:
        from prometheus_client import write_to_textfile

        write_to_textfile(str(textfile), self.registry)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.snapshot
        if s is None:
            return
        for name, doc, value in GAUGES:
            yield GaugeMetricFamily(name, doc, value=value(s))
        for name, doc, value in COUNTERS:
            yield CounterMetricFamily(name, doc, value=value(s))
        free = GaugeMetricFamily("ckptd_root_free_bytes", "Free space on each root's filesystem.", labels=["root"])
        size = GaugeMetricFamily("ckptd_root_size_bytes", "Size of each root's filesystem.", labels=["root"])
        for r in s["roots"]:
            if r["free_bytes"] is not None:
                free.add_metric([r["path"]], r["free_bytes"])
                size.add_metric([r["path"]], r["total_bytes"])
        yield free
        yield size
