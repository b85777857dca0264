"""The fuzz session against a live daemon: an arena of slots and paths, hypothesis strategies
for malformed and adversarial requests, a raw-socket fuzzer that checks every request gets
exactly one answer, and a legitimate client saving throughout.

Shared by ``test_fuzz_daemon.py`` (the same examples every run) and its soak variant
(new examples every run); the module docstring of ``test_fuzz_daemon.py`` says what is checked.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import resource
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ckptd
from ckptd.client.flatten import flatten
from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.layout import plan_layout
from ckptd.protocol.messages import MAX_INT, MESSAGE_TYPES, Bye, Commit, Error, Hello, Ping, decode

from helpers import SHM, dead_pid

UID, PID = os.getuid(), os.getpid()
SLOT_BASE = 900_000
"""Slot numbers this file creates by hand (the client's own counter starts at 0)."""
NORMAL_REPLY = {
    "hello": "welcome",
    "commit": "accepted",
    "finalize": "done",
    "abort": "ok",
    "status": "status_reply",
    "ping": "pong",
    "bye": "ok",
    "lease": "granted",
    "release": "ok",
}
FINAL_REPLIES = {"done", "error", "durable"}
"""What may follow an ``accepted``: the commit's outcome (or, coordinated, its shard's durability)."""
REPLY_TYPES = ["welcome", "accepted", "done", "durable", "error", "status_reply", "pong", "ok", "granted"]
NEVER_SENT = {"stop"}
"""The one request that may stop the daemon; the fuzzer does not send it."""
SILENT_WHEN_VALID = {"staged"}
"""Notices: a valid one gets no reply at all (an invalid one gets its Error)."""
LATE_FIRST_REPLY = {"commit", "finalize", "abort", "status", "lease"}
"""Requests whose one reply may come after later requests are answered (their I/O runs on the daemon's
worker pools; the lease queue)."""
COMMIT_FIELDS = {f.name for f in dataclasses.fields(Commit)} - {"id"}


def cap_memory(daemon, limit: int = 3 * 2**30) -> None:
    """Limit the daemon's address space: a request that makes it allocate without bound then ends
    in a MemoryError in the daemon, not in the machine running out of memory."""
    resource.prlimit(daemon.proc.pid, resource.RLIMIT_AS, (limit, limit))


# -- the arena: slots and paths the fuzzer aims at ------------------------------


def slot_name(n: int, pid: int = PID, uid: int = UID) -> str:
    return f"ckptd-{uid}-{pid}-{n}"


DTYPE_NAMES = {torch.float32: "F32", torch.int64: "I64"}


def staged_slot(n: int, state: dict) -> tuple[Path, Any]:
    """A slot holding ``state`` as a client stages it (a safetensors file with the ckptd
    structure in its metadata, data 4096-aligned); returns its path and layout."""
    flat = flatten(state)
    layout = plan_layout([(name, DTYPE_NAMES[t.dtype], tuple(t.shape)) for name, t in flat.tensors], flat.metadata())
    data = bytearray(layout.nbytes)
    data[: layout.data_start] = layout.header
    tensors = dict(flat.tensors)
    for e in layout.entries:
        data[layout.data_start + e.begin : layout.data_start + e.end] = tensors[e.name].numpy().tobytes()
    return raw_slot(n, bytes(data), max(2**20, -(-layout.nbytes // 2**20) * 2**20)), layout


def raw_slot(n: int, data: bytes, size: int) -> Path:
    path = SHM / slot_name(n)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    return path


def make_commit(**fields) -> Commit:
    """A Commit from named fields, whatever fields this version of the protocol has.

    ``staged`` (bytes already final in the slot, when the protocol has it) defaults to all of them.
    """
    names = {f.name for f in dataclasses.fields(Commit)}
    fields.setdefault("staged", fields["nbytes"])
    return Commit(**{k: v for k, v in fields.items() if k in names})


def commit_fields(rid: int, slot: str, nbytes: int, header_len: int, tensors, path: str) -> dict:
    return dict(id=rid, slot=slot, nbytes=nbytes, header_len=header_len, tensors=tuple(tensors), path=path, rank=0,
                world_size=1, step=None, overwrite=False, coordinated=False, keep_last=None, timeout=60.0, waited=0.0)


def wire_table(layout) -> list:
    return [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in layout.entries]


@dataclasses.dataclass
class Arena:
    root: Path
    outside: Path
    slots: dict[str, str]
    files: list[Path]
    nbytes: int
    header_len: int
    table: list
    dead_pid: int

    def close(self) -> None:
        for p in self.files:
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def make_arena(root: Path, outside: Path) -> Arena:
    outside.mkdir()
    (outside / "sentinel").write_text("must not change")
    (root / "escape").symlink_to(outside)
    (root / "link-file").symlink_to(outside / "sentinel")
    (root / "afile").write_text("a regular file where a directory is expected")
    state = {"w": torch.arange(1024, dtype=torch.float32), "i": torch.tensor([1, 2, 3]), "step": 1}
    staged, layout = staged_slot(SLOT_BASE, state)
    files = [staged]
    slots = {"staged": staged.name}
    foreign = staged_slot(SLOT_BASE + 1, state)[0]
    files.append(foreign)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)  # owned by nobody: the daemon must refuse it
    slots["foreign-owner"] = foreign.name
    link = SHM / slot_name(SLOT_BASE + 2)
    link.symlink_to(staged)
    files.append(link)
    slots["symlink"] = link.name
    files.append(raw_slot(SLOT_BASE + 3, b"\x00" * 16, 4096))
    slots["too-small"] = slot_name(SLOT_BASE + 3)
    files.append(raw_slot(SLOT_BASE + 4, os.urandom(2**20), 2**20))
    slots["garbage"] = slot_name(SLOT_BASE + 4)
    lie = bytearray(staged.read_bytes()[: layout.nbytes])  # the header names "w"; make it name "v"
    lie[: layout.data_start] = lie[: layout.data_start].replace(b'"w"', b'"v"')
    files.append(raw_slot(SLOT_BASE + 5, bytes(lie), 2**20))
    slots["lying-header"] = slot_name(SLOT_BASE + 5)
    slots["missing"] = slot_name(SLOT_BASE + 99)
    slots["other-pid"] = slot_name(0, pid=1)
    slots["other-uid"] = slot_name(SLOT_BASE, uid=UID + 1)
    return Arena(root, outside, slots, files, layout.nbytes, layout.data_start, wire_table(layout), dead_pid())


# -- strategies ----------------------------------------------------------------

ADVERSARIAL = st.sampled_from([
    -1, -(2**63), 2**63, 2**64 - 1, 2**63 - 1, 0, 1, float("nan"), float("inf"), -0.0, 1e308,
    "", "x" * 70_000, "nul\x00byte", "..", "/", [], [1, 2], {}, {"a": 1}, b"\x00\xff", True, False, None,
])
PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
ANY = st.one_of(ADVERSARIAL, PLAIN)
CRAFTED = st.sampled_from([
    b"",
    b"\xc1",  # never used in msgpack
    b"\xdd\xff\xff\xff\xff",  # array of 4G elements, no elements
    b"\xdf\xff\xff\xff\xff",  # map of 4G pairs
    b"\xdb\xff\xff\xff\xff" + b"x" * 16,  # str of 4 GiB, 16 bytes given
    b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext of 4 GiB
    b"\x91" * 100_000,  # arrays nested 100k deep
    b"\x81\xa1v" * 50_000,  # maps nested 50k deep
    msgpack.packb({"v": 1, "type": "hello", "id": 5, "pid": 1, "uid": 0, "client_version": "x"})[:-3],  # truncated
    msgpack.packb([{"v": 1, "type": "ping", "id": 6}]),  # a list, not a map
    msgpack.packb({"v": 1, "type": "ping", "id": 7}) + b"trailing",
    msgpack.packb({1: 1, "v": 1, "type": "ping", "id": 8}),  # non-string key
])


def weighted(*branches: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """Choose a branch with the given weights (``st.one_of`` does not weight)."""
    table = [strategy for weight, strategy in branches for _ in range(weight)]
    return st.sampled_from(range(len(table))).flatmap(lambda i: table[i])


def path_strategy(arena: Arena) -> st.SearchStrategy[str]:
    root, outside = arena.root, arena.outside
    fixed = [
        root / "exists",  # a committed checkpoint
        root / ".." / outside.name / "x",
        outside / "x",
        root / "escape" / "x",  # through a symlink out of the root
        root / "escape",  # the final component is a symlink
        root / "link-file",
        root / "afile" / "x",  # a file where a directory should be
        root / "x.incomplete",
        root,  # the root itself
        root / ("a" * 300),  # a name longer than NAME_MAX
        root / "deep" / "er" / "est",
        Path("/ckptd-fuzz-top"),
        Path("/dev/shm/ckptd-fuzz"),
        Path(str(root) + "/./dot"),
        Path(str(root) + "//double"),
    ]
    texts = [str(p) for p in fixed] + ["relative/x", "", "/", "x" * 5000, f"{root}/../{root.name}/x"]
    fresh = st.integers(0, 10**9).map(lambda n: f"{root}/fuzz-{n}")
    return weighted((1, fresh), (3, st.sampled_from(texts)), (1, st.text(max_size=40)))


def tables(arena: Arena) -> st.SearchStrategy[tuple[Any, Any, Any]]:
    """(nbytes, header_len, tensors): the true table, or one with something wrong."""
    n, h, t = arena.nbytes, arena.header_len, arena.table
    w = next(e for e in t if e[0] == "w")

    def with_entry(**change) -> list:
        out = [list(e) for e in t]
        i = out.index(w)
        for k, v in change.items():
            out[i][{"name": 0, "dtype": 1, "shape": 2, "begin": 3, "end": 4}[k]] = v
        return out

    variants = [
        (n, h, t),
        (n, h, t),
        (n, h, t),
        (n, h, with_entry(dtype="F33")),
        (n, h, with_entry(dtype="f32")),
        (n, h, with_entry(dtype="F64")),  # itemsize disagrees with the bytes
        (n, h, with_entry(shape=[1023])),
        (n, h, with_entry(shape=[2, 512, 1])),  # same bytes, other shape than the header
        (n, h, with_entry(shape=[2**62, 2**62])),
        (n, h, with_entry(end=w[4] + 4)),
        (n, h, with_entry(begin=w[3] + 4)),
        (n, h, with_entry(end=2**63 - 1)),
        (n, h, with_entry(begin=w[4], end=w[3])),
        (n, h, with_entry(name="v")),  # the slot's header says "w"
        (n, h, t + [t[0]]),  # a tensor twice
        (n, h, t[1:]),
        (n, h, []),
        (n, h, [t[0][:4]]),
        (n, h, ["not a list"]),
        (n + 4096, h, t),
        (2**62, h, t),
        (2**63 - 1, h, t),
        (0, h, t),
        (n, 0, t),
        (n, 8, t),
        (n, h - 1, t),
        (n, h + 4096, t),
        (n, n, t),
        (h + 20_000, h, [[f"t{i}", "U8", [1], i, i + 1] for i in range(20_000)]),
    ]
    return st.sampled_from(variants)


def request_fields(arena: Arena) -> dict[str, st.SearchStrategy[dict]]:
    paths = path_strategy(arena)
    slots = st.one_of(
        st.sampled_from(sorted(arena.slots.values())),
        st.just(arena.slots["staged"]),
        st.sampled_from(["ckptd-../../etc/passwd", "ckptd-", "nope", "ckptd-0-0-0", "ckptd-x-y-z", f"ckptd-{UID}-{PID}"]),
    )
    ranks = st.sampled_from([(0, 1)] * 6 + [(1, 1), (0, 0), (3, 2), (0, 2), (1, 2), (0, 2**62)])

    valid_table = (arena.nbytes, arena.header_len, arena.table)
    fresh = st.integers(0, 10**9).map(lambda n: f"{arena.root}/fuzz-{n}")

    @st.composite
    def commit(draw) -> dict:
        """A commit that is valid but for (at most) one defect, so every check is reached."""
        defect = draw(st.sampled_from(["none", "none", "slot", "slot", "table", "table", "path", "path", "path",
                                       "rank", "staged", "options"]))
        nbytes, header_len, tensors = draw(tables(arena)) if defect == "table" else valid_table
        rank, world_size = draw(ranks) if defect == "rank" else (0, 1)
        doc = {
            "slot": draw(slots) if defect == "slot" else arena.slots["staged"],
            "nbytes": nbytes, "header_len": header_len, "tensors": tensors,
            "path": draw(paths) if defect == "path" else draw(fresh),
            "rank": rank, "world_size": world_size,
            "step": draw(st.none() | st.integers(0, 10**6)), "overwrite": draw(st.booleans()),
            "coordinated": False, "keep_last": None, "timeout": 600.0, "waited": draw(st.floats(0, 10)),
        }
        if defect == "options":
            doc["coordinated"] = draw(st.booleans())
            doc["keep_last"] = draw(st.sampled_from([None, 1, 2, 0]))
            doc["timeout"] = draw(st.sampled_from([1.0, 0.5, 0.0, -1.0, 7 * 24 * 3600 + 1, float("nan")]))
            doc["waited"] = draw(st.sampled_from([-1.0, float("inf"), float("nan"), 1e308]))
        doc = {k: v for k, v in doc.items() if k in COMMIT_FIELDS}
        for name in COMMIT_FIELDS - doc.keys():
            if name == "staged":  # bytes already final in the slot (overlapped staging)
                doc[name] = nbytes if defect != "staged" else draw(
                    st.sampled_from([header_len, (header_len + nbytes) // 2, nbytes + 1, 0, header_len - 1]))
            else:
                doc[name] = draw(ANY)
        return doc

    @st.composite
    def finalize(draw) -> dict:
        world_size = draw(st.sampled_from([1, 1, 2]))
        files = [[f"rank-{r:05d}-of-{world_size:05d}.safetensors", r, draw(st.integers(0, 2**20)),
                  draw(st.integers(0, 2**32 - 1)), 2] for r in range(world_size)]
        if draw(st.booleans()):
            files[0][0] = draw(st.sampled_from(["../escape", "", ".", "..", "/etc/passwd", "ckptd.json", "x/y"]))
        return {"path": draw(paths), "world_size": world_size, "step": draw(st.none() | st.integers(0, 100)),
                "overwrite": draw(st.booleans()), "keep_last": draw(st.sampled_from([None, 1])), "files": files}

    pids = st.sampled_from([PID] * 6 + [0, 1, arena.dead_pid, 2**22, 2**31, 2**63 - 1])
    uids = st.sampled_from([UID] * 6 + [UID + 1, 65534, 2**32])
    fields: dict[str, st.SearchStrategy[dict]] = {
        "hello": st.fixed_dictionaries({"pid": pids, "uid": uids, "client_version": st.text(max_size=20)}),
        "commit": commit(),
        "finalize": finalize(),
        "abort": st.fixed_dictionaries({"path": paths, "reason": st.text(max_size=30)}),
        "status": st.just({}),
        "ping": st.just({}),
        "bye": st.just({}),
    }
    if "staged" in MESSAGE_TYPES:  # notices of overlapped staging: how far the slot is final
        names = {f.name for f in dataclasses.fields(MESSAGE_TYPES["staged"])}
        template = {"upto": st.one_of(st.integers(0, 2**21), st.just(arena.nbytes)),
                    "error": st.sampled_from(["", "", "", "staging failed on the client"])}
        fields["staged"] = st.fixed_dictionaries({k: v for k, v in template.items() if k in names})
    # request types the daemon learned after this file was written: fields of the right type
    for kind, cls in MESSAGE_TYPES.items():
        if kind in fields or kind in NEVER_SENT or kind in REPLY_TYPES:
            continue
        hints = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "id"}
        fields[kind] = st.fixed_dictionaries({name: ANY for name in hints})
    return fields


@dataclasses.dataclass
class Case:
    frames: list[bytes]
    kind: str | None
    """The request type, when the payload is a map that names one."""
    reply_id: int
    """The id the reply must echo (0 when the request has no usable id)."""
    registered: bool
    """Whether the fuzzer says hello (else bye) before sending this."""
    doc: dict | None = None
    retarget: bool = False
    """For notices: name the newest commit in progress instead of a fresh id."""

    def aimed_at(self, rid: int) -> "Case":
        doc = {**self.doc, "id": rid}
        return Case([msgpack.packb(doc, use_bin_type=True)], self.kind, rid, self.registered, doc, True)

    def __repr__(self) -> str:
        shown = []
        for f in self.frames:
            try:
                shown.append(repr(msgpack.unpackb(f, raw=False, strict_map_key=False))[:600])
            except Exception:
                shown.append(repr(f[:80]) + (f"... ({len(f)} bytes)" if len(f) > 80 else ""))
        return f"Case(registered={self.registered}, kind={self.kind!r}, reply_id={self.reply_id}, frames={shown})"


def reply_id_of(doc: Any) -> int:
    rid = doc.get("id") if isinstance(doc, dict) else None
    return rid if type(rid) is int and 0 <= rid <= MAX_INT else 0


def cases(arena: Arena, ids: itertools.count) -> st.SearchStrategy[Case]:
    fields = request_fields(arena)

    weights = {"commit": 8, "hello": 2, "finalize": 2, "abort": 2, "staged": 2}
    kinds = [k for k in sorted(fields) for _ in range(weights.get(k, 1))]

    @st.composite
    def message(draw) -> Case:
        kind = draw(st.sampled_from(kinds))
        doc: dict[Any, Any] = {"v": 1, "type": kind, "id": next(ids), **draw(fields[kind])}
        for _ in range(draw(st.sampled_from([0, 0, 0, 0, 0, 1, 1, 2]))):
            op = draw(st.sampled_from(["set", "set", "drop", "extra", "version", "type", "id"]))
            keys = sorted(k for k in doc if k not in ("v", "type", "id"))
            if op == "set" and keys:
                doc[draw(st.sampled_from(keys))] = draw(ANY)
            elif op == "drop" and keys:
                doc.pop(draw(st.sampled_from(keys)))
            elif op == "extra":
                doc[draw(st.text(max_size=8))] = draw(ANY)
            elif op == "version":
                doc["v"] = draw(st.sampled_from([0, 2, "1", 1.0, None, 2**64 - 1, True, []]))
            elif op == "type":
                doc["type"] = draw(st.sampled_from(REPLY_TYPES + ["", "HELLO", "hello ", 7, None, "x" * 1000]))
            elif op == "id":
                doc["id"] = draw(st.sampled_from([-1, 2**64 - 1, 1.5, "7", None, [], True]))
        kind = doc.get("type") if isinstance(doc.get("type"), str) else None
        retarget = kind in SILENT_WHEN_VALID and draw(st.booleans())
        return Case([msgpack.packb(doc, use_bin_type=True)], kind, reply_id_of(doc), draw(st.booleans()), doc, retarget)

    @st.composite
    def reply_as_request(draw) -> Case:
        kind = draw(st.sampled_from(REPLY_TYPES))
        cls = MESSAGE_TYPES[kind]
        doc = {"v": 1, "type": kind, "id": next(ids)}
        doc.update({f.name: draw(ANY) for f in dataclasses.fields(cls) if f.name != "id"})
        return Case([msgpack.packb(doc, use_bin_type=True)], kind, reply_id_of(doc), draw(st.booleans()))

    def one_frame(payload: st.SearchStrategy[bytes]) -> st.SearchStrategy[Case]:
        def build(args: tuple[bytes, bool]) -> Case:
            data, registered = args
            try:
                doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
            except Exception:
                doc = None
            kind = doc.get("type") if isinstance(doc, dict) and isinstance(doc.get("type"), str) else None
            return Case([data], kind, reply_id_of(doc), registered)

        return st.tuples(payload, st.booleans()).map(build)

    multi = st.tuples(st.lists(st.binary(max_size=64), min_size=2, max_size=4), st.booleans()).map(
        lambda a: Case(a[0], None, 0, a[1]))
    return weighted(
        (80, message()),
        (4, reply_as_request()),
        (4, one_frame(st.binary(max_size=256))),
        (4, one_frame(CRAFTED)),
        (4, one_frame(PLAIN.map(lambda v: msgpack.packb(v, use_bin_type=True)))),
        (4, multi),
    )


# -- the harness ----------------------------------------------------------------


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
