"""Replication to a buddy node and restore from it, beside a raw ZeroMQ stream, a cold disk load and an s3:// load
(issues #28, #40).

    python -m benchmarks.replication --mib 1024 --repeat 3 [--pin] [--restore-only] [--no-s3]
    python -m benchmarks.replication --steps --mib 256 --every 2 --repeat 6 --peer-rate 100MB
    python -m benchmarks.replication --frozen 0.9 --mib 512 --repeat 3

Two daemons on 127.0.0.1 stand for two nodes (origin and buddy), each with its own run directory and peer port,
CurveZMQ on for the peer protocol and GMAC-tagged frames on the data port (``--peer-encrypt``: AES-256-GCM), as
``docs/memory.md`` deploys them. In one run, for the same state:

- the link's limit: a plain TCP stream of the same bytes between two processes (the receiver ``recv_into`` one
  buffer), and a raw ZeroMQ stream (16 MiB frames, DEALER to ROUTER, the receiver copying each frame into one
  buffer), without CURVE and with it;
- a snapshot's blocking (``save_async`` to ``wait_staged``) with replication on, and on a daemon with
  ``--replicas 0``, and the time from held to replicated (``result()`` to ``wait_replicated()``);
- restoring a lost node: the origin's daemon SIGKILLed, a replacement started, ``latest()`` (which reads the
  replica back) plus ``load_into``, against ``load_into`` of the same state persisted on disk with its page
  cache dropped first, and of the same state saved to ``s3://`` on moto's S3 server on localhost (a subprocess;
  ``--no-s3``: not measured); the restore's two calls are also timed apart;
- the memory a buddy spends: the replica bytes it holds over the origin's own.

``--steps`` measures instead what replication costs a training loop (issue #40, item 3): the step-time
benchmark's trainee (``benchmarks/steps.py``: an MLP and its AdamW state of ``--mib``) snapshots every ``--every``
steps, each snapshot waited for before the next, on an origin with no replication (``--replicas 0``), replicating
as fast as it can, and replicating at ``--peer-rate``; each mode's median interval of ``--every`` steps, and its ratio
to the unreplicated one's.

``--frozen F`` measures sending only what changed (issue #40, item 4): a state of ``--mib`` whose share ``F`` is
frozen (the same bytes at every step, as a base model under LoRA) is snapshotted twice into a fresh directory per
repetition; the first is a full send (nothing to build from on the buddy, every chunk hashed all the same), the
second sends only its changed chunks; then the same two on an origin started with ``--peer-send-all`` (no digests:
every byte, as before item 4). For each: bytes sent (the origin's ``peers.replicated_sent_bytes_total``) and held to
replicated; and the origin's cost, SHA-256 of every chunk on one core. Two layouts: the frozen part as one tensor and the trained part
as another (``block``), and 32 layers each a frozen weight with its adapter's two small tensors beside it in the
shard (``interleaved``, as a LoRA model's state dict lays them out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import zmq

import ckptd

from benchmarks.limits import evict, files_under
from benchmarks.saves import free_port

FRAME = 16 << 20
RECEIVER = r"""
import sys, zmq
size, frame, curve = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER)
if curve:
    sock.curve_server = True; sock.curve_publickey, sock.curve_secretkey = sys.argv[4].encode(), sys.argv[5].encode()
port = sock.bind_to_random_port("tcp://127.0.0.1"); print(port, flush=True)
buf = bytearray(size)
while True:
    ident, data = sock.recv_multipart(copy=False)
    if len(data) == 0:
        break
    view = memoryview(buf); got = 0
    while True:
        chunk = data.buffer; view[got:got + len(chunk)] = chunk; got += len(chunk)
        sock.send_multipart([ident.bytes, b"ok"])
        if got >= size:
            break
        ident, data = sock.recv_multipart(copy=False)
"""


TCP_RECEIVER = r"""
import socket, sys
size = int(sys.argv[1])
server = socket.create_server(("127.0.0.1", 0)); print(server.getsockname()[1], flush=True)
buf = memoryview(bytearray(size))
while True:
    conn, _ = server.accept()
    got = 0
    while got < size:
        n = conn.recv_into(buf[got:])
        if not n:
            sys.exit(0)
        got += n
    conn.sendall(b"k")
    conn.close()
