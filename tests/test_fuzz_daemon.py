"""Whatever arrives on the daemon's socket gets exactly one answer, and the daemon serves on.

A hypothesis-driven client on a raw DEALER sends the daemon malformed and
adversarial requests: random bytes, msgpack headers claiming gigabytes,
wrong versions and types, replies sent as requests, multi-frame messages,
requests before hello, and well-formed requests with one thing wrong (slot
names of other pids and uids, missing, foreign-owned, symlinked, too small or
garbage slots; tensor tables whose dtype, shape, offsets or sizes disagree;
paths with ``..``, through symlinks out of the root, onto existing
checkpoints, onto the root itself). Every request must get exactly one
reply, an ``Error`` with a known code that is not INTERNAL (that code means
"a bug in ckptd"), or the normal reply when the request happens to be valid.
Meanwhile a real client saves in a loop and every one of its saves must
succeed; afterwards nothing outside the root has changed and every
committed checkpoint loads.

Also here: the trust model (run directory and socket private to the user,
foreign uids refused, file and directory modes) and one test per bug the
fuzzing found, so each has a precise reproduction.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq

import ckptd
from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.layout import TensorEntry
from ckptd.protocol.messages import Error, Hello, Persist, Status, StatusReply, decode

from fuzz_arena import PID, SLOT_BASE, UID, cap_memory, commit_fields, make_arena, make_commit, slot_name, staged_slot
from fuzz_cases import Case
from fuzzing import Fuzzer, run_fuzz
from helpers import SHM, raw_socket, short_tempdir, start_daemon


@pytest.mark.timeout(300)
def test_every_malformed_or_adversarial_request_gets_one_error_and_a_legitimate_client_saves_throughout(
    daemon, client_factory, root, tmp_path
) -> None:
    counts = run_fuzz(daemon, client_factory, root, tmp_path, examples=int(os.environ.get("FUZZ_EXAMPLES", "500")),
                      derandomize=os.environ.get("FUZZ_RANDOM") != "1")
    assert counts["requests"] >= 500


# -- adversarial requests, one each ------------------------------------------------


def ask(sock: zmq.Socket, msg) -> Any:
    sock.send(msg.to_wire())
    return decode(sock.recv())


@pytest.mark.timeout(60)
def test_a_hello_with_a_pid_beyond_pid_t_does_not_take_the_daemon_down(daemon) -> None:
    sockets = [raw_socket(daemon) for _ in range(2)]
    for sock, pid in zip(sockets, (2**31, 2**63 - 1)):
        reply = ask(sock, Hello(1, pid, UID, "fuzz"))
        assert reply.type in ("welcome", "error"), reply
    time.sleep(2.5)  # two housekeeping rounds, which check whether each client's pid is alive
    assert daemon.proc.poll() is None, (
        f"the daemon exited ({daemon.proc.poll()}): {daemon.proc.stderr.read().decode(errors='replace')[-1500:]}")
    assert isinstance(ask(sockets[0], Status(2)), StatusReply)
    for sock in sockets:
        sock.close()


@pytest.mark.timeout(60)
def test_a_slot_name_that_is_a_fifo_is_refused_without_blocking_the_daemon(daemon, root) -> None:
    sock = raw_socket(daemon)
    assert ask(sock, Hello(1, PID, UID, "fuzz")).type == "welcome"
    fifo = SHM / slot_name(SLOT_BASE + 50)
    os.mkfifo(fifo, 0o600)
    try:
        commit = make_commit(**commit_fields(2, fifo.name, 4096, 4096, (), str(root / "fifo")))
        sock.send(commit.to_wire())
        if not sock.poll(30_000):
            # unblock the daemon (it is stuck in open(2) for reading) so the teardown can stop it
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("the daemon blocked opening a FIFO named as a slot and answered nothing for 30 s")
        reply = decode(sock.recv())
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_SLOT, reply
        assert isinstance(ask(sock, Status(3)), StatusReply)
    finally:
        fifo.unlink()
        sock.close()
    assert not (root / "fifo").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("request_kind", ["abort", "finalize", "commit"])
def test_a_path_with_a_name_longer_than_name_max_is_refused_with_a_typed_error(daemon, client, root, request_kind) -> None:
    long = root / ("a" * 300)
    if request_kind == "commit":
        with pytest.raises(ckptd.CkptdError) as info:
            client.save_async({"w": torch.ones(4)}, long).result(30)
        code = info.value.code
    else:
        sock = raw_socket(daemon)
        assert ask(sock, Hello(1, PID, UID, "fuzz")).type == "welcome"
        doc = {"v": 1, "type": request_kind, "id": 2, "path": str(long)}
        if request_kind == "abort":
            doc["reason"] = "test"
        else:
            doc.update(world_size=1, step=None, overwrite=False, keep_last=None,
                       files=[["rank-00000-of-00001.safetensors", 0, 4096, 0, 0]])
        sock.send(msgpack.packb(doc))
        reply = decode(sock.recv())
        sock.close()
        assert isinstance(reply, Error), reply
        code = reply.code
    assert code in (ErrorCode.PATH_NOT_ALLOWED, ErrorCode.WRITE_FAILED), (
        f"a 300-character file name got error code {ErrorCode(code).name}, not PATH_NOT_ALLOWED or WRITE_FAILED")


@pytest.mark.timeout(60)
def test_the_fuzzer_takes_a_persist_answered_after_its_ping_as_its_one_reply(daemon_factory, root, tmp_path) -> None:
    # A persist's path is resolved on the daemon's admit pool (one thread, in order), so its answer may
    # follow the fuzzer's ping: held up here behind another persist whose path resolution waits for ``gate``.
    gate = tmp_path / "gate"
    daemon = daemon_factory(faults=[{"op": "resolve", "match": "held-up", "errno": 0, "wait_for": str(gate)}])
    other = raw_socket(daemon)
    assert ask(other, Hello(1, PID, UID, "fuzz")).type == "welcome"
    other.send(Persist(2, str(root / "held-up" / "snap")).to_wire())
    arena = make_arena(root, tmp_path / "outside")
    fuzzer = Fuzzer(daemon, arena)
    before_pong: list[list] = []
    collect = fuzzer.answers_before_pong

    def then_open_the_gate(case: Case) -> list:
        before_pong.append(collect(case))
        gate.touch()
        return before_pong[-1]

    fuzzer.answers_before_pong = then_open_the_gate  # type: ignore[method-assign]
    doc = {"v": 1, "type": "persist", "id": 3111, "path": "/"}
    try:
        fuzzer.run(Case([msgpack.packb(doc)], "persist", 3111, True, doc))
    finally:
        fuzzer.close()
        arena.close()
    assert before_pong[0] == [], "the persist was answered before the ping: nothing here was late"
    assert fuzzer.counts["error PATH_NOT_ALLOWED"] == 1, fuzzer.counts
    late = decode(other.recv())  # the held-up persist: no snapshot is held there
    other.close()
    assert isinstance(late, Error) and late.id == 2 and "holds no snapshot" in late.message, late


@pytest.mark.timeout(60)
def test_a_checkpoint_path_equal_to_the_root_is_refused_and_nothing_is_written_beside_the_root(
    client, root, tmp_path
) -> None:
    client.save_async({"w": torch.ones(4)}, root / "precious").result(30)
    beside = sorted(os.listdir(tmp_path))
    for overwrite in (False, True):
        fut = client.save_async({"w": torch.zeros(4)}, root, overwrite=overwrite)
        try:
            outcome = fut.result(30)
        except ckptd.CkptdError as exc:
            outcome = exc
        assert sorted(os.listdir(tmp_path)) == beside, (
            f"overwrite={overwrite}: the daemon wrote beside its root: {sorted(os.listdir(tmp_path))}")
        assert (root / "precious").is_dir(), (
            f"overwrite={overwrite}: the root was replaced by a checkpoint; it now holds {sorted(os.listdir(root))}")
        assert isinstance(outcome, (ckptd.PathNotAllowed, ckptd.CheckpointExists)), outcome
    assert torch.equal(ckptd.load(root / "precious")["w"], torch.ones(4))


@pytest.mark.timeout(60)
def test_a_commit_for_a_huge_world_size_neither_hangs_nor_exhausts_the_daemon(daemon, root, tmp_path) -> None:
    cap_memory(daemon)
    arena = make_arena(root, tmp_path / "outside")
    try:
        sock = raw_socket(daemon)
        assert ask(sock, Hello(1, PID, UID, "fuzz")).type == "welcome"
        table = [TensorEntry(e[0], e[1], tuple(e[2]), e[3], e[4]) for e in arena.table]
        fields = commit_fields(2, arena.slots["staged"], arena.nbytes, arena.header_len, table, str(root / "huge"))
        wire = {**fields, "world_size": 2**62, "v": 1, "type": "commit", "staged": arena.nbytes,
                "tensors": [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in table]}
        sock.send(msgpack.packb(wire))
        assert sock.poll(30_000), "no answer to a commit for 2^62 ranks"
        reply = decode(sock.recv())
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_MESSAGE, reply
        time.sleep(2.5)  # two housekeeping rounds, which look for ranks that never committed
        assert daemon.proc.poll() is None, (
            f"the daemon exited ({daemon.proc.poll()}): {daemon.proc.stderr.read().decode(errors='replace')[-1200:]}")
        sock.send(Status(3).to_wire())
        assert sock.poll(30_000), "the daemon stopped answering after a commit for 2^62 ranks"
        while (reply := decode(sock.recv())).type != "status_reply":
            pass
        finalize = {"v": 1, "type": "finalize", "id": 4, "path": str(root / "huge2"), "world_size": 2**40,
                    "step": None, "overwrite": False, "keep_last": None,
                    "files": [["rank-00000-of-00001.safetensors", 0, 4096, 0, 0]]}
        sock.send(msgpack.packb(finalize))
        assert sock.poll(30_000), "the daemon stopped answering after a finalize for 2^40 ranks"
        reply = decode(sock.recv())
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_MESSAGE, reply
        sock.close()
    finally:
        arena.close()


@pytest.mark.timeout(60)
def test_a_frame_over_the_size_limit_is_dropped_and_the_daemon_serves_on(daemon) -> None:
    sock = raw_socket(daemon)
    sock.send(b"\x00" * (64 * 2**20 + 1))
    assert not sock.poll(1000), "an oversized frame is dropped unanswered (documented)"
    other = raw_socket(daemon)
    assert isinstance(ask(other, Status(1)), StatusReply)
    other.close()
    sock.close()


# -- trust model ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_daemon_makes_its_run_dir_private_even_when_it_existed_with_looser_modes(root) -> None:
    base = short_tempdir("cktrust-")
    try:
        fresh = base / "fresh"
        loose = base / "loose"
        loose.mkdir(mode=0o755)
        os.chmod(loose, 0o777)
        for run_dir in (fresh, loose):
            d = start_daemon(run_dir, root)
            try:
                assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700, oct(run_dir.stat().st_mode)
                assert run_dir.stat().st_uid == UID
                sock_path = run_dir / "ckptd.sock"
                assert stat.S_ISSOCK(sock_path.stat().st_mode) and sock_path.stat().st_uid == UID
            finally:
                d.kill()
    finally:
        subprocess.run(["rm", "-rf", str(base)])


NOBODY = 65534
REACH = r"""
import os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused")
else:
    print("connected")
