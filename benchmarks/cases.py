"""The registry of cases (to measure something new, add a row), each run in a process of its own.

Each case runs in a fresh process forked from a server that has only imported torch and ckptd: no case inherits
another's memory or threads, none pays a torch import. It sends back one JSON line: its measurements, or an error.
"""
from __future__ import annotations
import importlib.util
import json
import multiprocessing as mp
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

STEP_CASES = {"dcp": "DCP async_save (THREAD)", "lightning": "Lightning Trainer", "fabric": "Lightning Fabric",
              "torchtitan": "torchtitan CheckpointManager (async)"}
"""The step-time cases (``integration_steps``): integration, label."""
TT_PY = Path(__file__).resolve().parent.parent / ".venv-torchtitan" / "bin" / "python"
"""The interpreter of ``make .venv-torchtitan/.installed``: torchtitan is installed there, not in ``.venv``."""

LOAD_METHODS = {"raw_read": "raw read, page cache (floor)", "raw_read_direct": "raw read, O_DIRECT",
                "ckptd_load": "ckptd.load, zero-copy", "ckptd_load_noverify": "ckptd.load verify=False, zero-copy",
                "ckptd_load_cpu": 'ckptd.load map_location="cpu"',
                "ckptd_load_into": "ckptd.load_into model, then optimizer",
                "ckptd_load_into_sd": "ckptd.load_into one state dict", "torch_load": "torch.load",
                "torch_load_mmap": "torch.load mmap=True", "dcp_load": "DCP load (in place)"}
DCP_MODES = {"save": "DCP save", "thread": "DCP async_save THREAD",
             "thread_stager": "DCP async_save THREAD + reused DefaultStager", "process": "DCP async_save PROCESS",
             "process_stager": "DCP async_save PROCESS + reused DefaultStager"}
TORCHCKPT_MODES = {"torchckpt": ("torch-checkpointing async (use_direct_io=False), as shipped: no fsync, not durable",
                                 False),
                   "torchckpt_fsync": ("torch-checkpointing async (use_direct_io=False) + the fsyncs durability needs",
                                       True)}
"""Case name: (label, fsync): torch-checkpointing 0.1.1 (``saves.torchckpt_saves``). Buffered writes: its O_DIRECT
default fails with EINVAL on this machine's ext4. ``fsync``: its files, the directory and its parent, in its hooks."""
SHARDED_MODES = {"memcpy": "memcpy of each rank's local bytes (limit)", "ckptd": "ckptd save_async, sync staging",
                 **{m: DCP_MODES[m] for m in ("process", "process_stager", "thread_stager")},
                 **{m: label for m, (label, _) in TORCHCKPT_MODES.items()},
                 "ckptd_dcp": "DCP async_save THREAD, ckptd.dcp.StorageWriter(stage_in_slot=True)",
                 "load_ckptd": "ckptd.load_into DTensors", "load_dcp": "dcp.load"}
PEER_CASES = {"torch_checkpointing": ("torch-checkpointing", TORCHCKPT_MODES)}
"""Module: (PyPI name, the modes that need it). Peers a test-only requirement brings (requirements-dev.txt)."""

TORCHTITAN_CASES = ("steps_torchtitan",)
"""The cases that run in torchtitan's venv (``missing_peers``' ``torchtitan``)."""


def missing_peers() -> dict[str, str]:
    """Each peer module that is not installed: why its cases are left out of the run."""
    out = {module: f"{pypi} is not installed (pip install -r requirements-dev.txt): its cases "
                   f"({', '.join(modes)}, sharded too) are skipped"
           for module, (pypi, modes) in PEER_CASES.items() if importlib.util.find_spec(module) is None}
    if not TT_PY.exists():
        out["torchtitan"] = ("torchtitan's venv is not built (make .venv-torchtitan/.installed): its step-time case "
                             "(steps_torchtitan) is skipped")
    return out


@dataclass
class Case:
    name: str
    section: str
    """``save``, ``multi``, ``scaling``, ``load``, ``sharded``, ``objects``, ``transport``, ``steps``, ``everystep`` or
    ``gpu``: where the report
    puts it. ``gpu`` (``gpu_check``) is the whole of a ``--device cuda`` run, and in a CPU run only when named."""
    method: str
    label: str
    repeat: int
    state: str = "transformer"
    size_gib: float = 1.0
    device: str = "cpu"
    params: dict = field(default_factory=dict)

