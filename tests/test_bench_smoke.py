"""The benchmark harness runs end to end at tiny sizes, so it cannot rot unnoticed.

Real runs of ``python -m benchmarks --smoke``: every case of the registry
once, each in its own process, real daemons, real files. The sections run in
two runs at once (``--only``; a run is a chain of case processes, so one run
would be the longest wait of the suite). No timing is asserted; what is
checked is that every case sent one valid JSON line with measurements, that
each run's report is made of its lines alone, and that the report of all of
them renders.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


PARTS = ("save,load,snapshot,gpu,everystep", "multi,scaling,sharded,objects,transport,steps")
"""The sections of each run (``--only``), about as long as each other."""


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _numbers(value: object) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


@pytest.mark.timeout(900)
def test_smoke_run_gives_every_case_one_json_line_and_renders_the_report(tmp_path: Path) -> None:
    listed = _bench("--smoke", "--list", timeout=120)
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert len(names) >= 36 and "ckptd_sync" in names and "load_ranks_lease" in names
    # The peers a user would pick today, dense and FSDP2: DCP's executors with and without a reused stager, and
    # torch-checkpointing (make test installs it: requirements-dev.txt), as shipped and with the fsyncs it leaves out.
    peers = ["dcp_thread_stager", "dcp_process", "dcp_process_stager", "torchckpt", "torchckpt_fsync"]
    assert set(peers) <= set(names), names
    sharded_saves = ["sharded_memcpy", "sharded_ckptd", "sharded_process", "sharded_process_stager",
                     "sharded_thread_stager", "sharded_torchckpt", "sharded_torchckpt_fsync", "sharded_ckptd_dcp"]
    sharded_loads = ["sharded_load_ckptd", "sharded_load_dcp"]
    assert set(sharded_saves + sharded_loads) <= set(names), names
    # Per integration, the step-time cost of a snapshot, a persisted save and the framework's own (torchtitan's only
    # where .venv-torchtitan is built: torchtitan is not in .venv).
    steps = [n for n in names if n.startswith("steps_")]
    assert {"steps_dcp", "steps_lightning", "steps_fabric"} <= set(steps) <= {*steps, "steps_torchtitan"}, names

    runs = [_start("--smoke", "--only", part, "--scratch", str(tmp_path / str(i)), "--out",
                   str(tmp_path / str(i) / "RESULTS.md")) for i, part in enumerate(PARTS)]
    results = [(run, *run.communicate(timeout=840)) for run in runs]
    for run, _, err in results:
        assert run.returncode == 0, err[-4000:]
    order = {name: i for i, name in enumerate(names)}
    records = sorted((json.loads(line) for _, out, _ in results for line in out.splitlines()),
                     key=lambda r: order[r["case"]])
    assert [r["case"] for r in records] == names  # every case ran once, in one of the runs
    for r in records:
        assert "error" not in r, r
        assert r["wall_s"] > 0
        if r["method"] != "load_prepare":
            reps = r["reps"]
            assert reps and all(len(v) >= 1 for v in reps.values()), r["case"]
            values = _numbers(reps)
            assert all(math.isfinite(v) and v >= 0 for v in values), r["case"]
            assert any(v > 0 for v in values), r["case"]
    saved = [r for r in records if r["method"] == "ckptd" or r["case"] == "sharded_ckptd"]
    assert all(r["writer"]["RssAnon"] > 0 and r["reps"]["daemon_s"][0] > 0 for r in saved), "daemon figures missing"
    for r in (r for r in records if r["method"] == "multi_saves"):  # whom each round's CPU went to, and the disk
        assert {"ranks", "daemon", "busy", "disk"} <= set(r["node"]) and r["node"]["wall"] > 0, r["node"]
        assert r["node"]["busy"] > 0 and r["node"]["disk"] >= 0 and r["ranks_cpu"] == r["node"]["ranks"], r["node"]
    by_name = {r["case"]: r for r in records}
    for name in sharded_saves:  # every rank of the save held a shard: its own bytes are a part of the whole
        state = by_name[name]["state"]
        assert 0 < state["nbytes"] < state["global_nbytes"], (name, state)
    for name in sharded_saves[1:] + peers:
        assert set(by_name[name]["reps"]) >= {"blocking", "staged", "durable"}, name
        first = by_name[name]["first"]  # the first save (the warm-up) is kept apart from the timed ones
        assert first["blocking"] > 0 and first["durable"] >= first["staged"] >= first["blocking"], (name, first)
    for name in ("torchckpt", "torchckpt_fsync", "sharded_torchckpt", "sharded_torchckpt_fsync"):
        assert by_name[name]["writer"]["RssAnon"] > 0, name  # its writer subprocess was sampled
    for name in steps:  # every way of saving timed in the same run as the steps that never saved
        reps = by_name[name]["reps"]
        assert set(reps) == {f"{m}_{k}" for m in ("none", "snapshot", "persisted", "own") for k in ("step", "interval")}
        assert all(len(reps[f"{m}_step"]) == by_name[name]["repeat"] for m in ("snapshot", "persisted", "own")), name
    transport = by_name["transport"]  # every candidate of the replication transport, beside plain TCP in each round
    assert {"tcp", "zmq", "curve", "curve2", "hmac", "blake2b"} <= set(transport["candidates"]), transport["candidates"]
    assert all(f"{n}_{f >> 10}k_{k}" in transport["reps"] for n in transport["candidates"] for f in transport["frames"]
               for k in ("s", "cpu_send", "cpu_recv")), sorted(transport["reps"])
    for name in sharded_loads:  # loaded on half the ranks: each holds a larger shard than a saving rank did
        assert set(by_name[name]["reps"]) == {"cold", "warm"}, name
        assert by_name[name]["state"]["nbytes"] > by_name["sharded_memcpy"]["state"]["nbytes"], name

    merged = []
    for i, (_, out, _) in enumerate(results):
        lines = (tmp_path / str(i) / "run" / "results.jsonl").read_text().splitlines()
        jsonl = [json.loads(x) for x in lines]
        assert "meta" in jsonl[0] and [x for x in lines if "meta" not in json.loads(x)] == out.splitlines()
        rendered = tmp_path / f"again-{i}.md"
        again = _bench("--report", str(tmp_path / str(i) / "run" / "results.jsonl"), "--out", str(rendered),
                       timeout=120)
        assert again.returncode == 0, again.stderr
        assert rendered.read_text() == (tmp_path / str(i) / "RESULTS.md").read_text()  # made of the lines alone
        merged += lines
    (tmp_path / "all.jsonl").write_text("\n".join(merged) + "\n")
    whole = _bench("--report", str(tmp_path / "all.jsonl"), "--out", str(tmp_path / "RESULTS.md"), timeout=120)
    assert whole.returncode == 0, whole.stderr

    report = (tmp_path / "RESULTS.md").read_text()
    for heading in ("## Targets", "## Saving", "## Clients on one node", "## Scaling", "## Loading",
                    "## Ranks loading at once", "## Sharded state: FSDP2", "## Replication transport",
                    "## Step-time cost of a save", "## A capture every step", "## Every repetition"):
        assert heading in report
    assert "## Failed cases" not in report
    for r in records:
        if r.get("reps"):
            assert f"- {r['case']} (" in report
    targets = report.split("## Targets")[1].split("## ")[0]
    assert targets.count("| met |") + targets.count("| missed |") >= 19
    fsdp2 = [line for line in targets.splitlines() if line.startswith("| FSDP2")]  # the rows, not the causes
    assert len(fsdp2) == 8 and all(line.endswith(("| met |", "| missed |")) for line in fsdp2), fsdp2
    strongest = [line for line in targets.splitlines() if "the strongest peer: " in line]
    assert len(strongest) == 2, strongest  # dense and FSDP2, each naming the peer that was fastest to durable
    labels = {by_name[n]["label"] for n in peers[:3] + ["torchckpt_fsync"]}
    sharded_labels = {by_name[n]["label"] for n in sharded_saves[2:5] + ["sharded_torchckpt_fsync"]}
    assert any(f"strongest peer: {label} (" in strongest[0] for label in labels), strongest[0]
    assert any(f"strongest peer: {label} (" in strongest[1] for label in sharded_labels), strongest[1]
    assert all(line.endswith(("| met |", "| missed |")) for line in strongest), strongest
