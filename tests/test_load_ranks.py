"""Loading by rank: ``load`` and ``load_into`` never hand a process another rank's state unasked (a larger world's
new ranks take only what every saved rank shares), and refuse a device they cannot reach."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.protocol.errors import InvalidCheckpoint


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


@pytest.fixture
def rank_2_of_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is rank 2 of a world of 3 (torchrun's environment): a rank a two-rank checkpoint never had."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")


def _two_rank_checkpoint(client_factory, root: Path, per_rank: list[dict]) -> Path:
    path = root / "two"
    futs = [client_factory(rank=r, world_size=2).save_async({"w": torch.full((4,), float(r)), **per_rank[r]}, path,
                                                            step=3, replicated=("w",)) for r in range(2)]
    for f in futs:
        f.result(timeout=60)
    return path


def test_load_into_on_a_larger_world_refuses_other_ranks_per_rank_state_unless_asked(daemon, client_factory, root,
                                                                                      rank_2_of_3) -> None:
    path = _two_rank_checkpoint(client_factory, root, [{"data_pos": 100}, {"data_pos": 200}])
    target = {"w": torch.zeros(4), "data_pos": 0}
    with pytest.raises(InvalidCheckpoint, match=r"rank 2.*differs between the saved ranks \(ranks 0 and 1 differ at "
                                                r"state_dict\['data_pos'\]\).*rank=0"):
        ckptd.load_into(target, path)
    assert target["data_pos"] == 0
    with pytest.raises(InvalidCheckpoint, match=r"has no rank 5; it holds ranks 0..1"):
        ckptd.load_into(target, path, rank=5)  # a rank the checkpoint lacks is never rank 0's in disguise
    ckptd.load_into(target, path, rank=1)  # asked for on purpose
    assert target["data_pos"] == 200 and torch.equal(target["w"], torch.zeros(4))


def test_load_into_on_a_larger_world_takes_per_rank_values_every_saved_rank_shares(daemon, client_factory, root,
                                                                                   rank_2_of_3) -> None:
    path = _two_rank_checkpoint(client_factory, root, [{"step": 3}, {"step": 3}])
    target = {"w": torch.ones(4), "step": 0}
    ckptd.load_into(target, path)
    assert target["step"] == 3 and torch.equal(target["w"], torch.zeros(4))


def test_load_into_on_a_larger_world_leaves_per_rank_state_the_target_does_not_take(daemon, client_factory, root,
                                                                                   rank_2_of_3) -> None:
    path = _two_rank_checkpoint(client_factory, root, [{"data": {"pos": 100}, "step": 3},
                                                       {"data": {"pos": 200}, "step": 3}])
    target = {"w": torch.ones(4), "step": 0}  # the data position is not restored here (a new data-parallel degree)
    report = ckptd.load_into(target, path, strict=False)
    assert report.unexpected == ["data"]
    assert target["step"] == 3 and torch.equal(target["w"], torch.zeros(4))
    with pytest.raises(InvalidCheckpoint, match=r"ranks 0 and 1 differ at state_dict\['data'\]\['pos'\]"):
        ckptd.load_into({"w": torch.ones(4), "data": {"pos": 0}}, path, strict=False)  # one it takes still may not
