"""Big shards are committed before the copy ends and written while it runs."""

from __future__ import annotations

import time

import pytest
import torch

import ckptd
from ckptd.client.staging import STREAM_MIN_BYTES


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
