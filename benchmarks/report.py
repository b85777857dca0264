"""Turning the sections' measurements into printed tables and ``RESULTS.md``.

Every save is reduced to what the trainer cares about (how long the caller
is blocked, when the tensors may change, when the checkpoint is durable,
how much memory it costs) and set against its machine limit (a memcpy into
a reused buffer, a raw O_DIRECT write + fsync of the same bytes) and
against each peer. Loads are set against a raw sequential read of the same
file in the same cache state. The closing sentences and the targets are
generated from the same numbers, so they cannot drift from the tables.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from .loading import LoadSection
from .measure import QUIET_CORES, QUIET_WINDOW_S, MemPeak, QuietLog, Series
from .multi import MultiSection
from .save import SaveSection
from .scaling import COLLAPSE, ScalePoint, size_label
from .targets import Target

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class Machine:
    """What the numbers were measured on."""

    date: str
    cpu: str
    cores: int
    ram_gib: float
    shm_gib: float
    kernel: str
    python: str
    torch: str
    scratch: Path
    scratch_fs: str
    load: tuple[float, float, float]
    """1/5/15-minute load average at the start: other work on two cores shows up in the numbers."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def filesystem_of(path: Path) -> str:
    """``fstype on mountpoint (device)`` of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best.mountpoint)):
            best = part
    return f"{best.fstype} on {best.mountpoint} ({best.device})" if best else "unknown"


def library_line() -> str:
    """ckptd's version and the repository commit it was measured at (the library changes often)."""
    import subprocess

    import ckptd

    repo = Path(__file__).resolve().parent.parent
    line = f"ckptd {ckptd.__version__}"
    try:
        head = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h %ad %s", "--date=iso", "--",
                               "client", "ckptd", "protocol"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "client", "ckptd", "protocol"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if head:
            sha, _, rest = head.partition(" ")
            line += f", library last changed in commit {sha} ({rest[:25].strip()}: “{rest[26:].strip()[:80]}”)"
            line += "; library files modified since" if dirty else "; library files as committed"
    except (OSError, subprocess.SubprocessError):
        pass
    return line


def describe_machine(scratch: Path) -> Machine:
    return Machine(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        cpu=_cpu_model(),
        cores=os.cpu_count() or 0,
        ram_gib=psutil.virtual_memory().total / GIB,
        shm_gib=shutil.disk_usage("/dev/shm").total / GIB,
        kernel=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
        torch=torch.__version__,
        scratch=scratch,
        scratch_fs=filesystem_of(scratch),
        load=os.getloadavg(),
    )


# --- formatting ----------------------------------------------------------------


def f3(x: float | None) -> str:
    return "–" if x is None or x != x else f"{x:.3f}"


def f2(x: float | None) -> str:
    return "–" if x is None or x != x else f"{x:.2f}"


def gib(n: int | float | None) -> str:
    return "–" if n is None else f"{n / GIB:.2f}"


def mib(n: int | float | None) -> str:
    return "–" if n is None else f"{n / MIB:.0f}"


