"""Where an FSDP2 rank's blocking time goes (issue #30): cProfile of ``save_async`` on rank 0, beside a memcpy.

    python -m benchmarks.profile_sharded --ranks 4 --size-gib 1 --saves 5

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--saves", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckbench-prof-") as root, BenchDaemon(Path(root)) as daemon:
        out = run_ranks(args.ranks, _body, root, args.size_gib, args.saves, str(daemon.run_dir))
    print(f"{args.ranks} ranks, rank 0: {out['tensors']} tensors, {out['nbytes'] / 2**20:.0f} MiB; slowest rank's "
          f"medians: blocking {out['blocking']:.4f} s, memcpy {out['memcpy']:.4f} s "
          f"({out['blocking'] / out['memcpy']:.2f} x)")
    print(out["profile"])


if __name__ == "__main__":
    main()
