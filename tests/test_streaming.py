"""Big shards are committed before the copy ends and written while it runs."""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckptd
from ckptd.client.staging import STREAM_MIN_BYTES
from ckptd.protocol.checksums import updater
from ckptd.protocol.index import CHECKSUM_ALGORITHM
from ckptd.lifecycle.writer import CRC_CHUNK, Progress, checksum_when_staged

from helpers import wait_until


class ExplodingTensor(torch.Tensor):
    """A tensor subclass whose copy-out fails, as a broken wrapper type would."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.detach, torch._foreach_copy_):  # copied alone, or in one batched copy
            raise RuntimeError("this tensor cannot be read")
        return super().__torch_function__(func, types, args, kwargs or {})


def big_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(STREAM_MIN_BYTES // 4, generator=g), "b": torch.randn(1000, 1000, generator=g),
            "small": torch.arange(10, dtype=torch.int8)}


def test_a_big_shard_streams_and_round_trips_bitwise(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory()
    state = big_state()
    result = client_factory(stream_commit=True).save_async(state, root / "big", step=1).result(60)
    assert result.bytes_written > STREAM_MIN_BYTES
    back = ckptd.load(root / "big")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert ckptd.verify_checkpoint(root / "big").ok
    assert daemon.status()["completed"]["count"] == 1


def test_staging_that_fails_midway_fails_the_save_and_leaves_nothing(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory()
    state = big_state()
    state["zz"] = torch.zeros(100, dtype=torch.uint8).as_subclass(ExplodingTensor)  # copied last
    fut = client_factory(stream_commit=True).save_async(state, root / "broken")
    with pytest.raises(RuntimeError, match="cannot be read"):
        fut.result(60)
    with pytest.raises(RuntimeError, match="cannot be read"):
        fut.staged.result(0)
    wait_until(lambda: not (root / "broken.incomplete").exists() and daemon.status()["errors"], 60,
               "the daemon did not give up the save")
    assert not (root / "broken").exists()
    assert "staging failed" in daemon.status()["errors"][-1]["message"]


class PausingTensor(torch.Tensor):
    """A tensor whose copy-out waits for ``release``: the client's copy stops there, mid-shard."""

    reached = threading.Event()
    release = threading.Event()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.detach, torch._foreach_copy_):  # copied alone, or in one batched copy
            cls.reached.set()
            assert cls.release.wait(60), "the test never let the copy go on"
        return super().__torch_function__(func, types, args, kwargs or {})


CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("stream_commit, torch_threads, streams", [
    (True, CORES, True), (None, 1, CORES > 1), (None, CORES, False)],
    ids=["stream_commit=True", "default, torch on one thread", "default, torch on every core"])
def test_the_daemon_writes_what_is_staged_while_the_copy_is_paused(daemon_factory, client_factory, root,
                                                                    stream_commit, torch_threads, streams) -> None:
    """Streamed where asked, or by default where torch's copy leaves a core free (``overlap_pays``)."""
    daemon = daemon_factory()
    PausingTensor.reached.clear()
    PausingTensor.release.clear()
    state = {"a": torch.randn(STREAM_MIN_BYTES // 4), "b": torch.randn(STREAM_MIN_BYTES // 4),
             "zz": torch.arange(100, dtype=torch.uint8).as_subclass(PausingTensor)}  # copied last
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        fut = client_factory(stream_commit=stream_commit, background_staging=True).save_async(state, root / "p")
        assert PausingTensor.reached.wait(60), "the copy never reached the last tensor"
        def writing() -> dict | None:
            saves = daemon.status()["saves"]
            return saves[0] if saves and saves[0]["written"] > 0 else None
        if streams:
            wait_until(writing, 30, "the daemon wrote nothing while the copy was paused")
            now = writing()
            assert now is not None and 0 < now["written"] <= now["staged"] < now["bytes"]
        else:
            assert daemon.status()["saves"] == []  # committed only once copied
        assert not fut.staged.done() and not fut.done()
    finally:
        PausingTensor.release.set()
        torch.set_num_threads(threads)
    fut.result(60)
    back = ckptd.load(root / "p")
    assert all(torch.equal(back[k], v.as_subclass(torch.Tensor)) for k, v in state.items())
    assert ckptd.verify_checkpoint(root / "p").ok


class WatchedProgress(Progress):
    """A shard's staging progress that records how far each wait asked for."""

    def __init__(self, staged: int, total: int) -> None:
        super().__init__(staged, total, deadline=time.monotonic() + 60)
        self.asked: list[int] = []
        self.waiting = threading.Event()

    def wait_for(self, upto: int) -> None:
        self.asked.append(upto)
        self.waiting.set()
        super().wait_for(upto)


def test_the_checksum_waits_for_the_end_of_the_copy_then_covers_every_byte() -> None:
    """Beside the copy it would take a core from torch's copy; it starts once the slot is final."""
    total = 3 * CRC_CHUNK + 12345
    data = mmap.mmap(-1, total)
    data[:] = bytes(range(256)) * (total // 256) + bytes(total % 256)
    progress = WatchedProgress(staged=2 * CRC_CHUNK, total=total)  # the copy is two chunks in
    with ThreadPoolExecutor(1) as pool:
        crc = pool.submit(checksum_when_staged, memoryview(data), total, progress)
        try:
            assert progress.waiting.wait(30), "the checksum never waited for the copy"
            assert progress.asked == [total] and not crc.done()
        finally:
            progress.advance(total)
        assert crc.result(30) == updater(CHECKSUM_ALGORITHM)(data, 0)
