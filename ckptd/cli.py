"""``ckptd start | status | stop | list | verify | inspect | export``.

``start``, ``status`` and ``stop`` talk to (or are) the daemon; ``list``,
``verify``, ``inspect`` and ``export`` read checkpoints from disk and need none.

Exit codes: 0 success, 1 no daemon answers, 2 usage error, 3 the daemon (or
start-up) reported an error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from ckptd.protocol.endpoint import default_run_dir
from ckptd.protocol.errors import CkptdError, DaemonUnavailable
from ckptd.protocol.messages import Error, SnapshotList, Snapshots, Status, StatusReply, Stop
from ckptd.protocol.objects import check_url, display, is_object_path, object_url

from .config import DaemonConfig
from .control import request
from .render import human_bytes, printable, render_status

EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description="Per-node asynchronous checkpoint writer.")
    sub = p.add_subparsers(dest="command", required=True)

    def with_run_dir(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--run-dir", type=Path, default=None,
                        help="daemon run directory (default: $CKPTD_RUN_DIR, $XDG_RUNTIME_DIR/ckptd or /tmp/ckptd-UID)")
        return sp

    start = with_run_dir(sub.add_parser("start", help="start this node's daemon"))
    start.add_argument("--foreground", action="store_true", help="run in this process (for supervisors and tests)")
    start.add_argument("--root", action="append", type=_path_arg, default=None, metavar="DIR",
                       help="allow checkpoints below DIR (repeatable; default $CKPTD_ROOTS or /)")
    start.add_argument("--max-concurrent-writes", type=_positive_int, default=2, metavar="N",
                       help="shard files written at once on this node (default 2)")
    start.add_argument("--exit-when-idle", type=_seconds, default=None, metavar="SECONDS",
                       help="exit after this long with no clients and no work")
    start.add_argument("--buffered-io", action="store_true", help="do not use O_DIRECT")
    start.add_argument("--keep", action="append", default=None, metavar="DIR=K", type=_keep_arg,
                       help="retention: keep only the K newest checkpoints in DIR and below (repeatable)")
    start.add_argument("--mirror", action="append", default=None, metavar="DIR=s3://BUCKET/PREFIX", type=_mirror_arg,
                       help="upload every checkpoint committed under DIR to the prefix after its commit (repeatable)")
    start.add_argument("--mirror-keep", type=_positive_int, default=None, metavar="N",
                       help="keep only the N newest mirrored checkpoints beside each upload on the store")
    start.add_argument("--max-concurrent-loads", type=_positive_int, default=None, metavar="N",
                       help="default cap on ranks of this node loading at once (loads that ask for it)")
    start.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                       help="serve Prometheus metrics on this port (needs prometheus-client)")
    start.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                       help="address for --metrics-port (default 127.0.0.1)")
    start.add_argument("--metrics-textfile", type=Path, default=None, metavar="FILE",
                       help="write Prometheus metrics to FILE every second")
    start.add_argument("--sweep", choices=("remove", "move", "off"), default="remove",
                       help="on start, remove (default), move aside, or keep orphaned .incomplete directories")
    start.add_argument("--drain-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="on stop, wait this long for checkpoints still missing ranks (default 60)")
    start.add_argument("--storage", default=os.environ.get("CKPTD_STORAGE") or None, metavar="MODULE:CLASS",
                       help="checkpoint storage implementation (default $CKPTD_STORAGE, else the local filesystem)")
    start.add_argument("--housekeeping-interval", type=_seconds, default=1.0, metavar="SECONDS",
                       help="how often to look for dead clients and overdue checkpoints (default 1)")
    start.add_argument("--memory-budget", type=_memory_budget, default=None, metavar="BYTES",
                       help="node memory for held snapshots, e.g. 8GiB (default: half of /dev/shm's free space, "
                            "at most a quarter of the RAM)")
    start.add_argument("--keep-snapshots", type=_positive_int, default=1, metavar="K",
                       help="newest memory snapshots kept per checkpoint directory (default 1)")
    start.add_argument("--persist-on-exit", choices=("newest", "never"), default="newest",
                       help="when a trainer closes or dies, write its newest snapshot to disk (default newest)")
    start.add_argument("--quiet", action="store_true", help="with --foreground: log to the log file only")

    status = with_run_dir(sub.add_parser("status", help="show what the daemon is doing"))
    status.add_argument("--json", action="store_true", help="print the status snapshot as JSON")
    status.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait for an answer")
    status.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    status.add_argument("--interval", type=_seconds, default=1.0, help="seconds between redraws with --watch")
    status.add_argument("--count", type=_positive_int, default=None, help="with --watch: stop after this many redraws")

    listing = with_run_dir(sub.add_parser("list", help="list the checkpoints under a directory (no daemon needed)"))
    listing.add_argument("root", type=_path_arg)
    listing.add_argument("--json", action="store_true")

    verify = with_run_dir(sub.add_parser("verify", help="check a checkpoint's index, headers and checksums"))
    verify.add_argument("path", type=_path_arg)
    verify.add_argument("--json", action="store_true")

    inspect = with_run_dir(sub.add_parser("inspect", help="describe a checkpoint without reading tensor data"))
    inspect.add_argument("path", type=_path_arg)
    inspect.add_argument("--json", action="store_true")

    _export_parser(sub)

    stop = with_run_dir(sub.add_parser("stop", help="finish in-flight saves, then exit"))
    stop.add_argument("--timeout", type=_seconds, default=300.0,
                      help="seconds to wait for the daemon to answer and drain (default 300)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir: Path = (args.run_dir or default_run_dir()).absolute()
    try:
        return {"start": _start, "status": _status, "stop": _stop, "list": _list, "verify": _verify,
                "inspect": _inspect, "export": _export}[args.command](args, run_dir)
    except BrokenPipeError:  # the reader left (`ckptd status --json | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail
        return EXIT_OK
    except DaemonUnavailable as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except OSError as exc:  # its words and the name, not Python's "[Errno 13]"
        named = f"{display(exc.filename)}: {exc.strerror}" if exc.strerror and exc.filename else exc
        print(f"ckptd: {named}", file=sys.stderr)
        return EXIT_ERROR
    except CkptdError as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


def _start(args: argparse.Namespace, run_dir: Path) -> int:
    from .daemon import run_foreground, start_detached

    kwargs = {"run_dir": run_dir, "max_concurrent_writes": args.max_concurrent_writes,
              "exit_when_idle": args.exit_when_idle, "direct_io": not args.buffered_io,
              "keep_last": dict(args.keep or []), "sweep": args.sweep,
              "mirrors": dict(args.mirror or []), "mirror_keep": args.mirror_keep,
              "max_concurrent_loads": args.max_concurrent_loads, "metrics_port": args.metrics_port,
              "metrics_addr": args.metrics_addr, "metrics_textfile": args.metrics_textfile,
              "drain_timeout": args.drain_timeout, "storage": args.storage,
              "housekeeping_interval": args.housekeeping_interval, "keep_snapshots": args.keep_snapshots,
              "persist_on_exit": args.persist_on_exit}
    if args.memory_budget is not None:
        kwargs["memory_budget"] = args.memory_budget
    if args.root:
        kwargs["roots"] = tuple(args.root)
    config = DaemonConfig(**kwargs, log_to_stderr=args.foreground and not args.quiet)
    if args.foreground:
        run_foreground(config)
        return EXIT_OK
    argv = ["--run-dir", str(run_dir), "--max-concurrent-writes", str(config.max_concurrent_writes)]
    argv += [a for r in config.roots for a in ("--root", display(r))]
    if args.exit_when_idle is not None:
        argv += ["--exit-when-idle", str(args.exit_when_idle)]
    if args.buffered_io:
        argv.append("--buffered-io")
    argv += [a for d, k in config.keep_last.items() for a in ("--keep", f"{d}={k}")]
    argv += [a for d, r in config.mirrors.items() for a in ("--mirror", f"{d}={object_url(r)}")]
    if config.mirror_keep is not None:
        argv += ["--mirror-keep", str(config.mirror_keep)]
    argv += ["--sweep", config.sweep, "--drain-timeout", str(config.drain_timeout),
             "--housekeeping-interval", str(config.housekeeping_interval),
             "--keep-snapshots", str(config.keep_snapshots), "--persist-on-exit", config.persist_on_exit]
    if args.memory_budget is not None:
        argv += ["--memory-budget", str(config.memory_budget)]
    if config.max_concurrent_loads is not None:
        argv += ["--max-concurrent-loads", str(config.max_concurrent_loads)]
    if config.metrics_port is not None:
        argv += ["--metrics-port", str(config.metrics_port), "--metrics-addr", config.metrics_addr]
    if config.metrics_textfile is not None:
        argv += ["--metrics-textfile", str(config.metrics_textfile.absolute())]
    if config.storage is not None:
        argv += ["--storage", config.storage]
    pid = start_detached(argv, run_dir)
    print(f"ckptd started (pid {pid}) on {config.endpoint}")
    return EXIT_OK


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def _memory_budget(text: str) -> int:
    from .export import parse_size

    if text.strip().lstrip("-").isdigit():  # a plain number (0, -1): the range check names the bounds
        return int(text)
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, optionally with a suffix (8GiB, 500MB), "
                                         f"got {text!r}") from None


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port between 1 and 65535, got {text!r}")
    return int(text)


def _keep_arg(text: str) -> tuple[Path, int]:
    directory, sep, count = text.rpartition("=")
    if not sep or not directory or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected DIR=K with K >= 1, got {text!r}")
    return Path(directory), int(count)


def _path_arg(text: str) -> Path:
    """A local path or an s3:// URL, checked as the client checks one (``check_url``) before a Path collapses it."""
    try:
        check_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(text)


