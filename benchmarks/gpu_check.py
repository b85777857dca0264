#!/usr/bin/env python3
"""GPU check for ckptd: device-to-host staging and full saves from CUDA tensors.

Runs on one CUDA GPU (H100/H200 class) with torch built for CUDA and ckptd
installed (``pip install -e .`` from the repository root). In well under five
minutes it measures, on a ~4 GiB set of CUDA tensors shaped like a
transformer plus its AdamW state:

1. ckptd's own staging into a slot registered as pinned memory
   (``Slot(nbytes)``, ``.pin()`` = ``cudaHostRegister``, then
   ``staging.stage(flat, layout, slot)``: copies on a side stream, then
   ``copies.wait()``): how long the caller is blocked issuing the copies,
   and how long until they have landed (the D2H bandwidth);
2. the same slot's copies without pinning (a second slot, never
   registered): pageable D2H;
3. ``tensor.to("cpu", non_blocking=True)`` for every tensor (torch's
   pinned caching host allocator), and ``copy_(non_blocking=True)`` into
   preallocated pinned tensors (the best a hand-written stager does);
4. ``ckptd.Client().save_async`` through a daemon the client spawns under a
   temporary run directory (``CKPTD_ROOTS`` set to the checkpoint directory):
   blocking, staged and durable time, sync and background staging;
5. DCP ``async_save`` (PROCESS checkpointer, default and with a reused
   ``DefaultStager``): blocking, staged and durable time.

The D2H part needs no daemon. It prints a table and writes JSON to
``$OUT/gpu_check.json`` when ``$OUT`` is set, else ``./gpu_check.json``
(or ``--out``).

``--dry-run`` does the same bookkeeping on a small set of CPU tensors (no
GPU needed: pinning is refused and the copies are plain ``copy_``), so the
script is known to run before it meets a GPU. Importing this module does
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

GIB = 1 << 30


# --- the state -------------------------------------------------------------------


def make_state(nbytes: int, device: str, dtype_name: str = "float32") -> dict:
    """``{"model", "optimizer", "step"}`` of about ``nbytes``: a transformer and its AdamW state.

    Parameters and both AdamW moments in ``dtype``; per-parameter ``step``
    scalars on the CPU, as torch's AdamW keeps them. Values are random
    (``torch.randn`` on the device), which costs milliseconds on a GPU.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    el = torch.empty((), dtype=dtype).element_size()
    vocab, layers = 32000, 12

    def params(d: int) -> int:
        per_block = 2 * (2 * d) + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return 2 * vocab * d + layers * per_block + 2 * d

    d = 64
    while params(d + 64) * 3 * el <= nbytes:
        d += 64
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"blocks.{i}."
        shapes.update({p + "ln1.weight": (d,), p + "ln1.bias": (d,)})
        for n in ("q", "k", "v", "o"):
            shapes.update({p + f"{n}.weight": (d, d), p + f"{n}.bias": (d,)})
        shapes.update({p + "ln2.weight": (d,), p + "ln2.bias": (d,), p + "fc1.weight": (4 * d, d),
                       p + "fc1.bias": (4 * d,), p + "fc2.weight": (d, 4 * d), p + "fc2.bias": (d,)})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "head.weight": (vocab, d)})
    model = {k: torch.randn(s, device=device, dtype=dtype) for k, s in shapes.items()}
    opt_state = {i: {"step": torch.tensor(1000.0), "exp_avg": torch.randn_like(t).mul_(1e-3),
                     "exp_avg_sq": torch.rand_like(t).mul_(1e-6)} for i, t in enumerate(model.values())}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "params": list(range(len(model)))}]
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": groups}, "step": 1000}


def tensors_of(obj: Any) -> list:
    import torch

    out, seen = [], set()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out


# --- timing helpers -----------------------------------------------------------------


def sync_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def repeat_timed(fn: Callable[[], dict[str, float]], repeat: int) -> dict[str, list[float]]:
    """One warm-up, then ``repeat`` runs; ``fn`` returns named durations in seconds."""
    out: dict[str, list[float]] = {}
    for i in range(1 + repeat):
        got = fn()
        if i:
            for k, v in got.items():
                out.setdefault(k, []).append(v)
    return out


# --- the measurements ------------------------------------------------------------------


