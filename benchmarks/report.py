"""From the cases' JSON lines to ``RESULTS.md``: targets as data rows, tables side by side, every repetition.

Nothing here measures, so a changed report renders again from a run's ``results.jsonl``. Every ratio is against a
limit measured in the same run. A failed case is listed, and whatever depends on it shows as "–".
"""
from __future__ import annotations
import statistics
from dataclasses import dataclass
from typing import Any, Callable

GIB, MIB, GB = 1 << 30, 1 << 20, 1e9
Records = dict[str, dict]

def med(rec: dict | None, key: str) -> float | None:
    values = (rec or {}).get("reps", {}).get(key)
    return statistics.median(values) if values else None

def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None

def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"

def nbytes(rec: dict) -> int:
    return rec.get("nbytes") or rec["state"]["nbytes"]

EVERY_CKPTD = ("ckptd_sync", "ckptd_bg")
"""ckptd's documented ways of a snapshot every step (``benchmarks/every_step.py``)."""
EVERY_PEERS = ("dcp_stager", "torchckpt", "gemini")
"""The peers' captures every step; the one of least step overhead in the run is the strongest."""

FIELDS: dict[str, Callable[[dict], float | None]] = {  # any other field: the median of that repetition list
    "first_blocking": lambda r: r.get("first", {}).get("blocking"),
    "extra_per_state": lambda r: div(r.get("trainer_extra"), r["state"]["nbytes"]),
    "daemon_anon": lambda r: ((r.get("writer") if "ckptd" in r["name"] or r["method"] == "scaling" else r.get("daemon"))
                              or {}).get("RssAnon"),
    "daemon_cpu_per_gb": lambda r: div((r.get("writer") or {}).get("cpu"), nbytes(r) / GB),
    "gbps": lambda r: div(nbytes(r) / GB, med(r, "aggregate")),
    "raw_gbps": lambda r: div(nbytes(r) / GB, med(r, "single")),
    "blocking_per_gib": lambda r: div(med(r, "blocking"), nbytes(r) / GIB),
    "durable_per_gib": lambda r: div(med(r, "durable"), nbytes(r) / GIB),
    **{f"{m}_overhead": (lambda m: lambda r: overhead(r, m))(m) for m in EVERY_CKPTD},
    "ckptd_overhead": lambda r: min((v for m in EVERY_CKPTD if (v := overhead(r, m)) is not None), default=None),
    "peer_overhead": lambda r: strongest_peer(r)[0],
}

def overhead(r: dict, mode: str) -> float | None:
    """A mode's step overhead in an ``everystep`` record: per round, the median of its steps less the median of
    the plain steps right before them; the median over the rounds."""
    steps, plain = r["reps"].get(f"{mode}_round"), r["reps"].get(f"{mode}_plain")
    return statistics.median(s - p for s, p in zip(steps, plain)) if steps and plain else None

def strongest_peer(r: dict) -> tuple[float, str] | tuple[None, None]:
    """The lowest step overhead of the peers' modes in an ``everystep`` record, and that mode."""
    found = [(v, m) for m in EVERY_PEERS if (v := overhead(r, m)) is not None]
    return min(found) if found else (None, None)

@dataclass(frozen=True)
class Target:
    """``measured`` ("case.field") over ``reference`` (the value itself where None) must be ``op`` ``bound``.
    Case ``*``: the highest over every case; ``scaling:base`` / ``scaling:top``: the sizes nearest 1 GiB, largest;
    ``best:a,b,c``: the lowest of those cases measured in the run, whose label fills ``{peer}`` in ``text``.
    """
    text: str
    measured: str
    reference: str | None
    bound: float
    issue: int
    op: str = "≤"

S, W, L, F = "ckptd_sync", "write_direct.seconds", "load_raw_read.cold", "sharded_process"
PEERS = ("dcp_process", "dcp_process_stager", "dcp_thread_stager", "torchckpt_fsync")
"""The durable peer configurations a user would pick today; the fastest of them in the run is the strongest peer
(torch-checkpointing with the fsyncs it leaves out: without them it is not durable)."""
BEST, SHARDED_BEST = (f"best:{','.join(f'{prefix}{p}' for p in peers)}.durable" for prefix, peers in
                      (("", PEERS), ("sharded_", [p.removeprefix("dcp_") for p in PEERS])))
TARGETS = [Target(*row) for row in (  # text, measured, reference (None: the value itself), bound, issue[, op]
    ("blocking with sync staging ≤ 1.2 × memcpy into a reused buffer", f"{S}.blocking", "memcpy.seconds", 1.2, 5),
    ("background staging: blocking ≤ 10 ms", "ckptd_bg.blocking", None, 0.010, 5),
    ("background staging: staged ≤ 1.5 × memcpy", "ckptd_bg.staged", "memcpy.seconds", 1.5, 5),
    ("time to durable ≤ 1.15 × raw O_DIRECT write + fsync (sync staging)", f"{S}.durable", W, 1.15, 5),
    ("time to durable ≤ 0.5 × DCP async_save PROCESS", f"{S}.durable", "dcp_process.durable", 0.5, 5),
    ("time to durable ≤ 0.5 × the strongest peer: {peer} (the fastest durable of DCP PROCESS, PROCESS + stager, "
     "THREAD + stager, torch-checkpointing + fsyncs)", f"{S}.durable", BEST, 0.5, 30),
    ("trainer extra memory ≤ 1.05 × state (background staging)", "ckptd_bg.extra_per_state", None, 1.05, 5),
    ("daemon RssAnon ≤ 100 MB (highest of every case)", "*.daemon_anon", None, 100e6, 5),
    *((f"clients at once, {what}: aggregate ≥ 85% of raw O_DIRECT bandwidth", f"{case}.gbps", "multi_raw.raw_gbps",
       0.85, issue, "≥") for what, case, issue in (("separate checkpoints", "multi_separate", 5),
                                                   ("one checkpoint", "multi_one", 5),
                                                   ("8 ranks, one checkpoint", "multi_one_many", 15))),
    ("scaling, blocking s/GiB at the largest size ≤ 1.25 × at 1 GiB", "scaling:top.blocking_per_gib",
     "scaling:base.blocking_per_gib", 1.25, 5),
    ("scaling, durable s/GiB at the largest size ≤ 1.25 × at 1 GiB", "scaling:top.durable_per_gib",
     "scaling:base.durable_per_gib", 1.25, 5),
    ("daemon CPU-seconds per GB written ≤ 0.1 (sync staging)", f"{S}.daemon_cpu_per_gb", None, 0.1, 15),
    ("time to durable ≤ 1.1 × raw O_DIRECT write + fsync (sync staging)", f"{S}.durable", W, 1.1, 15),
    ("blocking with sync staging ≤ 1.15 × memcpy", f"{S}.blocking", "memcpy.seconds", 1.15, 15),
    ("blocking with sync staging ≤ 1.1 × memcpy into reused memory", f"{S}.blocking", "memcpy.seconds", 1.1, 30),
    ("1,000 tensors of 256 B: blocking ≤ 5 ms", f"{S}_small.blocking", None, 0.005, 15),
    ("first save blocking ≤ 2 × a steady one", f"{S}.first_blocking", f"{S}.blocking", 2.0, 15),
    ("first save blocking without reserve_bytes ≤ 2 × a steady one", f"{S}_noreserve.first_blocking",
     f"{S}_noreserve.blocking", 2.0, 30),
    ("load_into one state dict, cold ≤ 1.15 × raw read", "load_ckptd_load_into_sd.cold", L, 1.15, 15),
    ("ckptd.load (owning copy), cold ≤ 1.2 × raw read", "load_ckptd_load_cpu.cold", L, 1.2, 15),
    ("FSDP2: blocking ≤ 1.2 × memcpy of the rank's local bytes", "sharded_ckptd.blocking", "sharded_memcpy.seconds",
     1.2, 10),
    ("FSDP2: time to durable ≤ 0.5 × DCP async_save PROCESS", "sharded_ckptd.durable", f"{F}.durable", 0.5, 10),
    ("FSDP2: time to durable ≤ 0.5 × DCP async_save PROCESS, reused stager", "sharded_ckptd.durable",
     f"{F}_stager.durable", 0.5, 10),
    ("FSDP2: time to durable ≤ 0.5 × the strongest peer: {peer} (the fastest durable of DCP PROCESS, PROCESS + "
     "stager, THREAD + stager, torch-checkpointing + fsyncs)", "sharded_ckptd.durable", SHARDED_BEST, 0.5, 30),
    ("FSDP2, dcp.async_save with ckptd's writer: time to durable ≤ 0.5 × with DCP's FileSystemWriter (PROCESS)",
     "sharded_ckptd_dcp.durable", f"{F}.durable", 0.5, 22),
    ("FSDP2, dcp.async_save with ckptd's writer: blocking ≤ DCP's own writer's staged time (reused stager)",
     "sharded_ckptd_dcp.blocking", f"{F}_stager.staged", 1.0, 22),
    ("FSDP2, dcp.async_save with ckptd's writer: blocking ≤ the staged time of DCP's own stager at its fastest: "
     "{peer} (the lower of PROCESS and THREAD, each with a reused DefaultStager)", "sharded_ckptd_dcp.blocking",
     "best:sharded_process_stager,sharded_thread_stager.staged", 1.0, 30),
    ("s3:// save to durable ≤ 1.11 × obstore put (upload ≥ 0.9 ×)", "objects.durable", "objects.raw_up", 1.11, 14),
    ("s3:// load ≤ 1.11 × obstore ranged gets (download ≥ 0.9 × raw)", "objects.load", "objects.raw_down", 1.11, 14),
    ("s3:// save blocking ≤ 1.1 × a local save's", "objects.blocking", "objects.local_blocking", 1.1, 14),
    ("snapshot blocking ≤ 1.1 × a disk save's blocking", "snapshots.blocking", "snapshots.disk_blocking", 1.1, 13),
    ("restore from memory ≤ 1.5 × memcpy into fresh memory", "snapshots.restore", "snapshots.memcpy_fresh", 1.5, 13),
    ("restore from memory ≤ 0.3 × a cold disk load", "snapshots.restore", "snapshots.cold_load", 0.3, 13),
    ("load_into from memory ≤ 2 × memcpy into the same targets", "snapshots.restore_into", "snapshots.memcpy_into",
     2.0, 20),
    ("load_into from memory, verify=False ≤ 1.2 × memcpy into the same targets", "snapshots.restore_into_unverified",
     "snapshots.memcpy_into", 1.2, 20),
    ("FSDP2: reshard load, cold ≤ 0.8 × dcp.load", "sharded_load_ckptd.cold", "sharded_load_dcp.cold", 0.8, 10),
    ("a snapshot every step, sync staging: step overhead ≤ 1.5 × one memcpy of the state",
     "everystep.ckptd_sync_overhead", "everystep.copy", 1.5, 40),
    ("a snapshot every step, background staging: step overhead ≤ 1.5 × one memcpy of the state",
     "everystep.ckptd_bg_overhead", "everystep.copy", 1.5, 40),
    ("a snapshot every step: ckptd's step overhead (the lower of sync and background staging) ≤ 0.5 × the "
     "strongest peer's at every step (the lowest of DCP + reused stager, torch-checkpointing, lm-resiliency)",
     "everystep.ckptd_overhead", "everystep.peer_overhead", 0.5, 40),
    ("GPU: D2H staging into the pinned slot ≥ 90% of a pinned to(\"cpu\", non_blocking=True) (speed)",
     "gpu_check.to_cpu", "gpu_check.ckptd_staged", 0.9, 30, "≥"),
    ("GPU: blocking with sync staging ≤ DCP's pinned DefaultStager's staged time", "gpu_check.ckptd_blocking",
     "gpu_check.dcp_staged", 1.0, 30),
    ("GPU: background staging's staged time ≤ DCP's pinned DefaultStager's", "gpu_check.ckptd_bg_staged",
     "gpu_check.dcp_staged", 1.0, 30),
    ("GPU: steps between saves with background staging ≤ with awaited staging (interval of N steps)",
     "gpu_check.background_interval", "gpu_check.awaited_interval", 1.0, 30))]
