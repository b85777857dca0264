"""The fuzz session against a live daemon: a raw-socket fuzzer that checks every request gets
exactly one answer, and a legitimate client saving throughout.

Shared by ``test_fuzz_daemon.py`` (the same examples every run) and its soak variant
(new examples every run); the module docstring of ``test_fuzz_daemon.py`` says what is checked.
The arena is in ``fuzz_arena.py``, the requests in ``fuzz_cases.py``.
"""

from __future__ import annotations

import collections
import itertools
import os
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings

import ckptd
from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.messages import Bye, Error, Hello, Ping, decode

from fuzz_arena import PID, UID, Arena, cap_memory, make_arena
from fuzz_cases import FINAL_REPLIES, LATE_FIRST_REPLY, NORMAL_REPLY, SILENT_WHEN_VALID, Case, cases

class Fuzzer:
    """Sends cases on one DEALER and checks each gets exactly one acceptable reply."""

    def __init__(self, daemon, arena: Arena) -> None:
        self.daemon, self.arena = daemon, arena
        self.ids = itertools.count(10**7)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(daemon.endpoint)
        self.awaiting: dict[int, int] = {}
        """Ids of accepted commits, and how many more replies each may still get (its outcome: one)."""
        self.history: collections.deque = collections.deque(maxlen=12)
        self.counts: collections.Counter = collections.Counter()
        self.sent = 0

    def close(self) -> None:
        self.sock.close()

    def diagnose(self, problem: str) -> str:
        lines = [problem, "last requests sent (oldest first):"]
        lines += [f"  {h!r}"[:1500] for h in self.history]
        code = self.daemon.proc.poll()
        lines.append(f"daemon pid {self.daemon.proc.pid}: {'running' if code is None else f'exited with {code}'}")
        if code is None:  # where is each daemon thread blocked?
            for task in sorted(Path(f"/proc/{self.daemon.proc.pid}/task").iterdir()):
                try:
                    comm = (task / "comm").read_text().strip()
                    wchan = (task / "wchan").read_text().strip()
                    lines.append(f"  thread {task.name} {comm}: {(task / 'stat').read_text().split()[2]} in {wchan}")
                except OSError:
                    pass
        spy = os.environ.get("CKPTD_TEST_PYSPY")  # optional: a py-spy binary, for the daemon's Python stacks
        if code is None and spy:
            out = subprocess.run([spy, "dump", "--pid", str(self.daemon.proc.pid)], capture_output=True, text=True)
            lines.append(out.stdout[-6000:] + out.stderr[-500:])
        if code is not None:
            lines.append("daemon stderr: " + self.daemon.proc.stderr.read().decode(errors="replace")[-3000:])
        try:
            log = (self.daemon.run_dir / "ckptd.log").read_text(errors="replace")
            errors = [line for line in log.splitlines() if "level=INFO" not in line]
            lines.append("daemon log, last warnings and errors:\n" + "\n".join(errors[-6:]))
        except OSError:
            pass
        return "\n".join(lines)

    def recv(self, what: str, timeout: float = 10.0):
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(self.diagnose(f"no reply within {timeout:g} s to {what}"))
        data = self.sock.recv()
        try:
            return decode(data)
        except Exception as exc:
            raise AssertionError(self.diagnose(f"the daemon sent an undecodable reply {data[:200]!r}: {exc}")) from None

    def expect(self, rid: int, what: str):
        """The next reply meant for ``rid``; late outcomes of accepted commits are taken aside."""
        while True:
            reply = self.recv(what)
            if reply.id in self.awaiting and reply.type in FINAL_REPLIES and reply.id != rid:
                self.late(reply)
                continue
            if reply.id != rid:
                raise AssertionError(self.diagnose(f"reply {reply!r} does not answer {what} (id {rid})"))
            return reply

    def late(self, reply) -> None:
        self.counts[f"later {reply.type}"] += 1
        self.awaiting[reply.id] -= 1
        if not self.awaiting[reply.id]:
            del self.awaiting[reply.id]

    def call(self, msg) -> Any:
        self.sock.send(msg.to_wire())
        return self.expect(msg.id, repr(msg))

    def answers_before_pong(self, case: Case) -> list:
        """Ping, and collect what answers ``case`` until the pong (the daemon serves one socket in order)."""
        fid = next(self.ids)
        self.sock.send(Ping(fid).to_wire())
        answers = []
        while True:
            reply = self.recv(f"the ping after {case!r}")
            if reply.id == fid and reply.type == "pong":
                return answers
            if reply.id in self.awaiting and reply.type in FINAL_REPLIES:
                self.late(reply)
            elif reply.id == case.reply_id:
                answers.append(reply)
                if reply.type == "accepted":
                    self.awaiting[reply.id] = 1
            else:
                raise AssertionError(self.diagnose(f"reply {reply!r} answers nothing that was asked ({case!r})"))

    def run(self, case: Case) -> None:
        if case.registered:
            reply = self.call(Hello(next(self.ids), PID, UID, "fuzz"))
            assert reply.type == "welcome", self.diagnose(f"hello got {reply!r}")
        else:
            self.call(Bye(next(self.ids)))  # what follows arrives before any hello
        if case.retarget and self.awaiting and case.kind in SILENT_WHEN_VALID:
            case = case.aimed_at(max(self.awaiting))  # a notice about a commit in progress
            self.awaiting[case.reply_id] += 1  # an invalid notice's Error shares the commit's id
        self.history.append(case)
        self.sent += 1
        self.sock.send_multipart(case.frames)
        answers = self.answers_before_pong(case)
        if case.reply_id in self.awaiting and case.retarget:
            self.counts["notices about commits in progress"] += 1
            return  # its outcome is the commit's one final reply
        if not answers and case.kind in LATE_FIRST_REPLY:
            answers = [self.expect(case.reply_id, repr(case))]
            if answers[0].type == "accepted":
                self.awaiting[case.reply_id] = 1  # its outcome follows later, like any accepted commit's
            answers += self.answers_before_pong(case)
        if not answers and case.kind in SILENT_WHEN_VALID:
            self.counts[f"silent {case.kind}"] += 1
            return
        assert answers, self.diagnose(f"no reply to {case!r}")
        assert len(answers) == 1, self.diagnose(f"{len(answers)} replies {answers!r} to {case!r}")
        (reply,) = answers
        if isinstance(reply, Error):
            known = {c.value for c in ErrorCode}
            assert reply.code in known, self.diagnose(f"error code {reply.code} is not one of {sorted(known)}")
            assert reply.code != ErrorCode.INTERNAL, self.diagnose(
                f"INTERNAL error (a bug in ckptd, per protocol/errors.py) for {case!r}: {reply.message}")
            self.counts[f"error {ErrorCode(reply.code).name}"] += 1
        else:
            want = NORMAL_REPLY.get(case.kind or "")
            assert want is None or reply.type == want, self.diagnose(f"{case!r} got {reply!r}, expected {want}")
            self.counts[f"ok {reply.type}"] += 1


