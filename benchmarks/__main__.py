"""``python -m benchmarks``: measure ckptd, its limits and torch.save in one run.

Everything runs in one process on one state dict, in a fixed order (limits,
``torch.save``, ckptd sync, ckptd background), so every ratio in the report
compares numbers taken minutes apart on the same machine state. The run
prints progress to stderr, the table to stdout, and writes ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from pathlib import Path

from . import limits
from .ckptd_runs import BenchDaemon, CkptdResult, clean_scratch, run_client
from .measure import RssSampler, Series
from .peers import torch_save
from .report import GIB, Findings, Row, describe_machine, markdown, render_text, rss_lines, summary, table_lines
from .state import build_state

HERE = Path(__file__).resolve().parent
QUICK_GIB = 1 / 16
LIMIT_REPEAT = 5


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state dict size in GiB (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (default 3)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_GIB * 1024:.0f} MiB, 1 repetition; writes RESULTS-quick.md "
                        "into the scratch dir unless --out is given")
    p.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/RESULTS.md)")
    p.add_argument("--scratch", type=Path, default=HERE / "out",
                   help="directory on the disk under test for checkpoints (default benchmarks/out, git-ignored)")
    return p


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _command() -> str:
    exe = sys.executable
    rel = os.path.relpath(exe)
    return f"{rel if not rel.startswith('..') else exe} -m benchmarks {shlex.join(sys.argv[1:])}".rstrip()


def _details(rows: list[Row], ts_serialize: Series, ts_bytes: int, ck: list[CkptdResult], nbytes: int,
             limit_repeat: int, repeat: int) -> list[str]:
    lines = [f"Every timed repetition (s), min-max ({limit_repeat} for the machine limits, {repeat} for the others):", ""]
    for r in rows:
        parts = [f"blocking {r.blocking.spread()}" if r.blocking else "", f"durable {r.durable.spread()}" if r.durable else ""]
        lines.append(f"- {r.what}: " + ", ".join(p for p in parts if p))
    lines += [
        "",
        f"- `torch.save` alone (bytes in the page cache, before fsync): median {ts_serialize.median:.3f} s; "
        f"its file is {ts_bytes / GIB:.3f} GiB.",
    ]
    for c in ck:
        mode = "background" if c.background else "sync"
        lines.append(
            f"- ckptd {mode}: shard {c.bytes_written / GIB:.3f} GiB ({c.bytes_written - nbytes:,} bytes of header "
            f"over the tensor data); `SaveResult.seconds` median {c.reported.median:.3f} s; "
            f"staged after {c.staged.median:.3f} s"
            + (f"; the daemon's accepted-to-committed time (its log) median {c.daemon.median:.3f} s." if c.daemon.values else ".")
        )
    lines += ["", "The daemon ran with its defaults: O_DIRECT, 8 MiB writes, 2 concurrent writes; the client with "
              "`max_inflight=1`. Saves were back to back (each waited for the previous one to be durable)."]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    size_gib, repeat = (QUICK_GIB, 1) if args.quick else (args.size_gib, args.repeat)
    if repeat < 1 or size_gib <= 0:
        _parser().error("--repeat must be at least 1 and --size-gib positive")
    # The limits are the denominators of every ratio and take well under a
    # second each, so they get more repetitions: one slow memcpy (this VM
    # shows occasional 3-6x outliers) must not move the baseline.
    limit_repeat = repeat if args.quick else max(repeat, LIMIT_REPEAT)
    scratch: Path = args.scratch.resolve()
    out: Path = args.out or (scratch / "RESULTS-quick.md" if args.quick else HERE / "RESULTS.md")
    clean_scratch(scratch)
    machine = describe_machine(scratch)
    if machine.scratch_fs.startswith("tmpfs"):
        _log(f"warning: {scratch} is on tmpfs; disk numbers will be memory numbers")

    sampler = RssSampler().start()
    _log(f"building a {size_gib:g} GiB state dict")
    bench = build_state(size_gib)
    nbytes, tensors = bench.nbytes, bench.tensors
    state_line = (f"{nbytes / GIB:.3f} GiB ({nbytes:,} bytes) in {len(tensors)} float32 tensors "
                  f"(largest {bench.largest / (1 << 20):.1f} MiB): a {bench.layers}-layer transformer of width "
                  f"{bench.width}, {bench.params / 1e6:.1f} M parameters, plus AdamW exp_avg, exp_avg_sq and step")
    _log(f"state: {state_line}")

    sampler.phase("machine limits")
    _log("memcpy into a reused buffer")
    memcpy = limits.memcpy_reused(tensors, nbytes, limit_repeat)
    gc.collect()
    _log("memcpy into fresh /dev/shm")
    fresh = limits.memcpy_fresh_shm(tensors, nbytes, limit_repeat)
    _log("O_DIRECT write + fsync")
    direct = limits.odirect_write(scratch, nbytes, limit_repeat)
    _log("buffered write + fsync")
    buffered = limits.buffered_write(scratch, nbytes, limit_repeat)
    gc.collect()

    sampler.phase("torch.save")
    _log("torch.save + fsync")
    ts = torch_save(bench.state, scratch, repeat)

    results: list[CkptdResult] = []
    sampler.phase("ckptd start")
    _log("starting a ckptd daemon")
    with BenchDaemon(scratch) as daemon:
        sampler.watch_daemon(daemon.pid)
        for background in (False, True):
            name = "ckptd background" if background else "ckptd sync"
            sampler.phase(name)
            _log(f"{name}: 1 warm-up + {repeat} saves")
            results.append(run_client(daemon, bench.state, scratch, background=background, repeat=repeat))
        sampler.phase("ckptd stop")
    peaks = sampler.stop()
    sync, bg = results

    rows = [
        Row("memcpy → reused buffer", memcpy, None),
        Row("memcpy → fresh /dev/shm", fresh, None),
        Row("write O_DIRECT + fsync", direct, direct),
        Row("write buffered + fsync", buffered, buffered),
        Row("torch.save + fsync", ts.durable, ts.durable),
        Row("ckptd save_async, sync staging", sync.returned, sync.durable),
        Row("ckptd save_async, background staging", bg.returned, bg.durable),
        Row("ckptd background, until staged", bg.staged, bg.durable),
    ]
    cells = table_lines(rows, nbytes, memcpy.median, direct.median)
    text = summary(Findings(memcpy.median, fresh.median, direct.median, ts.durable.median, sync.returned.median,
                            sync.durable.median, bg.returned.median, bg.staged.median, bg.durable.median))
    rss = rss_lines({k: v for k, v in peaks.items() if k not in ("ckptd start", "ckptd stop")})
    print(render_text(cells))
    print()
    print(render_text(rss))
    print()
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(command=_command(), machine=machine, state_line=state_line, table=cells, text=text,
                            rss=rss, details=_details(rows, ts.serialize, ts.file_bytes, results, nbytes,
                                                    limit_repeat, repeat)))
    _log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