SEPARATE = [  # measured by scripts of their own, not by ``make bench``: each with its command, date and load
    "DCP writer per save (issue #26, `CKPTD_ROOTS=... OMP_NUM_THREADS=1 torchrun --nproc-per-node N "
    "benchmarks/dcp_clients.py DIR --mib 128 --saves 8`, N = 1 and 2, 2026-12-01, library commit 398619d, load "
    "average 9-10: other work shared the machine; both ways in one run, so only the ratios compare): "
    "`dcp.save` with a `StorageWriter(path)` made per save, time from the writer made to committed, slowest rank. "
    "A client per writer (what `StorageWriter(path)` did before) over the process's shared client (what it does "
    "now): first save 1.27 × (1 rank: 0.52 s vs 0.41) and 1.57 × (2 ranks: 0.57 vs 0.36); steady saves 3.08 × "
    "(0.55 vs 0.18) and 2.04 × (0.50 vs 0.24). The old default also never closed its clients: each save left its "
    "slot (the rank's shard) in /dev/shm until the process exited.",
    ("First save without reserve_bytes, where its blocking went and what changed (issue #30, `python -m "
     "benchmarks.first_save --mib 256 --repeat 3`): on 2026-12-02 at load 2.0 the fresh slot's posix_fallocate "
     "(allocating every page) took 0.067 s and its populate for writing (zeroing and mapping every page) 0.084 s, "
     "against 0.020 s for the copy: the first save blocked 8.6 x a steady one's. /dev/shm has no huge pages here "
     "(shmem_enabled: never; anon THP: madvise). Options measured side by side on 256 MiB (2026-12-02, load 1.3-2.2, "
     "steady copy 0.029-0.06 s): the copy faulting the pages itself 0.127 s; a helper thread faulting the next "
     "16 MiB ahead of the copy 0.25-0.32 s (worse: both cores were busy); pages already allocated and zeroed by "
     "another process (what a warm spare segment the daemon kept would give), mapped with MADV_POPULATE_READ "
     "(fault-around: 16 pages a fault, writable in a shared tmpfs mapping) 0.016 s + the copy at steady speed "
     "(1.5 x, but only where a spare of the right size exists); pwritev of the tensors into the empty file "
     "(tmpfs allocates each page and copies into it, no zeroing, no page-table entries) 0.09-0.12 s on 1-2 "
     "threads. The last is what a fresh slot's first save does now (client/fill.py, commit d328f41): the slot's "
     "tail is reserved with posix_fallocate after, and its mapping populated on a helper thread for the next save. "
     "Through a real daemon (same command, 2026-12-02, library commit b2d1c4b, load 8.7-10: other sessions' test "
     "suites shared the machine): with OMP_NUM_THREADS=1 a fresh client's first save blocked 0.314 s against "
     "0.252 s for its steady saves (1.25 x; firsts 0.259-0.431 s, steadies 0.169-0.494 s); with torch on both "
     "cores the steady saves took 0.35-5.6 s at that load (torch's spinning OpenMP team on stolen cores; the "
     "first save's pwritev has none), so that ratio (0.17 x) says nothing. The bench case ckptd_sync_noreserve "
     "and its target (first save without reserve_bytes <= 2 x a steady one) are in the registry; no full run was "
     "made this round to fill its row."),
    ("FSDP2 blocking, profiled (issue #30, `python -m benchmarks.profile_sharded --ranks 4 --size-gib 1 --saves "
     "5`, 2026-12-02, load 11-15: other sessions' work shared the machine, so only the split is meaningful): "
     "cProfile of rank 0's five saves (one intra-op thread per rank, streamed commit by default there): "
     "torch._foreach_copy_ 3.5 s of 8.2 s, flatten 3.9 s, of it dtensor_chunk 2.2 s (DeviceMesh.__hash__ for the "
     "layout caches' keys, the rank asked of torch.distributed twice per DTensor, the placements checked again) and "
     "msgpack ExtType 0.5 s. After caching the chunk layout by mesh identity, placements, shape and rank (commit "
     "b2d1c4b): flatten 1.09 s of the profile, the copy 2.5 s. Blocking over a memcpy of the rank's local bytes in "
     "those runs: 0.94 x and 1.52 x, within the spread the load makes (the target row needs a quiet run)."),
    ("GPU check (issue #30): `python -m benchmarks --device cuda` runs one case (benchmarks/gpu_check.py: a 4 GiB "
     "state on the GPU; D2H staging into the pinned slot against a pinned to(\"cpu\", non_blocking=True) of the "
     "same tensors, blocking and staged time against DCP's pinned DefaultStager, step-time cost of background "
     "against awaited staging with a small MLP training between saves) and writes benchmarks/out/run/results.jsonl "
     "and RESULTS-cuda.md (`--out FILE` elsewhere). No GPU was lent this round: it ran on the CPU only "
     "(`python -m benchmarks --only gpu_check --size-gib 0.125 --repeat 2`, 73 s at load 12), which tries the "
     "harness; its CPU figures say nothing about a GPU and are not recorded."),
    "Replication to a buddy node and restore from it (issue #28, `python -m benchmarks.replication --mib 1024 "
    "--repeat 3`, 2026-12-02, library commit fef9cb4, 2 cores, load 2.7 falling from 4.6: another session's work "
    "shared the machine; two daemons on 127.0.0.1 as two nodes, CurveZMQ on; medians of the steady repetitions, "
    "every one below). The link's limits in the same run: a raw ZeroMQ stream of the same 1 GiB between two "
    "processes, four 16 MiB frames in flight, 0.88 s (1.22 GB/s) plain and 3.78 s (0.28 GB/s) with CURVE, whose "
    "encryption runs on one libzmq I/O thread. Held to replicated 5.47 s (0.20 GB/s): 0.69 x the CURVE stream's "
    "speed, 0.16 x the plain one's (target >= 0.70 of the stream: met only against the encrypted stream, just "
    "short; striping a stream over several connections, so that several I/O threads encrypt, is the next lever, "
    "untried). A replicated snapshot's blocking 0.35 s against 0.22 s unreplicated (1.53 x, target <= 1.05: "
    "missed here); on one machine the buddy's unlinking of the 1 GiB replica it replaced (tmpfs freeing its "
    "pages, after its seal was answered) runs on the same two cores as the next save's copy, which separate nodes "
    "would not share, and this was not measured apart. Restore of the lost node (origin SIGKILLed, a replacement "
    "started; `latest()` reads the replica back, then `load_into`) 5.94 s against 0.83 s for a cold `load_into` "
    "of the same state from disk (7.2 x): the read back is bound by the same encrypted stream. The buddy held "
    "1.00 x the origin's own snapshot bytes in replicas (target <= 2 x). `lm-resiliency` and DLRover's flash "
    "checkpoint were not measured: neither was installed (both pull in their frameworks' training stacks), which "
    "remains to do.\n  every repetition: raw 1.149, 0.884, 0.845 s; raw CURVE 3.955, 3.784, 3.654 s; unreplicated "
    "blocking 1.174 (first save of the client's second slot), 0.205, 0.231 s; replicated blocking 3.471 (the same "
    "first save into a second slot), 0.353, 0.334 s; held to replicated 8.377, 5.473, 5.375 s; restore 6.794, "
    "5.799, 5.937 s; cold disk load 2.238, 0.829, 0.619 s.",
    "Replication again, and where its blocking goes (issue #28; `python -m benchmarks.replication --mib 1024 "
    "--repeat 3`, then the same with `--pin`, 2026-12-03, commit 42a4e4c, 2 cores, load 0.1 and 0.6, run one "
    "after the other; medians of 3). `--pin` puts the buddy's daemon on core 1 and the trainer with the origin's "
    "daemon on core 0, as two nodes' CPUs are apart. Unpinned: blocking 0.183 s replicated against 0.124 s "
    "unreplicated (**1.47 ×**, target ≤ 1.05, missed); held to replicated 2.43 s, 0.69 × the CURVE stream (1.67 "
    "s, 0.64 GB/s; plain 0.54 s, 2.00 GB/s); restore (latest + load_into) 3.29 s against a cold disk load_into "
    "0.70 s (4.7 ×); the buddy held 1.00 × the origin's bytes. Pinned: blocking 0.256 s against 0.227 s (**1.13 "
    "×**, missed by less), held to replicated 2.70 s, 0.94 × the CURVE stream (2.55 s on one core); restore 2.88 "
    "s against 0.73 s cold (3.9 ×). So most of the unpinned excess (0.47 of it) is the buddy's work (decrypting, "
    "checksumming, then freeing the replaced 1 GiB replica) on the trainer's cores, which separate nodes do not "
    "share; 0.13 remains with the buddy on a core of its own, not measured apart (the origin's daemon, on the "
    "trainer's core, unpins and drops the snapshot the newer one replaces while the next save copies). Every "
    "repetition, unpinned: blocking plain 0.546 (first save into the client's second slot), 0.124, 0.123 s, "
    "replicated 0.456 (the same), 0.183, 0.143 s; held to replicated 2.614, 2.431, 2.370 s; restore 3.331, 2.923, "
    "3.291 s; cold 0.700, 0.714, 0.609 s. Pinned: blocking plain 0.337, 0.210, 0.227 s, replicated 0.484, 0.256, "
    "0.236 s; held to replicated 2.715, 2.701, 2.399 s; restore 2.875, 3.207, 2.760 s; cold 0.751, 0.653, 0.729 "
    "s. An `s3://` load of the same state was not measured (lm-resiliency and DLRover: the next bullet).",
    "Restore of a lost node from its buddy, profiled and made faster (issue #40, item 2; `python -m "
    "benchmarks.replication --mib 30 --repeat 9 --restore-only`, 2026-12-07, library commit 661365f, 2 cores, "
    "**load 11.7-12.3: other work loaded the machine throughout**, so only ratios within one run compare; two "
    "daemons on 127.0.0.1 as two nodes, CurveZMQ on; medians of 9). Profile (wall-clock marks in the client and "
    "both daemons, not committed; medians of 6 restores of 30 MiB, load 11-12), before / after: listing "
    "(`latest()`'s PeerSnapshots, of it 3 ms the new link's TCP connect, CURVE handshake and ZAP) 5.4 / 7.7 ms; "
    "the Restore request to its reply 298 / 90 ms, of it the second listing 1.6 / 1.6 ms, the new shm file "
    "(fallocate) 7.1 / 7.0 ms, the fetch 265 / 80 ms (within it the copy into the file 53 ms through a fresh "
    "mapping's page faults / 7 ms by pwrite, crc32c 8 / 1.4 ms, the rest waiting on the two ends' CURVE ciphers),"
    " holding it and the reply 10 / 0.9 ms; load_into from this node's memory 24 / 19 ms; other client work 1 ms;"
    " total 330 / 117 ms. The request round trips cost nothing measurable either way (every piece was asked for "
    "before the first came back); with 16 MiB pieces the buddy's encryption of a whole piece and its decryption "
    "here ran one after the other (each ZeroMQ I/O thread ciphers a whole message), with 2 MiB pieces, eight "
    "ahead, they overlap. In the recorded run: restore (latest + load_into) 0.124 s (latest 0.096 s, load_into "
    "0.023 s) against a cold disk load_into of the same state 0.030 s (**4.12 ×, target ≤ 1.0: missed**) and an "
    "s3:// load_into on moto 0.073 s (**1.71 ×, target ≤ 1.0: missed**); before the change, in a run at the same "
    "load (`--repeat 5`, commit 103ecc7), 0.246 s against 0.031 s cold (8.03 ×) and 0.108 s s3:// (2.28 ×). Cause"
    " of the miss, measured in the same run: a raw CURVE stream of the same 30 MiB between two processes takes "
    "0.059 s in the restore's pieces (0.061 s in 16 MiB frames; plain ZeroMQ 0.022 s), itself 2.0 × the cold disk"
    " load and 0.8 × the s3:// one, so no restore over CurveZMQ meets ≤ 1.0 × the disk here; the rest is fixed "
    "(listing 8 ms, shm file 7 ms, load_into 20 ms). The bulk transport of item 1 (an AEAD or MAC over a plain "
    "data connection) is what is left to meet it.\n  every repetition: restore 0.124, 0.136, 0.116, 0.117, 0.133, "
    "0.111, 0.202, 0.119, 0.142 s; latest 0.104, 0.114, 0.093, 0.096, 0.104, 0.089, 0.083, 0.089, 0.115 s; "
    "load_into 0.020, 0.023, 0.023, 0.022, 0.029, 0.022, 0.119, 0.030, 0.027 s; cold 0.026, 0.060, 0.030, 0.029, "
    "0.024, 0.081, 0.029, 0.032, 0.190 s; s3:// 0.127, 0.076, 0.073, 0.071, 0.073, 0.085, 0.091, 0.064, 0.064 s; "
    "raw CURVE in 2 MiB pieces 0.074, 0.062, 0.059, 0.052, 0.048, 0.051, 0.092, 0.057, 0.060 s; raw CURVE 16 MiB "
    "0.099, 0.070, 0.095, 0.092, 0.057, 0.054, 0.054, 0.054, 0.061 s; raw plain 0.054, 0.032, 0.153, 0.025, "
    "0.016, 0.020, 0.022, 0.016, 0.018 s.",
    "Peers' in-memory checkpoints with a copy on another node: lm-resiliency's GEMINI and DLRover's flash "
    "checkpoint (issue #28; `/work/peervenv/bin/python -m benchmarks.peer_memory --mib 256 --repeat 3 --only "
    "gemini`, then `... --mib 256 --repeat 2 --warmup 0 --only dlrover`, 2026-12-03, 2 cores, load 1.5 and 2.2; a "
    "venv of their own: `lm-resiliency` 0.2.0, `dlrover` 0.6.1 plus `grpcio` and `tornado`, which its flash "
    "checkpoint imports though they are only in its `k8s` extra, on torch 2.13.0+cpu; neither is a ckptd "
    "requirement). Two processes joined by a 2-rank gloo group on 127.0.0.1 stand for two nodes, rank r alone on "
    'core r with one thread; each holds `{"w": torch.randn(size // 4)}` of 256 MiB and both save at once; times '
    "are the slower rank's; the peer's copy was checked against the peer's state after every save. Both run on "
    'CPU. GEMINI (`InMemoryCheckpointManager`, disk tier off, 16 MiB chunks; on CPU its "async" device copy is a '
    "synchronous `copy_` on the caller, then a thread sends and receives over gloo): blocking (`save`) 0.141 s, "
    "**1.83 ×** a memcpy of the same bytes in the same run (0.077 s, one core); peer copy complete "
    "(`finalize_replication()` True) 0.471 s, **6.11 ×** memcpy and 1.80 × a plain gloo exchange of the same "
    "bytes (0.262 s, 1.03 GB/s). DLRover (`DdpCheckpointer(global_shard_num=2, replica_count=2)`, whose "
    "`ShardCkptReplicaManager` all-gathers each rank's shared-memory buffer inside `save_to_memory`, so the call "
    "returns with the peer's copy done): 81.4 s and 83.9 s per save, blocking and complete alike, **1,314 ×** "
    "that run's steady memcpy (0.064 s) and 305 × its gloo exchange (0.275 s). cProfile at 16 MiB: 11.8 s of a "
    "12.1 s save in `replica.py` `_gather_peer_ckpt` itself, whose `torch.ByteTensor(buffer)` builds the tensor "
    "from the shared memory's memoryview element by element (4 MiB: 1.30 s, against 0.014 s for "
    "`torch.frombuffer(...).clone()`); that line is the same whatever the device. Also measured: on the second "
    "node the peer's replica replaced that node's own checkpoint (the own shared memory no longer held rank 1's "
    "state after any save; rank 0's was intact): the replica's `SharedMemoryHandler(local_rank=config.rank)` gets "
    "the name `ckpt_shm_0`, the name of node 1's own local rank 0, and `_create_shared_memory` attaches to an "
    "existing segment of that name. Started without `dlrover-run` (the engine forks its own saver), one start of "
    'seven hung with a rank stopped after "Notify agent to create a checkpoint saver" (its saver never made) and '
    "one more hung in engine start without a cause found; the script retries a start that is not ready in 60 s "
    "(no retry was needed in the measured runs). Every repetition (first two of GEMINI are warm-ups, the second "
    "the first save into its other slot; DLRover's first is its first save): memcpy 0.247, 0.070, 0.069, 0.077, "
    "0.087 s (GEMINI run), 0.198, 0.064 s (DLRover run); gloo exchange 0.602, 0.237, 0.256, 0.262, 0.279 s and "
    "0.673, 0.275 s; GEMINI blocking 0.437, 0.411, 0.134, 0.143, 0.141 s, peer copy complete 1.272, 1.103, 0.450, "
    "0.484, 0.471 s; DLRover save 81.426, 83.949 s.",
    "DCP writer, where its blocking goes (issue #30, `python -m benchmarks.profile_sharded --ranks 4 --size-gib 1 "
    "--saves 5 --dcp`, phases per rank, slowest rank's medians): before (2026-12-03, library commit eb3817b^, "
    "load 6-10 while a test suite ran, so only the split counts) planning took most of the block: to DCP's local "
    "plan 0.06 s, the local plan 0.49 s, the plan exchange and global plan 2.56 s, building the shard 0.17 s, the "
    "copy and commit 0.40 s, against a memcpy of the rank's bytes of 0.37 s. Staged before the plan now (commit "
    "eb3817b, client/dcp_writer.py `_stage_ahead`): at load 0.9 blocking 0.29 s against that memcpy's 0.25 s "
    "(1.17 ×); the plan runs after `async_save` returned. The full run's rows (0.72 × DCP's THREAD stager's "
    "staged time) are in the table above.",
    "The dense save cases rerun alone (issue #30, `python -m benchmarks --only 'memcpy,write_direct,ckptd_sync,"
    "ckptd_sync_noreserve,torchckpt_fsync,dcp_thread_stager' --repeat 5`, 2026-12-03T07:44Z, library commit 3381e19, "
    "load average 0.9, right after the full run above): sync blocking 0.193 s against a memcpy of 0.181 s (1.06 ×, "
    "met: ≤ 1.1), where the full run had 1.42 ×; durable 0.950 s against torch-checkpointing with the fsyncs "
    "durability needs 2.239 s (0.42 ×, met: ≤ 0.5; DCP THREAD + reused stager 2.617 s), where the full run had "
    "0.51 ×; first save without reserve_bytes 0.564 s against 0.193 s steady (2.92 ×, missed as in the full run). "
    "The two runs' spread is that of two quiet runs of the same code on this machine.",
    "A snapshot every step and the first saves (issue #40, items 5 and 6), 2026-12-07, 2 cores (AMD EPYC), "
    "**loaded**: other sessions' DeepSpeed runs and test suites shared the machine (load 0.3-2.5 in the first run, "
    "3-6 in the others), so step-time overheads spread by more than a capture costs (the memcpy floor's own overhead "
    "read 0.80-1.41 × its copy); only the CPU figures and in-run ratios compare. `python -m benchmarks --only "
    "everystep --repeat 3` (library 0c8f45f, load 0.3-2.5): overhead ÷ memcpy sync 2.15, background -1.11 (noise), "
    "daemon at nice 19 1.69, DCP + reused stager 10.1, torch-checkpointing 10.0, GEMINI 0.95; CPU over plain ÷ "
    "memcpy's 3.30, 3.40, 3.70, 17.0, 16.3, 1.80. Again with `--repeat 5` (library 2fe2c9e, load 4.7-5.8): "
    "overhead ÷ memcpy 1.70 sync, 1.93 background, 2.30 niced, 18.8 DCP, 18.3 torch-checkpointing, 0.49 GEMINI "
    "(targets ≤ 1.5 × memcpy and ≤ 0.5 × the strongest peer: missed); CPU over plain ÷ memcpy's 2.33, 1.73, 3.00, "
    "14.7, 14.9, 1.53; the daemon's checksum threads 0.020 CPU-s a step. Side by side in one run (a script of the "
    "session's, 10 rounds, load 3.3; ckptd's daemon with its CRC32C stubbed out is a measurement only): overhead ÷ "
    "memcpy 1.61 sync, 1.56 sync without checksum, 1.41 niced, 1.22 background, 0.81 background without "
    "checksum, 1.07 background niced; CPU over plain 0.054, 0.032, 0.047, 0.042, 0.027, 0.045 s against memcpy's "
    "0.025. Phases of one sync snapshot save with no training beside it (257 MiB): copy 0.016 s, accept round "
    "trip 0.0075, flatten and send 0.0004; held 0.017-0.020 s later (the CRC32C). A snapshot client's first saves "
    "(a script of the session's, torch on one thread, 256 MiB transformer state, 0.3 s between saves, 4 clients "
    "with SlotPool.lend as before commit 2fe2c9e and 4 with it, alternating in one run, load 4.4): blocking of "
    "saves 1 to 5 before 0.322, 0.280, 0.095, 0.088, 0.084 s, after 0.327, 0.093, 0.096, 0.072, 0.074 s (save 2: "
    "3.0 × a steady one before, 1.1 × after; its CPU 0.173 against 0.049 s); the first save stays 3.5-4 × a steady "
    "one. `OMP_NUM_THREADS=1 python -m benchmarks.first_save --mib 256 --repeat 3` (library 2fe2c9e, load 5.9 "
    "rising to 11 as this session's tests ran beside it): pwritev into an empty slot 0.24-0.78 s on one thread "
    "against a steady copy of 0.18-0.26 s, a disk save's first save 6.8 × its steady ones, a snapshot client's "
    "saves 1.84, 1.40, 0.44, 0.41, 0.43 s: the second slot's preparation on its helper thread, starved of a core, "
    "had not ended by the second save.",
]
PEER_NOTES = [  # how each peer is configured, and why: rendered under the first table of peers
    "DCP + reused DefaultStager: one stager for every save (its staging copies kept); PROCESS stages into shared "
    "memory for its checkpoint process, THREAD (whose writer is a thread of the trainer) into private memory.",
    "torch-checkpointing 0.1.1 (`CheckpointManager`, its default async saver): `save` returns once staging started "
    "on a thread; staged is when `manager.lock()` (its guard for an optimizer step) can be taken; a writer "
    "subprocess per rank, spawned when the manager is built (just before the first save here, which waits for it: "
    "the first save blocking column) `torch.save`s each item to `tmp_<name>/<item>_<rank>.pt`, meets the other "
    "ranks on the process group's store and rank 0 renames the directory. Its default O_DIRECT writes fail on this "
    "ext4 (EINVAL: torch.save's records are unaligned; the failed save leaves `tmp_<name>` behind), so both rows "
    "write buffered (`use_direct_io=False`).",
    "torch-checkpointing never fsyncs: its \"no fsync\" row is durable as it reports it (written to the page cache, "
    "not on disk); the \"+ fsyncs\" row adds what durability needs as its own write hooks, timed inside the save "
    "(`benchmarks/fsync_hooks.py`): each rank fsyncs the files it wrote before the barrier and rename, then rank 0 "
    "the checkpoint directory and its parent. Only that row competes for the strongest peer.",
    "torch-checkpointing on FSDP2: the rank's DTensor shards with the default `ItemSpec` (loadable on the same "
    "world size). Its resharding save (`ItemSpec(resharder=DefaultResharder())`) gathers metadata in CUDA tensors "
    "(`metadata_manager._all_gather_pickled_data`, `device=\"cuda\"`) and fails without CUDA, so it is not measured "
    "on gloo.",
]
CAUSES = [  # of misses, as measured in runs of their own (per-thread /proc CPU, perf_counter, thread_time)
    "FSDP2 blocking: one intra-op thread per rank (as now): 0.94 × and 1.60 × in runs at load average 8 and 16 "
    "(2: 1.29 ×).",
    "Daemon CPU/GB (0.12): CRC32C thread 0.07 (14-15 GB/s per core, 256 KiB-64 MiB buffers alike, GIL released), writer "
    "0.025 in 64 MiB O_DIRECT writes (0.07 in 8 MiB: kernel cost per call), loop + commit 0.02: CRC32C is 70% of 0.1.",
    "Durable: streamed (the default only where torch's copy leaves a core free) 1 GiB was durable at 0.83 × raw, "
    "blocking 1.17 ×.",
    "Sync blocking: side by side 0.082 s vs the same per-tensor memcpy 0.077 (1.06 ×); the limit itself spans 0.065-0.077 "
    "s between runs. Background staged: its copy takes 0.12-0.13 s on the staging thread, 0.075 on the caller's; with "
    "OMP_WAIT_POLICY=passive both take 0.11-0.12: the staging thread's OpenMP team beside the caller's spinning one.",
    "Owning load: fresh pages' faults, 0.45-0.5 CPU-s per GB (a raw read: 0.15), now on a helper thread: a gain "
    "if a core is idle.",
    "1,000 × 256 B: 4.6 ms at load 1.7, 5-6.6 at 5-7: caller CPU 3.2 ms (flatten 1.4, copy 0.45), accept round "
    "trip 1.3-1.8.",
    "First save: 1.12-1.53 × a steady one at load 1.7; a new slot costs 0.53 CPU-s/GiB under memory pressure, "
    "0.02 s when free.",
    "Ranks at once: 2 intra-op threads per rank spun 4.1 CPU-s/round (1: 0.21); others' processes: 3.9 of 4.4 "
    "CPU-s/round.",
    "s3:// on moto (256 MiB): moto's CPU is the wall time (2.2-2.9 CPU-s a phase, one GIL); any ranged GET of a 16-part "
    "object costs it 0.15 CPU-s (it joins the parts), so both loads make 16; an s3:// save costs the daemon 0.37 "
    "CPU-s.",
    "Spread between make bench runs of this round (same code, shared disk): load_into cold 0.98 and 1.28 × raw, snapshot "
    "blocking 0.94 and 1.21 × a disk save's, FSDP2 reshard load 0.55 and 0.81 × dcp.load.",
    "A snapshot every step (issue #40, item 5; 257 MiB, one memcpy 0.024-0.027 s): ckptd's work beyond the copy is the "
    "daemon's CRC32C of the shard, 0.018-0.022 CPU-s a step on the step's two cores (held waits for it); the "
    "client's and daemon's bookkeeping is under 0.005 CPU-s, the accept round trip 1-8 ms of a sync step (ping 0.3 "
    "ms; the rest is the admission's hops between threads, worse under load). With the checksum stubbed out "
    "(a measurement), CPU per step over plain fell from 2.2 × to 1.3 × memcpy's (sync) and from 1.7 × to 1.1 × "
    "(background). The daemon at nice 19 gained nothing consistent (1.41-2.30 × against 1.61-2.15 ×). Against "
    "GEMINI (≤ 0.5 ×): its capture is one copy_ per tensor and no checksum (0.5-1.0 × memcpy), and no capture "
    "that copies the state can cost less than that copy on two cores the step keeps busy.",
    "First save without reserve_bytes (issue #40, item 6; 256 MiB): tmpfs allocates each 4 KiB page of the fresh "
    "slot as the first save writes it (pwritev 0.13-0.17 s on one thread against a 0.035-0.045 s copy into reused "
    "pages; no huge pages in /dev/shm, and allocation into one file does not scale over 2-4 threads); a second "
    "Client's first save pays the same (its pool is its own, and close() leaves nothing in /dev/shm, so a closed "
    "client's slots cannot wait for the next). A snapshot client's second save no longer does: its slot is prepared "
    "when the first is lent (commit 2fe2c9e).",
    "Restore from memory vs a cold load: a memcpy of the same bytes into fresh memory is itself 0.5 × this disk's cold "
    "load (page faults on fresh memory), so 0.3 × is out of reach here; restore is one read of the slot plus CRC32C.",
    "load_into from memory: another process's /dev/shm pages cost per 4 KiB page here (no huge pages: shmem_enabled "
    "never): 256 MiB preadv from a slot 0.034 s (7.9 GB/s, one core; two threads no faster with both cores busy), "
    "mapped 0.044-0.045 (faults or MAP_POPULATE), memmove between touched pages of one process 0.014 (19 GB/s). So "
    "2.5 × memcpy is the floor of any copy out of a slot. Measured apart on 0.96 GiB in 60 tensors: load_into "
    "unverified 0.155 s (preadv alone: 4 × 0.034), verified 0.185 (the CRC runs behind each 8 MiB piece), memmove "
    "0.054; the copy through fresh memory that load_into made before took 1.3 s.",
    "First save without reserve_bytes (2.9 × in the full run and in a rerun of the dense save cases, repeat 5): the "
    "fresh slot's pages are allocated by tmpfs as the first save writes them (pwritev, one thread: 0.56 s for 1 GiB, "
    "where the steady copy into mapped pages takes 0.19 s on torch's two threads); `benchmarks.first_save` (below) "
    "measured the options, and what remains is the kernel allocating 262,144 pages on the save's thread.",
]

