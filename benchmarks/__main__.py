"""``python -m benchmarks``: every case of the registry, each in its own process, then the report.

Each case's JSON line goes to stdout and to ``<scratch>/run/results.jsonl`` (after a ``{"meta": ...}`` line), progress
to stderr; ``--report FILE`` renders a report from such a file without measuring.
"""
from __future__ import annotations
import argparse
import datetime
import fnmatch
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from .cases import Settings, missing_peers, registry, run_all
from .report import render

HERE = Path(__file__).resolve().parent

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks the harness in seconds")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the saved tensors live; cuda runs the GPU check alone (gpu_check, 4 GiB by default)")
    p.add_argument("--only", default="", help="comma-separated case names or sections, shell patterns allowed "
                                              "(e.g. 'save,load_ckptd*'); default every case")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--size-gib", type=float, default=None, help="state size for save and load (default 1)")
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions after one warm-up (default 3)")
    p.add_argument("--scratch", type=Path, default=HERE / "out",
                   help="directory on the disk under test; the run uses (and first empties) its run/ subdirectory")
    p.add_argument("--out", type=Path, default=None, help="where the report goes (default: benchmarks/RESULTS.md "
                                                          "for a full run, else <scratch>/run/RESULTS-<kind>.md)")
    p.add_argument("--report", type=Path, default=None, metavar="JSONL", help="render only, from a results.jsonl")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one case may take (default 1800)")
    return p

def _settings(args: argparse.Namespace) -> Settings:
    s = Settings.smoke(args.device) if args.smoke else Settings(device=args.device)
    if args.size_gib is not None:
        s.size_gib = args.size_gib
    if args.repeat is not None:
        s.repeat = s.limit_repeat = args.repeat
    if args.device == "cuda" and args.size_gib is None and not args.smoke:
        s.size_gib = 4.0  # the GPU check's state
    if s.repeat < 1 or s.size_gib <= 0:
        raise SystemExit("python -m benchmarks: --repeat must be at least 1 and --size-gib positive")
    return s

def machine(scratch: Path) -> dict[str, str]:
    """What the numbers were measured on, and which library commit."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(HERE.parent), *a], capture_output=True, text=True).stdout.strip()
    import psutil
    mounts = [p for p in psutil.disk_partitions(all=True) if str(scratch).startswith(p.mountpoint)]
    fs = max(mounts, key=lambda p: len(p.mountpoint)) if mounts else None
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    changed = git("status", "--porcelain", "--", "client", "ckptd", "protocol")
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / (1 << 30):.1f} GiB RAM, "
                   f"/dev/shm {shutil.disk_usage('/dev/shm').total / (1 << 30):.1f} GiB",
        "software": f"{platform.system()} {platform.release()}; Python {platform.python_version()}; "
                    f"torch {metadata.version('torch')}; ckptd {metadata.version('ckptd')}",
        "library measured": git("log", "-1", "--format=commit %h (%ad)", "--date=short", "--", "client", "ckptd",
                                "protocol") + ("; library files modified since" if changed else "; as committed"),
        "scratch": f"{scratch} on {fs.fstype} ({fs.device})" if fs else str(scratch),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }

def _log_tail(log: Path, lines: int = 40) -> str:
    """The last ``lines`` of a failed case's log, indented under its error line."""
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"    (its log {log} cannot be read: {exc})"
    return "\n".join(f"    | {line}" for line in tail)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report is not None:
        lines = [json.loads(x) for x in args.report.read_text().splitlines() if x.strip()]
        out = args.out or args.report.with_name("RESULTS-rendered.md")
        meta = {k: v for x in lines for k, v in x.get("meta", {}).items()}
        out.write_text(render([x for x in lines if "meta" not in x], meta))
        print(f"wrote {out}", file=sys.stderr)
        return 0
    cases = registry(_settings(args))
    skipped = missing_peers()
    for reason in skipped.values():
        print(f"[bench] skipping a peer: {reason}", file=sys.stderr, flush=True)
    patterns = [p.strip() for p in args.only.split(",") if p.strip()]
    if not patterns:  # a cuda run is the GPU check; a CPU run tries it only when named (or in a smoke run)
        cases = [c for c in cases if (c.section == "gpu") == (args.device == "cuda") or (args.smoke and c.section == "gpu")]
    if patterns:
        cases = [c for c in cases if any(fnmatch.fnmatch(c.name, p) or c.section == p for p in patterns)]
        if not cases:
            raise SystemExit(f"python -m benchmarks: no case matches --only {args.only!r} (see --list)")
    if args.list:
        print("\n".join(f"{c.name:28} {c.section:8} {c.label}" for c in cases))
        return 0
    scratch = args.scratch.resolve() / "run"  # ours alone: emptied at the start, whatever else is beside it
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    started = time.monotonic()
    meta = {"command": f"python -m benchmarks {shlex.join(argv if argv is not None else sys.argv[1:])}".strip(),
            **machine(scratch), **({"peers skipped": "; ".join(skipped.values())} if skipped else {})}
    records = []
    with open(scratch / "results.jsonl", "w", buffering=1) as f:  # the meta line(s), then one line per case
        f.write(json.dumps({"meta": meta}) + "\n")
        for case, record in zip(cases, run_all(cases, scratch, timeout=args.timeout)):
            print(json.dumps(record), file=f)
            print(json.dumps(record), flush=True)
            print(f"[bench] {case.name}: {record.get('error') or 'done'}", file=sys.stderr, flush=True)
            if "error" in record:  # the cause where it is read (a CI log), not only in a scratch file gone after
                print(_log_tail(scratch / "logs" / f"{case.name}.log"), file=sys.stderr, flush=True)
            records.append(record)
        meta["wall time of the run"] = f"{(time.monotonic() - started) / 60:.1f} min"
        f.write(json.dumps({"meta": {"wall time of the run": meta["wall time of the run"]}}) + "\n")
    full = not (args.smoke or patterns or args.size_gib or args.repeat or args.device != "cpu")
    kind = "smoke" if args.smoke else "partial" if args.device == "cpu" else args.device
    out = args.out or (HERE / "RESULTS.md" if full else scratch / f"RESULTS-{kind}.md")
    out.write_text(render(records, meta))
    print(f"[bench] wrote {out}", file=sys.stderr)
    return 1 if any("error" in r for r in records) else 0

if __name__ == "__main__":
    sys.exit(main())
