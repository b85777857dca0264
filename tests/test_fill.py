"""A fresh slot's first save, written with ``pwritev`` (``client/fill.py``): every byte where the layout puts it, the
whole slot reserved afterwards, its mapping populated for the next save, and a full ``/dev/shm`` still ``NoSpace``.
"""

from __future__ import annotations

import os
import resource

import pytest
import torch

import ckptd
from ckptd.client.fill import IOV_MAX, split, write_segments
from ckptd.client.flatten import flatten
from ckptd.client.slots import Slot
from ckptd.client.staging import LayoutCache, stage
from ckptd.protocol.shm import shm_dir
from helpers import SHM, floats, own_segments, tmpfs


def odd_state() -> dict:
    """Tensors a first save must write as ``copy_`` would: views, transposes, several dtypes, empty and 0-dim."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(300, 200, generator=g)
    return {"t": base.t(), "slice": base[::3, 5:77], "bf16": torch.randn(4097, generator=g).to(torch.bfloat16),
            "i8": torch.randint(-100, 100, (33, 3), dtype=torch.int8, generator=g), "empty": torch.zeros(0, 5),
            "scalar": torch.tensor(2.5, dtype=torch.float64), "big": floats(9), "step": 7}


def slot_bytes(slot: Slot, nbytes: int) -> bytes:
    with open(slot.path, "rb") as f:
        return f.read(nbytes)


def test_a_fresh_slot_holds_the_same_bytes_as_a_slot_copied_into(tmp_path) -> None:
    flat = flatten(odd_state())
    layout = LayoutCache().layout(flat)
    fresh, copied = Slot(layout.nbytes, prepared=False), Slot(layout.nbytes)
    try:
        assert fresh.fresh and not copied.fresh
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)  # fill writes on as many threads as torch copies with
            stage(flat, layout, fresh)
            assert not fresh.fresh
            fresh.ready()
            fresh.close()
            fresh = Slot(layout.nbytes, prepared=False)
        stage(flat, layout, fresh)
        cache = LayoutCache()
        cache.layout(flat)
        cache.views(layout, copied)
        stage(flat, layout, copied, views=cache.views(layout, copied))
        assert slot_bytes(fresh, layout.nbytes) == slot_bytes(copied, layout.nbytes)
        st = os.stat(fresh.path)
        assert st.st_blocks * 512 >= st.st_size == fresh.size, "the written slot has holes a copy could fault on"
    finally:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        fresh.close()
        copied.close()


def test_after_a_fill_the_next_copy_into_the_slot_takes_no_page_faults() -> None:
    flat = flatten({"w": floats(64)})
    layout = LayoutCache().layout(flat)
    slot = Slot(layout.nbytes, prepared=False)
    try:
        stage(flat, layout, slot)
        slot.ready()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        slot.tensor.fill_(7)  # 16,384 pages
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 2000, f"the copy after a fill took {faults} page faults: the mapping was not populated"
    finally:
        slot.close()


def test_many_small_pieces_and_cuts_are_written_in_place(tmp_path) -> None:
    """More buffers than one ``pwritev`` takes, cut at offsets inside and between them."""
    pieces, offset, expected = [], 0, bytearray()
    for i in range(3 * IOV_MAX + 7):
        data = bytes([i % 251]) * (1 + i % 13)
        pieces.append((offset, memoryview(data)))
        expected += data
        offset += len(data)
    cuts = [1, 5000, 5001, offset // 2, offset - 1]
    parts = split(pieces, cuts)
    assert len(parts) == len(cuts) + 1
    assert [p[0][0] for p in parts] == [0, *cuts]
    path = tmp_path / "pieces"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for part in reversed(parts):  # in any order: each piece goes to its own offsets
            write_segments(fd, list(part))
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(expected)


def test_a_first_save_without_reserve_round_trips_and_so_does_the_next(client_factory, daemon, root) -> None:
    client = client_factory(max_inflight=1)
    state = odd_state()
    client.save_async(state, root / "first").result(30)
    (name,) = own_segments()
    st = os.stat(SHM / name)
    assert st.st_blocks * 512 >= st.st_size, "the first save left holes in its slot"
    state["big"].add_(1)
    state["t"].mul_(-1)
    client.save_async(state, root / "second").result(30)
    assert own_segments() == {name}
    back = ckptd.load(root / "second")  # copied through the mapping the fill left populated
    assert all(torch.equal(back[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert ckptd.load(root / "first")["big"].eq(1).all()
    assert ckptd.verify_checkpoint(root / "first").ok


def test_a_first_save_that_finds_shared_memory_full_is_no_space_and_leaves_no_slot(monkeypatch, daemon_factory,
                                                                                   client_factory, tmp_path) -> None:
    with tmpfs(tmp_path / "shm", 24) as shm:  # the daemon keeps 16 MiB of it free
        monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
        daemon = daemon_factory()
        client = client_factory()
        with pytest.raises(ckptd.NoSpace, match=rf"needs {33 << 20} bytes \(33.0 MiB\) of shared memory in {shm}, but only"):
            client.save_async({"w": floats(32)}, daemon.root / "big").result(30)
        assert shm_dir() == shm and not list(shm.iterdir())
        client.save_async({"w": floats(1)}, daemon.root / "small").result(30)  # the room it gave back is usable
        assert torch.equal(ckptd.load(daemon.root / "small")["w"], floats(1))
