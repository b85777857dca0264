"""load never hands a process another rank's state unasked, and refuses a device it cannot reach."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd


@pytest.fixture
def two_rank_checkpoint(daemon, client_factory, root: Path) -> Path:
    clients = [client_factory(rank=r, world_size=2) for r in range(2)]
    futures = [c.save_async({"rank": r, "w": torch.full((3,), float(r))}, root / "ck", step=1)
               for r, c in enumerate(clients)]
    for f in futures:
        f.result(30)
    return root / "ck"


@pytest.mark.timeout(60)
def test_a_rank_beyond_the_saved_world_gets_an_error_not_rank_0s_state(two_rank_checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ckptd.InvalidCheckpoint, match=r"ranks 0\.\.1; this process is rank 2.*rank="):
        ckptd.load(two_rank_checkpoint)
    assert ckptd.load(two_rank_checkpoint, rank=1)["rank"] == 1  # asking on purpose still works
    monkeypatch.setenv("RANK", "1")
    assert ckptd.load(two_rank_checkpoint)["rank"] == 1


@pytest.mark.timeout(60)
def test_a_cuda_map_location_this_host_lacks_is_named(two_rank_checkpoint) -> None:
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last device this host has (cuda:0 on a CPU build)
    with pytest.raises(ValueError, match=rf"map_location '{missing}'.*CUDA device"):
        ckptd.load(two_rank_checkpoint, rank=0, map_location=missing)


def test_latest_of_no_path_is_a_type_error_not_none() -> None:
    with pytest.raises(TypeError, match="root must be a path"):
        ckptd.latest(None)


@pytest.mark.parametrize("timeout, error", [(-1, ValueError), (float("nan"), ValueError), ("5", TypeError)])
def test_client_wait_refuses_a_timeout_that_is_not_seconds(daemon, client, timeout, error) -> None:
    with pytest.raises(error, match="timeout"):
        client.wait(timeout)
    client.wait(0.5)  # a real timeout still works