def _mirror_arg(text: str) -> tuple[Path, Path]:
    local, sep, remote = text.partition("=")
    if not sep or not local or not remote.startswith("s3://"):
        raise argparse.ArgumentTypeError(f"expected DIR=s3://BUCKET/PREFIX, got {text!r}")
    return Path(local), _path_arg(remote)


def _list(args: argparse.Namespace, run_dir: Path) -> int:
    from .listing import add_memory, list_checkpoints, render_listing

    on_disk = is_object_path(args.root) or args.root.is_dir()
    rows = list_checkpoints(args.root) if on_disk else []
    try:  # the node's daemon, if one answers, knows which checkpoints are (also) in memory
        held = request(run_dir, Snapshots(1), timeout=1.0)
    except DaemonUnavailable:
        held = None
    if isinstance(held, SnapshotList):
        rows = add_memory(rows, held.snapshots, args.root)
    if not on_disk and not rows:  # a directory that holds only memory snapshots need not exist on disk
        raise ValueError(f"{args.root} is not a directory and the daemon holds no snapshots under it: "
                         f"give the directory that holds the checkpoints")
    print(json.dumps(rows, indent=2) if args.json else render_listing(rows))
    return EXIT_OK


def _verify(args: argparse.Namespace, run_dir: Path) -> int:
    from ckptd.protocol.inspect import verify_checkpoint

    report = verify_checkpoint(args.path)
    if args.json:
        print(json.dumps({"path": str(report.path), "ok": report.ok, "problems": report.problems,
                          "checked_bytes": report.checked_bytes}, indent=2))
    elif report.ok:
        print(f"{printable(str(report.path))}: ok ({report.checked_bytes} bytes checked)")
    else:
        for problem in report.problems:
            print(f"ckptd: {printable(problem)}", file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_ERROR


def _inspect(args: argparse.Namespace, run_dir: Path) -> int:
    from ckptd.protocol.inspect import inspect_checkpoint

    info = inspect_checkpoint(args.path).to_dict()
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"{printable(info['path'])}: step {info['step']}, {info['world_size']} rank(s), {human_bytes(info['bytes'])}")
    for shard in info["shards"]:
        print(f"  rank {shard['rank']}: {shard['file']} ({human_bytes(shard['size'])}, {len(shard['tensors'])} tensors)")
        for t in shard["tensors"]:
            print(f"    {printable(t['name']):<48} {t['dtype']:<8} {str(t['shape']):<20} {human_bytes(t['bytes'])}")
    return EXIT_OK