def d2h_ckptd(state: dict, device: str, repeat: int, *, pinned: bool) -> dict:
    """ckptd's ``stage`` into a slot, pinned (``Slot.pin``) or deliberately not."""
    from ckptd.client import staging
    from ckptd.client.flatten import flatten
    from ckptd.client.slots import Slot
    from ckptd.client.staging import layout_for, stage

    write_header = getattr(staging, "write_header", None)  # newer clients write the header apart from stage()
    flat = flatten(state)
    layout = layout_for(flat)
    t0 = time.perf_counter()
    slot = Slot(layout.nbytes)
    t_slot = time.perf_counter() - t0
    t_pin = None
    if pinned:
        t0 = time.perf_counter()
        ok = slot.pin()
        t_pin = time.perf_counter() - t0
    else:
        slot.pinned = False  # stage() calls pin(); this makes it a no-op, so the copies are pageable
        ok = False

    def once() -> dict[str, float]:
        sync_device(device)
        t0 = time.perf_counter()
        if write_header is not None:
            write_header(layout, slot)
        copies = stage(flat, layout, slot)
        t1 = time.perf_counter()
        if copies is not None:
            copies.wait()
        t2 = time.perf_counter()
        return {"issue": t1 - t0, "landed": t2 - t0}

    try:
        times = repeat_timed(once, repeat)
    finally:
        slot.close()
    return {"nbytes": layout.nbytes, "pinned": bool(ok), "slot_create_s": t_slot, "pin_s": t_pin, **times}


def d2h_torch(state: dict, device: str, repeat: int) -> dict:
    """``.to("cpu", non_blocking=True)`` per tensor, and ``copy_`` into preallocated pinned tensors."""
    import torch

    src = [t for t in tensors_of(state) if t.device.type == device.split(":")[0]]
    cuda = device.startswith("cuda")

    def to_cpu() -> dict[str, float]:
        sync_device(device)
        t0 = time.perf_counter()
        out = [t.to("cpu", non_blocking=True) for t in src]
        t1 = time.perf_counter()
        sync_device(device)
        t2 = time.perf_counter()
        del out
        return {"issue": t1 - t0, "landed": t2 - t0}

    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in src]

    def into_pinned() -> dict[str, float]:
        sync_device(device)
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=cuda)
        t1 = time.perf_counter()
        sync_device(device)
        t2 = time.perf_counter()
        return {"issue": t1 - t0, "landed": t2 - t0}

    return {"to_cpu_non_blocking": repeat_timed(to_cpu, repeat),
            "copy_into_preallocated_pinned": repeat_timed(into_pinned, repeat), "pinned": cuda}


