"""Object storage (#14), moto's S3 server on localhost (a subprocess): ckptd's s3:// save and load against obstore's
put and 16 MiB ranged gets (8 at once, as ckptd) of the same bytes, blocking against a local save, CPU-s (``cpu_*``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch

import ckptd
from ckptd.protocol import objects

from .saves import BenchDaemon, free_port


def objects_case(case, scratch: Path) -> dict:
    import boto3  # moto's dependency
    import obstore
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{(port := free_port())}")
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
        data, store, reps = memoryview(state["w"].numpy()).cast("B"), objects.store("bench"), {}
        procs = {"moto": psutil.Process(moto.pid), "daemon": psutil.Process(daemon.pid), "client": psutil.Process()}
        cpu = lambda: {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}  # noqa: E731 (user + system seconds)
        end = lambda s: min(s + objects.READ_PART, len(data))  # noqa: E731
        with ckptd.Client(run_dir=daemon.run_dir, spawn=False, timeout=60) as client, \
                ThreadPoolExecutor(objects.PARALLEL_READS) as pool:
            for i in range(case.repeat + 1):  # the first round is a warm-up
                times, marks = {}, [("", time.perf_counter(), cpu())]
                mark = lambda key: marks.append((key, time.perf_counter(), cpu()))  # noqa: E731
                obstore.put(store, f"raw-{i}", data, chunk_size=objects.READ_PART, max_concurrency=objects.PARALLEL_READS)
                mark("raw_up")
                buffer = memoryview(bytearray(len(data)))  # get_range, not get_ranges: that one merges the ranges
                list(pool.map(lambda s: buffer.__setitem__(slice(s, end(s)), memoryview(obstore.get_range(
                    store, f"raw-{i}", start=s, end=end(s)))), range(0, len(data), objects.READ_PART)))
                mark("raw_down")
                for key, target in (("local_blocking", scratch / f"local-{i}"), ("blocking", f"s3://bench/ckpt-{i}")):
                    t = time.perf_counter()
                    fut = client.save_async(state, target, step=i)
                    times[key] = time.perf_counter() - t
                    fut.result()
                    mark("durable" if key == "blocking" else "local_durable")
                ckptd.load(f"s3://bench/ckpt-{i}")
                mark("load")
                for (_, t0, c0), (key, t1, c1) in zip(marks, marks[1:]):  # seconds, and CPU-seconds in them
                    times.update({key: t1 - t0, **{f"cpu_{key}_{k}": c1[k] - c0[k] for k in c1}})
                for k, v in times.items():
                    reps.setdefault(k, []).extend([v] if i else [])
        return {"nbytes": len(data), "reps": reps}
    finally:
        daemon.__exit__()
        moto.terminate()
        moto.wait(30)
