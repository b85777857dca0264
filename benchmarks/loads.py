"""Loading the same state back every way, cold and warm, against a raw read of the same file.

``prepare`` saves one state with ckptd, ``torch.save`` + fsync and DCP, and records its sum; each load method is a
case of its own, checked against that sum. Cold: the files evicted (``POSIX_FADV_DONTNEED``) before each repetition.
Zero-copy results are also timed until a sum has touched every byte. The floor: a sequential read of the ckptd shard,
same cache.
"""
from __future__ import annotations
import gc
import json
import os
import time
from pathlib import Path
from typing import Any, Callable
import ckptd
from ckptd.client.verified import forget
import torch
import torch.distributed.checkpoint as dcp
from .limits import Sampler, evict, files_under, memory, read_files
from .saves import BenchDaemon, init_gloo, torch_save_synced
from .state import build, iter_tensors, tensor_sum

TOUCHING = {"ckptd_load", "ckptd_load_noverify", "torch_load_mmap"}
"""Methods whose result is backed by the file: also timed until every byte was touched."""

REF = Path("load", "ref.json")
"""Under the scratch directory: what ``prepare`` saved, where, and its sum."""

def prepare(scratch: Path, size_gib: float) -> dict:
    """Save one state with ckptd, ``torch.save`` and DCP; record its sum and the paths."""
    bench = build("transformer", size_gib)
    root = scratch / "load"
    root.mkdir(parents=True, exist_ok=True)
    with BenchDaemon(scratch) as daemon, ckptd.Client(run_dir=daemon.run_dir, spawn=False) as client:
        client.save_async(bench.state, root / "ckptd", step=1, overwrite=True).result()
    torch_save_synced(bench.state, root / "torch.pt")
    init_gloo()
    dcp.save(bench.state, checkpoint_id=root / "dcp")
    ref = {"nbytes": bench.nbytes, "sum": tensor_sum(bench.tensors), "ckptd": str(root / "ckptd"),
           "torch": str(root / "torch.pt"), "dcp": str(root / "dcp"), "size_gib": size_gib}
    (scratch / REF).write_text(json.dumps(ref))
    return {"nbytes": bench.nbytes}

def _loader(method: str, ref: dict, target: Any) -> tuple[Callable[[], Any], Callable[[Any], float], list[Path]]:
    """(load, the sum of what was loaded, the files read) for ``method``."""
    ck, tf = Path(ref["ckptd"]), Path(ref["torch"])
    shards = [p for p in files_under(ck) if p.suffix == ".safetensors"]
    def loaded(obj: Any) -> float:
        return tensor_sum(iter_tensors(obj))
    if method in ("raw_read", "raw_read_direct"):
        return (lambda: read_files(shards, direct=method.endswith("direct"))), (lambda _: ref["sum"]), shards
    if method.startswith("ckptd_load_into"):
        model, opt = target.model, target.optimizer
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 0}
        if method == "ckptd_load_into":  # two calls: model, then optimizer
            return (lambda: (ckptd.load_into(model, ck, key="model"), ckptd.load_into(opt, ck, key="optimizer"))), (
                lambda _: loaded({"m": model.state_dict(), "o": opt.state_dict()})), files_under(ck)
        return (lambda: ckptd.load_into(sd, ck)), (lambda _: loaded(sd)), files_under(ck)
    if method.startswith("ckptd_load"):
        kwargs = {"map_location": "cpu"} if method.endswith("cpu") else {"mmap": True, "verify": method == "ckptd_load"}
        return (lambda: ckptd.load(ck, **kwargs)), loaded, files_under(ck)
    if method.startswith("torch_load"):
        return (lambda: torch.load(tf, mmap=method.endswith("mmap"))), loaded, [tf]
    if method == "dcp_load":
        init_gloo()
        return (lambda: dcp.load(target.state, checkpoint_id=ref["dcp"])), (lambda _: loaded(target.state)), \
            files_under(Path(ref["dcp"]))
    raise ValueError(f"unknown load method {method!r}")

def load(scratch: Path, size_gib: float, method: str, repeat: int) -> dict:
    """``repeat`` cold and ``repeat`` warm loads by ``method`` (after one warm-up each)."""
    if not (scratch / REF).exists():
        prepare(scratch, size_gib)
    ref = json.loads((scratch / REF).read_text())
    target = build("transformer", ref["size_gib"], seed=1) if "load_into" in method or method == "dcp_load" else None
    gc.collect()
    fn, check, files = _loader(method, ref, target)
    reps: dict[str, list[float]] = {}
    base = memory()
    with Sampler({"self": [os.getpid()]}) as sampler:
        for cache in ("cold",) if method == "raw_read_direct" else ("cold", "warm"):
            reps[cache], reps[f"{cache}_touch"] = [], []
            for i in range(1 + repeat):
                forget()  # each load is a process's first: its checksums are computed
                if cache == "cold":
                    evict(files)
                t0 = time.perf_counter()
                result = fn()
                t1 = time.perf_counter()
                if method in TOUCHING:
                    tensor_sum(iter_tensors(result))
                t2 = time.perf_counter()
                got = check(result) if i == 0 and cache == "cold" else ref["sum"]
                if abs(got - ref["sum"]) > 1e-6 * max(1.0, abs(ref["sum"])):
                    raise AssertionError(f"{method} loaded tensors summing to {got}, saved {ref['sum']}")
                del result
                gc.collect()
                if i:
                    reps[cache].append(t1 - t0)
                    reps[f"{cache}_touch"] += [t2 - t0] if method in TOUCHING else []
    peak = sampler.peaks["self"]
    return {"reps": {k: v for k, v in reps.items() if v}, "nbytes": ref["nbytes"],
            "extra": {k: peak[k] - base[k] for k in ("VmRSS", "RssAnon", "RssFile")}}
