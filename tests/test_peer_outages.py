"""Peers seen from outside, with real daemons as nodes on 127.0.0.1: ``ckptd status`` and the metrics say how
replication goes, and an outage between two peers (the tests' TCP proxy, cut whole or in the middle of a stream)
fails replication visibly, replication resumes once the link is back, and a replica cut off half-way is never
loaded by a node restoring from it."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.protocol.errors import InvalidCheckpoint

from helpers import Daemon, ckptd_cli, segments_of, start_daemon, wait_until
from proxy import TcpProxy
from test_peers import _node

MIB = 1 << 20


def _metric(textfile: Path, name: str) -> float | None:
    """A metric's value in a node-exporter textfile (None while it is not written yet)."""
    if not textfile.exists():
        return None
    found = re.search(rf"^{name} (\S+)$", textfile.read_text(), re.M)
    return None if found is None else float(found[1])


def _state(mib: float, seed: int) -> dict:
    return {"w": torch.randn(int(mib * MIB) // 4, generator=torch.Generator().manual_seed(seed)), "step": seed}


def test_status_and_metrics_show_each_peer_and_what_was_replicated(root: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, origin_ep = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    keys.write_text("".join(lines))
    prom, buddy_prom = tmp_path / "origin.prom", tmp_path / "buddy.prom"
    buddy = start_daemon(buddy_dir, root, "--peer-listen", buddy_ep, "--peer-keys", str(keys),
                         "--metrics-textfile", str(buddy_prom))
    origin = start_daemon(origin_dir, root, "--peer-listen", origin_ep, "--peer", buddy_ep, "--peer-keys", str(keys),
                          "--metrics-textfile", str(prom))
    try:
        (link,) = origin.status()["peers"]["links"]
        assert (link["endpoint"], link["buddy"], link["connected"], link["authenticated"]) == (buddy_ep, True, None,
                                                                                               False)
        client = ckptd.Client(run_dir=origin_dir, spawn=False)
        fut = client.save_async(_state(2, 1), root / "step-1", step=1, persist=False)
        fut.wait_replicated(60)
        client.close()
        info = origin.status()
        (snap,) = info["memory"]["snapshots"]
        (link,) = info["peers"]["links"]
        assert snap["replication"] == "replicated" and snap["replication_lag_s"] > 0
        assert (link["connected"], link["authenticated"], link["bytes_replicated"], link["snapshots_replicated"],
                link["failures"]) == (True, True, snap["bytes"], 1, 0)
        assert link["bytes_per_second"] > 0 and link["lag_s"] == snap["replication_lag_s"]
        assert (info["peers"]["replicated_bytes_total"], info["peers"]["replicated_total"],
                info["peers"]["replication_failures_total"]) == (snap["bytes"], 1, 0)
        text = ckptd_cli("status", "--run-dir", str(origin_dir)).stdout
        assert f"buddy {buddy_ep}  connected, authenticated" in text and "replicated: 1 snapshots" in text, text
        wait_until(lambda: _metric(prom, "ckptd_replicated_bytes_total") == snap["bytes"], 30,
                   "the origin's metrics never counted the replicated bytes")
        assert _metric(prom, "ckptd_replicated_snapshots_total") == 1
        assert _metric(prom, "ckptd_replication_failures_total") == 0
        assert _metric(prom, "ckptd_peers_connected") == 1
        assert _metric(prom, "ckptd_replication_lag_seconds") == pytest.approx(snap["replication_lag_s"])
        (replica,) = buddy.status()["peers"]["replicas_held"]["held"]
        assert replica["origin_endpoint"] == origin_ep  # named as the keys file names it, not by a key prefix
        assert f"from {origin_ep}" in ckptd_cli("status", "--run-dir", str(buddy_dir)).stdout
        wait_until(lambda: _metric(buddy_prom, "ckptd_replicas_held") == 1, 30,
                   "the buddy's metrics never counted the replica it holds")
        assert _metric(buddy_prom, "ckptd_replicas_held_bytes") == snap["bytes"]
    finally:
        origin.kill()
        buddy.kill()


def _through(proxy: TcpProxy, root: Path, keys: Path, lines: list[str], buddy_dir: Path, buddy_ep: str,
             origin_dir: Path, *origin_args: str, buddy_args: tuple[str, ...] = ()) -> tuple[Daemon, Daemon, str]:
    """The buddy on its own endpoint and the origin reaching it through ``proxy`` (its peer port and data port; the
    keys file names the buddy's key at the proxy's port too), the origin giving up on a link after 3 s: (buddy, origin, the proxy's
    endpoint)."""
    via_proxy = f"tcp://127.0.0.1:{proxy.port}"
    lines.append(f"{lines[1].split()[0]} {via_proxy}\n")
    keys.write_text("".join(lines))
    buddy = start_daemon(buddy_dir, root, "--peer-listen", buddy_ep, "--peer-keys", str(keys), *buddy_args)
    origin = start_daemon(origin_dir, root, "--peer", via_proxy, "--peer-keys", str(keys), "--peer-timeout", "3",
                          *origin_args)
    return buddy, origin, via_proxy


def test_an_outage_between_peers_fails_replication_visibly_it_resumes_and_a_cut_replica_is_never_loaded(
        root: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, _ = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    host, port = buddy_ep.removeprefix("tcp://").split(":")
    never = ("--persist-on-exit", "never")
    with TcpProxy(host, int(port), peer=True) as proxy:
        buddy, origin, _ = _through(proxy, root, keys, lines, buddy_dir, buddy_ep, origin_dir, *never)
        replacement = None
        states = {step: _state(mib, step) for step, mib in ((1, 1), (2, 1), (3, 1), (4, 48))}
        try:
            client = ckptd.Client(run_dir=origin_dir, spawn=False)

            def snapshot(step: int) -> ckptd.SaveFuture:
                fut = client.save_async(states[step], root / f"step-{step}", step=step, persist=False)
                fut.result(60)  # held on the origin, whatever the link does
                return fut

            snapshot(1).wait_replicated(60)
            assert proxy.connections >= 1  # it went through the proxy

            proxy.cut()  # the link is down: replication fails, and says so
            held_2 = snapshot(2)
            held_at = time.monotonic()
            with pytest.raises(InvalidCheckpoint, match="not replicated: peer .* did not answer"):
                held_2.wait_replicated(60)
            assert proxy.resets >= 1  # the outage was met
            info = origin.status()
            (link,) = info["peers"]["links"]
            assert (link["connected"], link["authenticated"], link["failures"]) == (False, True, 1)
            assert "did not answer" in link["last_error"] and info["peers"]["replication_failures_total"] == 1
            assert next(s for s in info["memory"]["snapshots"] if s["step"] == 2)["replication"] == "failed"

            outage = time.monotonic() - held_at  # step 2 cannot reach the buddy before this
            proxy.restore()  # back: the snapshot whose stream it did not answer is sent again, no new save needed
            replication = lambda: next(s for s in origin.status()["memory"]["snapshots"]  # noqa: E731
                                       if s["step"] == 2)["replication"]
            wait_until(lambda: replication() == "replicated", 60,
                       lambda: f"step 2 sent again once the buddy answered: {replication()}")
            assert "event=replication_resumed" in (origin_dir / "ckptd.log").read_text()
            lag = next(s for s in origin.status()["memory"]["snapshots"] if s["step"] == 2)["replication_lag_s"]
            assert lag >= outage, f"its lag runs from when it was held, through the outage ({outage:.1f} s): {lag}"
            assert [r["step"] for r in buddy.status()["peers"]["replicas_held"]["held"]] == [2]
            snapshot(3).wait_replicated(60)  # and the next one as ever
            (link,) = origin.status()["peers"]["links"]
            assert (link["connected"], link["snapshots_replicated"]) == (True, 3)
            held = buddy.status()["peers"]["replicas_held"]["held"]
            assert [r["step"] for r in held] == [3]

            proxy.cut_after(16 * MIB)  # the link goes down in the middle of the next stream
            with pytest.raises(InvalidCheckpoint, match="not replicated"):
                snapshot(4).wait_replicated(120)
            assert proxy.is_cut
            # part of it came: the buddy dropped it when its data connection broke, and never listed it
            wait_until(lambda: buddy.status()["peers"]["replicas_held"]["receiving"] == 0, 30,
                       "the buddy kept the replica whose stream was cut")
            assert [r["step"] for r in buddy.status()["peers"]["replicas_held"]["held"]] == [3]
            assert "event=replica_stream_failed" in (buddy_dir / "ckptd.log").read_text()
            client.close()

            # the origin is lost; a node restoring from the buddy finds step 3, never the half of step 4
            origin.kill()
            assert origin.proc.returncode == -signal.SIGKILL
            new_dir, _ = _node(keys, lines)
            keys.write_text("".join(lines))
            replacement = start_daemon(new_dir, root, "--peer", buddy_ep, "--peer-keys", str(keys), *never)
            assert ckptd.latest(root, run_dir=new_dir) == root / "step-3"
            back = {"w": torch.zeros_like(states[3]["w"]), "step": 0}
            ckptd.load_into(back, root / "step-3", run_dir=new_dir)
            assert torch.equal(back["w"], states[3]["w"]) and back["step"] == 3
            assert not any(root.iterdir())  # nothing of it came from disk
        finally:
            for daemon in (origin, buddy, replacement):
                if daemon is not None:
                    daemon.kill()



def test_a_buddy_that_answers_but_whose_data_port_is_shut_is_sent_a_failed_snapshot_again_once_not_each_check(
        root: Path, tmp_path: Path) -> None:
    """A snapshot's stream failed because the buddy did not answer (the link cut); the link comes back with only
    the peer port open (a firewall that forgot the data port): the buddy answers the check, so the snapshot is
    sent again, once, and that stream fails too (its data port refuses). That failure is final: no resend at
    every check for ever, each half-offered and dropped on the buddy, the failure counter climbing. Another
    directory's replicated snapshot makes the origin ask the buddy at every check, so the test sees checks pass.
    With the data port open again, the next snapshot is replicated as ever."""
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, _ = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    host, port = buddy_ep.removeprefix("tcp://").split(":")
    with TcpProxy(host, int(port), peer=True) as proxy:
        buddy, origin, _ = _through(proxy, root, keys, lines, buddy_dir, buddy_ep, origin_dir)
        try:
            client = ckptd.Client(run_dir=origin_dir, spawn=False)
            client.save_async(_state(1, 0), root / "a" / "step-0", step=0, persist=False).wait_replicated(60)
            proxy.cut()
            cut = client.save_async(_state(1, 1), root / "b" / "step-1", step=1, persist=False)
            with pytest.raises(InvalidCheckpoint, match="did not answer"):
                cut.wait_replicated(60)
            proxy.refuse_data = True
            proxy.restore()
            log = origin_dir / "ckptd.log"
            failures = lambda: origin.status()["peers"]["replication_failures_total"]  # noqa: E731
            wait_until(lambda: failures() == 2, 60, lambda: f"the resent stream failed at the data port: {failures()}")
            answers: set[float] = set()

            def two_more_checks() -> bool:  # each answered check of a/step-0's copy is a new last_answer
                (link,) = origin.status()["peers"]["links"]
                answers.add(link["last_answer"])
                return len(answers) >= 3
            wait_until(two_more_checks, 60, "two more answered checks")
            assert log.read_text().count("event=replication_resumed") == 1 and failures() == 2
            assert next(s for s in origin.status()["memory"]["snapshots"] if s["step"] == 1)["replication"] == "failed"
            proxy.refuse_data = False
            client.save_async(_state(1, 2), root / "b" / "step-2", step=2, persist=False).wait_replicated(60)
            client.close()
        finally:
            origin.kill()
            buddy.kill()


def test_a_buddy_restarted_during_an_outage_gets_the_newest_snapshot_of_a_directory_not_the_older_it_lost(
        root: Path, tmp_path: Path) -> None:
    """With ``--keep-snapshots 2`` the origin holds step 1 (replicated) and step 2 (its stream failed: the link
    was cut). The buddy restarts meanwhile and loses step 1's replica. Once the link is back, the check finds
    step 1's copy gone, and sends step 2, the one the buddy keeps for that directory, not step 1 first (a stream
    spent, and the buddy holding only the older state until the next check); step 1 then says superseded."""
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, _ = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    host, port = buddy_ep.removeprefix("tcp://").split(":")
    with TcpProxy(host, int(port), peer=True) as proxy:
        buddy, origin, _ = _through(proxy, root, keys, lines, buddy_dir, buddy_ep, origin_dir,
                                    "--keep-snapshots", "2")
        try:
            client = ckptd.Client(run_dir=origin_dir, spawn=False)
            client.save_async(_state(1, 1), root / "step-1", step=1, persist=False).wait_replicated(60)
            proxy.cut()
            with pytest.raises(InvalidCheckpoint, match="did not answer"):
                client.save_async(_state(1, 2), root / "step-2", step=2, persist=False).wait_replicated(60)
            buddy.kill()
            buddy = start_daemon(buddy_dir, root, "--peer-listen", buddy_ep, "--peer-keys", str(keys))
            proxy.restore()
            replication = lambda: {s["step"]: s["replication"]  # noqa: E731
                                   for s in origin.status()["memory"]["snapshots"]}
            wait_until(lambda: replication() == {1: "superseded", 2: "replicated"}, 60,
                       lambda: f"step 2 resumed, step 1 superseded: {replication()}")
            log = (origin_dir / "ckptd.log").read_text()
            assert "event=replication_resumed" in log and "action=sent_again" not in log
            assert [r["step"] for r in buddy.status()["peers"]["replicas_held"]["held"]] == [2]
            client.close()
        finally:
            origin.kill()
            buddy.kill()


def test_a_buddy_killed_mid_stream_fails_that_snapshot_visibly_and_its_restart_takes_the_next(
        root: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    keys = tmp_path / "keys"
    origin_dir, _ = _node(keys, lines)
    buddy_dir, buddy_ep = _node(keys, lines)
    host, port = buddy_ep.removeprefix("tcp://").split(":")
    with TcpProxy(host, int(port), peer=True) as proxy:
        buddy, origin, _ = _through(proxy, root, keys, lines, buddy_dir, buddy_ep, origin_dir)
        try:
            client = ckptd.Client(run_dir=origin_dir, spawn=False)
            proxy.stall_after(8 * MIB)  # the stream is held part-way, so the kill lands in its middle
            big = client.save_async(_state(48, 1), root / "step-1", step=1, persist=False)
            big.result(60)
            assert proxy.stalled.wait(60)
            wait_until(lambda: buddy.status()["peers"]["replicas_held"]["receiving"] == 1, 30,
                       "the buddy never started receiving the replica")
            killed = buddy.proc.pid
            assert segments_of(killed)  # the half-received replica, in the buddy's shared memory
            buddy.kill()
            assert buddy.proc.returncode == -signal.SIGKILL
            proxy.restore()
            with pytest.raises(InvalidCheckpoint, match="not replicated"):
                big.wait_replicated(60)
            (snap,) = origin.status()["memory"]["snapshots"]
            assert snap["replication"] == "failed" and snap["replication_error"]

            buddy = start_daemon(buddy_dir, root, "--peer-listen", buddy_ep, "--peer-keys", str(keys))  # restarted
            wait_until(lambda: not segments_of(killed), 30, "the killed buddy's half replica was never unlinked")
            client.save_async(_state(1, 2), root / "step-2", step=2, persist=False).wait_replicated(60)
            client.close()
            assert [r["step"] for r in buddy.status()["peers"]["replicas_held"]["held"]] == [2]
        finally:
            origin.kill()
            buddy.kill()
