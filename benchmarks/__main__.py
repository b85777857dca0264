"""``python -m benchmarks``: ckptd against its limits and its peers, in one run.

Sections (``--only``, default all, in this order):

* ``save``: machine limits, ``torch.save`` + fsync, DCP ``save`` and
  ``async_save`` (THREAD, PROCESS, PROCESS with a reused stager), ckptd with
  sync and background staging: blocking, staged, durable, memory;
* ``multi``: several clients on one node saving at once, against a raw
  O_DIRECT write of the same bytes;
* ``scaling``: ckptd sync staging from 64 MiB to 4 GiB;
* ``load``: loading the same state back every way, cold and warm, and
  several ranks loading at once with and without the daemon's load lease.

The targets of the issue are evaluated from whatever ran. The run prints
progress to stderr and the tables to stdout, and writes ``RESULTS.md`` and
``results.png`` (with matplotlib installed) beside this file when every
section ran at the default settings; a partial or ``--quick`` run writes
into the scratch directory instead, unless ``--out`` says where.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shlex
import sys
import time
from pathlib import Path

from . import chart
from .ckptd_runs import clean_scratch
from .measure import QuietLog, Sampler, can_drop_caches
from .report import (GIB, Block, describe_machine, details, header, library_line, load_blocks, markdown,
                     multi_block, save_blocks, scaling_block, summary, targets_block)
from .runner import Ctx, log
from .scaling import DEFAULT_SIZES, parse_size
from .targets import evaluate

HERE = Path(__file__).resolve().parent
SECTIONS = ("save", "multi", "scaling", "load")
QUICK_GIB = 1 / 16
LIMIT_REPEAT = 5
LAST_RUN = "last-run.pkl"
"""The last run's measurements, in the scratch dir, for ``--rerender``."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example: python -m benchmarks --only save,load --size-gib 0.5 --repeat 2")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    p.add_argument("--size-gib", type=float, default=1.0, help="state size for save and load, GiB (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (default 3)")
    p.add_argument("--ranks", type=int, default=4, help="clients saving at once, and ranks loading at once (default 4)")
    p.add_argument("--rank-size-gib", type=float, default=0.5,
                   help="state per client in multi, and shard per rank in load (default 0.5)")
    p.add_argument("--scaling-sizes", default=DEFAULT_SIZES, help=f"sizes for scaling (default {DEFAULT_SIZES})")
    p.add_argument("--no-dcp", action="store_true", help="skip the DCP peers in save")
    p.add_argument("--evict", choices=("fadvise", "drop_caches"), default="fadvise",
                   help="how load makes the page cache cold: per-file fadvise (default) or the global drop_caches")
    p.add_argument("--quiet-budget", type=float, default=120.0,
                   help="seconds the whole run may wait for quiet windows (default 120; 0: never wait)")
    p.add_argument("--quiet-max-wait", type=float, default=30.0, help="seconds one phase may wait (default 30)")
    p.add_argument("--busy-retries", type=int, default=3,
                   help="phases that may be rerun because other work used the CPUs during them (default 3)")
    p.add_argument("--patience-min", type=float, default=9.0,
                   help="minutes after which the run stops waiting for quiet windows and rerunning busy phases, "
                        "so a busy machine cannot push it far past ~12 minutes (default 9)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64 MiB states, 1 repetition, scaling 16M,64M, 32 MiB per rank; writes "
                        "RESULTS-quick.md into the scratch dir unless --out is given")
    p.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/RESULTS.md)")
    p.add_argument("--rerender", type=Path, default=None, metavar="PKL",
                   help=f"measure nothing: write the report again from a run's saved measurements (the scratch "
                        f"dir's {LAST_RUN}), e.g. after changing report.py; --out as for that run")
    p.add_argument("--scratch", type=Path, default=HERE / "out",
                   help="directory on the disk under test for checkpoints (default benchmarks/out, git-ignored)")
    return p


def _command() -> str:
    exe = sys.executable
    rel = os.path.relpath(exe)
    return f"{rel if not rel.startswith('..') else exe} -m benchmarks {shlex.join(sys.argv[1:])}".rstrip()


