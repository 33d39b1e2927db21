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
    # and the program must match brute force exactly; option 0 is exact, option 1 the user's.
    reference = rng.integers(1, levels.STEPS // groups, groups).astype(float)
    reference *= levels.STEPS / reference.sum()  # whole steps still: the budget is STEPS steps
    errors = rng.integers(0, levels.STEPS // 2, (groups, options)).astype(float)
    errors[:, 0], errors[:, 1] = 0.0, reference
    budget = float(reference.sum())
    picked = levels.choose(costs, errors, reference)
    rows = np.arange(groups)
    assert errors[rows, picked].sum() <= budget * (1 + 1e-12)
    assert costs[rows, picked].sum() == pytest.approx(brute_force(costs, errors, budget))


def test_choose_never_exceeds_the_budget_and_the_users_level_always_fits() -> None:
    rng = np.random.default_rng(7)
    costs = rng.uniform(0.1, 10.0, (30, 5))
    costs[:, 1:] = np.sort(costs[:, 1:], axis=1)[:, ::-1]  # lossier options are cheaper
    costs[:, 0] = 20.0  # and exact is the dearest
    errors = np.sort(rng.uniform(0.0, 1.0, (30, 5)), axis=1)
    errors[:, 0] = 0.0
    costs[3, 4] = np.inf  # group 3 cannot take option 4
    errors[5, 3] = np.nan  # nor group 5 option 3: its error was not finite
    for level in (1, 2, 3, 4):  # the user's level: the budget is its error on every group
        reference = errors[:, level].copy()
        reference[5] = errors[5, 4] if level == 3 else reference[5]
        picked = levels.choose(costs, errors, reference)
        assert np.nansum(errors[np.arange(30), picked]) <= reference.sum() * (1 + 1e-12)
        assert picked[3] != 4 and picked[5] != 3
    # Rounding never rules out the user's own level everywhere: with nothing cheaper that fits,
    # that is the answer.
    only_own = np.full((30, 3), np.inf)
    only_own[:, 0], only_own[:, 1] = 20.0, 1.0
    own_errors = np.column_stack([np.zeros(30), rng.uniform(0.1, 1.0, 30), np.full(30, 9.0)])
    assert (levels.choose(only_own, own_errors, own_errors[:, 1]) == 1).all()
    assert (levels.choose(costs[:, :2], errors[:, :2], np.zeros(30)) == 0).all()  # a zero budget


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
    by_spec = {
        "topk:ratio=0.1": (0.1, 0.1, 0.1),
        "topk:ratio=0.03": (0.38, 0.38, 0.38),
        "topk:ratio=0.01": (0.5, 0.5, 0.5),
    }
    errors = levels.Errors(by_spec, own="topk:ratio=0.03")  # a budget of 1.14
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
    return levels.Errors(by_spec, own=levels.spec(config.compressor, config.compressor_args))


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
    # A gradient measured non-finite (an overflow step), or not measured at all, keeps the user's
    # level: no error of its own counts, and no other level is open to it.
    bad = {**measured, 1: {"int8": math.inf, "int4": math.nan}}
    for errors in (tuner.budget(config, bad, [1, 0]), tuner.budget(config, {0: measured[0]}, [1, 0])):
        assert errors.by_spec["int4"][0] == 0.0 and errors.by_spec["int8"][0] == math.inf
        assert errors.budget == pytest.approx(measured[0]["int4"])
        assert errors.fits("int4", [0, 1]) and not errors.fits("int8", [0, 1]) and errors.fits("fp16", [0])


def test_powersgd_levels_are_measured_on_each_gradient_as_its_own_matrix() -> None:
    # A (40, 30) gradient of rank 2: rank 2 holds it whole as its matrix, as the hook compresses
    # it; a near-square view of its 1,200 elements (35 x 35) would not.
    g = torch.Generator().manual_seed(1)
    gradient = torch.randn(40, 2, generator=g) @ torch.randn(2, 30, generator=g)
    config = SyncConfig(compressor="powersgd", compressor_args={"rank": 2}, plan="auto")
    measured = tuner.error_levels({0: gradient}, config)[0]
    total = float(gradient.square().sum())
    assert measured["powersgd:rank=2"] < 1e-8 * total
    assert measured["powersgd:rank=1"] > 1e-3 * total


def test_a_group_may_go_exact_and_pass_its_share_of_the_budget_to_a_coarser_level_elsewhere() -> None:
    # The user's int8 everywhere loses 5 + 1 = 6. Sending the small group exactly (0) lets the
    # big one take int4 (4): 4 <= 6, and far cheaper than int8 on both.
    spec_of = ["none", "int8", "int4"]
    costs = np.array([[10.0, 9.0, 8.0], [200.0, 100.0, 50.0]])
    errors = levels.Errors({"int8": (5.0, 1.0), "int4": (50.0, 4.0)}, own="int8")
    valid = np.ones_like(costs, dtype=bool)
    open_to = levels.allowed(spec_of, [[0], [1]], costs, valid, errors)
    assert open_to.tolist() == [[True, False, False], [True, False, True]]
