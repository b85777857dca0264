"""``replicated=``: state identical on every rank is written once and served to every rank; bad arguments say why.

Two clients of one real daemon play ranks 0 and 1 of a two-rank checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd


def two_ranks(client_factory):
    return [client_factory(rank=r, world_size=2) for r in (0, 1)]


def test_replicated_keys_are_stored_once_by_rank_0_and_loaded_by_every_rank(daemon, client_factory, root: Path):
    clients = two_ranks(client_factory)
    model = {"w": torch.arange(1024, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.bfloat16), "n": 4}
    futures = [c.save_async({"model": model, "mine": torch.full((2,), r)}, root / "ck", replicated=("model",))
               for r, c in enumerate(clients)]
    for f in futures:
        f.result(60)
    index = ckptd.read_index(root / "ck")
    assert sorted(index.tensors) == ["model.b", "model.w"]
    assert all(c.file == index.files[0].file for t in index.tensors.values() for c in t.chunks)
    info = ckptd.inspect(root / "ck")
    assert [t.name for t in info.shards[1].tensors] == ["mine"]  # rank 1 wrote only its own tensor
    for r in (0, 1):
        state = ckptd.load(root / "ck", rank=r)
        assert torch.equal(state["model"]["w"], model["w"]) and torch.equal(state["model"]["b"], model["b"])
        assert state["model"]["n"] == 4 and state["mine"].tolist() == [r, r]
        target = {"model": {"w": torch.zeros(1024), "b": torch.ones(3, dtype=torch.bfloat16), "n": 0},
                  "mine": torch.zeros(2, dtype=torch.int64)}
        assert ckptd.load_into(target, root / "ck", rank=r).copied == 3
        assert torch.equal(target["model"]["w"], model["w"]) and target["model"]["n"] == 4
        assert target["mine"].tolist() == [r, r]


def test_an_optimizer_without_state_restores_replicated_state_through_load_state_dict(client, root: Path):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    client.save_async({"optimizer": optim.state_dict()}, root / "ck", replicated=("optimizer",)).result(60)
    fresh = torch.optim.AdamW(model.parameters())
    ckptd.load_into(fresh, root / "ck", key="optimizer")
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    "state, replicated, error, message",
    [
        pytest.param({"model": {}}, "model", TypeError, "replicated must be a tuple of top-level keys", id="a-string"),
        pytest.param({"model": {}}, (1,), TypeError, "replicated must be a tuple of top-level keys", id="not-str"),
        pytest.param({"model": {}}, ("model", "optim"), ValueError, "keys the state does not hold: ['optim']",
                     id="missing-key"),
        pytest.param([torch.zeros(1)], ("model",), TypeError, "needs a dict state, got list", id="not-a-dict"),
    ],
)
def test_a_bad_replicated_argument_is_refused_before_anything_is_staged(client, root: Path, state, replicated,
                                                                          error, message):
    with pytest.raises(error) as info:
        client.save_async(state, root / "ck", replicated=replicated)
    assert message in str(info.value)
    assert not list(root.iterdir())
