"""The fuzz arena: slots and paths the fuzzer aims at, and commits made by hand.

Slots are written straight into ``/dev/shm`` as a client stages them (or broken on
purpose: foreign-owned, symlinked, too small, garbage, with a lying header), so a
raw request can name them. Shared by ``fuzz_cases.py``, ``fuzzing.py`` and the
bug reproductions in ``test_fuzz_daemon.py``.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from pathlib import Path
from typing import Any

import torch

from ckptd.client.flatten import flatten
from ckptd.protocol.layout import plan_layout
from ckptd.protocol.messages import WriteShard

from helpers import SHM, dead_pid

UID, PID = os.getuid(), os.getpid()
SLOT_BASE = 900_000
"""Slot numbers this file creates by hand (the client's own counter starts at 0)."""


def cap_memory(daemon, limit: int = 3 * 2**30) -> None:
    """Limit the daemon's address space: a request that makes it allocate without bound then ends
    in a MemoryError in the daemon, not in the machine running out of memory."""
    resource.prlimit(daemon.proc.pid, resource.RLIMIT_AS, (limit, limit))



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


def make_commit(**fields) -> WriteShard:
    """A WriteShard from named fields, whatever fields this version of the protocol has.

    ``staged`` (bytes already final in the slot, when the protocol has it) defaults to all of them.
    """
    names = {f.name for f in dataclasses.fields(WriteShard)}
    fields.setdefault("staged", fields["nbytes"])
    return WriteShard(**{k: v for k, v in fields.items() if k in names})


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
