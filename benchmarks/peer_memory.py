"""Peers' in-memory checkpoints replicated to another node: lm-resiliency's GEMINI and DLRover's flash checkpoint (issue #28).

    /work/peervenv/bin/python -m benchmarks.peer_memory --mib 256 --repeat 3 [--only gemini,dlrover] [--no-pin]

Measurement only: both packages live in a venv of their own (``lm-resiliency`` 0.2.0, ``dlrover`` 0.6.1 with
``grpcio`` and ``tornado``, which its flash checkpoint imports, on ``torch`` 2.13.0+cpu) and are used as installed;
ckptd neither imports nor requires them. Two processes on 127.0.0.1, joined by a gloo process group of 2 ranks,
stand for two nodes of one rank each; by default rank r runs on core r alone with one intra-op thread, as two
nodes' CPUs are apart (``--no-pin``: both ranks on every core, torch's default threads). Each rank holds the state
benchmarks/replication.py uses, ``{"w": torch.randn(size // 4)}``, and both ranks save at once after a barrier.
In one run, for the same bytes:

- the machine's reference: a memcpy of the state into a reused buffer (``copy_``, one thread on one core when
  pinned), and the link's: both ranks exchanging the same bytes with plain gloo ``isend``/``irecv``;
- GEMINI (``lm_resiliency.checkpointing.InMemoryCheckpointManager``, disk tier off, 16 MiB replication chunks):
  blocking is ``save(state, step)`` returning; peer copy complete is ``finalize_replication()`` returning True
  (this rank's send and the peer's shard into this rank's peer slot both done; the exchange is symmetric);
- DLRover (``DdpCheckpointer(..., global_shard_num=2, replica_count=2)``, whose ``ShardCkptReplicaManager``
  all-gathers each rank's shared-memory buffer over gloo within ``save_checkpoint(..., StorageType.MEMORY)``):
  blocking is that call returning, and the peer's copy is complete when it returns, so both times are the same.

Times are per repetition the slower rank's, from the barrier's release; the first ``--warmup`` saves (default 2:
GEMINI rotates two own and two peer slots, so its second save is the first into fresh pages) are not in the
medians but are printed. After each save the peer's copy is checked against the sum of the peer's state (through
the packages' internal slot and shared-memory handles, for the check only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SYSTEMS = ("gemini", "dlrover")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(rank: int | None) -> None:
    if rank is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)


def memcpy(size: int, runs: int) -> list[float]:
    src = torch.randn(size // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return times


# ---------------------------------------------------------------- worker side (one rank, one "node")


def _worker(args: argparse.Namespace) -> None:
    rank, system = args.rank, args.worker
    if system == "dlrover":
        # dlrover's env_utils: each rank the only one (local rank 0) of node `rank`; TORCHELASTIC_RUN_ID names the
        # node's shared memory and socket directory, so two "nodes" on one machine do not share them.
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", RANK=str(rank), WORLD_SIZE="2", NODE_RANK=str(rank),
                          NODE_NUM="2", GROUP_RANK=str(rank), GROUP_WORLD_SIZE="2",
                          TORCHELASTIC_RUN_ID=f"{args.tag}n{rank}")
    import torch.distributed as dist

    _pin(rank if args.pin else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    size = args.mib << 20
    torch.manual_seed(rank)
    state = {"w": torch.randn(size // 4)}
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(sums, state["w"].double().sum().reshape(1))
    peer_sum = float(sums[1 - rank])
    runs = args.warmup + args.repeat
    out: dict = {"rank": rank, "blocking": [], "peer_complete": [], "checked": []}

    # the link: both ranks exchange the same bytes with plain gloo send/recv
    recv = torch.empty_like(state["w"])
    out["gloo_exchange"] = []
    for _ in range(runs):
        dist.barrier()
        started = time.perf_counter()
        works = [dist.isend(state["w"], 1 - rank), dist.irecv(recv, 1 - rank)]
        for w in works:
            w.wait()
        out["gloo_exchange"].append(time.perf_counter() - started)
    del recv

    scratch = Path(args.scratch) / f"{system}-{rank}"
    if system == "gemini":
        from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig

        config = InMemoryCkptConfig(interval=1, replication_jump=1, disk_flush_interval=0, disk_folder=str(scratch),
                                    run_id=args.tag, pin_memory=False)
        mgr = InMemoryCheckpointManager(config)
        print("READY", flush=True)
        for step in range(1, runs + 1):
            dist.barrier()
            started = time.perf_counter()
            mgr.save(state, step)
            out["blocking"].append(time.perf_counter() - started)
            ok = mgr.finalize_replication()
            out["peer_complete"].append(time.perf_counter() - started)
            got = mgr._buffer_pool.peer_current.tensors[0]  # the check only
            out["checked"].append(bool(ok) and abs(float(got.double().sum()) - peer_sum) <= 1e-6 * abs(peer_sum) + 1e-3)
        mgr.close()
    else:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        ckpt = DdpCheckpointer(checkpoint_dir=str(scratch), local_shard_num=1, global_shard_num=2, replica_count=2)
        engine = ckpt._engine
        print("READY", flush=True)
        out["saved"], out["own_checked"] = [], []
        own_sum = float(sums[rank])
        for step in range(1, runs + 1):
            dist.barrier()
            started = time.perf_counter()
            saved = engine.save_to_memory(step, {"model_states": state}, {"model_states": str(scratch / f"{step}.pt")})
            elapsed = time.perf_counter() - started
            out["blocking"].append(elapsed)
            out["peer_complete"].append(elapsed)  # the all-gather into the peer's shared memory is inside the call
            out["saved"].append(bool(saved))
            handler = engine._replica_manager._rank_shms.get(1 - rank)  # the check only
            ok = False
            if saved and handler is not None and handler.shared_memory is not None:
                meta = handler.metadata.get()["model_states"]["w"]
                got = torch.frombuffer(handler.shared_memory.buf, dtype=torch.float32, count=meta.numel,
                                       offset=meta.offset)
                ok = abs(float(got.double().sum()) - peer_sum) <= 1e-6 * abs(peer_sum) + 1e-3
                del got
            out["checked"].append(ok)
            own = engine._shm_handler  # and this rank's own copy, which the peer's replica must not replace
            meta = own.metadata.get()["model_states"]["w"]
            got = torch.frombuffer(own.shared_memory.buf, dtype=torch.float32, count=meta.numel, offset=meta.offset)
            out["own_checked"].append(abs(float(got.double().sum()) - own_sum) <= 1e-6 * abs(own_sum) + 1e-3)
            del got
        for handler in list(engine._replica_manager._rank_shms.values()):
            try:
                handler.close()
                handler.unlink()
            except Exception:  # noqa: BLE001 - cleanup only
                pass
    dist.barrier()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # dlrover's saver process and shared objects are torn down by the parent


# ---------------------------------------------------------------- parent side


def _run_pair(system: str, args: argparse.Namespace, scratch: str, attempt: int = 0) -> list[dict]:
    port, tag = _port(), f"peermem{os.getpid()}{system}{attempt}"
    procs, logs = [], []
    for rank in (0, 1):
        cmd = [sys.executable, "-W", "ignore", "-m", "benchmarks.peer_memory", "--worker", system, "--rank", str(rank),
               "--port", str(port), "--mib", str(args.mib), "--repeat", str(args.repeat), "--warmup",
               str(args.warmup), "--scratch", scratch, "--tag", tag] + ([] if args.pin else ["--no-pin"])
        # output to files, not pipes: dlrover's saver process (forked by the rank) inherits them and outlives it
        logs.append(Path(scratch) / f"{tag}-{rank}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    results, errors, started = [], [], False
    deadline = time.monotonic() + args.timeout
    try:
        ready_by = time.monotonic() + args.startup
        while time.monotonic() < ready_by and not started:
            time.sleep(0.5)
            started = all("\nREADY\n" in "\n" + log.read_text() for log in logs)
            if any(proc.poll() is not None for proc in procs):
                break
        if not started:
            errors.append(f"not started within {args.startup} s: " + " || ".join(log.read_text()[-600:] for log in logs))
        for proc, log in zip(procs if started else (), logs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                errors.append(f"timed out after {args.timeout} s: {log.read_text()[-2000:]}")
                break
            text = log.read_text()
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                errors.append(f"rank exited {proc.returncode}: {text.strip()[-3000:]}")
            else:
                results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for proc in procs:  # each rank's session: the rank and any process it started (dlrover's saver)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        shutil.rmtree(f"/tmp/ckpt_sock/{tag}n0", ignore_errors=True)
        shutil.rmtree(f"/tmp/ckpt_sock/{tag}n1", ignore_errors=True)
        for leftover in Path("/dev/shm").glob(f"{tag}*"):
            leftover.unlink(missing_ok=True)
    if errors and not started and attempt + 1 < args.attempts:
        print(f"{system}: attempt {attempt + 1} did not start: {errors[0][-400:]}", flush=True)
        return _run_pair(system, args, scratch, attempt + 1)
    if errors:
        raise RuntimeError(f"{system}: " + " | ".join(errors))
    return sorted(results, key=lambda r: r["rank"])


def _slower(results: list[dict], key: str) -> list[float]:
    return [max(pair) for pair in zip(*(r[key] for r in results))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default=",".join(SYSTEMS))
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--startup", type=int, default=60, help="seconds for both ranks to be ready (else retried)")
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    size = args.mib << 20
    med = statistics.median
    w = args.warmup
    print(f"{args.mib} MiB per rank, 2 ranks, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          + ("rank r on core r, one thread each" if args.pin else "unpinned"), flush=True)
    _pin(0 if args.pin else None)
    ref = memcpy(size, w + args.repeat)
    mc = med(ref[w:])
    print(f"memcpy into a reused buffer: {mc:.4f} s ({size / mc / 1e9:.2f} GB/s)", flush=True)
    every: dict = {"memcpy": ref}
    with tempfile.TemporaryDirectory(dir=os.environ.get("CKPTD_BENCH_DIR", "/tmp")) as scratch:
        for system in args.only.split(","):
            try:
                results = _run_pair(system, args, scratch)
            except Exception as error:  # noqa: BLE001 - report and go on to the next
                print(f"{system}: did not run: {error}", flush=True)
                every[system] = str(error)
                continue
            gloo, blocking, done = (_slower(results, k) for k in ("gloo_exchange", "blocking", "peer_complete"))
            g, b, d = med(gloo[w:]), med(blocking[w:]), med(done[w:])
            checked = all(all(r["checked"]) for r in results)
            own = [r.get("own_checked") for r in results]
            print(f"{system}: gloo exchange of the same bytes {g:.4f} s ({size / g / 1e9:.2f} GB/s, {g / mc:.2f} x "
                  f"memcpy); blocking {b:.4f} s ({b / mc:.2f} x memcpy); peer copy complete {d:.4f} s "
                  f"({d / mc:.2f} x memcpy, {d / g:.2f} x the gloo exchange); peer copies checked: {checked}"
                  + (f"; own copies intact after the save, rank 0 and 1: {own}" if own[0] is not None else ""),
                  flush=True)
            every[system] = {"gloo_exchange": gloo, "blocking": blocking, "peer_complete": done,
                             "per_rank": results}
    print("every repetition (first %d warm-up): %s" % (w, json.dumps(every)))


if __name__ == "__main__":
    main()
