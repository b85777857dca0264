"""Big shards are committed before the copy ends and written while it runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ckptd
from ckptd.client.staging import STREAM_MIN_BYTES

from helpers import wait_until


class ExplodingTensor(torch.Tensor):
    """A tensor subclass whose copy-out fails, as a broken wrapper type would."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
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
    deadline = time.monotonic() + 10
    while (root / "broken.incomplete").exists() or not daemon.status()["errors"]:
        assert time.monotonic() < deadline, "the daemon did not give up the save"
        time.sleep(0.05)
    assert not (root / "broken").exists()
    assert "staging failed" in daemon.status()["errors"][-1]["message"]


class PausingTensor(torch.Tensor):
    """A tensor whose copy-out waits for ``release``: the client's copy stops there, mid-shard."""

    reached = threading.Event()
    release = threading.Event()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            cls.reached.set()
            assert cls.release.wait(60), "the test never let the copy go on"
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_daemon_writes_what_is_staged_while_the_copy_is_paused(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory()
    state = {"a": torch.randn(STREAM_MIN_BYTES // 4), "b": torch.randn(STREAM_MIN_BYTES // 4),
             "zz": torch.arange(100, dtype=torch.uint8).as_subclass(PausingTensor)}  # copied last
    fut = client_factory(stream_commit=True, background_staging=True).save_async(state, root / "paused", step=1)
    try:
        assert PausingTensor.reached.wait(60), "the copy never reached the last tensor"
        def writing() -> dict | None:
            saves = daemon.status()["saves"]
            return saves[0] if saves and saves[0]["written"] > 0 else None
        wait_until(writing, 30, "the daemon wrote nothing while the copy was paused")
        now = writing()
        assert now is not None and 0 < now["written"] <= now["staged"] < now["bytes"]
        assert not fut.staged.done() and not fut.done()
    finally:
        PausingTensor.release.set()
    fut.result(60)
    back = ckptd.load(root / "paused")
    assert all(torch.equal(back[k], v.as_subclass(torch.Tensor)) for k, v in state.items())
    assert ckptd.verify_checkpoint(root / "paused").ok
