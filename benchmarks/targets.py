"""The issue's targets, evaluated from the measurements, each with its ratio.

A target is met when the measured ratio is within its bound. Where one is
missed, ``why`` says what the measurements show about the cause and what
would close the gap; the sentence is built from the same numbers.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .multi import MultiSection
    from .save import SaveSection
    from .scaling import ScalePoint

MB = 10**6
CORES = os.cpu_count() or 1
SYNC_BLOCKING = 1.2
BG_BLOCKING_S = 0.010
BG_STAGED = 1.5
DURABLE_VS_DIRECT = 1.15
DURABLE_VS_DCP = 0.5
TRAINER_EXTRA = 1.05
DAEMON_ANON = 100 * MB
MULTI_BW = 0.85


@dataclass
class Target:
    name: str
    measured: str
    ratio: float | None
    bound: str
    met: bool | None
    why: str = ""

    @property
    def ratio_text(self) -> str:
        return "–" if self.ratio is None else f"{self.ratio:.2f} (bound {self.bound})"


def _med(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def evaluate(save: "SaveSection | None", multi: "MultiSection | None", scaling: "list[ScalePoint] | None",
             daemon_anon_peaks: list[tuple[str, int]]) -> list[Target]:
    out: list[Target] = []
    if save is not None:
        out += _save_targets(save, scaling)
    if daemon_anon_peaks:
        where, peak = max(daemon_anon_peaks, key=lambda x: x[1])
        r = peak / DAEMON_ANON
        out.append(Target(
            "daemon RSS outside the mapped slots (RssAnon) ≤ 100 MB",
            f"peak RssAnon {peak / MB:.1f} MB (in: {where}; highest over "
            f"{len(daemon_anon_peaks)} phases)", r, "≤ 1", r <= 1,
            why=f"the daemon's private memory reached {peak / MB:.0f} MB; RssAnon excludes the mapped slots, so "
                "this is buffers and Python objects of the daemon itself: look for per-save copies or caches "
                "that grow with the shard size."))
    if multi is not None:
        single_bw = multi.total_bytes / 1e9 / multi.raw_single.median
        for lay in multi.layouts:
            r = lay.gbps / single_bw
            blocking = lay.blocking.median
            durable = lay.durable.median
            cpu = ""
            if lay.daemon_cpu and lay.ranks_cpu:
                cpu = (f" In a round the ranks used {statistics.median(lay.ranks_cpu):.2f} CPU-s together and the "
                       f"daemon {statistics.median(lay.daemon_cpu):.2f}, on a machine with "
                       f"{lay.aggregate.median * CORES:.2f} core-seconds in the window ({CORES} cores).")
            out.append(Target(
                f"{multi.ranks} clients × {multi.per_rank_bytes / (1 << 30):.2f} GiB at once ({lay.what}): "
                "aggregate ≥ 85% of raw O_DIRECT bandwidth",
                f"{lay.gbps:.2f} GB/s vs raw {single_bw:.2f} GB/s ({lay.aggregate.median:.3f} s for "
                f"{lay.nbytes / (1 << 30):.2f} GiB)", r, "≥ 0.85", r >= MULTI_BW,
                why=f"the aggregate window ({lay.aggregate.median:.3f} s) includes {multi.ranks} ranks staging "
                    f"at once on the machine's cores (per-rank blocking median {blocking:.3f} s, each rank durable "
                    f"after {durable:.3f} s) before the daemon's writes (2 at a time) can finish; the raw write of "
                    f"the same bytes takes {multi.raw_single.median:.3f} s.{cpu} The copies and the daemon's "
                    "checksums compete for the same cores; less CPU per byte (no second pass for the checksum, "
                    "or a checksum folded into the copy) would close it."))
    if scaling:
        out += _scaling_targets(scaling)
    return out


def _save_targets(s: "SaveSection", scaling: "list[ScalePoint] | None" = None) -> list[Target]:
    out: list[Target] = []
    mem, direct = s.memcpy.median, s.direct.median
    sync, bg, dcp = s.method("ckptd_sync"), s.method("ckptd_bg"), s.method("dcp_process")
    stager = s.method("dcp_process_stager")
    if sync is not None:
        b = sync.returned.median
        r = b / mem
        bd = sync.extra.get("breakdown") or {}
        fl, lay, st = _med(bd.get("flatten")), _med(bd.get("layout")), _med(bd.get("stage"))
        daemon = _med(sync.extra.get("daemon"))
        accepted = sync.durable.median - daemon if daemon else None
        cpu = (f" During the timed saves the daemon used {sync.writer_cpu:.2f} CPU-s per save and the trainer "
               f"{sync.trainer_cpu:.2f}." if sync.writer_cpu is not None and sync.trainer_cpu is not None else "")
        alone = ""
        if fl is not None and lay is not None and st is not None:
            alone = (f"Measured alone in the same process, with the daemon idle: `flatten` {fl * 1000:.1f} ms, "
                     f"`layout_for` {lay * 1000:.1f} ms, the copy into a pre-faulted slot (`stage`) {st:.3f} s "
                     f"({st / mem:.2f}× the memcpy). ")
        if accepted is not None and accepted < b - 0.02:
            cause = (f"The daemon accepted the commit {accepted:.3f} s after the call, {b - accepted:.3f} s before "
                     "the copy ended, so it wrote and checksummed the slot while the trainer was still copying "
                     f"into it.{cpu} {alone}"
                     + (f"So about {b - st - (fl or 0) - (lay or 0):.3f} s of the blocking time is the copy slowed "
                        f"by sharing this machine's {CORES} cores and its memory bandwidth with the daemon. "
                        if st is not None else "")
                     + "Closing it on a machine without spare cores needs the daemon's CPU work (checksum, write "
                     "submission) kept off the cores of a synchronous copy: stream only with background staging "
                     "or when a core is free, or checksum after the copy.")
        else:
            rest = b - (fl or 0) - (lay or 0) - (st or 0)
            cause = (f"{alone}The remaining {rest * 1000:.0f} ms is the client's protocol and bookkeeping "
                     f"around the copy.{cpu} Closing it needs the non-copy part under "
                     f"{max(0.0, SYNC_BLOCKING * mem - (st or mem)) * 1000:.0f} ms.")
        out.append(Target(
            "blocking with sync staging ≤ 1.2 × memcpy into a reused buffer",
            f"{b:.3f} s vs memcpy {mem:.3f} s", r, "≤ 1.2", r <= SYNC_BLOCKING,
            why=f"save_async blocked {b:.3f} s against {mem:.3f} s for the memcpy loop. {cause}"))
    breakdown = (sync.extra.get("breakdown") or {}) if sync is not None else {}
    flatten_s = _med(breakdown.get("flatten"))
    if bg is not None:
        b = bg.returned.median
        fl = (f"`flatten` of this state alone takes {flatten_s * 1000:.1f} ms (measured in the sync worker); "
              if flatten_s is not None else "")
        out.append(Target("background staging: blocking ≤ 10 ms", f"{b * 1000:.1f} ms", b / BG_BLOCKING_S,
                          "≤ 1", b <= BG_BLOCKING_S,
                          why=f"save_async returned after {b * 1000:.1f} ms; {fl}whatever the call does on the "
                              "caller's thread before handing off (flattening and checking the state) would have "
                              "to move to the staging thread or be cached for an unchanged structure."))
        st = bg.staged.median
        r = st / mem
        alone = _med(breakdown.get("stage"))
        bg_daemon = _med(bg.extra.get("daemon"))
        bg_accepted = bg.durable.median - bg_daemon if bg_daemon else None
        if bg_accepted is not None and bg_accepted < st - 0.02:
            cause = (f"the daemon accepted the save {bg_accepted:.3f} s after the call and wrote while the copy ran"
                     + (f" (it used {bg.writer_cpu:.2f} CPU-s per save)" if bg.writer_cpu is not None else "")
                     + (f"; the copy alone, with the daemon idle, takes {alone:.3f} s" if alone else "")
                     + f". On {CORES} cores the copy shares the CPU and memory bandwidth with the daemon; keeping "
                     "the daemon's CPU work off the copy's cores would close it.")
        elif sync is not None and alone is not None:
            cause = (f"{st - alone:.3f} s more than the copy alone takes with the daemon idle ({alone:.3f} s). The "
                     "difference is the per-save work around the copy (laying out the header, the messages to the "
                     "daemon, taking a slot) and the copy running on the staging thread, not broken down further; "
                     f"synchronous staging does the same work in {sync.returned.median:.3f} s. The daemon was not "
                     "writing meanwhile: it "
                     "accepted the save after the copy. Closing it needs the copy at the memcpy's speed and that "
                     f"per-save work under {max(0.0, BG_STAGED * mem - mem) * 1000:.0f} ms.")
        else:
            cause = "see the breakdown of sync staging's blocking time."
        out.append(Target("background staging: staged within 1.5 × memcpy", f"{st:.3f} s vs memcpy {mem:.3f} s",
                          r, "≤ 1.5", r <= BG_STAGED,
                          why=f"the staging thread needed {st:.3f} s ({r:.2f}× the memcpy), {cause}"))
    if sync is not None:
        d = sync.durable.median
        r = d / direct
        after = d - sync.returned.median
        daemon = _med(sync.extra.get("daemon"))
        dtext = f"; the daemon's own accepted-to-committed time is {daemon:.3f} s" if daemon else ""
        bg_text = f" (background staging: {bg.durable.median:.3f} s, {bg.durable.median / direct:.2f}×)" if bg else ""
        serial = ""
        accepted = d - daemon if daemon else None
        if accepted is not None and accepted < sync.returned.median - 0.02:
            serial = (f" The daemon accepted the commit {accepted:.3f} s after the call and committed {daemon:.3f} s "
                      f"later ({daemon / direct:.2f}× the raw write): writing overlaps the copy, so durable is "
                      f"bounded by the slower of the two, and on {CORES} cores each slows the other. A daemon write at "
                      "the raw speed while the copy runs on cores of its own would reach the target.")
        elif daemon and abs(sync.returned.median + daemon - d) <= 0.1 * d:
            serial = (f" Blocking + the daemon's time = {sync.returned.median + daemon:.3f} s ≈ durable: staging and "
                      "writing run one after the other, so durable exceeds the raw write by about the staging "
                      "time; having the daemon write each part of the slot as soon as it is staged would bring "
                      "durable towards max(staging, write).")
            stream = s.method("ckptd_sync_stream")
            if stream is not None:
                serial += (f" The client's opt-in `stream_commit=True` does that: measured here, durable after "
                           f"{stream.durable.median:.3f} s ({stream.durable.median / direct:.2f}× the raw write), "
                           f"but the caller blocked {stream.returned.median:.3f} s "
                           f"({stream.returned.median / mem:.2f}× the memcpy) because the copy shares the cores with "
                           "the daemon's write and checksum (on a machine with cores to spare that contention would "
                           "shrink; not measured here).")
            if bg is not None:
                serial += (f" With background staging the save is durable after {bg.durable.median:.3f} s "
                           f"({bg.durable.median / direct:.2f}×).")
        elif after > DURABLE_VS_DIRECT * direct:
            serial = (" The part after the call returns is itself slower than the raw write: the daemon's write "
                      "path (checksum, index, renames, fsyncs) costs more than one O_DIRECT pass.")
        same = ""
        if scaling:
            near = min(scaling, key=lambda p: abs(p.nbytes - s.nbytes))
            if abs(near.nbytes - s.nbytes) <= 0.1 * s.nbytes:
                same = (f"; in the scaling section, with the raw write measured in the same process seconds "
                        f"before, {near.durable.median / near.direct.median:.2f}×")
        out.append(Target(
            "time to durable ≤ 1.15 × raw O_DIRECT write + fsync (sync staging)",
            f"{d:.3f} s vs raw {direct:.3f} s{bg_text}{same}", r, "≤ 1.15", r <= DURABLE_VS_DIRECT,
            why=f"durable = staging ({sync.returned.median:.3f} s, the caller blocked) + what follows "
                f"({after:.3f} s, {after / direct:.2f}× the raw write){dtext}.{serial}"))
        if dcp is not None:
            dd = dcp.durable.median
            r2 = d / dd
            stager_txt = ""
            if stager is not None:
                stager_txt = (f"; against DCP PROCESS with a reused DefaultStager ({stager.durable.median:.3f} s) "
                              f"the ratio is {d / stager.durable.median:.2f}")
            out.append(Target(
                "time to durable ≤ 0.5 × DCP async_save (PROCESS) time to durable",
                f"{d:.3f} s vs DCP PROCESS {dd:.3f} s{stager_txt}", r2, "≤ 0.5", r2 <= DURABLE_VS_DCP,
                why=f"ckptd needs {d:.3f} s and DCP's PROCESS checkpointer {dd:.3f} s on this disk; below "
                    f"{0.5 * dd:.3f} s would need ckptd's durable time closer to the raw write "
                    f"({direct:.3f} s) — see the target above."))
    extras = [(m, m.trainer_extra) for m in (sync, bg) if m is not None]
    if extras:
        m, extra = max(extras, key=lambda x: x[1])
        r = extra / s.nbytes
        shard = m.extra.get("bytes_written") or s.nbytes
        slot = -(-shard // (1 << 20)) * (1 << 20)
        beyond = extra - slot
        out.append(Target(
            "trainer extra memory ≤ 1.05 × state size",
            f"{extra / (1 << 30):.3f} GiB over a {s.nbytes / (1 << 30):.3f} GiB state ({m.what}; peak RSS during "
            "the timed saves minus RSS with the state built)", r, "≤ 1.05", r <= TRAINER_EXTRA,
            why=f"the slot holds the shard ({shard / (1 << 20):.1f} MiB with its header) rounded up to whole MiB: "
                f"{slot / (1 << 20):.0f} MiB, {slot / s.nbytes:.3f}× the state; the other "
                f"{beyond / (1 << 20):.1f} MiB of the peak is what the client allocates around a save (flattened "
                "names, packed structure, header, Python objects) and what the allocator keeps. For small states "
                "the whole-MiB rounding and the fixed header alone exceed 5%."))
    return out


def _scaling_targets(points: "list[ScalePoint]") -> list[Target]:
    from .scaling import COLLAPSE, size_label

    base = min(points, key=lambda p: abs(p.size_gib - 1.0))
    big = [p for p in points if p.size_gib > base.size_gib]
    if not big:
        return []
    out = []
    for label, attr in (("blocking", "blocking"), ("durable", "durable")):
        per = {p.size_gib: getattr(p, attr).median / p.gib for p in points}
        worst = max(big, key=lambda p: per[p.size_gib])
        r = per[worst.size_gib] / per[base.size_gib]
        listing = ", ".join(f"{size_label(p.size_gib)} {per[p.size_gib]:.3f}" for p in points)
        out.append(Target(
            f"scaling, {label}: no collapse up to {size_label(points[-1].size_gib)} (s/GiB within {COLLAPSE}× "
            f"of {size_label(base.size_gib)})",
            f"s/GiB: {listing}", r, f"≤ {COLLAPSE}", r <= COLLAPSE,
            why=f"{label} time per GiB at {size_label(worst.size_gib)} is {r:.2f}× that at "
                f"{size_label(base.size_gib)}; the limits at the same size (memcpy {worst.memcpy.median / worst.gib:.3f}"
                f" s/GiB, O_DIRECT {worst.direct.median / worst.gib:.3f} s/GiB) show whether the machine or "
                "ckptd slows down."))
    return out
