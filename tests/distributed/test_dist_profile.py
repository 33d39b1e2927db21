"""gradsync.profile on 2 gloo ranks over loopback: collective fits every rank agrees on, the
compute timeline of a DDP model under no_sync, and a whole profile identical on both ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import batch, ddp, flat_params, make_mlp, run_ranks, sgd
from torch import nn

from gradsync import profile
from gradsync.comm import TorchComm
from gradsync.cost import LinearFit

WORLD_SIZE = 2


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, second: bool) -> torch.Tensor:
        return self.second(self.first(x)) if second else self.first(x)


def profile_on_ranks(rank: int, world_size: int) -> dict[str, Any]:
    comm = TorchComm()
    fits = profile.probe_collectives(comm, repeats=3)

    model = ddp(make_mlp(seed=0))
    loss_fn = nn.CrossEntropyLoss()

    def step(i: int) -> torch.Tensor:
        x, y = batch(rank, i)
        return loss_fn(model(x), y)

    _, backward_s, _, tensors = profile.time_backward(model, step, sgd(model), steps=3, warmup=1)
    after_timing = flat_params(model)

    found = profile.run(
        model,
        step,
        sgd(model),
        compressors=["fp16"],
        steps=2,
        warmup=1,
        codec_sizes=(1 << 12, 1 << 16),
        collective_sizes=(4, 65536),
        repeats=2,
    )
    # A parameter only one rank's data uses: both ranks still agree on one list of gradients.
    heads = ddp(TwoLayers())

    def uneven_step(i: int) -> torch.Tensor:
        return heads(torch.ones(2, 4), second=rank == 1).sum()

    uneven = profile.run(
        heads, uneven_step, sgd(heads), compressors=[], steps=1, warmup=0, collective_sizes=(4, 64), repeats=1
    )
    contention = profile.measure_contention(
        model, step, comm, nbytes=1 << 18, names=["allreduce", "allreduce:float16"], transfers=3, steps=2
    )
    return {
        "contention": contention,
        "uneven": uneven.to_json(),
        "fits": {name: fit.to_dict() for name, fit in fits.items()},
        "order": [(t.index, t.name, t.numel) for t in tensors],
        "readies": [t.ready_s for t in tensors],
        "backward_s": backward_s,
        "params": after_timing,
        "profile": found.to_json(),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(profile_on_ranks, WORLD_SIZE, timeout_s=60)


def test_every_rank_gets_the_same_collective_fits(runs: list[dict[str, Any]]) -> None:
    assert runs[0]["fits"] == runs[1]["fits"]
    assert sorted(runs[0]["fits"]) == sorted(profile.COLLECTIVES)


def test_collective_fits_cost_time_and_grow_with_size(runs: list[dict[str, Any]]) -> None:
    fits = {name: LinearFit.from_dict(d) for name, d in runs[0]["fits"].items()}
    assert fits["allreduce"].per_unit_s > 0
    assert fits["allreduce"](4 << 20) > fits["allreduce"](4096)
    for name, fit in fits.items():
        assert fit(4096) > 0, name
        assert fit.points == len(profile.DEFAULT_COLLECTIVE_NBYTES), name


def test_time_backward_of_a_ddp_model_gives_one_order_on_every_rank(runs: list[dict[str, Any]]) -> None:
    order = runs[0]["order"]
    assert order == runs[1]["order"]
    names = [name for name, _ in make_mlp(seed=0).named_parameters()]
    assert sorted(index for index, _, _ in order) == list(range(len(names)))
    assert [name for _, name, _ in order][:2] in (["4.weight", "4.bias"], ["4.bias", "4.weight"])
    for run in runs:
        assert run["readies"] == sorted(run["readies"]) and run["readies"][-1] <= run["backward_s"]


def test_time_backward_exchanges_no_gradients(runs: list[dict[str, Any]]) -> None:
    # Each rank trained on its own data under no_sync: had gradients been averaged, the replicas
    # would still be equal.
    assert not torch.equal(runs[0]["params"], runs[1]["params"])


def test_run_returns_the_same_profile_on_every_rank(runs: list[dict[str, Any]]) -> None:
    assert runs[0]["profile"] == runs[1]["profile"]
    found = profile.Profile.from_json(runs[0]["profile"])
    assert (found.world_size, found.backend, found.device) == (WORLD_SIZE, "gloo", "cpu")
    assert found.collectives["allreduce"].points == 2
    assert sorted(t.index for t in found.tensors) == list(range(6))


def test_run_agrees_on_gradients_that_only_some_ranks_produce(runs: list[dict[str, Any]]) -> None:
    assert runs[0]["uneven"] == runs[1]["uneven"]
    found = profile.Profile.from_json(runs[0]["uneven"])
    assert sorted(t.name for t in found.tensors) == [
        "first.bias",
        "first.weight",
        "second.bias",
        "second.weight",
    ]


def test_contention_is_measured_per_collective_and_agreed_by_every_rank(runs: list[dict[str, Any]]) -> None:
    assert runs[0]["contention"] == runs[1]["contention"]
    assert sorted(runs[0]["contention"]) == ["allreduce", "allreduce:float16"]
    for slowdowns in runs[0]["contention"].values():
        assert sorted(slowdowns) == ["compute", "transfer"]
        assert all(v >= 0 and v == v for v in slowdowns.values())
