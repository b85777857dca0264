"""``ckptd start | status | stop | list | verify | inspect | export``.

``start``, ``status`` and ``stop`` talk to (or are) the daemon; ``list``,
``verify``, ``inspect`` and ``export`` read checkpoints from disk and need none.

Exit codes: 0 success, 1 no daemon answers, 2 usage error, 3 the daemon (or
start-up) reported an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ckptd.protocol.endpoint import default_run_dir
from ckptd.protocol.names import DRAIN_FAILED_NAME
from ckptd.protocol.errors import CkptdError, DaemonUnavailable
from ckptd.protocol.messages import Error, SnapshotList, ListSnapshots, Status, StatusReply, Stop
from ckptd.protocol.objects import display
from ckptd.protocol.reading import files_for

from ckptd.core.config import DaemonConfig, check_peer_endpoint
from ckptd.core.render import human_bytes, printable, render_status
from ckptd.tools.control import request
from ckptd.tools.options import add_start_options, config_kwargs, detached_argv, path_arg, positive_int, seconds

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
    add_start_options(start)
    start.add_argument("--quiet", action="store_true", help="with --foreground: log to the log file only")

    status = with_run_dir(sub.add_parser("status", help="show what the daemon is doing"))
    status.add_argument("--json", action="store_true", help="print the status snapshot as JSON")
    status.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for an answer")
    status.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    status.add_argument("--interval", type=seconds, default=1.0, help="seconds between redraws with --watch")
    status.add_argument("--count", type=positive_int, default=None, help="with --watch: stop after this many redraws")

    listing = with_run_dir(sub.add_parser("list", help="list the checkpoints under a directory (no daemon needed)"))
    listing.add_argument("root", type=path_arg, help="a directory or an s3:// prefix")
    listing.add_argument("--json", action="store_true", help="print the listing as JSON")

    verify = with_run_dir(sub.add_parser("verify", help="check a checkpoint's index, headers and checksums"))
    verify.add_argument("path", type=path_arg, help="a checkpoint directory or s3:// URL")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")

    inspect = with_run_dir(sub.add_parser("inspect", help="describe a checkpoint without reading tensor data"))
    inspect.add_argument("path", type=path_arg, help="a checkpoint directory or s3:// URL")
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")

    _export_parser(sub)

    peer_key = with_run_dir(sub.add_parser("peer-key", help="print this node's peer public key, as a line of the "
                                                             "--peer-keys file (made on first use)"))
    peer_key.add_argument("--endpoint", default=None, metavar="tcp://HOST:PORT",
                          help="this node's --peer-listen endpoint, for peers that connect to it (--peer)")

    stop = with_run_dir(sub.add_parser("stop", help="finish in-flight saves, then exit"))
    stop.add_argument("--timeout", type=seconds, default=300.0,
                      help="seconds to wait for the daemon to answer and drain (default 300)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir: Path = (args.run_dir or default_run_dir()).absolute()
    try:
        return {"start": _start, "status": _status, "stop": _stop, "list": _list, "verify": _verify,
                "inspect": _inspect, "export": _export, "peer-key": _peer_key}[args.command](args, run_dir)
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


def lost_snapshots(pid: int | None, failed: list[str]) -> str:
    """The one line that says a drain lost held snapshots (``path: why`` each)."""
    return (f"ckptd: daemon (pid {pid}) stopped, but could not persist {len(failed)} held snapshot(s), now lost: "
            + "; ".join(failed))


def _peer_key(args: argparse.Namespace, run_dir: Path) -> int:
    from ckptd.core.keys import key_line

    if args.endpoint is not None:
        check_peer_endpoint("--endpoint", args.endpoint)  # as --peer-listen checks it
    print(key_line(run_dir, args.endpoint))
    return EXIT_OK


def _start(args: argparse.Namespace, run_dir: Path) -> int:
    from ckptd.loop.daemon import StartFailed, run_foreground, start_detached

    config = DaemonConfig(run_dir=run_dir, **config_kwargs(args), log_to_stderr=args.foreground and not args.quiet)
    if args.foreground:
        lost = run_foreground(config)
        if lost:  # what a supervisor sees of a drain that lost held snapshots (``ckptd stop`` says the same)
            print(lost_snapshots(os.getpid(), lost), file=sys.stderr)
            return EXIT_ERROR
        return EXIT_OK
    try:
        pid = start_detached(["--run-dir", str(run_dir), *detached_argv(config, args)], run_dir)
    except StartFailed as exc:  # the daemon's own line and exit code, as a --foreground start gives them
        print(f"ckptd: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"ckptd started (pid {pid}) on {config.endpoint}")
    return EXIT_OK


def _list(args: argparse.Namespace, run_dir: Path) -> int:
    from ckptd.tools.listing import add_memory, list_checkpoints, render_listing

    on_disk = files_for(args.root).holds_checkpoints(args.root)
    rows = list_checkpoints(args.root) if on_disk else []
    try:  # the node's daemon, if one answers, knows which checkpoints are (also) in memory
        held = request(run_dir, ListSnapshots(1), timeout=1.0)
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
    export.add_argument("--max-shard-size", default="5GB",
                        help="largest output file: 5GB = 5*10**9 bytes, 2GiB = 2*2**30")
    export.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)


def _export(args: argparse.Namespace, run_dir: Path) -> int:
    from ckptd.tools.export import export_checkpoint

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
    from ckptd.loop.daemon import wait_for_exit

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
        print(lost_snapshots(pid, failed), file=sys.stderr)
        return EXIT_ERROR
    print(f"ckptd stopped (pid {pid})")
    return EXIT_OK
