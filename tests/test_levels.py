"""Error-aware levels: the dynamic program against brute force, and plans kept within the budget."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from gradsync import autoplan, levels, planner, tuner
from gradsync.config import SyncConfig
from gradsync.cost import fit_linear
from gradsync.sim import cluster
from gradsync.sim.compute import Compute, Gradient
from gradsync.strategy import parse


def brute_force(costs: np.ndarray, errors: np.ndarray, budget: float) -> float:
    """The least total cost of any choice within the budget."""
    best = math.inf
    for choice in itertools.product(*(range(costs.shape[1]) for _ in range(costs.shape[0]))):
        rows = np.arange(costs.shape[0])
        if errors[rows, choice].sum() <= budget * (1 + 1e-12):
            best = min(best, float(costs[rows, choice].sum()))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_choose_finds_the_cheapest_choice_within_the_budget(seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups, options = int(rng.integers(1, 6)), int(rng.integers(2, 5))
    costs = rng.uniform(0.1, 10.0, (groups, options))
    # Errors on the program's own grid (whole steps of the budget), so that rounding loses nothing
    # and the program must match brute force exactly; option 0 is exact.
    budget = 3.0
    errors = rng.integers(0, levels.STEPS // 2, (groups, options)) * budget / levels.STEPS
    errors[:, 0] = 0.0
    picked = levels.choose(costs, errors, budget)
    rows = np.arange(groups)
    assert errors[rows, picked].sum() <= budget * (1 + 1e-12)
    assert costs[rows, picked].sum() == pytest.approx(brute_force(costs, errors, budget))


def test_choose_never_exceeds_the_budget_and_skips_what_a_group_cannot_take() -> None:
    rng = np.random.default_rng(7)
    costs = rng.uniform(0.1, 10.0, (30, 5))
    costs[:, 1:] = np.sort(costs[:, 1:], axis=1)[:, ::-1]  # lossier options are cheaper
    costs[:, 0] = 20.0  # and exact is the dearest
    errors = np.sort(rng.uniform(0.0, 1.0, (30, 5)), axis=1)
    errors[:, 0] = 0.0
    costs[3, 4] = np.inf  # group 3 cannot take option 4
    for budget in (0.0, 0.5, 3.0, 100.0):
        picked = levels.choose(costs, errors, budget)
        assert errors[np.arange(30), picked].sum() <= budget
        assert picked[3] != 4
    assert (levels.choose(costs, errors, 100.0)[np.arange(30) != 3] == 4).all()  # all the cheapest
    assert (levels.choose(costs, errors, 0.0) == 0).all()  # nothing lossy


def test_each_codec_s_levels_run_finest_first_and_hold_the_users_own() -> None:
    assert levels.specs("topk", {"ratio": 0.02, "mode": "exact"}) == [
        f"topk:mode=exact:ratio={r}" for r in (0.1, 0.03, 0.02, 0.01, 0.003, 0.001)
    ]
    # The user's own level keeps the user's spelling (no arguments: PowerSGD's default rank 1).
    assert levels.specs("powersgd") == [f"powersgd:rank={r}" for r in (32, 16, 8, 4, 2)] + ["powersgd"]
    assert levels.specs("int4") == ["int8", "int4"] and levels.specs("int8") == ["int8", "int4"]
    assert levels.specs("efsignsgd") == ["efsignsgd"]
    for name in ("topk", "qsgd", "powersgd", "int4", "terngrad"):
        assert all(parse(spec).spec == spec for spec in levels.specs(name))


def test_allowed_leaves_each_group_one_lossy_level_and_every_exact_way() -> None:
    specs = ["none", "fp16", "topk:ratio=0.1", "topk:ratio=0.1", "topk:ratio=0.01"]
    costs = np.array([[9.0, 5.0, 3.0, 2.5, 1.0]] * 3)
    valid = np.ones((3, 5), dtype=bool)
    errors = levels.Errors({"topk:ratio=0.1": (0.1, 0.1, 0.1), "topk:ratio=0.01": (0.5, 0.5, 0.5)}, 1.15)
    allowed = levels.allowed(specs, [[0], [1], [2]], costs, valid, errors)
    assert allowed[:, :2].all()  # fp32 and the cast: always open
    for row in allowed:
        assert len({s for s, ok in zip(specs[2:], row[2:], strict=True) if ok}) == 1
    # Two groups can afford the coarse level (0.5 each), the third the fine one.
    assert sorted(int(row[4]) for row in allowed) == [0, 1, 1]


def _compute() -> Compute:
    # Two gradients in two of DDP's buckets: top-k loses a hundred times more of the small one's.
    grads = (Gradient("small", 1 << 21, 0.02), Gradient("big", 1 << 24, 0.05))
    return Compute(0.02, 0.05, 0.01, grads, name="two")


def _errors(config: SyncConfig) -> levels.Errors:
    by_spec = {}
    for spec in tuner.lossy_specs(config):
        ratio = dict(parse(spec).args)["ratio"]
        by_spec[spec] = (0.01 / ratio, 0.0001 / ratio)  # (small, big)
    own = levels.spec(config.compressor, config.compressor_args)
    return levels.Errors(by_spec, math.fsum(by_spec[own]))


def test_plans_stay_within_the_error_budget_and_spend_it_where_it_buys_speed() -> None:
    config = SyncConfig(compressor="topk", compressor_args={"ratio": 0.01}, plan="auto")
    codec = {
        "compress": fit_linear([1, 2], [1e-4, 1e-4 + 2e-9]),
        "decompress": fit_linear([1, 2], [1e-4, 1e-4]),
    }
    link = fit_linear([1, 2], [2e-4, 2e-4 + 1e-8])  # about 1 Gbit/s
    where = cluster.measured(
        4,
        {"allreduce": link, "allgather": link, "all_to_all": link},
        {spec: codec for spec in autoplan.codec_specs(config)},
    )
    errors = _errors(config)
    plans = autoplan.make_all(_compute(), where, "topk", {"ratio": 0.01}, errors=errors)
    for plan in plans:
        assert plan.meta["error"] <= plan.meta["error_budget"] == errors.budget
    best = plans[0]
    chosen = {g.names: g.parsed for g in best.groups}
    # The big gradient goes coarser than the uniform 1%, paid for by the small one going exact or
    # finer, and the plan is predicted faster than top-k 1% everywhere.
    assert dict(chosen[("big",)].args)["ratio"] < 0.01
    small = chosen[("small",)]
    assert not levels.is_lossy(small.spec) or dict(small.args)["ratio"] > 0.01
    uniform = autoplan.make_all(_compute(), where, "topk", {"ratio": 0.01})
    assert best.predicted_step_s < min(
        p.predicted_step_s for p in uniform if p.meta["chosen"].startswith("topk:ratio=0.01, DDP")
    )
    # Without measured errors the space holds the user's level alone, as before.
    assert {s.spec for s in planner.space(where, "topk", {"ratio": 0.01})} >= {"topk:ratio=0.01"}
    assert not any(s.spec == "topk:ratio=0.001" for s in planner.space(where, "topk", {"ratio": 0.01}))


def test_the_budget_is_the_users_own_level_on_every_gradient_in_the_planners_order() -> None:
    config = SyncConfig(compressor="int4", plan="auto")
    g = torch.Generator().manual_seed(0)
    gradients = {0: torch.randn(300, generator=g), 1: torch.randn(1000, generator=g) * 5}
    measured = tuner.error_levels(gradients, config)
    assert set(measured[0]) == {"int8", "int4"} and measured[1]["int4"] > measured[1]["int8"] > 0
    found = tuner.budget(config, measured, order=[1, 0])
    assert found.by_spec["int4"] == (measured[1]["int4"], measured[0]["int4"])
    assert found.budget == pytest.approx(measured[0]["int4"] + measured[1]["int4"])
    assert tuner.budget(SyncConfig(compressor="fp16", plan="auto"), measured, [1, 0]) is None
