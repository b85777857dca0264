"""deploy/kubernetes/: every manifest is valid against the Kubernetes API's schema (kubernetes-validate's strict
schemas, offline: no cluster), its command lines are ones ckptd's own parser accepts, the daemon and the training
pod agree on what they must share, and the DaemonSet's entrypoint (start.sh, from its ConfigMap) runs: three nodes
on 127.0.0.1 wait for their lines in the peer keys file, start in a ring once the lines are gathered, replicate a
snapshot to the buddy, run the example trainer's program, and drain with the preStop command."""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import torch
import yaml

import ckptd
from ckptd.cli import _parser
from ckptd.peers.bulk import data_address
from ckptd.tools.options import config_kwargs
from helpers import REPO, free_port, short_tempdir, status, wait_until

FOLDER = REPO / "deploy" / "kubernetes"
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
"""The oldest Kubernetes release still widely run, and the newest the validator knows."""


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = [(p.name, d) for p in sorted(FOLDER.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    assert docs, f"no manifest in {FOLDER}"
    return docs


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for _, d in _documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


def _pod(kind: str) -> dict[str, Any]:
    return _one(kind)["spec"]["template"]["spec"]


def _container(kind: str) -> dict[str, Any]:
    (container,) = _pod(kind)["containers"]
    return container


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schema(version: str) -> None:
    for name, doc in _documents():
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field, where it is not


def test_the_validation_catches_a_misspelt_field() -> None:
    """So the test above can fail: a field the API does not know (``hostPid``) is refused, as is a wrong type."""
    daemonset = copy.deepcopy(_one("DaemonSet"))
    spec = daemonset["spec"]["template"]["spec"]
    spec["hostPid"] = spec.pop("hostPID")
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)
    daemonset = copy.deepcopy(_one("DaemonSet"))
    daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "600"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def _start_argv(run_dir: str, args: list[str], *, me: str, keys: str, buddy: str | None) -> list[str]:
    """What start.sh runs: its own options, then the container's args, then the buddy."""
    script = _one("ConfigMap", "ckptd-start")["data"]["start.sh"]
    assert 'exec ckptd start --foreground --run-dir "$RUN_DIR" "$@"' in script
    assert 'set -- --peer-listen "$ME" --peer-keys "$KEYS" "$@"' in script and 'set -- "$@" --peer "$BUDDY"' in script
    return ["start", "--foreground", "--run-dir", run_dir, "--peer-listen", me, "--peer-keys", keys, *args,
            *(["--peer", buddy] if buddy else [])]


def test_the_command_lines_are_ones_ckptd_accepts() -> None:
    container = _container("DaemonSet")
    env = _env(container)
    args = _parser().parse_args(_start_argv(env["CKPTD_RUN_DIR"], container["args"], me="tcp://10.0.0.1:29100",
                                            keys=env["CKPTD_PEER_KEYS"], buddy="tcp://10.0.0.2:29100"))
    given = config_kwargs(args)
    assert given["peers"] == ("tcp://10.0.0.2:29100",) and given["peer_listen"] == "tcp://10.0.0.1:29100"
    assert given["memory_budget"] == 8 * 2**30 and given["roots"] == (Path("/checkpoints"),)
    for command in (container["lifecycle"]["preStop"]["exec"]["command"],
                    container["readinessProbe"]["exec"]["command"]):
        assert command[0] == "ckptd"
        parsed = _parser().parse_args(command[1:])
        assert parsed.run_dir == Path(env["CKPTD_RUN_DIR"])
    stop = _parser().parse_args(container["lifecycle"]["preStop"]["exec"]["command"][1:])
    assert stop.command == "stop" and stop.timeout < _pod("DaemonSet")["terminationGracePeriodSeconds"]
    peer = int(env["CKPTD_PEER_PORT"])  # and its data port, always the next one (ckptd.peers.bulk)
    assert [p["containerPort"] for p in container["ports"]] == [peer, data_address(f"tcp://0.0.0.0:{peer}")[1]]
    assert [p["port"] for p in _one("Service")["spec"]["ports"]] == [peer, data_address(f"tcp://0.0.0.0:{peer}")[1]]


def test_the_training_pod_shares_with_the_daemon_what_it_must() -> None:
    """The same uid (the daemon serves its own only), the node's PID namespace, the run directory, /dev/shm and the
    checkpoints at the same paths, the image, and CKPTD_RUN_DIR naming the run directory."""
    daemon_pod, trainer_pod = _pod("DaemonSet"), _pod("Job")
    daemon, trainer = _container("DaemonSet"), _container("Job")
    assert daemon_pod["hostPID"] and trainer_pod["hostPID"]
    for key in ("runAsUser", "runAsGroup"):
        assert daemon_pod["securityContext"][key] == trainer_pod["securityContext"][key]
    assert f"chown {daemon_pod['securityContext']['runAsUser']}:{daemon_pod['securityContext']['runAsGroup']} " \
        in " ".join(daemon_pod["initContainers"][0]["command"])
    assert daemon["image"] == trainer["image"] == daemon_pod["initContainers"][0]["image"]
    assert _env(daemon)["CKPTD_RUN_DIR"] == _env(trainer)["CKPTD_RUN_DIR"]

    def mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """mount path -> host path"""
        host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        return {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host}

    theirs, ours = mounts(daemon_pod, daemon), mounts(trainer_pod, trainer)
    for path in (_env(daemon)["CKPTD_RUN_DIR"], "/dev/shm", "/checkpoints"):
        assert theirs[path] == ours[path], path
    assert daemon["args"][daemon["args"].index("--root") + 1] == "/checkpoints"
    assert "/checkpoints/" in trainer["args"][0]


class Node:
    """start.sh of the ConfigMap, run as the DaemonSet's container runs it, on 127.0.0.1."""

    def __init__(self, script: Path, keys: Path, root: Path, env: dict[str, str]) -> None:
        self.run_dir = short_tempdir("ckk8s-")
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        args = [{"/checkpoints": str(root), "8GiB": "64MiB"}.get(a, a) for a in _container("DaemonSet")["args"]]
        self.proc = subprocess.Popen(
            ["/bin/sh", str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**env, "HOST_IP": "127.0.0.1", "CKPTD_PEER_PORT": str(self.port), "CKPTD_RUN_DIR": str(self.run_dir),
                 "CKPTD_PEER_KEYS": str(keys)})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def key_line(self) -> str | None:
        """What README.md's gathering takes from the pod's log."""
        found = [m[1] for line in self.lines if (m := re.match(r"ckptd-peer-key: (.*)$", line.rstrip("\n")))]
        return found[0] if found else None


@pytest.fixture
def nodes(tmp_path: Path, root: Path) -> Iterator[tuple[list[Node], Path]]:
    script = tmp_path / "start.sh"
    script.write_text(_one("ConfigMap", "ckptd-start")["data"]["start.sh"])
    keys = tmp_path / "peer-keys"
    keys.write_text(_one("Secret")["stringData"]["peer-keys"])  # as applied: no node's line yet
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    made = [Node(script, keys, root, env) for _ in range(3)]
    yield made, keys
    for node in made:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(10)
        shutil.rmtree(node.run_dir, ignore_errors=True)


@pytest.mark.timeout(300)
def test_three_nodes_wait_for_the_secret_start_in_a_ring_replicate_and_drain_with_the_prestop_command(
        nodes: tuple[list[Node], Path], root: Path) -> None:
    made, keys = nodes
    wait_until(lambda: all(n.key_line() for n in made), timeout=60, what="every node printed its key line")
    wait_until(lambda: all(any("waiting for this node's line" in line for line in n.lines) for n in made),
               timeout=30, what="every node waiting for the Secret")
    assert all(n.proc.poll() is None and not (n.run_dir / "ckptd.sock").exists() for n in made)
    keys.write_text("".join(f"{n.key_line()}\n" for n in made))  # the Secret, gathered (README.md)
    wait_until(lambda: all((n.run_dir / "ckptd.pid").exists() and status(n.run_dir)["daemon"]["pid"]
                           for n in made if n.proc.poll() is None) and all(n.proc.poll() is None for n in made),
               # 150 s: a full run with a Hugging Face training beside it once took longer than 60 s here
               timeout=150, what=lambda: f"three daemons: {[''.join(n.lines[-3:]) for n in made]}")
    ring = sorted(made, key=lambda n: n.endpoint)
    for i, node in enumerate(ring):  # each node's buddy is the next by endpoint, the last's the first
        buddy = ring[(i + 1) % 3].endpoint
        assert any(f"buddy {buddy}" in line for line in node.lines), node.lines

    origin, buddy = ring[0], ring[1]
    state = {"w": torch.randn(10_000)}
    client = ckptd.Client(run_dir=origin.run_dir, spawn=False)
    client.save_async(state, root / "snap" / "step-1", step=1, persist=False).wait_replicated(60)
    client.close()
    held = status(buddy.run_dir)["peers"]["replicas_held"]["held"]
    assert [r["path"] for r in held] == [str(root / "snap" / "step-1")]

    program = _container("Job")["args"][0].replace("/checkpoints", str(root))
    ran = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CKPTD_RUN_DIR": str(origin.run_dir), "PYTHONPATH": str(REPO)})
    assert ran.returncode == 0 and f"latest: {root / 'example' / 'step-2'}" in ran.stdout, ran.stderr

    pre_stop = _container("DaemonSet")["lifecycle"]["preStop"]["exec"]["command"]
    for node in made:
        argv = [a if a != _env(_container("DaemonSet"))["CKPTD_RUN_DIR"] else str(node.run_dir) for a in pre_stop]
        stopped = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        assert stopped.returncode == 0, stopped.stderr
        assert node.proc.wait(60) == 0  # the entrypoint's exec'd daemon drained and exited clean
    assert (root / "snap" / "step-1" / "ckptd.json").exists()  # the origin's drain persisted its snapshot