def field(rec: dict, name: str) -> float | None:
    return FIELDS[name](rec) if name in FIELDS else med(rec, name)

def best(recs: Records, where: str) -> tuple[float, str] | tuple[None, None]:
    """``best:a,b,c.field``: the lowest ``field`` of the cases measured, and that case's name."""
    cases, name = where.removeprefix("best:").split(".")
    found = [(v, c) for c in cases.split(",") if c in recs and (v := field(recs[c], name)) is not None]
    return min(found) if found else (None, None)

def _resolve(recs: Records, where: str) -> float | None:
    """The value ``where`` ("case.field") names in ``recs`` (None where it was not measured)."""
    if where.startswith("best:"):
        return best(recs, where)[0]
    case, name = where.split(".")
    if case == "*":
        values = [v for r in recs.values() if (v := field(r, name)) is not None]
        return max(values) if values else None
    if case.startswith("scaling:"):
        points = sorted((r for r in recs.values() if r["section"] == "scaling"), key=lambda r: r["size_gib"])
        if len(points) < 2:
            return None
        return field(points[-1] if case.endswith("top") else min(points, key=lambda r: abs(r["size_gib"] - 1)), name)
    return field(recs[case], name) if case in recs else None

def targets_table(recs: Records) -> str:
    rows = []
    for t in TARGETS:
        value, ref = _resolve(recs, t.measured), t.reference and _resolve(recs, t.reference)
        compared = div(value, ref) if t.reference else value
        met = "–" if compared is None else ("met" if (compared <= t.bound if t.op == "≤" else compared >= t.bound)
                                            else "missed")
        mb = t.measured.endswith("daemon_anon")
        shown = "–" if value is None else (f"{value / 1e6:.1f} MB" if mb else f"{value:.4g}")
        against = f" vs {ref:.4g}" if ref is not None else ""
        bound = f"{t.bound / 1e6:g} MB" if mb else f"{t.bound:g}"
        text = t.text
        if t.reference and t.reference.startswith("best:"):
            peer = best(recs, t.reference)[1]
            text = text.format(peer=recs[peer]["label"] if peer else "none measured")
        rows.append([text, f"#{t.issue}", shown + against, fmt(compared if t.reference else None, 2),
                     f"{t.op} {bound}", met])
    return table(["target", "issue", "measured (s, or as named)", "ratio", "bound", "met"], rows)