class LegitSaver(threading.Thread):
    """A well-behaved client saving in a loop while the fuzzer runs."""

    def __init__(self, client, directory: Path) -> None:
        super().__init__(name="legit-saver", daemon=True)
        self.client, self.directory = client, directory
        self.halt = threading.Event()
        self.saved: list[int] = []
        self.failed: list[tuple[int, str]] = []

    def run(self) -> None:
        i = 0
        while not self.halt.is_set():
            state = {"w": torch.full((4096,), float(i)), "i": i}
            try:
                self.client.save_async(state, self.directory / f"step-{i}", step=i).result(60)
                self.saved.append(i)
            except Exception as exc:  # reported by the test
                self.failed.append((i, repr(exc)))
            i += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(120)
        assert not self.is_alive(), "the legitimate client's save never finished"


def tree(top: Path, skip: Path) -> dict[str, tuple]:
    """Every entry below ``top`` except ``skip``: type, size, mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        d = Path(dirpath)
        dirnames[:] = [n for n in dirnames if d / n != skip]
        for name in dirnames + filenames:
            st_ = (d / name).lstat()
            out[str((d / name).relative_to(top))] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mtime_ns)
    return out


OUTSIDE_ABSOLUTE = [Path("/ckptd-fuzz-top"), Path("/dev/shm/ckptd-fuzz"), Path("/ckptd-fuzz-top.incomplete"),
                    Path("/dev/shm/ckptd-fuzz.incomplete")]


def committed_under(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if "ckptd.json" in filenames and not dirpath.endswith(".incomplete"):
            found.append(Path(dirpath))
    return found


def run_fuzz(daemon, client_factory, root: Path, tmp_path: Path, *, examples: int,
             derandomize: bool) -> collections.Counter:
    """The fuzz session, shared by the fast test (the same examples every run: ``derandomize``)
    and the soak variant (new examples every run)."""
    for p in OUTSIDE_ABSOLUTE:
        assert not p.exists(), f"{p} exists before the test"
    cap_memory(daemon)
    arena = make_arena(root, tmp_path / "outside")
    fuzzer = Fuzzer(daemon, arena)
    legit_client = client_factory(timeout=30.0)
    legit_client.save_async({"w": torch.ones(8)}, root / "exists", step=0).result(30)
    before = tree(tmp_path, skip=root)
    legit = LegitSaver(legit_client, root / "legit")
    legit.start()
    ids = itertools.count(1)

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              derandomize=derandomize, suppress_health_check=list(HealthCheck))
    @given(case=cases(arena, ids))
    def one(case: Case) -> None:
        fuzzer.run(case)

    started = time.monotonic()
    try:
        one()
    finally:
        legit.stop()
        fuzzer.close()
        arena.close()
    elapsed = time.monotonic() - started
    def about_the_root() -> str:
        log = (daemon.run_dir / "ckptd.log").read_text(errors="replace").splitlines()
        lines = [line for line in log if f"path={root} " in line or f"path={root}.incomplete" in line]
        return f"the root now holds {sorted(os.listdir(root))[:12]}; daemon log lines about the root itself: {lines[-4:]}"

    assert not legit.failed, f"the legitimate client's saves failed during fuzzing: {legit.failed[:3]}; {about_the_root()}"
    assert legit.saved, "the legitimate client saved nothing"
    assert daemon.proc.poll() is None
    status = daemon.status()
    assert status["daemon"]["pid"] == daemon.proc.pid
    assert tree(tmp_path, skip=root) == before, "the daemon changed something outside its root"
    assert not [p for p in OUTSIDE_ABSOLUTE if os.path.lexists(p)], "the daemon wrote outside its root"
    gone = [i for i in legit.saved if not (root / "legit" / f"step-{i}").is_dir()]
    assert not gone, (f"{len(gone)} of the legitimate client's {len(legit.saved)} committed checkpoints vanished "
                      f"(e.g. step-{gone[0]}); {about_the_root()}")
    for i in legit.saved:
        loaded = ckptd.load(root / "legit" / f"step-{i}", rank=0)
        assert torch.equal(loaded["w"], torch.full((4096,), float(i))) and loaded["i"] == i
    for path in committed_under(root):
        index = ckptd.read_index(path)
        for rank in range(index.world_size):
            ckptd.load(path, rank=rank)  # checks the CRC and the header
    fuzzer.counts["requests"] = fuzzer.sent
    fuzzer.counts["legitimate saves"] = len(legit.saved)
    fuzzer.counts["seconds"] = round(elapsed)
    print(f"\nfuzz: {dict(sorted(fuzzer.counts.items()))}")
    return fuzzer.counts