def _export_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write full tensors as Hugging Face safetensors (no torch needed)")
    export.add_argument("path", type=Path, help="a committed checkpoint")
    export.add_argument("outdir", type=Path, help="new (or empty) directory for model*.safetensors")
    export.add_argument("--prefix", default="", help="export only tensors named PREFIX..., with PREFIX removed")
    export.add_argument("--max-shard-size", default="5GB", help="largest output file (5GB = 10**9 bytes, 2GiB)")
    export.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)


def _export(args: argparse.Namespace, run_dir: Path) -> int:
    from .export import export_checkpoint

    result = export_checkpoint(args.path, args.outdir, prefix=args.prefix, max_shard_size=args.max_shard_size)
    index_note = " and an index" if result.tensor_files < len(result.files) else ""
    print(f"{result.outdir}: {result.tensors} tensors, {human_bytes(result.total_size)} "
          f"in {result.tensor_files} safetensors file(s){index_note}")
    if result.skipped_per_rank:
        print(f"  left out {result.skipped_per_rank} per-rank tensors of a {args.path} saved by several ranks "
              "(they differ between ranks; save them with replicated= to export them)")
    return EXIT_OK


def _status(args: argparse.Namespace, run_dir: Path) -> int:
    if args.watch and args.json:
        raise ValueError("--watch and --json do not go together")
    shown = 0
    while True:
        reply = request(run_dir, Status(1), timeout=args.timeout)
        if isinstance(reply, Error):
            print(f"ckptd: daemon error {reply.code}: {reply.message}", file=sys.stderr)
            return EXIT_ERROR
        assert isinstance(reply, StatusReply)
        if args.json:
            print(json.dumps(reply.info, indent=2, sort_keys=True))
            return EXIT_OK
        if args.watch:
            print(CLEAR_SCREEN + time.strftime("%H:%M:%S") + f"  (every {args.interval:g} s, Ctrl-C to stop)")
        print(render_status(reply.info), flush=True)
        shown += 1
        if not args.watch or (args.count is not None and shown >= args.count):
            return EXIT_OK
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return EXIT_OK