def client_saves(state: dict, ckpt_dir: Path, repeat: int, *, background: bool) -> dict:
    """``ckptd.Client().save_async`` through a daemon it spawns under a temporary run dir."""
    import ckptd

    run_dir = Path(tempfile.mkdtemp(prefix="ckgpu-", dir="/tmp"))  # short: the socket path must fit 107 bytes
    os.environ.setdefault("CKPTD_ROOTS", str(ckpt_dir))
    client = ckptd.Client(run_dir=run_dir, spawn=True, background_staging=background, rank=0, world_size=1)
    previous: Path | None = None

    def once(i: list[int] = [0]) -> dict[str, float]:  # noqa: B006 (a counter)
        nonlocal previous
        i[0] += 1
        path = ckpt_dir / f"ckptd-{'bg' if background else 'sync'}-{i[0]}"
        t0 = time.perf_counter()
        fut = client.save_async(state, path, step=i[0])
        t1 = time.perf_counter()
        fut.wait_staged()
        t2 = time.perf_counter()
        res = fut.result()
        t3 = time.perf_counter()
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        previous = path
        return {"blocking": t1 - t0, "staged": t2 - t0, "durable": t3 - t0, "bytes": float(res.bytes_written)}

    try:
        times = repeat_timed(once, repeat)
    finally:
        client.close()
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        try:
            import subprocess

            subprocess.run([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(run_dir), "--timeout", "60"],
                           capture_output=True, timeout=90)
        except Exception:
            pass
        shutil.rmtree(run_dir, ignore_errors=True)
    return times


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dcp_saves(state: dict, ckpt_dir: Path, repeat: int, *, reused_stager: bool, cuda: bool) -> dict:
    """DCP ``async_save`` with the PROCESS checkpointer (default stager, or one reused DefaultStager)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    stager = None
    if reused_stager:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                              use_non_blocking_copy=cuda))
    previous: Path | None = None

    def once(i: list[int] = [0]) -> dict[str, float]:  # noqa: B006 (a counter)
        nonlocal previous
        i[0] += 1
        path = ckpt_dir / f"dcp-{'stager' if reused_stager else 'default'}-{i[0]}"
        t0 = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              async_stager=stager)
        t1 = time.perf_counter()
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result()
            t2 = time.perf_counter()
            resp.upload_completion.result()
        else:
            t2 = t1
            resp.result()
        t3 = time.perf_counter()
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        previous = path
        return {"blocking": t1 - t0, "staged": t2 - t0, "durable": t3 - t0}

    try:
        return repeat_timed(once, repeat)
    finally:
        if stager is not None:
            stager.close()
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)


def stop_dcp_process() -> None:
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        if proc is not None:
            ape._CHECKPOINT_PROCESS = None
            proc.__del__()
    except Exception:
        pass


# --- driver -----------------------------------------------------------------------------


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": device, "host": platform.node(), "cpus": os.cpu_count()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import ckptd

        env["ckptd"] = ckptd.__version__
    except Exception:
        pass
    return env


def rows(results: dict, nbytes: int) -> list[list[str]]:
    """The printed table: one row per measurement, medians."""
    gb = nbytes / 1e9

    def fmt(x: float | None) -> str:
        return "–" if x is None else f"{x:.3f}"

    def bw(x: float | None) -> str:
        return "–" if not x else f"{gb / x:.1f}"

    out = [["what", "caller blocked s", "staged / landed s", "durable s", "GB/s (landed or durable)"]]
    for key, label in (("d2h_ckptd_pinned", "ckptd stage → slot, pinned (cudaHostRegister)"),
                       ("d2h_ckptd_unpinned", "ckptd stage → slot, not pinned")):
        r = results.get(key)
        if r and "error" not in r:
            out.append([label + ("" if r.get("pinned") or key.endswith("unpinned") else " [pin refused]"),
                        fmt(median(r.get("issue"))), fmt(median(r.get("landed"))), "–", bw(median(r.get("landed")))])
    r = results.get("d2h_torch")
    if r and "error" not in r:
        for key, label in (("to_cpu_non_blocking", 'tensor.to("cpu", non_blocking=True)'),
                           ("copy_into_preallocated_pinned", "copy_(non_blocking) into preallocated pinned")):
            x = r[key]
            out.append([label, fmt(median(x.get("issue"))), fmt(median(x.get("landed"))), "–",
                        bw(median(x.get("landed")))])
    for key, label in (("client_sync", "ckptd Client.save_async, sync staging"),
                       ("client_background", "ckptd Client.save_async, background staging"),
                       ("dcp_process", "DCP async_save PROCESS"),
                       ("dcp_process_stager", "DCP async_save PROCESS + reused DefaultStager")):
        x = results.get(key)
        if x and "error" not in x:
            out.append([label, fmt(median(x.get("blocking"))), fmt(median(x.get("staged"))),
                        fmt(median(x.get("durable"))), bw(median(x.get("durable")))])
        elif x:
            out.append([label + f" [failed: {x['error'][:60]}]", "–", "–", "–", "–"])
    return out


def render(cells: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=4.0, help="size of the CUDA state (default 4)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (default 3)")
    p.add_argument("--dtype", default="float32", help="dtype of parameters and moments (default float32)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/ckptd-gpu-check"),
                   help="where the full saves write (default /tmp/ckptd-gpu-check; also CKPTD_ROOTS)")
    p.add_argument("--skip-saves", action="store_true", help="D2H only: no daemon, no DCP")
    p.add_argument("--skip-dcp", action="store_true", help="no DCP saves")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU tensors, 64 MiB, 1 repetition: exercises the bookkeeping without a GPU")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default $OUT/gpu_check.json or ./gpu_check.json)")
    args = p.parse_args(argv)

    try:
        import torch

        import ckptd  # noqa: F401
    except ImportError as exc:
        print(f"gpu_check needs torch and ckptd installed (pip install -e . from the repository root): {exc}",
              file=sys.stderr)
        return 2
    if args.dry_run:
        device, size, repeat = "cpu", 1 / 16, 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or use --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device, size, repeat = "cuda:0", args.size_gib, args.repeat
    out_path = args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                            else Path("gpu_check.json"))
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[gpu_check {time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    log(f"building a {size:g} GiB state on {device}")
    state = make_state(int(size * GIB), device, args.dtype)
    sync_device(device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    results: dict[str, Any] = {"environment": environment(device), "dry_run": args.dry_run, "nbytes": nbytes,
                               "tensors": len(tensors_of(state)), "repeat": repeat}

    def attempt(key: str, fn: Callable[[], Any]) -> None:
        log(key)
        try:
            results[key] = fn()
        except Exception as exc:  # one failing part must not lose the others
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{key} failed: {results[key]['error']}")

    attempt("d2h_ckptd_pinned", lambda: d2h_ckptd(state, device, repeat, pinned=True))
    attempt("d2h_ckptd_unpinned", lambda: d2h_ckptd(state, device, repeat, pinned=False))
    attempt("d2h_torch", lambda: d2h_torch(state, device, repeat))
    if not args.skip_saves:
        attempt("client_sync", lambda: client_saves(state, args.ckpt_dir, repeat, background=False))
        attempt("client_background", lambda: client_saves(state, args.ckpt_dir, repeat, background=True))
        if not args.skip_dcp:
            cuda = device.startswith("cuda")
            attempt("dcp_process", lambda: dcp_saves(state, args.ckpt_dir, repeat, reused_stager=False, cuda=cuda))
            attempt("dcp_process_stager",
                    lambda: dcp_saves(state, args.ckpt_dir, repeat, reused_stager=True, cuda=cuda))
            stop_dcp_process()
    results["seconds"] = time.perf_counter() - started
    table = rows(results, nbytes)
    results["table"] = table
    print(f"{nbytes / GIB:.2f} GiB in {results['tensors']} tensors on {device}; medians of {repeat} after a warm-up")
    print(render(table))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2, default=str))
    log(f"wrote {out_path}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
