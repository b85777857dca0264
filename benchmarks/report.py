"""Turning the measurements into a printed table and ``RESULTS.md``.

Every row is reduced to two numbers the trainer cares about: how long the
caller is blocked, and how long until the checkpoint is durable. Each is set
against its machine limit (blocking against a memcpy into a reused buffer,
durable against a raw O_DIRECT write of the same bytes), so the report reads
the same on any machine. The closing sentences are generated from the same
numbers, so they cannot drift from the table.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from .measure import Peak, Series

GIB = 1 << 30


@dataclass
class Row:
    """One line of the results table; ``None`` where a quantity does not apply."""

    what: str
    blocking: Series | None
    durable: Series | None

    def seconds(self) -> float:
        """The time the throughput is computed from: to durable if it applies."""
        return (self.durable or self.blocking).median  # type: ignore[union-attr]


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


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table_lines(rows: list[Row], nbytes: int, base_memcpy: float, base_direct: float) -> list[list[str]]:
    """Header plus one list of cells per row, as strings."""
    out = [["what", "blocking s", "to-durable s", "GB/s", "blocking ÷ memcpy", "durable ÷ O_DIRECT"]]
    for r in rows:
        b = r.blocking.median if r.blocking else None
        d = r.durable.median if r.durable else None
        out.append([
            r.what, _fmt(b, ".3f"), _fmt(d, ".3f"), f"{nbytes / 1e9 / r.seconds():.2f}",
            _fmt(None if b is None else b / base_memcpy, ".2f"),
            _fmt(None if d is None else d / base_direct, ".2f"),
        ])
    return out


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
class Findings:
    """The medians the closing sentences are made of, in seconds."""

    memcpy: float
    fresh_shm: float
    direct: float
    torch_save: float
    sync_blocking: float
    sync_durable: float
    bg_returned: float
    bg_staged: float
    bg_durable: float


def summary(f: Findings) -> str:
    """Two to four plain sentences on what the table says."""
    return " ".join([
        f"With synchronous staging, `save_async` blocks the caller for {f.sync_blocking:.3f} s, "
        f"{f.sync_blocking / f.memcpy:.2f}× a memcpy of the same tensors into a reused buffer "
        f"({f.memcpy:.3f} s; a copy into fresh shared memory takes {f.fresh_shm:.3f} s, "
        f"{f.fresh_shm / f.memcpy:.1f}×).",
        f"With background staging it returns in {f.bg_returned * 1000:.1f} ms and the tensors may change after "
        f"{f.bg_staged:.3f} s ({f.bg_staged / f.memcpy:.2f}× the memcpy).",
        f"A save is durable after {f.sync_durable:.3f} s with sync staging ({f.bg_durable:.3f} s background), "
        f"{f.sync_durable / f.direct:.2f}× the raw O_DIRECT write + fsync of the same bytes ({f.direct:.3f} s): "
        f"staging and the daemon's write run one after the other, and the part after `save_async` returns "
        f"({f.sync_durable - f.sync_blocking:.3f} s) is {(f.sync_durable - f.sync_blocking) / f.direct:.2f}× "
        f"the raw write.",
        f"`torch.save` + fsync blocks the caller for {f.torch_save:.3f} s, "
        f"{f.torch_save / f.sync_blocking:.1f}× longer than `save_async` with synchronous staging, "
        f"and its checkpoint is durable after {f.torch_save / f.sync_durable:.2f}× ckptd's time to durable.",
    ])


def rss_lines(peaks: dict[str, Peak]) -> list[list[str]]:
    out = [["phase", "trainer peak RSS GiB", "daemon peak RSS GiB"]]
    for name, p in peaks.items():
        out.append([name, f"{p.trainer / GIB:.2f}", f"{p.daemon / GIB:.2f}" if p.daemon else "–"])
    return out


def markdown(*, command: str, machine: Machine, state_line: str, table: list[list[str]], text: str,
             rss: list[list[str]], details: list[str]) -> str:
    """The whole ``RESULTS.md``."""
    m = machine
    return "\n".join([
        "# ckptd benchmark results",
        "",
        "Generated by `benchmarks/`; rerun to refresh. Medians of the timed repetitions, after one warm-up each.",
        "",
        f"- command: `{command}`",
        f"- date: {m.date}",
        f"- machine: {m.cores} cores ({m.cpu}), {m.ram_gib:.1f} GiB RAM, /dev/shm {m.shm_gib:.1f} GiB",
        f"- kernel: {m.kernel}; Python {m.python}; torch {m.torch}",
        f"- load average at start: {m.load[0]:.2f} {m.load[1]:.2f} {m.load[2]:.2f}",
        f"- scratch dir: `{m.scratch}` on {m.scratch_fs}",
        f"- state: {state_line}",
        "",
        "## Results",
        "",
        render_markdown(table),
        "",
        "GB/s is 10⁹ bytes of tensor data per second of the to-durable time where there is one, else of the "
        "blocking time. Ratios compare each row's blocking time with the memcpy into a reused buffer and its "
        "time to durable with the raw O_DIRECT write + fsync of the same number of bytes.",
        "",
        text,
        "",
        "## Peak memory",
        "",
        "Sampled every 20 ms with psutil; RSS includes touched pages of shared-memory mappings "
        "(the trainer's staging slot, the daemon's read-only map of it): the slot is counted in both processes "
        "but exists once in memory.",
        "",
        render_markdown(rss),
        "",
        "## Details",
        "",
        *details,
        "",
    ])