def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|:---|" + "---:|" * (len(header) - 1)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])

def _limit(recs: Records, rec: dict, name: str) -> dict | None:
    """The limit case ``name`` measured on the same state as ``rec`` (``memcpy`` or ``write_direct``)."""
    return next((r for r in recs.values() if r["method"] == ("memcpy" if name == "memcpy" else "write")
                 and r["name"].startswith(name) and r["state"] == rec["state"]), None)

def save_table(recs: Records) -> str:
    rows = []
    for r in (r for r in recs.values() if r["section"] == "save"):
        memcpy, direct = med(_limit(recs, r, "memcpy"), "seconds"), med(_limit(recs, r, "write_direct"), "seconds")
        secs = med(r, "seconds")
        blocking = secs if r["method"].startswith("memcpy") else med(r, "blocking")
        durable = secs if r["method"] == "write" else med(r, "durable")
        w = r.get("writer") or {}
        rows.append([r["label"], fmt(blocking), fmt(med(r, "staged")), fmt(durable),
                     fmt(div(r["state"]["nbytes"] / GB, durable or blocking), 2), fmt(div(blocking, memcpy), 2),
                     fmt(div(med(r, "staged"), memcpy), 2), fmt(div(durable, direct), 2),
                     fmt((r.get("first") or {}).get("blocking")), fmt(FIELDS["extra_per_state"](r), 2),
                     fmt(div(w.get("RssAnon"), MIB), 0), fmt(div(w.get("RssShmem"), MIB), 0),
                     fmt(r.get("trainer_cpu"), 2), fmt(w.get("cpu"), 2), fmt(med(r, "daemon_s"))])
    return table(["what", "blocking s", "staged s", "durable s", "GB/s", "blocking ÷ memcpy", "staged ÷ memcpy",
                  "durable ÷ O_DIRECT", "first save blocking s", "trainer extra ÷ state", "writer RssAnon MiB",
                  "writer RssShmem MiB", "trainer CPU s/save", "writer CPU s/save", "daemon's own s (status)"], rows)