def _stop(args: argparse.Namespace, run_dir: Path) -> int:
    from .daemon import DRAIN_FAILED_NAME, wait_for_exit

    deadline = time.monotonic() + args.timeout  # the whole command, answers and drain alike
    status = request(run_dir, Status(1), timeout=min(5.0, args.timeout))
    reply = request(run_dir, Stop(2), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
    if isinstance(reply, Error):
        print(f"ckptd: daemon error {reply.code}: {reply.message}", file=sys.stderr)
        return EXIT_ERROR
    pid = status.info["daemon"]["pid"] if isinstance(status, StatusReply) else None
    if pid is not None and not wait_for_exit(pid, max(0.0, deadline - time.monotonic())):
        print(f"ckptd: daemon (pid {pid}) still draining after {args.timeout:g} s", file=sys.stderr)
        return EXIT_ERROR
    try:
        failed = (run_dir / DRAIN_FAILED_NAME).read_text().splitlines()
    except FileNotFoundError:
        failed = []
    if failed:
        print(f"ckptd: daemon (pid {pid}) stopped, but could not persist {len(failed)} held snapshot(s), now lost: "
              + "; ".join(failed), file=sys.stderr)
        return EXIT_ERROR
    print(f"ckptd stopped (pid {pid})")
    return EXIT_OK
