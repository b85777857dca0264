"""Object storage (#14), moto's S3 server on localhost (a subprocess): ckptd's s3:// save and load against obstore's
own put and ranged gets of the same bytes, and an s3:// save's blocking against a local one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import ckptd
from ckptd.protocol import objects
from ckptd.protocol.objects import READ_PART as PART

from .saves import BenchDaemon, free_port


def objects_case(case, scratch: Path) -> dict:
    import boto3  # moto's dependency
    import obstore
    port = free_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = BenchDaemon(scratch)
    try:
        for _ in range(200):
            try:
                boto3.client("s3").create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.05)
        daemon._ckptd("start", "--root", str(scratch), "--root", "s3://bench")
        daemon.pid = daemon.status()["daemon"]["pid"]
        state = {"w": torch.randn(int(case.size_gib * (1 << 30)) // 4)}
        data, store = memoryview(state["w"].numpy()).cast("B"), objects.store("bench")
        starts = list(range(0, len(data), PART))
        reps: dict[str, list] = {k: [] for k in ("raw_up", "raw_down", "durable", "load", "blocking", "local_blocking")}
        with ckptd.Client(run_dir=daemon.run_dir, spawn=False, timeout=60) as client:
            for i in range(case.repeat + 1):  # the first round is a warm-up
                t, times = time.perf_counter(), {}
                obstore.put(store, f"raw-{i}", data, chunk_size=PART, max_concurrency=objects.PARALLEL_READS)
                times["raw_up"], t = time.perf_counter() - t, time.perf_counter()
                got = obstore.get_ranges(store, f"raw-{i}", starts=starts, ends=[s + PART for s in starts])
                buffer = bytearray(len(data))
                for s, part in zip(starts, got):
                    buffer[s : s + len(part)] = memoryview(part)
                times["raw_down"] = time.perf_counter() - t
                for key, target in (("local_blocking", scratch / f"local-{i}"), ("blocking", f"s3://bench/ckpt-{i}")):
                    t = time.perf_counter()
                    fut = client.save_async(state, target, step=i)
                    times[key] = time.perf_counter() - t
                    fut.result()
                    times["durable"] = time.perf_counter() - t  # the s3:// one, measured last
                t = time.perf_counter()
                times["load"] = ckptd.load(f"s3://bench/ckpt-{i}") and time.perf_counter() - t
                for k, v in times.items():
                    reps[k] += [v] if i else []
        return {"nbytes": len(data), "reps": reps}
    finally:
        daemon.__exit__()
        moto.terminate()
        moto.wait(30)