def multi_table(recs: Records) -> str:
    raw = recs.get("multi_raw")
    single, parallel = med(raw, "single"), med(raw, "parallel")
    bw = [div(nbytes(raw) / GB, v) if raw else None for v in (single, parallel)]  # ratios below: of bandwidths
    rows = [[f"raw O_DIRECT write + fsync, {n}", fmt(v), fmt(b, 2), *(fmt(div(b, x), 2) for x in bw)] + ["–"] * 9
            for n, v, b in (("1 writer", single, bw[0]), (f"{raw['params']['ranks']} writers at once", parallel, bw[1]))
            ] if raw else []
    for r in (r for r in recs.values() if r["method"] == "multi_saves"):
        agg, node, gbps = med(r, "aggregate"), r.get("node") or {"busy": None}, FIELDS["gbps"](r)
        others = node["busy"] - r["ranks_cpu"] - r["daemon_cpu"] if node["busy"] else None  # the rest of the machine
        rows.append([r["label"], fmt(agg), fmt(gbps, 2), *(fmt(div(gbps, x), 2) for x in bw), fmt(med(r, "blocking")),
                     fmt(med(r, "durable")),
                     fmt(r["ranks_peak"]["VmRSS"] / GIB, 2), fmt(r["daemon"]["RssAnon"] / MIB, 0),
                     fmt(r["ranks_cpu"], 2), fmt(r["daemon_cpu"], 2), fmt(others, 2),
                     fmt(div(node["busy"], node.get("wall", 0) * r["cores"]), 2),
                     fmt(div(node.get("disk"), node.get("wall")), 2)])
    return table(["what", "aggregate s", "GB/s", "÷ raw, 1 writer", "÷ raw, N writers", "per-rank blocking s",
                  "per-rank durable s", "ranks peak RSS GiB", "daemon RssAnon MiB", "ranks CPU s/round",
                  "daemon CPU s/round", "others' CPU s/round", "machine CPU busy ÷ cores", "disk busy ÷ wall"], rows)