def cores(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def render_text(cells: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join([":---"] + ["---:"] * (len(cells[0]) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    return "\n".join(lines)


@dataclass
class Block:
    """A titled part of the report: prose and tables, in order."""

    title: str
    parts: list[str | list[list[str]]]

    def markdown(self) -> str:
        out = [f"## {self.title}", ""]
        for p in self.parts:
            out += [render_markdown(p) if isinstance(p, list) else p, ""]
        return "\n".join(out)

    def text(self) -> str:
        out = [f"== {self.title} =="]
        for p in self.parts:
            if isinstance(p, list):
                out += [render_text(p), ""]
        return "\n".join(out)


# --- save ----------------------------------------------------------------------


def save_blocks(s: SaveSection, chart: str | None) -> list[Block]:
    n, mem, direct = s.nbytes, s.memcpy.median, s.direct.median

    def row(what: str, b: Series | None, st: Series | None, d: Series | None, others: float | None) -> list[str]:
        bm = b.median if b else None
        sm = st.median if st else None
        dm = d.median if d else None
        basis = dm if dm is not None else bm
        return [what, f3(bm), f3(sm), f3(dm), f2(n / 1e9 / basis) if basis else "–",
                f2(None if bm is None else bm / mem), f2(None if sm is None else sm / mem),
                f2(None if dm is None else dm / direct), cores(others)]

    table = [["what", "blocking s", "staged s", "to-durable s", "GB/s", "blocking ÷ memcpy", "staged ÷ memcpy",
              "durable ÷ O_DIRECT", "other CPU, cores"]]
    table.append(row("memcpy → reused buffer (limit)", s.memcpy, None, None, s.limits_others))
    table.append(row("memcpy → fresh /dev/shm", s.fresh, None, None, s.limits_others))
    table.append(row("write O_DIRECT + fsync (limit)", s.direct, None, s.direct, s.limits_others))
    table.append(row("write buffered + fsync", s.buffered, None, s.buffered, s.limits_others))
    for m in s.methods:
        table.append(row(m.what, m.returned, m.staged, m.durable, m.others))

    memt = [["what", "trainer RSS with state GiB", "trainer peak GiB", "trainer extra GiB", "extra ÷ state",
             "writer process", "writer peak RSS MiB", "RssAnon MiB", "RssFile MiB", "RssShmem MiB",
             "trainer CPU s/save", "writer CPU s/save"]]
    for m in s.methods:
        w = m.writer
        memt.append([m.what, gib(m.rss_built), gib(m.trainer_peak), gib(m.trainer_extra), f2(m.trainer_extra / n),
                     m.writer_name or "– (in the trainer)", mib(w.rss) if w else "–", mib(w.anon) if w else "–",
                     mib(w.file) if w else "–", mib(w.shmem) if w else "–", f2(m.trainer_cpu), f2(m.writer_cpu)])

    sync, bg = s.method("ckptd_sync"), s.method("ckptd_bg")
    peers = [m for m in s.methods if not m.key.startswith("ckptd")]
    vs = [["peer", "its blocking ÷ ckptd sync", "its blocking ÷ ckptd background", "its staged ÷ ckptd background staged",
           "its durable ÷ ckptd sync", "its durable ÷ ckptd background", "its extra memory ÷ ckptd's"]]
    if sync and bg:
        for p in peers:
            vs.append([p.what, f2(p.returned.median / sync.returned.median), f2(p.returned.median / bg.returned.median),
                       f2(p.staged.median / bg.staged.median), f2(p.durable.median / sync.durable.median),
                       f2(p.durable.median / bg.durable.median),
                       f2(p.trainer_extra / sync.trainer_extra) if sync.trainer_extra else "–"])

    parts: list = [
        f"Every method ran in its own process on the same state dict ({n / GIB:.3f} GiB), one warm-up, then "
        "saves back to back (each waited for the previous one to be durable). Blocking: the call returned. "
        "Staged: the tensors may change (the call's return where the copy happens inside it). To durable: "
        "`torch.save` + fsync returned, DCP's future resolved, ckptd's future resolved. GB/s is 10⁹ bytes of "
        "tensor data per second of the to-durable time where there is one. \"Other CPU\" is the average number "
        "of cores kept busy by everything outside the benchmark's processes during the phase (on two cores, a "
        "busy neighbour slows every copy).",
        table,
        "DCP's `FileSystemWriter` defaults to `sync_files=True`: it fsyncs each data file and the `.metadata` "
        "file (written to a temporary name and renamed), so its time to durable includes the fsyncs, as "
        "ckptd's does; it does not fsync the checkpoint directory, and writes the data files under their "
        "final names. ckptd fsyncs the shard, writes and fsyncs its index, renames the directory and fsyncs "
        "the parent.",
        "### Memory and CPU while saving",
        "Trainer extra: the trainer's peak RSS during the timed saves (`VmHWM`, reset after the warm-up) minus "
        "its RSS once the state was built; for ckptd that is the reused slot. The writer's figures are each "
        "field's peak during the timed saves, sampled every 20 ms from `/proc/<pid>/status`: RssAnon is the "
        "process's private memory, RssFile its mapped files (libraries), RssShmem the shared memory it has "
        "touched (ckptd's daemon maps the trainer's slot; DCP's process receives its staging copy in shared "
        "memory). Shared memory counts in both processes but exists once. CPU: seconds of CPU time (user + "
        "system, all threads) per timed save, from `/proc/<pid>/stat`; on two cores, CPU the writer uses while "
        "the trainer copies is CPU the copy does not get.",
        memt,
    ]
    if len(vs) > 1:
        parts += ["### ckptd against each peer", "Each peer's median over ckptd's (above 1: ckptd is faster or "
                  "smaller).", vs]
    if chart:
        parts += [f"![blocking and durable time per method]({chart})"]
    return [Block("Saving: ckptd, its limits and its peers", parts)]


# --- multi ---------------------------------------------------------------------


def multi_block(m: MultiSection) -> Block:
    total = m.total_bytes
    single_bw = total / 1e9 / m.raw_single.median
    par_bw = total / 1e9 / m.raw_parallel.median
    t = [["what", "aggregate s", "GB/s", "÷ raw O_DIRECT, 1 writer", f"÷ raw O_DIRECT, {m.ranks} writers",
          "per-rank blocking s", "per-rank durable s", f"{m.ranks} ranks peak RSS GiB", "daemon RssAnon MiB",
          "other CPU, cores"]]
    t.append(["raw O_DIRECT write + fsync, 1 writer", f3(m.raw_single.median), f2(single_bw), "1.00",
              f2(single_bw / par_bw), "–", "–", "–", "–", cores(m.raw_others)])
    t.append([f"raw O_DIRECT write + fsync, {m.ranks} writers at once", f3(m.raw_parallel.median), f2(par_bw),
              f2(par_bw / single_bw), "1.00", "–", "–", "–", "–", cores(m.raw_others)])
    for lay in m.layouts:
        others = statistics.median(lay.others) if lay.others else None
        t.append([f"ckptd, {lay.what}", f3(lay.aggregate.median), f2(lay.gbps), f2(lay.gbps / single_bw),
                  f2(lay.gbps / par_bw), f3(lay.blocking.median), f3(lay.durable.median),
                  gib(lay.ranks.rss) if lay.ranks else "–", mib(lay.daemon.anon) if lay.daemon else "–",
                  cores(others)])
    return Block(f"{m.ranks} clients on one node", [
        f"{m.ranks} processes, each its own `ckptd.Client` and its own {m.per_rank_bytes / GIB:.3f} GiB state "
        f"({total / GIB:.2f} GiB together), call `save_async` at the same moment (sync staging) through one "
        "daemon (2 concurrent writes, its default). Aggregate: from the first call to the last future "
        "resolved, median of the timed rounds after a warm-up round; GB/s is all ranks' tensor bytes over it. "
        "The raw writes are of the same total bytes, measured in the same section just before.",
        t,
    ])


# --- scaling -------------------------------------------------------------------


def scaling_block(points: list[ScalePoint]) -> Block:
    t = [["state", "GiB", "blocking s", "to-durable s", "blocking s/GiB", "durable s/GiB", "memcpy s/GiB",
          "O_DIRECT s/GiB", "blocking ÷ memcpy", "durable ÷ O_DIRECT", "trainer extra ÷ state", "other CPU, cores"]]
    for p in points:
        g = p.gib
        t.append([size_label(p.size_gib), f"{g:.3f}", f3(p.blocking.median), f3(p.durable.median),
                  f3(p.blocking.median / g), f3(p.durable.median / g), f3(p.memcpy.median / g),
                  f3(p.direct.median / g), f2(p.blocking.median / p.memcpy.median),
                  f2(p.durable.median / p.direct.median), f2(p.extra / p.nbytes), cores(p.others)])
    span = f"{size_label(points[0].size_gib)} to {size_label(points[-1].size_gib)}" if points else ""
    return Block(f"Scaling: ckptd with sync staging, {span}", [
        "One worker per size: the same transformer-plus-AdamW state at that size, the two limits at that size, "
        "then ckptd sync-staging saves (one warm-up, then the timed ones), through one daemon. \"No collapse\": "
        f"the per-GiB times at the largest sizes stay within {COLLAPSE}× of those at 1 GiB.",
        t,
    ])


# --- load ----------------------------------------------------------------------


def load_blocks(ls: LoadSection) -> list[Block]:
    n = ls.nbytes
    raw = ls.method("raw_read")
    raw_cold = raw.cold.median if raw and raw.cold else None
    raw_warm = raw.warm.median if raw and raw.warm else None

    def cells(series: Series | None, base: float | None) -> list[str]:
        if series is None:
            return ["–", "–", "–"]
        x = series.median
        return [f3(x), f2(n / 1e9 / x), f2(x / base) if base else "–"]

    def memcell(p: MemPeak | None) -> str:
        if p is None:
            return "–"
        return f"{mib(p.rss - p.first_rss)} ({mib(p.anon - p.first_anon)} / {mib(p.file - p.first_file)})"

    def after_del(m) -> str:
        a, b = m.after_del, m.base
        if not a or not b:
            return "–"
        return f"{mib(a['file'] - b['file'])} → {mib(a['file_gc'] - b['file'])}"

    t = [["what", "cold s", "cold GB/s", "cold ÷ raw read", "warm s", "warm GB/s", "warm ÷ raw read",
          "peak extra RSS MiB (anon / file)", "file pages mapped after del MiB (→ after gc)", "other CPU, cores"]]
    for m in ls.methods:
        t.append([m.what, *cells(m.cold, raw_cold), *cells(m.warm, raw_warm), memcell(m.mem), after_del(m),
                  cores(m.others)])
        if m.cold_touch or m.warm_touch:
            t.append([f"{m.what}, then a sum over every tensor", *cells(m.cold_touch, raw_cold),
                      *cells(m.warm_touch, raw_warm), "", "", ""])
    t.append(["sum over every tensor of the state in memory (floor for the sums)", "–", "–", "–",
              *cells(ls.sum_in_memory, raw_warm), "–", "–", cores(ls.prepare_others)])
    resident = max((m.resident_before_cold for m in ls.methods), default=0.0)
    how = ("`posix_fadvise(POSIX_FADV_DONTNEED)` on the checkpoint's own files (the rest of the machine's page "
           "cache is left alone)" if ls.evict_mode == "fadvise" else
           "`echo 3 > /proc/sys/vm/drop_caches` (the whole machine's clean page cache)")
    f = ls.files
    parts: list = [
        f"The same {n / GIB:.3f} GiB state, saved once by ckptd ({f['ckptd_bytes'] / GIB:.3f} GiB shard), by "
        f"`torch.save` ({f['torch_bytes'] / GIB:.3f} GiB file) and by DCP `save` ({f['dcp_bytes'] / GIB:.3f} GiB), "
        "each load method in its own process. Cold: before each repetition the files were evicted with "
        f"{how}; `mincore` found at most {resident * 100:.1f}% of them still resident. Warm: right after "
        "reading them. GB/s is 10⁹ bytes of tensor data per second; ratios are to the raw sequential read of "
        "the ckptd shard (8 MiB `readinto` into one reused buffer) in the same cache state. Every load was "
        "checked against the sum of the saved tensors. `ckptd.load` zero-copy returns views of a "
        "copy-on-write map of the shard: its first row is the time to return, the next the time until a sum "
        "has touched every byte. `load_into` copies into an existing model and optimizer (built from another "
        "seed); DCP `load` copies into an existing state dict in place. The memory column is the worker's peak "
        "RSS during its loads over its RSS before the first one, and the growth of RssAnon (private memory) "
        "and RssFile (mapped file pages: page cache, reclaimable) within it, each at its own peak. The last "
        "column: the worker's mapped file pages over its baseline right after `del` of the last result, and after "
        "a `gc.collect()` (a mapping still there after `del` is kept alive by a reference cycle until the "
        "garbage collector runs).",
        t,
    ]
    notes = []
    zc, nv, cpu = ls.method("ckptd_load"), ls.method("ckptd_load_noverify"), ls.method("ckptd_load_cpu")
    if zc and zc.after_del and zc.base:
        kept = zc.after_del["file"] - zc.base["file"]
        if kept > 0.5 * n and zc.after_del["file_gc"] - zc.base["file"] < 0.1 * n:
            line = (f"After `del` of a zero-copy `ckptd.load` result, {kept / MIB:.0f} MiB of the shard stayed mapped "
                    f"in the process until `gc.collect()` ({(zc.after_del['file_gc'] - zc.base['file']) / MIB:.0f} "
                    "MiB after it): something in the loaded structure is in a reference cycle, so only the cyclic "
                    "garbage collector frees it")
            if (cpu and cpu.after_del and cpu.base
                    and cpu.after_del["anon"] - cpu.after_del["anon_gc"] > 0.25 * n):
                anon = cpu.after_del["anon"] - cpu.base["anon"]
                line += (f"; with map_location=\"cpu\" the copies stay too: {anon / MIB:.0f} MiB of RssAnon after "
                         f"`del`, {(cpu.after_del['anon_gc'] - cpu.base['anon']) / MIB:.0f} MiB after `gc.collect()`")
            notes.append(line + ".")
    two, one = ls.method("ckptd_load_into"), ls.method("ckptd_load_into_sd")
    if two and one and two.warm and one.warm and zc and nv and zc.warm and nv.warm:
        notes.append(f"Restoring the model and then the optimizer with two `load_into` calls took "
                     f"{two.warm.median:.3f} s warm against {one.warm.median:.3f} s for one call over a state dict "
                     f"holding both: each call maps and checksums the whole shard (one warm checksum pass is "
                     f"{zc.warm.median - nv.warm.median:.3f} s, the difference between `ckptd.load` with and without "
                     "verification).")
    if notes:
        parts.append(" ".join(notes))
    blocks = [Block("Loading", parts)]
    if ls.ranks:
        shard = ls.shard_bytes
        rt = [["limit", "wall s", "per-rank load s (median / max)", "peak RSS sum GiB", "peak RssAnon sum GiB",
               "idle RSS sum GiB", "peak growth GiB (RSS / anon)", "anon growth ÷ shard",
               "RSS sum after del GiB (→ after gc; anon after gc)", "other CPU, cores"]]
        for r in ls.ranks:
            pr, pa = _med(r.peak_rss), _med(r.peak_anon)
            br, ba = _med(r.base_rss), _med(r.base_anon)
            rt.append([r.label, f3(r.wall.median), f"{f3(r.load.median)} / {f3(max(r.load.values))}",
                       gib(pr), gib(pa), gib(br), f"{gib(pr - br)} / {gib(pa - ba)}", f2((pa - ba) / shard),
                       f"{gib(_med(r.after_del_rss))} (→ {gib(_med(r.after_gc_rss))}; {gib(_med(r.after_gc_anon))})",
                       cores(_med(r.others) if r.others else None)])
        blocks.append(Block(f"{ls.rank_count} ranks loading at once: node memory", [
            f"A {ls.rank_count}-rank ckptd checkpoint ({shard / GIB:.3f} GiB per shard), cold (evicted before "
            f"each round). {ls.rank_count} processes, started and idle beforehand, each call "
            f"`ckptd.load(path, rank=r, map_location=\"cpu\")` at the same moment, hold the result "
            f"{0.5:g} s, then drop it (`del`, then `gc.collect()`); the sampler sums their RSS and RssAnon "
            "every 20 ms. Each round uses fresh processes (a restart loads once; a process that loaded before "
            "keeps freed heap), idle RSS is theirs after importing torch and ckptd. Wall: from go to the last "
            "rank having dropped its state; medians over the rounds. The lease covers the load call only: it is "
            "released when `load` returns, before the caller holds and drops the tensors.",
            rt,
            *_rank_note(ls),
        ]))
    return blocks


def _rank_note(ls: LoadSection) -> list[str]:
    limited = [r for r in ls.ranks if r.limit is not None]
    free = [r for r in ls.ranks if r.limit is None]
    if not limited or not free or not ls.shard_bytes:
        return []
    lim, nol = limited[0], free[0]
    grow_l = (_med(lim.peak_anon) - _med(lim.base_anon)) / ls.shard_bytes
    grow_n = (_med(nol.peak_anon) - _med(nol.base_anon)) / ls.shard_bytes
    text = (f"Private memory grew by {grow_n:.2f} shards' worth with no limit and by {grow_l:.2f} with "
            f"{lim.label}; wall time {nol.wall.median:.2f} s against {lim.wall.median:.2f} s.")
    if grow_l > lim.limit + 0.5:
        text += (f" With a limit of {lim.limit} the node still held about {grow_l:.1f} shards at once: the lease is "
                 "released when `load` returns, so the next rank loads while the previous one still holds its copy "
                 "(here for the 0.5 s hold, and until its `gc.collect()`).")
    return [text]


def _med(values: list) -> float:
    return statistics.median(values) if values else float("nan")


# --- targets and summary ----------------------------------------------------------


def targets_block(targets: list[Target]) -> Block:
    t = [["target", "measured", "ratio", "met"]]
    for x in targets:
        t.append([x.name, x.measured, x.ratio_text, "met" if x.met else ("not met" if x.met is False else "not measured")])
    notes = [f"- {x.name}: {x.why}" for x in targets if x.met is False and x.why]
    parts: list = ["Each target from the issue, with the measured value and its ratio to the target's "
                   "reference (met when the ratio is within the bound).", t]
    if notes:
        parts += ["Where a target is missed, and what would close it:", "\n".join(notes)]
    return Block("Targets", parts)


def quiet_line(q: QuietLog) -> str:
    got = sum(1 for *_, ok in q.entries if ok)
    noisy = q.noisy_starts()
    line = (f"before each timed phase the run waited for {QUIET_WINDOW_S:g} s in which other work used under "
            f"{QUIET_CORES} cores (at most 30 s a phase, {q.budget:.0f} s in all): {got} of {len(q.entries)} "
            f"phases got one, {q.spent:.0f} s spent waiting")
    if noisy:
        listed = ", ".join(f"{name} ({'?' if o is None else f'{o:.2f}'} cores)" for name, o in noisy[:8])
        more = f" and {len(noisy) - 8} more" if len(noisy) > 8 else ""
        line += f"; started busy: {listed}{more}"
    return line


def header(*, command: str, machine: Machine, sections: list[str], state_line: str | None, wall_s: float,
           quiet: QuietLog, retried: list[tuple[str, float, float | None]] | None = None,
           library: str | None = None) -> str:
    m = machine
    lines = [
        "# ckptd benchmark results",
        "",
        "Generated by `benchmarks/` (`make bench`, i.e. `python -m benchmarks`); rerun to refresh. Medians of the "
        "timed repetitions after one warm-up; every method runs in its own process.",
        "",
        f"- command: `{command}`",
        f"- date: {m.date}; wall time of the whole run: {wall_s / 60:.1f} min ({wall_s:.0f} s)",
        f"- machine: {m.cores} cores ({m.cpu}), {m.ram_gib:.1f} GiB RAM, /dev/shm {m.shm_gib:.1f} GiB",
        f"- kernel: {m.kernel}; Python {m.python}; torch {m.torch}",
        *([f"- measured: {library}"] if library else []),
        f"- filesystem: scratch dir `{m.scratch}` on {m.scratch_fs}",
        f"- load average at start: {m.load[0]:.2f} {m.load[1]:.2f} {m.load[2]:.2f}",
        f"- sections: {', '.join(sections)}",
        f"- quiet windows: {quiet_line(quiet)}",
    ]
    if retried:
        lines.append("- phases rerun because other work used the CPUs during them (other CPU of the discarded run → "
                     "the kept one): " + "; ".join(f"{p} ({a:.2f} → {'?' if b is None else f'{b:.2f}'} cores)"
                                                     for p, a, b in retried))
    if state_line:
        lines.append(f"- state: {state_line}")
    return "\n".join(lines)


def details(save: SaveSection | None, multi: MultiSection | None, scaling: list[ScalePoint] | None,
            load: LoadSection | None) -> Block:
    lines: list[str] = ["Every timed repetition in order, seconds."]
    if save:
        lines += ["", "Saving:"]
        for what, series in (("memcpy → reused buffer", save.memcpy), ("memcpy → fresh /dev/shm", save.fresh),
                             ("write O_DIRECT + fsync", save.direct), ("write buffered + fsync", save.buffered)):
            lines.append(f"- {what}: {series.listing()}")
        for m in save.methods:
            lines.append(f"- {m.what}: blocking {m.returned.listing()}; staged {m.staged.listing()}; "
                         f"durable {m.durable.listing()}")
            e = m.extra
            if m.key == "torch_save":
                lines.append(f"  - `torch.save` alone (page cache, before fsync): {Series(e['serialize']).listing()}; "
                             f"file {e['file_bytes'] / GIB:.3f} GiB")
            if m.key.startswith("dcp"):
                lines.append(f"  - DCP checkpoint on disk: {e['files_bytes'] / GIB:.3f} GiB")
            if m.key.startswith("ckptd"):
                lines.append(f"  - shard {e['bytes_written'] / GIB:.3f} GiB ({e['bytes_written'] - save.nbytes:,} "
                             f"bytes of header over the tensor data); `SaveResult.seconds` "
                             f"{Series(e['reported']).listing()}; the daemon's accepted-to-committed time (its log) "
                             f"{Series(e['daemon']).listing() if e['daemon'] else 'not found'}")
        noisy = [(m.what, m.durable.spread()) for m in save.methods if len(m.durable.values) > 1
                 and m.durable.spread() > 1.5]
        if noisy:
            lines.append("- repetitions disagreeing by more than 1.5× (durable, slowest ÷ fastest): "
                         + "; ".join(f"{w} {r:.1f}×" for w, r in noisy))
        lines.append("- the daemon ran with its defaults (O_DIRECT, 8 MiB writes, 2 concurrent writes); clients "
                     "with `max_inflight=1`.")
    if multi:
        lines += ["", "Clients on one node:",
                  f"- raw O_DIRECT, 1 writer: {multi.raw_single.listing()}; {multi.ranks} writers: "
                  f"{multi.raw_parallel.listing()}"]
        for lay in multi.layouts:
            lines.append(f"- {lay.what}: aggregate {lay.aggregate.listing()}; per-rank blocking "
                         f"{lay.blocking.listing()}; per-rank durable {lay.durable.listing()}")
    if scaling:
        lines += ["", "Scaling:"]
        for p in scaling:
            lines.append(f"- {size_label(p.size_gib)}: memcpy {p.memcpy.listing()}; O_DIRECT {p.direct.listing()}; "
                         f"blocking {p.blocking.listing()}; durable {p.durable.listing()}")
    if load:
        lines += ["", "Loading:"]
        for m in load.methods:
            parts = []
            for label, s in (("cold", m.cold), ("cold + sum", m.cold_touch), ("warm", m.warm),
                             ("warm + sum", m.warm_touch)):
                if s:
                    parts.append(f"{label} {s.listing()}")
            lines.append(f"- {m.what}: " + "; ".join(parts))
        for r in load.ranks:
            lines.append(f"- {load.rank_count} ranks, {r.label}: wall {r.wall.listing()}; peak RSS sums "
                         + ", ".join(gib(x) for x in r.peak_rss) + " GiB; peak RssAnon sums "
                         + ", ".join(gib(x) for x in r.peak_anon) + " GiB")
    return Block("Details", ["\n".join(lines)])


def markdown(head: str, blocks: list[Block]) -> str:
    return "\n".join([head, "", *(b.markdown() for b in blocks)])


def summary(save: SaveSection | None, multi: MultiSection | None, scaling: list[ScalePoint] | None,
            load: LoadSection | None, targets: list[Target]) -> Block:
    """Three to six plain sentences on what the tables say, built from the same numbers."""
    out: list[str] = []
    if save is not None:
        sync, bg = save.method("ckptd_sync"), save.method("ckptd_bg")
        mem, direct = save.memcpy.median, save.direct.median
        if sync and bg:
            out.append(
                f"With synchronous staging ckptd blocks the trainer for {sync.returned.median:.3f} s "
                f"({sync.returned.median / mem:.2f}× a memcpy of the same bytes into a reused buffer) and the "
                f"checkpoint is durable after {sync.durable.median:.3f} s ({sync.durable.median / direct:.2f}× a "
                f"raw O_DIRECT write + fsync); with background staging the call returns in "
                f"{bg.returned.median * 1000:.1f} ms and the tensors are free again after {bg.staged.median:.3f} s.")
            peers = {m.key: m for m in save.methods}
            bits = []
            if "dcp_process" in peers:
                p = peers["dcp_process"]
                bits.append(f"DCP `async_save` with the PROCESS checkpointer blocks {p.returned.median:.3f} s and "
                            f"is durable after {p.durable.median:.3f} s (ckptd's durable time is "
                            f"{sync.durable.median / p.durable.median:.2f}× that)")
            if "dcp_process_stager" in peers:
                p = peers["dcp_process_stager"]
                bits.append(f"with a reused DefaultStager it returns in {p.returned.median * 1000:.1f} ms, stages "
                            f"in {p.staged.median:.3f} s and is durable after {p.durable.median:.3f} s")
            if "torch_save" in peers:
                p = peers["torch_save"]
                bits.append(f"`torch.save` + fsync blocks for all of its {p.durable.median:.3f} s")
            if bits:
                out.append("Against the peers, " + "; ".join(bits) + ".")
            writer = sync.writer
            dcp_w = peers.get("dcp_process")
            mem_bits = (f"ckptd's trainer holds one reused slot ({sync.trainer_extra / save.nbytes:.2f}× the state) "
                        + (f"and the daemon's private memory (RssAnon) peaks at {writer.anon / 1e6:.0f} MB"
                           if writer else ""))
            if dcp_w and dcp_w.writer:
                mem_bits += (f"; DCP's PROCESS checkpointer costs the trainer {dcp_w.trainer_extra / save.nbytes:.2f}× "
                             f"the state and its own process {dcp_w.writer.rss / GIB:.2f} GiB of RSS")
            out.append(mem_bits + ".")
    together = []
    if multi is not None and multi.layouts:
        single_bw = multi.total_bytes / 1e9 / multi.raw_single.median
        lay = " and ".join(f"{x.gbps:.2f} GB/s ({x.what}, {x.gbps / single_bw:.0%} of a raw O_DIRECT write)"
                           for x in multi.layouts)
        together.append(f"{multi.ranks} clients saving at once reach {lay}")
    if scaling:
        big = [p for p in scaling if p.size_gib >= 1] or scaling
        bl = [p.blocking.median / p.gib for p in big]
        du = [p.durable.median / p.gib for p in big]
        small = scaling[0]
        together.append(f"from {size_label(big[0].size_gib)} to {size_label(big[-1].size_gib)} the blocking time "
                        f"per GiB stays within {min(bl):.3f}–{max(bl):.3f} s and the durable time per GiB within "
                        f"{min(du):.3f}–{max(du):.3f} s (at {size_label(small.size_gib)}: "
                        f"{small.blocking.median / small.gib:.3f} and {small.durable.median / small.gib:.3f} s "
                        "per GiB, fixed costs per save)")
    if together:
        text = "; ".join(together)
        out.append(text[0].upper() + text[1:] + ".")
    if load is not None:
        zc, nv, cpu = load.method("ckptd_load"), load.method("ckptd_load_noverify"), load.method("ckptd_load_cpu")
        raw, tl = load.method("raw_read"), load.method("torch_load")
        s = ""
        if zc and nv and raw and zc.cold and nv.cold and raw.cold and zc.cold_touch:
            s = (f"Loading cold, `ckptd.load` returns in {zc.cold.median:.3f} s ({nv.cold.median * 1000:.0f} ms "
                 f"without verification: the checksum pass is what reads the file) and every byte is touched after "
                 f"{zc.cold_touch.median:.3f} s, {zc.cold_touch.median / raw.cold.median:.2f}× a raw read of the "
                 "shard")
            if cpu and cpu.cold:
                s += f"; map_location=\"cpu\" takes {cpu.cold.median:.3f} s"
            if tl and tl.cold:
                s += f" and `torch.load` {tl.cold.median:.3f} s"
        if load.ranks and len(load.ranks) >= 2:
            a, b = load.ranks[0], load.ranks[1]
            s += ("; " if s else "") + (
                f"{load.rank_count} ranks loading {load.shard_bytes / GIB:.2f} GiB shards at once peak at "
                f"{_med(a.peak_anon) / GIB:.2f} GiB of private memory in {a.wall.median:.2f} s, and with "
                f"{b.label} at {_med(b.peak_anon) / GIB:.2f} GiB in {b.wall.median:.2f} s")
        if s:
            out.append(s[0].upper() + s[1:] + ".")
    missed = [t for t in targets if t.met is False]
    if missed:
        out.append(f"{len(targets) - len(missed)} of {len(targets)} targets are met; the misses and their measured "
                   "causes are listed under Targets.")
    elif targets:
        out.append(f"All {len(targets)} measured targets are met.")
    return Block("What the numbers say", [" ".join(out)])