@dataclass
class Settings:
    """What one run measures; ``smoke`` shrinks every size so the whole registry runs in seconds."""
    size_gib: float = 1.0
    repeat: int = 3
    limit_repeat: int = 5
    ranks: int = 4
    many_ranks: int = 8
    rank_size_gib: float = 0.5
    scaling_gib: tuple[float, ...] = (1 / 16, 1 / 4, 1.0, 2.0, 4.0)
    device: str = "cpu"
    steps_gib: float = 1 / 4
    """The trainee's state (``benchmarks/steps.py``) in the step-time cases."""
    steps_every: int = 4
    """Training steps per save in the step-time cases."""
    @classmethod
    def smoke(cls, device: str = "cpu") -> "Settings":
        return cls(1 / 64, 1, 1, 2, 3, 1 / 80, (1 / 80, 1 / 32), device, steps_gib=1 / 64, steps_every=2)

def registry(s: Settings) -> list[Case]:
    """Every case of a run, in the order they run (the limits first, then what is set against them)."""
    dev, cpu = s.device, s.device == "cpu"
    save = dict(section="save", size_gib=s.size_gib, device=dev)
    lim = dict(save, repeat=s.limit_repeat)
    out = [Case("memcpy", method="memcpy", label="memcpy → reused buffer (limit)", **lim),
           Case("write_direct", method="write", label="write O_DIRECT + fsync (limit)", params={"direct": True}, **lim),
           Case("write_buffered", method="write", label="write buffered + fsync", params={"direct": False}, **lim),
           Case("torch_save", method="torch_save", label="torch.save + fsync", repeat=s.repeat, **save)]
    if cpu:
        out.insert(1, Case("memcpy_fresh", method="memcpy_fresh", label="memcpy → fresh /dev/shm", **lim))
    out += [Case(f"dcp_{m}", method="dcp", label=label, repeat=s.repeat, params={"mode": m}, **save)
            for m, label in DCP_MODES.items()]
    out += [Case(m, method="torchckpt", label=label, repeat=s.repeat, params={"fsync": fsync}, **save)
            for m, (label, fsync) in TORCHCKPT_MODES.items()]
    out += [Case("ckptd_sync", method="ckptd", label="ckptd save_async, sync staging", repeat=s.repeat, **save),
            Case("ckptd_sync_noreserve", method="ckptd", label="ckptd save_async, sync staging, no reserve_bytes",
                 repeat=s.repeat, params={"reserve": False}, **save),
            Case("ckptd_sync_stream", method="ckptd", label="ckptd save_async, sync staging, stream_commit=True",
                 repeat=s.repeat, params={"stream_commit": True}, **save),
            Case("ckptd_bg", method="ckptd", label="ckptd save_async, background staging", repeat=s.repeat,
                 params={"background_staging": True}, **save),
            Case("memcpy_small", method="memcpy", label="memcpy → reused buffer (limit), 1,000 × 256 B",
                 state="small", **lim),
            Case("snapshots", section="snapshot", method="snapshots", label="memory snapshots: blocking, restore",
                 repeat=s.repeat, size_gib=s.size_gib, device=dev),
            Case("ckptd_sync_small", method="ckptd", label="ckptd save_async, sync staging, 1,000 × 256 B",
                 state="small", repeat=s.repeat, **save)]
    if cpu:
        multi = dict(section="multi", size_gib=s.rank_size_gib, repeat=s.repeat)
        out += [Case("multi_raw", method="raw_write", label="raw O_DIRECT write + fsync", params={"ranks": s.ranks},
                     **dict(multi, repeat=s.limit_repeat)),
                Case("multi_separate", method="multi_saves", label=f"ckptd, {s.ranks} separate checkpoints",
                     params={"ranks": s.ranks, "shared": False}, **multi),
                *(Case(f"multi_one{'' if n == s.ranks else '_many'}", method="multi_saves", label=f"ckptd, one "
                       f"checkpoint, ranks 0-{n - 1} of {n}", params={"ranks": n, "shared": True}, **multi)
                  for n in (s.ranks, s.many_ranks))]
    out += [Case(f"scaling_{size_label(g)}".replace(" ", ""), section="scaling", method="scaling", label=size_label(g),
                 repeat=s.repeat, size_gib=g, device=dev) for g in s.scaling_gib]
    if cpu:
        load = dict(section="load", size_gib=s.size_gib, repeat=s.repeat)
        out.append(Case("load_prepare", method="load_prepare", label="writing the checkpoints", **load))
        out += [Case(f"load_{m}", method="load", label=label, params={"method": m}, **load)
                for m, label in LOAD_METHODS.items()]
        out += [Case(f"load_ranks_{'lease' if lease else 'nolimit'}", section="load", method="rank_loads",
                     label=f"max_concurrent_per_node={lease}" if lease else "no limit", repeat=s.repeat,
                     size_gib=s.rank_size_gib, params={"ranks": s.ranks, "limit": lease}) for lease in (None, 1)]
        out += [Case(f"sharded_{m}", section="sharded", method="sharded", repeat=s.repeat, size_gib=s.size_gib,
                     label=f"{s.ranks}{f' → {s.ranks // 2}' if m.startswith('load') else ''} ranks: {label}",
                     params={"mode": m, "ranks": s.ranks}) for m, label in SHARDED_MODES.items()]
        out.append(Case("objects", section="objects", method="objects", label="s3:// on moto's server",
                        repeat=s.repeat, size_gib=min(s.size_gib, 1 / 4)))
        out.append(Case("transport", section="transport", method="transport", repeat=s.repeat,
                        label="replication transport candidates against a plain TCP stream",
                        size_gib=min(s.size_gib, 1 / 4)))
        out += [Case(f"steps_{name}", section="steps", method="steps", label=label, repeat=s.repeat,
                     state="trainee", size_gib=s.steps_gib, params={"integration": name, "every": s.steps_every})
                for name, label in STEP_CASES.items() if name != "torchtitan" or TT_PY.exists()]
    if cpu:
        out.append(Case("everystep", section="everystep", method="everystep", repeat=s.repeat, state="trainee",
                        size_gib=s.steps_gib, label="a capture every step: ckptd's snapshot, its peers, one memcpy"))
    out.append(Case("gpu_check", section="gpu", method="gpu_check", repeat=s.repeat, size_gib=s.size_gib, device=dev,
                    label="GPU check: D2H staging, staging against DCP's pinned stager, step-time cost",
                    params={"steps_gib": s.steps_gib, "every": s.steps_every, "saves": s.repeat}))
    absent = {m for module in missing_peers() for m in (PEER_CASES[module][1] if module in PEER_CASES
                                                         else TORCHTITAN_CASES)}
    return [c for c in out if c.name not in absent and c.params.get("mode") not in absent]  # dense, sharded

def size_label(gib: float) -> str:
    return f"{gib:g} GiB" if gib >= 1 else f"{gib * 1024:g} MiB"

def _child(case: Case, scratch: str, conn: Any, log: str) -> None:
    """The case process's entry point (the server has imported ``methods`` already)."""
    from .methods import child
    child(case, scratch, conn, log)

def run_all(cases: list[Case], scratch: Path, *, timeout: float) -> Iterator[dict]:
    """Run each case in a fresh process, one after the other; yields each one's JSON record."""
    ctx = mp.get_context("forkserver")
    # Imported once by the server, never run: a case starts in milliseconds, without a torch import of its own.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "benchmarks.methods"])  # methods: ckptd, torch, DCP
    (scratch / "logs").mkdir(parents=True, exist_ok=True)
    for case in cases:
        log = scratch / "logs" / f"{case.name}.log"
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(case, str(scratch), send, str(log)), name=f"case-{case.name}")
        proc.start()
        send.close()
        try:
            line = json.loads(recv.recv()) if recv.poll(timeout) else None
        except EOFError:
            line = None
        proc.join(60 if line else 5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        yield line or {"case": case.name, "error": f"no result (exit code {proc.exitcode}; log: {log})"}
