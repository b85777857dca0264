"""``dcp.save`` with a ``ckptd.dcp.StorageWriter`` per save: a client per writer against the process's shared one.

Not part of ``make bench``: run it under torchrun (one rank or several, gloo
on CPU), with a daemon for ``folder``'s root running or spawned::

    CKPTD_ROOTS=/ckpts torchrun --nproc-per-node 2 benchmarks/dcp_clients.py /ckpts/bench-clients

Each rank holds ``--mib`` MiB of float32 tensors (DCP spreads the writes over
the ranks) and saves them ``--saves`` times each way, a writer per save as
DCP code makes them, to ``step-N`` paths (``keep_last=2``), each save after a
barrier; a save's time is the slowest rank's, from ``StorageWriter(...)`` to
``dcp.save`` returning (committed). First one warm-up save through a client
of its own (closed), so neither way pays the process's first DCP save.

* ``per_save``: ``StorageWriter(path, client=ckptd.Client())``, what
  ``StorageWriter(path)`` did before writers shared a client (closed after the
  timed part; the old default never closed it, so each save also left its
  slot in ``/dev/shm`` until exit);
* ``shared``: ``StorageWriter(path)``.

Rank 0 prints one JSON line: each way's first and median later save, and
``per_save`` over ``shared`` for both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd.dcp import StorageWriter


def _timed(path: Path, step: int, state: dict, own: bool) -> float:
    """One save's time on the slowest rank: the writer made, then ``dcp.save``."""
    dist.barrier()
    start = time.perf_counter()
    client = ckptd.Client() if own else None
    writer = StorageWriter(path, step=step, keep_last=2, client=client)
    dcp.save(state, storage_writer=writer)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if client is not None:
        client.close()
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--mib", type=int, default=64, help="MiB of tensors per rank (default 64)")
    parser.add_argument("--saves", type=int, default=6, help="saves each way (default 6)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    count = 16
    state = {"model": {f"layer{i}.weight": torch.randn(args.mib * (1 << 20) // 4 // count) for i in range(count)},
             "step": 0}
    with ckptd.Client() as warm_up:
        dcp.save(state, storage_writer=StorageWriter(args.folder / "warm-up", client=warm_up))
    times: dict[str, list[float]] = {"per_save": [], "shared": []}
    for way in times:
        for step in range(1, args.saves + 1):
            times[way].append(_timed(args.folder / way / f"step-{step:06d}", step, state, own=way == "per_save"))
    if rank == 0:
        summary = {way: {"first": round(t[0], 4), "steady": round(statistics.median(t[1:]), 4)}
                   for way, t in times.items()}
        ratios = {k: round(summary["per_save"][k] / summary["shared"][k], 2) for k in ("first", "steady")}
        print(json.dumps({"world": world, "mib_per_rank": args.mib, "saves": args.saves, **summary,
                          "per_save_over_shared": ratios, "every": {w: [round(x, 4) for x in t]
                                                                    for w, t in times.items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