"""


def tcp_stream(size: int, repeat: int) -> list[float]:
    """Seconds to stream ``size`` bytes over a plain TCP socket to another process that places them in one buffer
    (connect to its one-byte answer): the link's limit, which the data port's AEAD frames are measured against."""
    proc = subprocess.Popen([sys.executable, "-c", TCP_RECEIVER, str(size)], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    data = memoryview(torch.randint(0, 255, (size,), dtype=torch.uint8).numpy())
    times = []
    try:
        for _ in range(repeat):
            started = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(data)
                assert conn.recv(1) == b"k"
            times.append(time.perf_counter() - started)
    finally:
        proc.kill()
        proc.wait(30)
    return times


def _data_pair() -> int:
    """A port of 127.0.0.1 free with the next one (a peer endpoint's data port is its port + 1)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def raw_stream(size: int, curve: bool, repeat: int, frame: int = FRAME, window: int = 4) -> list[float]:
    """Seconds to stream ``size`` bytes to another process in ``frame``-byte frames, ``window`` in flight (as
    the CURVE link used to)."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(size), str(frame), "1" if curve else "0",
                             server_public.decode(), server_secret.decode()], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    if curve:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, client_public, client_secret
    sock.connect(f"tcp://127.0.0.1:{port}")
    data = memoryview(torch.randint(0, 255, (size,), dtype=torch.uint8).numpy())
    times = []
    for _ in range(repeat):
        started, unanswered = time.perf_counter(), 0
        for offset in range(0, size, frame):
            while unanswered >= window:
                sock.recv()
                unanswered -= 1
            sock.send(data[offset:offset + frame], copy=False)
            unanswered += 1
        while unanswered:
            sock.recv()
            unanswered -= 1
        times.append(time.perf_counter() - started)
    sock.send(b"")
    sock.close(0)
    proc.wait(30)
    return times


class Nodes:
    """Origin and buddy daemons with peers on, in one scratch directory."""

    ALWAYS: tuple[str, ...] = ()
    """``ckptd start`` options of every daemon of the run (``--peer-encrypt``, ``--peer-send-all``)."""

    def __init__(self, scratch: Path, cpus: tuple[set[int], set[int]] | None = None) -> None:
        """``cpus``: the cores of the origin's node (its daemon; the trainer pins itself) and the buddy's."""
        self.scratch, self.keys, self.cpus = scratch, scratch / "peer-keys", cpus
        self.root = scratch / "ckpts"
        self.root.mkdir()
        self.endpoints = [f"tcp://127.0.0.1:{_data_pair()}" for _ in range(2)]
        self.procs: list[subprocess.Popen | None] = [None, None]
        self.run_dirs: list[Path] = [Path(), Path()]

    def start(self, node: int, *extra: str) -> Path:
        run_dir = Path(tempfile.mkdtemp(prefix=f"ckb{node}-", dir="/tmp"))
        line = subprocess.check_output([sys.executable, "-m", "ckptd", "peer-key", "--run-dir", str(run_dir),
                                        "--endpoint", self.endpoints[node]], text=True)
        lines = [ln for ln in (self.keys.read_text().splitlines() if self.keys.exists() else [])
                 if not ln.endswith(self.endpoints[node])]
        self.keys.write_text("\n".join([*lines, line.strip()]) + "\n")
        self.run_dirs[node] = run_dir
        return run_dir

    def serve(self, node: int, *extra: str) -> None:
        run_dir = self.run_dirs[node]
        self.procs[node] = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "start", "--foreground", "--quiet", "--run-dir", str(run_dir),
             "--root", str(self.root), "--peer-listen", self.endpoints[node], "--peer", self.endpoints[1 - node],
             "--peer-keys", str(self.keys), "--persist-on-exit", "never", "--memory-budget", "8GiB", *self.ALWAYS,
             *extra],
            preexec_fn=None if self.cpus is None else lambda: os.sched_setaffinity(0, self.cpus[node]))
        while not (run_dir / "ckptd.sock").exists():
            time.sleep(0.02)
        while subprocess.run([sys.executable, "-m", "ckptd", "status", "--run-dir", str(run_dir)],
                             capture_output=True).returncode:
            time.sleep(0.05)

    def kill(self, node: int) -> None:
        proc = self.procs[node]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


def _status(run_dir: Path) -> dict[str, Any]:
    import json

    out = subprocess.check_output([sys.executable, "-m", "ckptd", "status", "--json", "--run-dir", str(run_dir)])
    return json.loads(out)


def snapshots(nodes: Nodes, state: dict, repeat: int, tag: str) -> dict[str, list[float]]:
    client = ckptd.Client(run_dir=nodes.run_dirs[0], spawn=False)
    out: dict[str, list[float]] = {"blocking": [], "held": [], "replicated": []}
    try:
        for i in range(repeat + 1):  # the first save makes the client's slots: not timed
            started = time.perf_counter()
            fut = client.save_async(state, nodes.root / f"{tag}-{i}", step=i, persist=False)
            fut.wait_staged()
            blocked = time.perf_counter() - started
            fut.result(600)
            held = time.perf_counter() - started
            if tag == "replicated":
                fut.wait_replicated(600)
            done = time.perf_counter() - started
            if i:
                out["blocking"].append(blocked)
                out["held"].append(held)
                out["replicated"].append(done - held)
    finally:
        client.close()
    return out


class Moto:
    """moto's S3 server on 127.0.0.1 (a subprocess), with bucket ``bench``; the AWS environment set in this process
    before the daemons start, so theirs points at it too."""

    def __enter__(self) -> "Moto":
        import boto3  # moto's dependency

        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{(port := free_port())}")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(400):
            try:
                boto3.client("s3").create_bucket(Bucket="bench")
                return self
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("moto's S3 server did not start")

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def restores(nodes: Nodes, state: dict, repeat: int, s3: bool) -> dict[str, list[float]]:
    """The lost node's restore (``latest`` + ``load_into``, each also timed apart) against a cold disk ``load_into``
    of the same state and an ``s3://`` one, in turns, ``repeat`` times."""
    on_disk, in_store = nodes.root / "disk", "s3://bench/restore-state"
    saver = ckptd.Client(run_dir=nodes.run_dirs[0], spawn=False)
    saver.save_async(state, on_disk, step=0).result(600)
    if s3:
        saver.save_async(state, in_store, step=0).result(600)
    saver.close()
    out: dict[str, list[float]] = {"restore": [], "latest": [], "load_into": [], "cold": [], "s3": []}
    target = {"w": torch.empty_like(state["w"])}
    for _ in range(repeat):
        nodes.kill(0)
        nodes.start(0)
        nodes.serve(0, *(("--root", "s3://bench") if s3 else ()))
        started = time.perf_counter()
        newest = ckptd.latest(nodes.root, run_dir=nodes.run_dirs[0])
        chosen = time.perf_counter()
        ckptd.load_into(target, newest, run_dir=nodes.run_dirs[0])
        ended = time.perf_counter()
        out["restore"].append(ended - started)
        out["latest"].append(chosen - started)
        out["load_into"].append(ended - chosen)
        assert torch.equal(target["w"], state["w"]), "the restored state differs"
        evict(files_under(on_disk))
        started = time.perf_counter()
        ckptd.load_into(target, on_disk)
        out["cold"].append(time.perf_counter() - started)
        if s3:
            target["w"].zero_()
            started = time.perf_counter()
            ckptd.load_into(target, in_store)
            out["s3"].append(time.perf_counter() - started)
            assert torch.equal(target["w"], state["w"]), "the state loaded from s3:// differs"
    med = statistics.median
    print(f"restore of the lost node from its buddy (latest + load_into): {med(out['restore']):.3f} s (latest, which "
          f"reads the replica back, {med(out['latest']):.3f} s; load_into {med(out['load_into']):.3f} s); cold disk "
          f"load_into of the same state: {med(out['cold']):.3f} s (restore / cold "
          f"{med(out['restore']) / med(out['cold']):.2f})"
          + (f"; s3:// load_into (moto on localhost): {med(out['s3']):.3f} s (restore / s3 "
             f"{med(out['restore']) / med(out['s3']):.2f})" if s3 else ""))
    return out


def _frozen_state(mib: int, frozen: float, layout: str, step: int) -> dict:
    """A state of ``mib`` MiB whose share ``frozen`` is the same at every ``step`` and the rest new at each."""
    total, base = mib << 18, int((mib << 18) * frozen)  # float32 elements
    fixed, trained = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1000 + step)
    if layout == "block":
        return {"base": torch.randn(base, generator=fixed), "lora": torch.randn(total - base, generator=trained)}
    layers = 32
    return {f"layers.{i:02d}.{name}": torch.randn(n, generator=fixed if name == "base" else trained)
            for i in range(layers) for name, n in (("base", base // layers), ("lora_a", (total - base) // layers // 2),
                                                   ("lora_b", (total - base) // layers // 2))}


def changed_only(nodes: Nodes, mib: int, frozen: float, repeat: int, layout: str) -> dict[str, list[float]]:
    """Bytes sent and held to replicated of a full send (a directory's first snapshot) and of one sending only its
    changed chunks (its second), ``repeat`` times, each in a directory of its own, deleted after."""
    from ckptd.peers import chunks

    client = ckptd.Client(run_dir=nodes.run_dirs[0], spawn=False)
    out: dict[str, list[float]] = {"full_s": [], "full_sent": [], "changed_s": [], "changed_sent": [], "hash_s": [],
                                   "hash_threads_s": []}
    try:
        for i in range(repeat + 1):  # the first makes the client's slots: not counted
            for step, kind in ((1, "full"), (2, "changed")):
                state = _frozen_state(mib, frozen, layout, step)
                before = _status(nodes.run_dirs[0])["peers"]["replicated_sent_bytes_total"]
                fut = client.save_async(state, nodes.root / f"{layout}-{i}" / f"step-{step}", step=step,
                                        persist=False)
                fut.result(600)
                held = time.perf_counter()
                fut.wait_replicated(600)
                took = time.perf_counter() - held
                sent = _status(nodes.run_dirs[0])["peers"]["replicated_sent_bytes_total"] - before
                if i:
                    out[f"{kind}_s"].append(took)
                    out[f"{kind}_sent"].append(sent)
            client.delete(nodes.root / f"{layout}-{i}" / "step-2")
            if i:
                flat = torch.cat([t.view(-1) for t in state.values()]).numpy().data.cast("B")
                for threads, key in ((1, "hash_s"), (chunks.HASH_THREADS, "hash_threads_s")):
                    started = time.perf_counter()
                    chunks.digests(flat, threads)
                    out[key].append(time.perf_counter() - started)
    finally:
        client.close()
    return out


def steps_under_replication(scratch: Path, mib: int, every: int, repeat: int, rate: str,
                            cpus: tuple[set[int], set[int]] | None) -> dict[str, list[float]]:
    """Each mode's intervals of ``every`` steps ending with a snapshot (the trainee and ``train`` of the step-time
    cases), one origin daemon per mode, the buddy started afresh with it."""
    from .steps import Trainee, train

    out: dict[str, list[float]] = {}
    for mode, extra in (("unreplicated", ("--replicas", "0")), ("replicated", ()),
                        ("capped", ("--peer-rate", rate))):
        nodes = Nodes(scratch / mode, cpus)
        try:
            nodes.start(0)
            nodes.start(1)
            nodes.serve(1)
            nodes.serve(0, *extra)
            trainee = Trainee(mib / 1024)
            client = ckptd.Client(run_dir=nodes.run_dirs[0], spawn=False)

            def save(step: int) -> Any:
                return client.save_async({"model": trainee.model.state_dict(),
                                          "optim": trainee.optimizer.state_dict()},
                                         nodes.root / "run" / f"s-{step}", step=step, persist=False)

            def wait(fut: Any) -> None:  # held before the next, as a trainer waits; its stream to the buddy
                fut.result(600)  # runs beside the steps that follow (a step pays for what it takes of the cores)
            out[mode] = train(trainee.step, save, every=every, saves=repeat, wait=wait)["interval"]
            client.close()
        finally:
            nodes.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pin", action="store_true",
                        help="the buddy's daemon on the last core, the trainer and the origin's daemon on the others, "
                             "as two nodes' CPUs are apart (one machine's nodes otherwise share every core)")
    parser.add_argument("--restore-only", action="store_true",
                        help="only the raw streams and the lost node's restore against the cold disk and s3:// loads")
    parser.add_argument("--no-s3", action="store_true", help="no s3:// load (moto) beside the restore")
    parser.add_argument("--steps", action="store_true",
                        help="a training loop's step time with no replication, replication, and replication at "
                             "--peer-rate (nothing else)")
    parser.add_argument("--every", type=int, default=2, help="--steps: steps per snapshot")
    parser.add_argument("--peer-rate", default=None,
                        help="--steps: the capped mode's --peer-rate (default 100MB); --frozen: the origin's, if given")
    parser.add_argument("--frozen", type=float, default=None,
                        help="only sending what changed: the share of the state frozen between snapshots (0.9)")
    parser.add_argument("--peer-encrypt", action="store_true",
                        help="both daemons encrypt the replicas' frames (AES-256-GCM; default: GMAC-tagged plain)")
    parser.add_argument("--send-all", action="store_true",
                        help="both daemons with --peer-send-all: no SHA-256 pass before a snapshot's stream")
    args = parser.parse_args()
    Nodes.ALWAYS = ("--peer-encrypt",) * args.peer_encrypt + ("--peer-send-all",) * args.send_all
    cpus = None
    if args.pin:
        every = sorted(os.sched_getaffinity(0))
        if len(every) < 2:
            raise SystemExit("--pin needs two cores at least")
        cpus = (set(every[:-1]), {every[-1]})
        os.sched_setaffinity(0, cpus[0])
    size = args.mib << 20
    state = {"w": torch.randn(size // 4)}
    print(f"{args.mib} MiB, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, frames "
          f"{'encrypted' if args.peer_encrypt else 'plain (GMAC)'}{', every byte sent' if args.send_all else ''}"
          + (f", origin's node on cores {sorted(cpus[0])}, buddy's on {sorted(cpus[1])}" if cpus else ""))
    med = statistics.median
    if args.frozen is not None:
        from ckptd.peers import chunks

        with tempfile.TemporaryDirectory(dir=os.environ.get("CKPTD_BENCH_DIR", "/tmp")) as scratch:
            nodes = Nodes(Path(scratch), cpus)
            try:
                nodes.start(0)
                nodes.start(1)
                nodes.serve(1)
                rate = ("--peer-rate", args.peer_rate) if args.peer_rate else ()
                nodes.serve(0, "--peer-send-all", *rate)
                every = {"send_all": changed_only(nodes, args.mib, args.frozen, args.repeat, "block")}
                nodes.kill(0)
                nodes.serve(0, *rate)
                for layout in ("block", "interleaved"):
                    every[layout] = changed_only(nodes, args.mib, args.frozen, args.repeat, layout)
                plain = statistics.median(every["send_all"]["changed_s"] + every["send_all"]["full_s"])
                print((f"origin at --peer-rate {args.peer_rate}; " if rate else "") + f"--peer-send-all: every snapshot {med(every['send_all']['changed_sent']) / 2**20:.1f} MiB in "
                      f"{plain:.3f} s")
                for layout in ("block", "interleaved"):
                    got = every[layout]
                    print(f"{layout}, {args.frozen:.0%} frozen: first snapshot {med(got['full_sent']) / 2**20:.1f} "
                          f"MiB in {med(got['full_s']):.3f} s ({med(got['full_s']) / plain:.2f} x --peer-send-all's); "
                          f"next {med(got['changed_sent']) / 2**20:.1f} MiB ({med(got['changed_sent']) / size:.1%} of "
                          f"the state) in {med(got['changed_s']):.3f} s ({med(got['changed_s']) / plain:.2f} x "
                          f"--peer-send-all's); SHA-256 of every chunk on one core {med(got['hash_s']):.3f} s "
                          f"({size / med(got['hash_s']) / 1e9:.2f} GB/s), on the daemon's {chunks.HASH_THREADS} "
                          f"threads {med(got['hash_threads_s']):.3f} s")
                print("every repetition:", every)
            finally:
                nodes.stop()
        return
    if args.steps:
        with tempfile.TemporaryDirectory(dir=os.environ.get("CKPTD_BENCH_DIR", "/tmp")) as scratch:
            for mode in ("unreplicated", "replicated", "capped"):
                (Path(scratch) / mode).mkdir()
            got = steps_under_replication(Path(scratch), args.mib, args.every, args.repeat,
                                          args.peer_rate or "100MB", cpus)
        base = med(got["unreplicated"])
        print(f"{args.every} steps ending with a snapshot: " + "; ".join(
            f"{mode} {med(v):.3f} s ({med(v) / base:.2f} x unreplicated)" for mode, v in got.items())
            + f"; --peer-rate {args.peer_rate or '100MB'}")
        print("every repetition:", got)
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("CKPTD_BENCH_DIR", "/tmp")) as scratch, \
            (contextlib.nullcontext() if args.no_s3 else Moto()):
        nodes = Nodes(Path(scratch), cpus)
        s3 = () if args.no_s3 else ("--root", "s3://bench")
        try:
            nodes.start(0)
            nodes.start(1)
            nodes.serve(1)
            tcp = tcp_stream(size, args.repeat)
            raw = raw_stream(size, False, args.repeat)
            raw_curve = raw_stream(size, True, args.repeat)
            print(f"plain TCP stream: {med(tcp):.3f} s ({size / med(tcp) / 1e9:.2f} GB/s); raw ZeroMQ stream: "
                  f"{med(raw):.3f} s ({size / med(raw) / 1e9:.2f} GB/s); with CURVE {med(raw_curve):.3f} s "
                  f"({size / med(raw_curve) / 1e9:.2f} GB/s)")
            if args.restore_only:
                nodes.serve(0, *s3)
                client = ckptd.Client(run_dir=nodes.run_dirs[0], spawn=False)
                client.save_async(state, nodes.root / "snap", step=1, persist=False).wait_replicated(600)
                client.close()
                print("every repetition:", {"tcp": tcp, "raw": raw, "raw_curve": raw_curve,
                                            **restores(nodes, state, args.repeat, not args.no_s3)})
                return
            nodes.serve(0, "--replicas", "0")
            plain = snapshots(nodes, state, args.repeat, "plain")
            nodes.stop()
            nodes.serve(1)
            nodes.serve(0, *s3)
            rep = snapshots(nodes, state, args.repeat, "replicated")
            replicated = med(rep["replicated"])
            print(f"snapshot blocking: replicated {med(rep['blocking']):.3f} s, unreplicated "
                  f"{med(plain['blocking']):.3f} s (ratio {med(rep['blocking']) / med(plain['blocking']):.2f}); held "
                  f"in {med(rep['held']):.3f} s; held to replicated {replicated:.3f} s "
                  f"({size / replicated / 1e9:.2f} GB/s, {med(tcp) / replicated:.2f} x the plain TCP stream's "
                  f"speed, {med(raw) / replicated:.2f} x the plain ZeroMQ stream's, {med(raw_curve) / replicated:.2f}"
                  f" x the CURVE stream's)")
            buddy = _status(nodes.run_dirs[1])["peers"]["replicas_held"]["bytes"]
            own = _status(nodes.run_dirs[0])["memory"]["held_bytes"]
            print(f"buddy memory: replicas {buddy / 2**20:.0f} MiB for the origin's {own / 2**20:.0f} MiB held "
                  f"({buddy / own:.2f} x; the buddy keeps the newest replica of each directory's ranks)")
            back = restores(nodes, state, args.repeat, not args.no_s3)
            print("every repetition:", {"tcp": tcp, "raw": raw, "raw_curve": raw_curve, "plain": plain,
                                        "replicated": rep, **back})
        finally:
            nodes.stop()

if __name__ == "__main__":
    main()
