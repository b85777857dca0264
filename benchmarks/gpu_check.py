"""The GPU check (issue #30): one short run of ``python -m benchmarks --device cuda`` on a GPU machine.

    python -m benchmarks --device cuda                 # ~4 GiB state on the GPU, under 5 minutes; rows in a file
    python -m benchmarks --only gpu_check --size-gib 0.25   # the same code on the CPU, to try the harness

One case, one process, every figure of one run:

- D2H staging: a state of ``--size-gib`` (default 4 for cuda) saved with sync staging into the pinned slot
  (``reserve_bytes``: the slot made and registered before the timed saves): its staged time against the same
  bytes copied by a pinned ``tensor.to("cpu", non_blocking=True)`` per tensor (the caching host allocator warm after
  the first round) and into one reused pinned buffer (``limits.memcpy_reused``), each followed by a synchronize.
- Blocking and staged time, sync and background staging, against DCP ``async_save`` (THREAD) with one reused
  ``DefaultStager`` staging into pinned memory with non-blocking copies, the strongest DCP staging on a GPU.
- Step-time cost: a small MLP (``steps.Trainee``, ``--steps-gib``' state) trained on the device, its state saved
  every ``steps_every`` steps: never (``none``), awaited (``wait_staged`` right after ``save_async``: the step
  pays the copy) and background (``background_staging=True``; the copy runs beside the next forward and backward,
  ``wait_staged`` before the optimizer step, as the README's loop does). Each step ends with a device synchronize.
- Replication (issue #40): the same state snapshotted (``persist=False``) to a daemon with a buddy, two daemons on
  127.0.0.1 as two nodes (``replication.Nodes``), while a matrix product runs on another CUDA stream as training
  would: its blocking (D2H into the slot), held and replicated times, against a plain TCP stream of the same bytes.

On the CPU the same code runs with CPU tensors (no pinning, host to host), so the harness is tried without a GPU;
its figures say nothing about a GPU.
"""
from __future__ import annotations
import time
from pathlib import Path
from typing import Any
import ckptd
import torch
from .cases import Case
from .limits import memcpy_reused
from .saves import BenchDaemon, ckptd_saves, dcp_saves
from .state import build
from .steps import Trainee
from .replication import Nodes, tcp_stream


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def to_cpu_times(tensors: list[torch.Tensor], repeat: int) -> list[float]:
    """Seconds of a pinned ``to("cpu", non_blocking=True)`` of every tensor (then a synchronize), after a warm-up
    (``copy=True``: a CPU tensor is copied too, so the CPU trial times a real copy)."""
    out = []
    for _ in range(1 + repeat):
        t0 = time.perf_counter()
        copies = [t.to("cpu", non_blocking=True, copy=True) for t in tensors]  # copy: on the CPU too
        sync(tensors[0].device.type)
        out.append(time.perf_counter() - t0)
        del copies
    return out[1:]


def step_costs(scratch: Path, daemon: BenchDaemon, size_gib: float, device: str, every: int, saves: int) -> dict:
    """Per mode (``none``, ``awaited``, ``background``): each step's seconds and each interval of ``every`` steps
    ending with a save, after a warm-up interval (the first save makes the slot)."""
    reps: dict[str, list[float]] = {}
    for mode in ("none", "awaited", "background"):
        t = Trainee(size_gib, device=device)
        with ckptd.Client(run_dir=daemon.run_dir, spawn=False, background_staging=mode == "background",
                          max_inflight=1) as client:
            times, pending, last = [], None, None
            for i in range(1, 1 + every * (1 + saves)):
                t0 = time.perf_counter()
                t.optimizer.zero_grad(set_to_none=True)
                t.loss().backward()
                if pending is not None:
                    pending.wait_staged()  # the tensors are copied out: the optimizer may change them
                t.optimizer.step()
                if mode != "none" and i % every == 0:
                    if last is not None:
                        last.result()  # one save in flight, as a trainer keeps it
                    state = {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), "step": i}
                    last = pending = client.save_async(state, scratch / f"steps-{mode}-{i}", step=i)
                    if mode == "awaited":
                        pending.wait_staged()
                        pending = None
                sync(device)
                times.append(time.perf_counter() - t0)
            if last is not None:
                last.result()
        timed = times[every:]
        reps[f"{mode}_step"] = timed if mode == "none" else timed[every - 1::every]
        reps[f"{mode}_interval"] = [sum(timed[j:j + every]) for j in range(0, len(timed), every)]
        nbytes = t.nbytes
    return {"steps_nbytes": nbytes, "reps": reps}


