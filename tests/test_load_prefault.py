"""Owning loads fault fresh tensors' pages in on a helper thread ahead of the read, and stay exact and verified."""

from __future__ import annotations

import ctypes
import json
import mmap
import struct

import pytest
import torch

import ckptd
from ckptd.client.prefault import STEP, Prefault

from helpers import wait_until

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) whole pages of ``t``'s memory, as the kernel's page tables have them (mincore)."""
    lo = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (t.data_ptr() + t.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    vec = ctypes.create_string_buffer((hi - lo) // mmap.PAGESIZE)
    assert _libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), len(vec.raw)


def test_prefault_populates_fresh_tensors_before_anything_writes_them() -> None:
    # Fresh anonymous memory, as a large torch.empty gets from malloc in a new process (here: whatever ran before).
    fresh = [torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8) for n in (3 * STEP + 12345, STEP // 3)]
    assert [resident_pages(t)[0] for t in fresh] == [0, 0], "fresh memory starts untouched"
    with Prefault(fresh):
        wait_until(lambda: all(r == n for r, n in map(resident_pages, fresh)), 60,
                   lambda: f"every page resident; resident, total: {list(map(resident_pages, fresh))}")


def test_owning_load_reads_tensors_spanning_many_reads_exactly_and_checks_them(client, root) -> None:
    torch.manual_seed(0)
    state = {"big": torch.randn(5 * STEP // 4 + 3), "odd": torch.randint(0, 255, (STEP + 1,), dtype=torch.uint8),
             "small": torch.arange(7, dtype=torch.int16), "empty": torch.empty(0), "step": 2}
    client.save_async(state, root / "big", step=2).result(60)
    loaded = ckptd.load(root / "big", map_location="cpu")
    assert loaded["step"] == 2 and loaded.keys() == state.keys()
    for k in ("big", "odd", "small", "empty"):
        assert torch.equal(loaded[k], state[k]), k
        assert loaded[k].untyped_storage().nbytes() == state[k].nbytes, f"{k} owns exactly its own bytes"
    shard = root / "big" / "rank-00000-of-00001.safetensors"
    with open(shard, "r+b") as f:  # one byte in the big tensor's second read
        hlen = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + hlen + json.loads(f.read(hlen))["big"]["data_offsets"][0] + STEP + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ckptd.InvalidCheckpoint, match="fails its checksum"):
        ckptd.load(root / "big", map_location="cpu")