def scaling_table(recs: Records) -> str:
    rows = []
    for r in sorted((r for r in recs.values() if r["section"] == "scaling"), key=lambda r: r["size_gib"]):
        rows.append([r["label"], fmt(nbytes(r) / GIB), fmt(med(r, "blocking")), fmt(med(r, "durable")),
                     fmt(FIELDS["blocking_per_gib"](r)), fmt(FIELDS["durable_per_gib"](r)),
                     fmt(div(med(r, "blocking"), med(r, "memcpy")), 2),
                     fmt(div(med(r, "durable"), med(r, "direct")), 2),
                     fmt(med(r, "daemon_s")), fmt(FIELDS["extra_per_state"](r), 2)])
    return table(["state", "GiB", "blocking s", "durable s", "blocking s/GiB", "durable s/GiB", "blocking ÷ memcpy",
                  "durable ÷ O_DIRECT", "daemon's own s", "trainer extra ÷ state"], rows)

def load_table(recs: Records) -> str:
    raw = recs.get("load_raw_read")
    rows = []
    for r in (r for r in recs.values() if r["method"] == "load"):
        e = r["extra"]
        mem = f"{e['VmRSS'] / MIB:.0f} ({e['RssAnon'] / MIB:.0f} / {e['RssFile'] / MIB:.0f})"
        for suffix, label, m in (("", r["label"], mem), ("_touch", r["label"] + ", then a sum over every tensor", "")):
            cold, warm = med(r, "cold" + suffix), med(r, "warm" + suffix)
            if cold is not None:
                rows.append([label, fmt(cold), fmt(div(r["nbytes"] / GB, cold), 2), fmt(div(cold, med(raw, "cold")), 2),
                             fmt(warm), fmt(div(warm, med(raw, "warm")), 2), m])
    return table(["what", "cold s", "cold GB/s", "cold ÷ raw read", "warm s", "warm ÷ raw read",
                  "peak extra RSS MiB (anon / file)"], rows)

def ranks_table(recs: Records) -> str:
    rows = []
    for r in (r for r in recs.values() if r["method"] == "rank_loads"):
        reps, shard = r["reps"], r["shard_bytes"]
        growth = statistics.median(a - b for a, b in zip(reps["peak_anon"], reps["idle_anon"]))
        rows.append([r["label"], fmt(med(r, "wall")), f"{fmt(med(r, 'load'))} / {fmt(max(reps['load']))}",
                     fmt(med(r, "peak_rss") / GIB, 2), fmt(med(r, "peak_anon") / GIB, 2),
                     fmt(med(r, "idle_rss") / GIB, 2), fmt(growth / shard, 2), fmt(med(r, "after_gc_rss") / GIB, 2)])
    return table(["limit", "wall s", "per-rank load s (median / max)", "peak RSS sum GiB", "peak RssAnon sum GiB",
                  "idle RSS sum GiB", "RssAnon growth ÷ shard", "RSS sum after del + gc GiB"], rows)

def sharded_table(recs: Records) -> str:
    memcpy, dcp = med(recs.get("sharded_memcpy"), "seconds"), med(recs.get("sharded_process"), "durable")
    load = recs.get("sharded_load_dcp")
    rows = []
    for r in (r for r in recs.values() if r["section"] == "sharded"):
        blocking, cold, warm = med(r, "seconds") or med(r, "blocking"), med(r, "cold"), med(r, "warm")
        rows.append([r["label"], fmt(div(r["state"].get("global_nbytes"), GIB)),
                     fmt(r["state"]["nbytes"] / GIB), fmt(blocking), fmt(med(r, "staged")), fmt(med(r, "durable")),
                     fmt(div(blocking, memcpy), 2), fmt(div(med(r, "durable"), dcp), 2),
                     fmt((r.get("first") or {}).get("blocking")), fmt(cold), fmt(warm),
                     fmt(div(cold, med(load, "cold")), 2), fmt(div(warm, med(load, "warm")), 2)])
    return table(["what", "GiB, all ranks", "GiB per rank", "blocking s", "staged s", "durable s",
                  "blocking ÷ memcpy", "durable ÷ DCP PROCESS", "first save blocking s", "load cold s", "load warm s",
                  "cold ÷ dcp.load", "warm ÷ dcp.load"], rows)

