"""Error memories follow the learning rate on real gloo ranks: int4 by two-shot, whose owners keep
a second memory, under SGD with a cosine decay.

Nothing is lost in parameter units: the rate-weighted sum of the averages every rank applied,
plus every rank's residual memory and every owner's memory of its re-encoded shard, at the rate
they are held for, is the rate-weighted sum of the true averages. Under EF21, whose mirrors
estimate the gradient and hold nothing back, nothing is rescaled: the ranks' mirrors sum to the
broadcast mirror plus the owners' shard memories at every rate.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch import nn
from torch.distributed.fsdp import FSDPModule

from gradsync import SyncConfig, SyncState
from gradsync.comm import TorchComm
from gradsync.fsdp import ShardedState

WORLD = 3  # shards of unequal length
STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same model on every rank, as DDP's broadcast would make it
    return nn.Sequential(nn.Linear(50, 40), nn.Linear(40, 7))


def rank_gradient(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank * 1_000 + step))


def _train(rank: int, world: int, feedback: str = "auto") -> dict:
    model = _model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    optimizer = torch.optim.SGD(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS + 3)
    config = SyncConfig(warmup_steps=2, min_compress_numel=0, error_feedback=feedback)
    state = SyncState(config, TorchComm(None), model)
    applied, rates = torch.zeros(numel, dtype=torch.float64), []
    for step in range(STEPS):
        average = state.sync(
            rank_gradient(rank, step, numel), 0, True, params=list(range(len(params)))
        ).wait()
        rates.append(optimizer.param_groups[0]["lr"])
        applied.add_(average.double(), alpha=rates[-1])
        optimizer.step()  # no gradients set: only its rate matters here
        scheduler.step()
    point = state.points[0]
    memories = {name: value.double() for name, value in point.feedback.state_dict().items()}
    return {
        "applied": applied,
        "rates": rates,
        "held_at": point.rates,
        **memories,  # "error" (residual feedback) or "h_local" and "h_mean" (EF21)
        "shard": point.shard_error.double(),  # type: ignore[union-attr]
        "collective": state.stats()["groups"][0]["collective"],
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_train, WORLD, timeout_s=120)


def test_nothing_is_lost_in_parameter_units(runs: list[dict]) -> None:
    assert all(out["collective"] == "two-shot" for out in runs)
    rates = runs[0]["rates"]
    numel = runs[0]["applied"].numel()
    assert rates[-1] < 0.5 * rates[0], "the rate must have decayed for this test to tell"
    for out in runs:
        assert out["held_at"] == (rates[-1],)
        assert torch.equal(out["applied"], runs[0]["applied"])  # every rank applied the same
    wanted = sum(
        rate * sum(rank_gradient(r, step, numel).double() for r in range(WORLD)) / WORLD
        for step, rate in enumerate(rates)
    )
    held = sum(out["error"] for out in runs) + torch.cat([out["shard"] for out in runs])
    assert float(torch.cat([out["shard"] for out in runs]).abs().max()) > 0  # the owners' memory counts
    torch.testing.assert_close(runs[0]["applied"] + rates[-1] * held, wanted, rtol=0, atol=1e-5)


def test_under_ef21_the_mirrors_and_the_owners_memories_stay_whole_as_the_rate_decays() -> None:
    # Each owner's re-encoding memory is what the broadcast mirror lacks of the ranks' mirrors'
    # sum; scaling it with the rate (as residual memories are) would break that for good.
    runs = run_ranks(_train, WORLD, args=("ef21",), timeout_s=120)
    assert runs[0]["collective"] == "two-shot" and runs[0]["rates"][-1] < 0.5 * runs[0]["rates"][0]
    shards = torch.cat([out["shard"] for out in runs])
    assert float(shards.abs().max()) > 0
    assert all(torch.equal(out["h_mean"], runs[0]["h_mean"]) for out in runs)
    mirrors = sum(out["h_local"] for out in runs)
    torch.testing.assert_close(mirrors - runs[0]["h_mean"], shards, rtol=0, atol=1e-5)


def _train_sharded(rank: int, world: int) -> dict:
    """The same under FSDP2's reduction (ShardedState.reduce_scatter, as gradsync's ReduceScatter
    calls it): each rank applies only its shard of the average; its one memory holds its own
    full gradient's residual, a world's share of the average."""
    model = _model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    shard = -(-numel // world)  # FSDP pads the flat gradient to equal shards
    optimizer = torch.optim.SGD(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS + 3)
    comm = TorchComm(None)
    state = ShardedState(SyncConfig(warmup_steps=2, min_compress_numel=0), comm, model)
    applied, rates = torch.zeros(shard, dtype=torch.float64), []
    for step in range(STEPS):
        x = torch.zeros(shard * world)
        x[:numel] = rank_gradient(rank, step, numel)
        out = torch.empty(shard)
        state.reduce_scatter(x, out, 0, comm, average=True)
        rates.append(optimizer.param_groups[0]["lr"])
        applied.add_(out.double(), alpha=rates[-1])
        optimizer.step()
        scheduler.step()
    point = state.points[0]
    error = point.feedback.error.double()  # type: ignore[attr-defined]
    return {"applied": applied, "rates": rates, "held_at": point.rates, "error": error}


@pytest.mark.skipif(
    not hasattr(FSDPModule, "set_custom_reduce_scatter"),
    reason=f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter: no FSDP path",
)
def test_nothing_is_lost_in_parameter_units_under_fsdp() -> None:
    runs = run_ranks(_train_sharded, WORLD, timeout_s=120)
    rates = runs[0]["rates"]
    assert rates[-1] < 0.5 * rates[0]
    assert all(out["held_at"] == (rates[-1],) for out in runs)
    applied = torch.cat([out["applied"] for out in runs])
    numel = sum(p.numel() for p in _model().parameters())
    wanted = sum(
        rate * sum(rank_gradient(r, step, numel).double() for r in range(WORLD)) / WORLD
        for step, rate in enumerate(rates)
    )
    held = sum(out["error"] for out in runs)[:numel] / WORLD
    torch.testing.assert_close(applied[:numel] + rates[-1] * held, wanted, rtol=0, atol=1e-5)
