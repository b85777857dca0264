"""Where an FSDP2 rank's blocking time goes (issue #30): cProfile of ``save_async`` on rank 0, beside a memcpy.

    python -m benchmarks.profile_sharded --ranks 4 --size-gib 1 --saves 5
    python -m benchmarks.profile_sharded --ranks 4 --size-gib 1 --saves 5 --dcp

``--dcp``: ``dcp.async_save`` (THREAD) through ``StorageWriter(stage_in_slot=True)`` instead, split into its phases
on every rank: DCP's planning (from the call to ``write_data``), building the shard from the plan
(``_planned_shard``) and the copy into the slot with the commit's round trip (to staged, when the call returns).
That split describes a writer that copies after DCP's plan (before commit eb3817b); since it stages ahead, the call
returns before the plan, so ``blocking`` is the copy alone and the phases after it run in the background.

Each rank (one intra-op thread, as torchrun sets it) builds the FSDP2 transformer (``state.build(fsdp=True)``), makes
a slot with a warm-up save, then times ``--saves`` saves with sync staging (each starting on a barrier) and the
same number of memcpys of its local bytes into a reused buffer; rank 0 profiles its saves. Prints the slowest rank's
medians and rank 0's functions by own time.
"""
from __future__ import annotations
import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path
import ckptd
import torch.distributed as dist
from . import limits, saves
from .ranks import run_ranks
from .saves import BenchDaemon
from .state import build


def _body(rank: int, root: str, size_gib: float, count: int, run_dir: str) -> dict:
    bench = build("transformer", size_gib, seed=rank, fsdp=True)
    memcpy = limits.memcpy_reused(bench.tensors, bench.nbytes, count, cleanup=dist.barrier)
    profile, blocking = cProfile.Profile(), []
    with ckptd.Client(run_dir=run_dir, spawn=False, max_inflight=1) as client:
        for i in range(1 + count):
            dist.barrier()
            if i and rank == 0:
                profile.enable()
            t0 = time.perf_counter()
            fut = client.save_async(bench.state, Path(root) / f"p-{i}", step=i)
            blocking.append(time.perf_counter() - t0)
            if i and rank == 0:
                profile.disable()
            fut.result()
    text = io.StringIO()
    if rank == 0:  # the others never enabled theirs: an empty profile has no stats
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    worst = saves.across_ranks([statistics.median(blocking[1:]), statistics.median(memcpy)])
    return {"blocking": worst[0], "memcpy": worst[1], "tensors": len(bench.tensors), "nbytes": bench.nbytes,
            "profile": text.getvalue()}


def _dcp_body(rank: int, root: str, size_gib: float, count: int, run_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from ckptd.client import dcp_writer
    from ckptd.dcp import StorageWriter

    bench = build("transformer", size_gib, seed=rank, fsdp=True)
    memcpy = limits.memcpy_reused(bench.tensors, bench.nbytes, count, cleanup=dist.barrier)
    marks: dict[str, float] = {}
    planned_shard = dcp_writer._planned_shard
    def timed_plan(*args):  # noqa: ANN001, ANN202
        marks["planned"] = time.perf_counter()
        flat = planned_shard(*args)
        marks["built"] = time.perf_counter()
        return flat
    dcp_writer._planned_shard = timed_plan
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    local_plan = DefaultSavePlanner.create_local_plan
    def timed_local_plan(self):  # noqa: ANN001, ANN202
        marks["local_start"] = time.perf_counter()
        out = local_plan(self)
        marks["local_end"] = time.perf_counter()
        return out
    DefaultSavePlanner.create_local_plan = timed_local_plan
    group = dist.new_group(backend="gloo")
    phases: dict[str, list[float]] = {"to_local_plan": [], "local_plan": [], "exchange": [], "building": [],
                                      "copy_commit": [], "blocking": []}
    with ckptd.Client(run_dir=run_dir, spawn=False, max_inflight=1) as client:
        for i in range(1 + count):
            dist.barrier()
            t0 = time.perf_counter()
            writer = StorageWriter(Path(root) / f"d-{i}", client=client, step=i, stage_in_slot=True)
            upload = dcp.async_save(bench.state, storage_writer=writer, process_group=group)
            t1 = time.perf_counter()
            upload.result()
            if i:
                for key, value in (("to_local_plan", marks["local_start"] - t0),
                                   ("local_plan", marks["local_end"] - marks["local_start"]),
                                   ("exchange", marks["planned"] - marks["local_end"]),
                                   ("building", marks["built"] - marks["planned"]),
                                   ("copy_commit", t1 - marks["built"]), ("blocking", t1 - t0)):
                    phases[key].append(value)
    dcp_writer._planned_shard, DefaultSavePlanner.create_local_plan = planned_shard, local_plan
    worst = saves.across_ranks([statistics.median(v) for v in phases.values()] + [statistics.median(memcpy)])
    return {**dict(zip(phases, worst)), "memcpy": worst[-1], "tensors": len(bench.tensors), "nbytes": bench.nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--dcp", action="store_true", help="dcp.async_save through ckptd's writer, split into phases")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckbench-prof-") as root, BenchDaemon(Path(root)) as daemon:
        out = run_ranks(args.ranks, _dcp_body if args.dcp else _body, root, args.size_gib, args.saves,
                        str(daemon.run_dir))
    if args.dcp:
        print(f"{args.ranks} ranks, rank 0: {out['tensors']} tensors, {out['nbytes'] / 2**20:.0f} MiB; slowest "
              "rank's medians (s): " + ", ".join(f"{k} {out[k]:.4f}" for k in ("to_local_plan", "local_plan", "exchange",
                                                                                 "building", "copy_commit", "blocking",
                                                                                 "memcpy")))
        return
    print(f"{args.ranks} ranks, rank 0: {out['tensors']} tensors, {out['nbytes'] / 2**20:.0f} MiB; slowest rank's "
          f"medians: blocking {out['blocking']:.4f} s, memcpy {out['memcpy']:.4f} s "
          f"({out['blocking'] / out['memcpy']:.2f} x)")
    print(out["profile"])


if __name__ == "__main__":
    main()