STEPS_OWN = {"dcp": "dcp.async_save, FileSystemWriter (THREAD)",
             "lightning": "AsyncCheckpointIO(TorchCheckpointIO()): torch.save on a thread, no fsync",
             "fabric": "fabric.save: torch.save in the call, no fsync",
             "torchtitan": "torchtitan's CheckpointManager, async_mode=\"async\""}
"""Each integration's own save, the third way of the step-time table."""

def step_costs(r: dict) -> dict[str, tuple[float | None, float | None]]:
    """Per saving mode: (step cost, interval cost), seconds over the steps of the run that never saved."""
    plain, every = med(r, "none_step"), r["every"]
    return {m: (None if plain is None or med(r, f"{m}_step") is None else med(r, f"{m}_step") - plain,
                None if plain is None or med(r, f"{m}_interval") is None else med(r, f"{m}_interval") - every * plain)
            for m in ("snapshot", "persisted", "own")}

def steps_table(recs: Records) -> str:
    rows = []
    for r in (r for r in recs.values() if r["section"] == "steps"):
        costs = step_costs(r)
        (snap, snap_i), (disk, disk_i), (own, own_i) = (costs[m] for m in ("snapshot", "persisted", "own"))
        rows.append([r["label"], STEPS_OWN.get(r["params"]["integration"], "–"), fmt(nbytes(r) / MIB, 0),
                     str(r["every"]), fmt(med(r, "none_step")), fmt(snap), fmt(disk), fmt(own),
                     fmt(div(snap, own), 2), fmt(div(snap, disk), 2), fmt(snap_i), fmt(disk_i), fmt(own_i),
                     fmt(div(snap_i, own_i), 2), fmt(div(snap_i, disk_i), 2)])
    return table(["integration", "its own save", "state MiB", "steps per save", "plain step s",
                  "snapshot: step cost s", "persisted: step cost s", "own: step cost s", "snapshot ÷ own",
                  "snapshot ÷ persisted", "snapshot: interval cost s", "persisted: interval cost s",
                  "own: interval cost s", "interval: snapshot ÷ own", "interval: snapshot ÷ persisted"], rows)

def everystep_table(recs: Records) -> str:
    """``benchmarks/every_step.py``: per mode, its step overhead over the plain steps of the same rounds, against one
    memcpy of the state and against the strongest peer, with the CPU and faults it adds."""
    r = recs.get("everystep")
    if r is None:
        return ""
    copy, plain = med(r, "copy"), med(r, "none_step")
    peer, peer_mode = strongest_peer(r)
    none_cpu, none_faults = med(r, "none_cpu"), med(r, "none_faults")
    def extra_cpu(mode: str) -> float | None:  # this process's over the plain steps', plus the helper's
        cpu, helper = med(r, f"{mode}_cpu"), med(r, f"{mode}_helper_cpu")
        return None if none_cpu is None or cpu is None or mode == "none" else cpu - none_cpu + (helper or 0.0)
    rows = []
    for mode, label in r["modes"].items():
        cost = overhead(r, mode)
        rows.append([label, fmt(med(r, f"{mode}_step")), fmt(cost), fmt(med(r, f"{mode}_blocking")),
                     fmt(div(cost, copy), 2), fmt(div(cost, peer), 2),
                     fmt(None if none_cpu is None or mode == "none" else med(r, f"{mode}_cpu") - none_cpu),
                     fmt(med(r, f"{mode}_helper_cpu")), fmt(med(r, f"{mode}_helper_crc_cpu")),
                     fmt(extra_cpu(mode)), fmt(div(extra_cpu(mode), extra_cpu("memcpy")), 2),
                     fmt(None if none_faults is None or mode == "none" else med(r, f"{mode}_faults") - none_faults, 0),
                     fmt(med(r, f"{mode}_helper_faults"), 0)])
    head = (f"{fmt(nbytes(r) / MIB, 0)} MiB of state (parameters and AdamW's), plain step {fmt(plain)} s, one "
            f"memcpy of the state {fmt(copy, 4)} s ({fmt(div(nbytes(r) / GB, copy), 1)} GB/s); strongest peer: "
            f"{r['modes'].get(peer_mode, 'none measured')}; load average per round "
            f"{', '.join(f'{x:.1f}' for x in r.get('load', []))}.")
    return head + "\n\n" + table(
        ["capture after every optimizer step", "step s", "overhead s", "in its calls s", "overhead ÷ memcpy",
         "overhead ÷ strongest peer's", "trainer CPU s/step over plain", "helper CPU s/step",
         "of it, checksum threads", "CPU s/step over plain, all", "CPU over plain ÷ memcpy's",
         "trainer faults/step over plain", "helper faults/step"], rows)

def transport_table(recs: Records) -> str:
    """``benchmarks/transport.py``: each candidate per frame size, its speed as a share of the plain TCP stream of the
    same round (the median of the rounds' ratios), and each side's CPU per GB."""
    rows = []
    for r in (r for r in recs.values() if r["name"] == "transport"):
        reps, gb = r["reps"], r["nbytes"] / GB
        for frame in r["frames"]:
            k = f"{frame >> 10}k"
            tcp = reps.get(f"tcp_{k}_s") or []
            for name, (label, gives) in r["candidates"].items():
                secs = reps.get(f"{name}_{k}_s") or []
                ratio = statistics.median(t / s for t, s in zip(tcp, secs)) if tcp and secs else None
                alone = med(r, f"alone_{name}_{k}_s")
                rows.append([label, f"{frame / MIB:g}", gives, fmt(div(gb, med(r, f"{name}_{k}_s")), 2),
                             fmt(ratio, 2), fmt(div(med(r, f"{name}_{k}_cpu_send"), gb), 2),
                             fmt(div(med(r, f"{name}_{k}_cpu_recv"), gb), 2), fmt(div(gb, alone), 2)])
            for label, why in r.get("absent", {}).items():
                rows.append([label, f"{frame / MIB:g}", why, "–", "–", "–", "–", "–"])
            alone = med(r, f"alone_crc32c_{k}_s")
            rows.append(["crc32c alone (ckptd's checksum, reference)", f"{frame / MIB:g}", "integrity (no key)", "–",
                         "–", "–", "–", fmt(div(gb, alone), 2)])
    return table(["stream between two processes on 127.0.0.1", "frame MiB", "gives", "GB/s", "× plain TCP (same "
                  "round)", "sender CPU s/GB", "receiver CPU s/GB", "its primitive alone, one core, GB/s"], rows)

def gpu_table(recs: Records) -> str:
    r = recs.get("gpu_check")
    if r is None:
        return ""
    ref = med(r, "to_cpu")
    rows = [[what, fmt(med(r, f"{k}_blocking") if k else None), fmt(med(r, f"{k}_staged") if k else med(r, limit)),
             fmt(med(r, f"{k}_durable") if k else None),
             fmt(div(nbytes(r) / GB, med(r, f"{k}_staged") if k else med(r, limit)), 2),
             fmt(div(ref, med(r, f"{k}_staged") if k else med(r, limit)), 2)]
            for what, k, limit in (("pinned tensor.to(\"cpu\", non_blocking=True) per tensor (limit)", None, "to_cpu"),
                                   ("copy into one reused pinned buffer", None, "pinned_buffer"),
                                   ("ckptd save_async, sync staging, into the pinned slot", "ckptd", None),
                                   ("ckptd save_async, background staging", "ckptd_bg", None),
                                   ("DCP async_save THREAD + reused pinned DefaultStager", "dcp", None))]
    steps = [[mode, fmt(med(r, f"{mode}_step")), fmt(med(r, f"{mode}_interval")),
              fmt(None if mode == "none" else med(r, f"{mode}_step") - med(r, "none_step")),
              fmt(None if mode == "none" else gpu_interval_cost(r, mode))] for mode in ("none", "awaited", "background")
             if med(r, f"{mode}_step") is not None]
    replicated = [[fmt(med(r, "rep_blocking")), fmt(med(r, "rep_held")), fmt(med(r, "rep_replicated")),
                   fmt(med(r, "rep_tcp")), fmt(div(med(r, "rep_tcp"), med(r, "rep_replicated")), 2)]]
    return "\n\n".join([table(["what", "blocking s", "staged s", "durable s", "staged GB/s",
                                "speed ÷ pinned to()"], rows),
                         "The same state snapshotted to a daemon whose buddy (a second daemon on 127.0.0.1) holds "
                         "its replica, another CUDA stream busy with matrix products meanwhile:",
                         table(["blocking s", "held s", "replicated s", "plain TCP stream s",
                                "replication speed ÷ plain TCP"], replicated if med(r, "rep_replicated") else []),
                         f"Steps of a {fmt(r.get('steps_nbytes', 0) / MIB, 0)} MiB MLP (state with AdamW's) trained on "
                         f"the device, saved every {r['params']['every']} steps:",
                         table(["saves", "step s (saving step)", "interval s", "step cost s", "interval cost s"],
                               steps)])