def _png_for(out: Path) -> Path:
    return out.parent / ("results.png" if out.name == "RESULTS.md" else out.stem.lower() + ".png")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = _parser()
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    sections = [s for s in SECTIONS if s in sections]
    if args.quick:
        args.size_gib, args.repeat, args.scaling_sizes, args.rank_size_gib = QUICK_GIB, 1, "16M,64M", 1 / 32
    if args.repeat < 1 or args.size_gib <= 0 or args.ranks < 1 or args.rank_size_gib <= 0:
        parser.error("--repeat and --ranks must be at least 1, sizes positive")
    if args.evict == "drop_caches" and not can_drop_caches():
        parser.error("--evict drop_caches needs write access to /proc/sys/vm/drop_caches (root)")
    scaling_sizes = [parse_size(x) for x in args.scaling_sizes.split(",") if x.strip()]
    scratch: Path = args.scratch.resolve()
    if args.rerender is not None:
        with open(args.rerender, "rb") as f:
            data = pickle.load(f)
        full = set(data["sections"]) == set(SECTIONS) and "--quick" not in data["command"]
        out = args.out or (HERE / "RESULTS.md" if full else scratch / "RESULTS-partial.md")
        render(data, out, _png_for(out))
        return 0
    full = set(sections) == set(SECTIONS) and not args.quick
    default_name = "RESULTS-quick.md" if args.quick else "RESULTS-partial.md"
    out: Path = args.out or (HERE / "RESULTS.md" if full else scratch / default_name)
    png = _png_for(out)

    clean_scratch(scratch)
    logs = scratch / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    machine = describe_machine(scratch)
    library = library_line()  # at the start: the library may change while the run goes on
    if machine.scratch_fs.startswith("tmpfs"):
        log(f"warning: {scratch} is on tmpfs; disk numbers will be memory numbers")
    limit_repeat = args.repeat if args.quick else max(args.repeat, LIMIT_REPEAT)
    sampler = Sampler().start()
    ctx = Ctx(scratch=scratch, repeat=args.repeat, limit_repeat=limit_repeat, size_gib=args.size_gib,
              sampler=sampler, quiet=QuietLog(args.quiet_budget), quiet_max_wait=args.quiet_max_wait, logs=logs,
              evict_mode=args.evict, retries_left=args.busy_retries,
              soft_deadline=started + 60 * args.patience_min)
    log(f"sections: {', '.join(sections)}; worker logs in {logs}")

    save = multi = scaling = load = None
    try:
        if "save" in sections:
            from . import save as save_mod

            save = save_mod.run_section(ctx, dcp=not args.no_dcp)
        if "multi" in sections:
            from . import multi as multi_mod

            multi = multi_mod.run_section(ctx, args.rank_size_gib, args.ranks)
        if "scaling" in sections:
            from . import scaling as scaling_mod

            scaling = scaling_mod.run_section(ctx, scaling_sizes)
        if "load" in sections:
            from . import loading

            load = loading.run_section(ctx, args.size_gib, args.rank_size_gib, ranks=args.ranks)
    finally:
        sampler.stop()
        clean_scratch(scratch, keep_logs=True)  # gigabytes of checkpoints; the worker logs stay

    wall = time.monotonic() - started
    library_end = library_line()
    if library_end != library:
        log(f"warning: the library changed during the run: {library} -> {library_end}")
        library += f" — CHANGED during the run, now {library_end}; rerun for consistent numbers"
    data = {"save": save, "multi": multi, "scaling": scaling, "load": load, "machine": machine,
            "sections": sections, "command": _command(), "wall": wall, "quiet": ctx.quiet, "retried": ctx.retried,
            "library": library}
    try:  # everything the report is made of, so a changed report can be rendered again (--rerender)
        with open(scratch / LAST_RUN, "wb") as f:
            pickle.dump(data, f)
    except (OSError, pickle.PicklingError) as exc:
        log(f"could not keep the measurements in {scratch / LAST_RUN}: {exc}")
    render(data, out, png)
    return 0


def render(data: dict, out: Path, png: Path) -> None:
    """Targets, tables, chart and ``RESULTS.md`` from one run's measurements."""
    save, multi, scaling, load = data["save"], data["multi"], data["scaling"], data["load"]
    daemon_anon: list[tuple[str, int]] = []
    if save:
        daemon_anon += [(m.what, m.writer.anon) for m in save.methods if m.key.startswith("ckptd") and m.writer]
    if multi:
        daemon_anon += [(f"{multi.ranks} clients, {x.what}", x.daemon.anon) for x in multi.layouts if x.daemon]
    if scaling:
        from .scaling import size_label

        daemon_anon += [(f"scaling {size_label(p.size_gib)}", p.daemon.anon) for p in scaling if p.daemon]
    targets = evaluate(save, multi, scaling, daemon_anon)

    drew = chart.draw(png, save, load)
    chart_ref = os.path.relpath(png, out.parent) if drew else None
    if not drew and (save or load):
        log("no chart: matplotlib is not installed (pip install matplotlib)")

    blocks: list[Block] = [targets_block(targets), summary(save, multi, scaling, load, targets)]
    if save:
        blocks += save_blocks(save, chart_ref)
    if multi:
        blocks.append(multi_block(multi))
    if scaling:
        blocks.append(scaling_block(scaling))
    if load:
        blocks += load_blocks(load)
        if chart_ref and not save:
            blocks.append(Block("Chart", [f"![load times]({chart_ref})"]))
    blocks.append(details(save, multi, scaling, load))

    state_line = None
    if save:
        st = save.state
        state_line = (f"{st['nbytes'] / GIB:.3f} GiB ({st['nbytes']:,} bytes) in {st['tensors']} float32 tensors "
                      f"(largest {st['largest'] / (1 << 20):.1f} MiB): a {st['layers']}-layer transformer of width "
                      f"{st['width']}, {st['params'] / 1e6:.1f} M parameters, plus AdamW exp_avg, exp_avg_sq and "
                      "step; other sections build the same model at their own sizes")
    head = header(command=data["command"], machine=data["machine"], sections=data["sections"],
                  state_line=state_line, wall_s=data["wall"], quiet=data["quiet"], retried=data["retried"],
                  library=data["library"])
    for b in blocks[:-1]:
        print(b.text() if b.title != "What the numbers say" else f"== {b.title} ==\n{b.parts[0]}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(head, blocks))
    log(f"wrote {out}" + (f" and {png}" if drew else "") + f"; the run took {data['wall'] / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