def busy(device: str) -> Any:
    """Work on another stream, as training's kernels run while a snapshot is taken (a no-op on the CPU)."""
    if device != "cuda":
        return None
    side, x = torch.cuda.Stream(), torch.randn(4096, 4096, device=device)
    with torch.cuda.stream(side):
        for _ in range(20):
            x = x @ x / 4096
    return side


def replication(state: dict, nbytes: int, scratch: Path, repeat: int, device: str) -> dict[str, list[float]]:
    """Snapshot ``state`` to a daemon whose buddy holds its replicas, ``repeat`` times after a first save (its slot
    made): blocking, held and replicated seconds each; and a plain TCP stream of the same bytes."""
    (scratch / "peers").mkdir()
    nodes = Nodes(scratch / "peers")
    out: dict[str, list[float]] = {"rep_blocking": [], "rep_held": [], "rep_replicated": [],
                                   "rep_tcp": tcp_stream(nbytes, repeat)}
    try:
        for node in (1, 0):
            nodes.start(node)
        nodes.serve(1)
        nodes.serve(0)
        with ckptd.Client(run_dir=nodes.run_dirs[0], spawn=False) as client:
            for i in range(repeat + 1):
                side = busy(device)
                started = time.perf_counter()
                fut = client.save_async(state, nodes.root / f"rep-{i}", step=i, persist=False)
                fut.wait_staged()
                blocked = time.perf_counter() - started
                fut.result(600)
                held = time.perf_counter() - started
                fut.wait_replicated(600)
                if i:
                    out["rep_blocking"].append(blocked)
                    out["rep_held"].append(held)
                    out["rep_replicated"].append(time.perf_counter() - started)
                if side is not None:
                    side.synchronize()
    finally:
        nodes.stop()
    return out


def gpu_check(case: Case, scratch: Path) -> dict:
    device = case.device
    bench = build("transformer", case.size_gib, device=device)
    sync(device)
    reps: dict[str, list[float]] = {"pinned_buffer": memcpy_reused(bench.tensors, bench.nbytes, case.repeat),
                                    "to_cpu": to_cpu_times(bench.tensors, case.repeat)}
    out: dict[str, Any] = {"state": bench.describe(), "reps": reps}
    with BenchDaemon(scratch) as daemon:
        for name, options in (("ckptd", {}), ("ckptd_bg", {"background_staging": True})):
            got = ckptd_saves(bench.state, scratch, case.repeat, 0, daemon, reserve_bytes=bench.nbytes + (1 << 20),
                              **options)
            reps.update({f"{name}_{k}": v for k, v in got["reps"].items() if k in ("blocking", "staged", "durable")})
            out[f"{name}_first_blocking"] = got["first"]["blocking"]
        got = dcp_saves(bench.state, scratch, case.repeat, 0, mode="thread_stager")
        reps.update({f"dcp_{k}": v for k, v in got["reps"].items() if k in ("blocking", "staged", "durable")})
        reps.update(replication(bench.state, bench.nbytes, scratch, case.repeat, device))
        del bench
        steps = step_costs(scratch, daemon, case.params["steps_gib"], device, case.params["every"],
                           case.params["saves"])
    reps.update(steps["reps"])
    out["steps_nbytes"] = steps["steps_nbytes"]
    out["params"] = case.params
    return out