def gpu_interval_cost(r: dict, mode: str) -> float | None:
    """Median interval of ``mode`` less ``every`` × the median step of the run that never saved."""
    interval, plain = med(r, f"{mode}_interval"), med(r, "none_step")
    return None if interval is None or plain is None else interval - r["params"]["every"] * plain

def details(recs: Records) -> list[str]:
    def values(vs: list) -> str:
        return ", ".join(f"{v:.3f}" if v < 1e4 else f"{v / GIB:.2f} GiB" for v in vs)
    return [f"- {r['name']} ({r['label']}): " + "; ".join(f"{k} {values(vs)}" for k, vs in r["reps"].items() if vs)
            for r in recs.values() if r.get("reps")]

def render(records: list[dict], meta: dict[str, Any]) -> str:
    """``RESULTS.md`` from the run's records and what the run was (``meta``)."""
    recs = {r["name"]: r for r in records if "error" not in r}
    failed = [f"- {r['case']}: {r['error']}" for r in records if "error" in r]
    sections = {r["section"] for r in recs.values()}
    main = recs.get("memcpy", {}).get("state")
    parts = ["# ckptd benchmark results", "",
             "Generated by `benchmarks/` (`make bench`, i.e. `python -m benchmarks`); rerun to refresh. Every case "
             "runs in its own process; figures are medians of the timed repetitions after one warm-up, and every "
             "ratio is against a limit measured in the same run. Daemon figures come from `ckptd status --json` "
             "and `/proc`, never from its log.", ""]
    parts += [f"- {k}: {v}" for k, v in meta.items()]
    if main:
        where = main["device"] + (f" ({main['gpu']})" if "gpu" in main else "")
        parts.append(f"- state: {main['nbytes'] / GIB:.3f} GiB in {main['tensors']} tensors (largest "
                     f"{main['largest'] / MIB:.1f} MiB) on {where}: a 12-layer transformer plus AdamW exp_avg, "
                     "exp_avg_sq and step")
    if failed:
        parts += ["", "## Failed cases", "", *failed]
    parts += ["", "## Targets", "", "Measured over reference (or the value itself where there is none) against the "
              "bound. Targets are data rows in `benchmarks/report.py` (`TARGETS`).", "", targets_table(recs), "",
              "Causes of misses, measured (`CAUSES`):", "", *(f"- {c}" for c in CAUSES)]
    blocks = [("save", "Saving: ckptd, its limits and its peers", save_table,
               "Blocking: the call returned. Staged: the tensors may change. Durable: on disk (fsync'd; for ckptd "
               "renamed and the directory fsync'd), except torch-checkpointing's no-fsync row (its own figure, "
               "below). Writer: ckptd's daemon, DCP's checkpoint process or torch-checkpointing's writer subprocess "
               "(peaks during the timed saves); trainer extra: its peak RSS during the timed saves over its RSS with "
               "the state built."),
              ("multi", "Clients on one node at once", multi_table,
               "Each client its own process (one intra-op thread, as under torchrun) and state, all calling at once "
               "through one daemon; aggregate from the first call to the last future resolved. Others' CPU: the "
               "machine's busy CPU (`/proc/stat`) less the ranks' and the daemon's; disk busy: the scratch disk's."),
              ("scaling", "Scaling: ckptd with sync staging", scaling_table,
               "One process per size: memcpy and O_DIRECT limits at that size, then ckptd's saves."),
              ("load", "Loading", load_table,
               "Cold: the checkpoint's files evicted before each repetition; warm: right after a read. Ratios to a "
               "raw sequential read of the ckptd shard in the same cache state. Every load checked against the "
               "saved sum."),
              ("load", "Ranks loading at once: node memory", ranks_table,
               "Fresh processes load their shard with map_location=\"cpu\" at the same moment, hold it 0.5 s, drop "
               "it; their memory summed every 20 ms."),
              ("sharded", "Sharded state: FSDP2 on several ranks", sharded_table,
               "FSDP2 (`fully_shard`, gloo on CPU): the transformer and its AdamW state as DTensors; each save starts "
               "on a barrier, each figure is the slowest rank's. Reshard load: the state saved on N ranks (by ckptd, "
               "by `dcp.save`) into a fresh model's and optimizer's DTensors on N/2, checked per tensor."),
              ("gpu", "GPU check", gpu_table,
               "`python -m benchmarks --device cuda` (`benchmarks/gpu_check.py`): one process, one state of the "
               "run's size on the device. Staged time against a pinned `tensor.to(\"cpu\", non_blocking=True)` of "
               "the same tensors and against DCP's pinned `DefaultStager`; step-time cost of background staging "
               "against an awaited one while a small model trains. On the CPU (`--only gpu_check`) the same code runs "
               "host to host: it tries the harness, its figures say nothing about a GPU."),
              ("transport", "Replication transport: authenticated bulk transfer against plain TCP", transport_table,
               "`benchmarks/transport.py` (issue #40): the same bytes streamed between two processes on 127.0.0.1, "
               "every candidate once per round, round after round; × plain TCP is the median of each round's ratio "
               "to the plain TCP stream of that round. CPU: each process's `time.process_time` (all its threads) "
               "per GB streamed. One thread a side, as the daemon's link; sender and receiver share this machine's "
               "cores (two nodes would not). The keyed candidates' key reaches the receiver over a stand-in for the "
               "CURVE control channel; every frame's 12-byte header is in its tag or its AEAD's associated data."),
              ("everystep", "A capture every step: ckptd's snapshot against one memcpy and the peers", everystep_table,
               "`benchmarks/every_step.py` (issue #40, item 5): one process trains an MLP with AdamW on the CPU and "
               "captures its state after every optimizer step, every way in turn, round after round (the first round "
               "a warm-up). Each way's steps follow plain steps in the same round; its overhead is the median of its "
               "steps less the median of those plain steps, the median over the rounds. In its calls: the time a "
               "step spent in the way's own calls (its capture, and its wait before the next `optimizer.step()`); "
               "the rest of the overhead is the capture's work beside the step (threads, the daemon). Helper: "
               "ckptd's daemon, torch-checkpointing's writer subprocess. The peers write to /dev/shm (memory, as a "
               "snapshot is), each awaits its previous save before the next."),
              ("steps", "Step-time cost of a save, per integration", steps_table,
               "One process per integration trains an MLP with AdamW on the CPU (`benchmarks/steps.py`), saving "
               "every N steps through the integration: a memory snapshot (ckptd's memory tier: DCP "
               "`StorageWriter(persist=False)`, Lightning `CkptdSnapshots`, Fabric `io.in_memory()`, torchtitan "
               "`memory_interval`), a persisted save through the same integration (ckptd writing to disk), and the "
               "framework's own save. Step cost: the median step that saved (its save call and its wait for the "
               "previous save in it) less the median step of a run that never saved; interval cost: the median N "
               "steps ending with a save less N plain steps (what the save's background work took from the steps "
               "beside it). A cost near 0 is within the steps' own spread, so its ratios mean little there.")]
    noted = False
    for section, title, make, text in blocks:
        if section in sections:
            parts += ["", f"## {title}", "", text, "", make(recs)]
            if section in ("save", "sharded") and not noted:  # once, under the first table of peers
                parts += ["", "Peers as configured (`PEER_NOTES`):", "", *(f"- {n}" for n in PEER_NOTES)]
                noted = True
    parts += ["", "## Measured by scripts of their own", "", *(f"- {m}" for m in SEPARATE)]
    parts += ["", "## Every repetition", "", *details(recs), ""]
    return "\n".join(parts)
