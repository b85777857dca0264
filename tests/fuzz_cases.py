"""Hypothesis strategies for the fuzzer's requests: malformed bytes, adversarial values, and
well-formed requests with (at most) one thing wrong, aimed at the arena's slots and paths;
and what the daemon may answer to each kind.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import strategies as st

from ckptd.protocol.messages import MAX_INT, MESSAGE_TYPES, WriteShard

from fuzz_arena import PID, UID, Arena

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
    "snapshot": "accepted",
    "persist": "done",
    "delete": "ok",
    "snapshots": "snapshot_list",
}
FINAL_REPLIES = {"done", "error", "durable", "held"}
"""What may follow an ``accepted``: the commit's outcome (or, coordinated, its shard's durability; for a
snapshot, that it is held)."""
REPLY_TYPES = ["welcome", "accepted", "done", "durable", "error", "status_reply", "pong", "ok", "granted"]
NEVER_SENT = {"stop"}
"""The one request that may stop the daemon; the fuzzer does not send it."""
SILENT_WHEN_VALID = {"staged"}
"""Notices: a valid one gets no reply at all (an invalid one gets its Error)."""
LATE_FIRST_REPLY = {"commit", "snapshot", "finalize", "abort", "persist", "delete", "status", "lease"}
"""Requests whose one reply may come after later requests are answered (their I/O runs on the daemon's
worker pools: admission, and the path resolution of finalize, abort, persist and delete; the lease queue)."""
COMMIT_FIELDS = {f.name for f in dataclasses.fields(WriteShard)} - {"id"}


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