"""


@pytest.mark.timeout(60)
def test_another_user_cannot_reach_the_socket(daemon) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    out = subprocess.run([sys.executable, "-c", REACH, str(daemon.run_dir / "ckptd.sock")],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "refused", out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_a_hello_with_another_uid_is_refused_and_that_client_can_commit_nothing(daemon, root) -> None:
    sock = raw_socket(daemon)
    reply = ask(sock, Hello(1, PID, UID + 1, "impostor"))
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_MESSAGE and "uid" in reply.message
    commit = make_commit(**commit_fields(2, slot_name(0), 4096, 4096, (), str(root / "x")))
    reply = ask(sock, commit)
    assert isinstance(reply, Error) and reply.code == ErrorCode.UNKNOWN_CLIENT
    assert daemon.status()["clients"] == []
    sock.close()


@pytest.mark.timeout(60)
def test_a_slot_owned_by_another_user_is_refused(daemon, root) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path, layout = staged_slot(SLOT_BASE + 60, {"w": torch.ones(16)})
    try:
        os.chown(path, NOBODY, NOBODY)
        sock = raw_socket(daemon)
        assert ask(sock, Hello(1, PID, UID, "x")).type == "welcome"
        commit = make_commit(**commit_fields(2, path.name, layout.nbytes, layout.data_start, layout.entries,
                                             str(root / "x")))
        reply = ask(sock, commit)
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_SLOT and "belongs to uid" in reply.message
        sock.close()
    finally:
        path.unlink()
    assert not (root / "x").exists()


@pytest.mark.timeout(60)
def test_checkpoint_files_are_created_0644_and_directories_0755(daemon_factory, client_factory, root) -> None:
    old = os.umask(0o022)  # the daemon inherits the usual umask
    try:
        daemon_factory()
    finally:
        os.umask(old)
    client = client_factory(world_size=2, rank=0)
    other = client_factory(world_size=2, rank=1)
    path = root / "new" / "sub" / "ckpt"
    futures = [c.save_async({"w": torch.ones(4) * c.rank}, path, step=1) for c in (client, other)]
    for f in futures:
        f.result(30)
    for d in (root / "new", root / "new" / "sub", path):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755, f"{d}: {oct(d.stat().st_mode)}"
    names = sorted(os.listdir(path))
    assert names == ["ckptd.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    for name in names:
        st_ = (path / name).stat()
        assert stat.S_IMODE(st_.st_mode) == 0o644, f"{name}: {oct(st_.st_mode)}"
        assert st_.st_uid == UID
    for rank in (0, 1):
        assert torch.equal(ckptd.load(path, rank=rank)["w"], torch.ones(4) * rank)
