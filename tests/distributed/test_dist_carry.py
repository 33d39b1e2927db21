"""A new plan adopted mid-run (plan="auto" switches plans while it probes its candidates) carries
what the old plan's memories held back into the next step's gradients, on real gloo ranks.

int4 by two-shot, whose owners keep a second memory of the shard they re-encode, then a plan of
other groups and codecs: nothing is lost. The sum of the averages every rank applied, plus every
memory the new plan holds at the end, is the sum of the true averages, the owners' memories of
the old plan included; also where the first step of the new plan is non-finite on one rank (an AMP
overflow) and skipped: what was carried into it goes into the next, at the next step's loss scale
where the overflow halved it (as GradScaler does).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

from gradsync import SyncConfig, SyncState, loss_scale
from gradsync.comm import TorchComm
from gradsync.plan import GroupPlan, Plan, signature

WORLD = 3  # shards of unequal length
STEPS_EACH = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(50, 40), nn.Linear(40, 7))  # parameters of 2000, 40, 280, 7


def _plan(model: nn.Module, groups: list[tuple[tuple[int, ...], str]]) -> Plan:
    numels = [p.numel() for p in model.parameters()]
    return Plan(
        signature(model), WORLD, tuple(GroupPlan(ps, sum(numels[p] for p in ps), text) for ps, text in groups)
    )


def rank_gradient(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank * 1_000 + step))


def _scale(step: int, skip: int | None, rescaled: bool) -> float:
    """The loss scale the gradients of `step` are at: 8, and 4 after the skipped step where
    `rescaled` (an overflow halves GradScaler's scale); 1 otherwise."""
    if not rescaled:
        return 1.0
    return 4.0 if skip is not None and step > skip else 8.0


def _train(rank: int, world: int, carry: bool, skip: int | None = None, rescaled: bool = False) -> dict:
    now = {"scale": _scale(0, skip, rescaled)}
    if rescaled:  # this rank's process only: the scale a GradScaler would report
        loss_scale.now = lambda: now["scale"]
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    before = _plan(model, [((0, 1, 2, 3), "int4")])
    # Where a step is skipped, the second group goes uncompressed: both paths keep what was carried.
    after = _plan(model, [((0, 1), "int8"), ((2, 3), "int4" if skip is None else "none")])
    state = SyncState(SyncConfig(plan=before, warmup_steps=0, error_feedback="ef"), TorchComm(None), model)
    applied = torch.zeros(numel, dtype=torch.float64)
    for step in range(STEPS_EACH):
        now["scale"] = scale = _scale(step, skip, rescaled)
        g = rank_gradient(rank, step, numel) * scale
        applied += state.sync(g, 0, True, params=[0, 1, 2, 3]).wait().double() / scale
    owned_at_switch = float(state.points[0].shard_error.abs().max())  # type: ignore[union-attr]
    memory = state.points[0].feedback.held_back()
    state.use_plan(after, carry=carry)
    # Handed over as it is, the owner's shard memory added into it: no group-sized copy.
    storage = memory.untyped_storage().data_ptr()
    in_place = bool(state._carry) and all(
        t.untyped_storage().data_ptr() == storage for t in state._carry.values()
    )
    for step in range(STEPS_EACH, 2 * STEPS_EACH):
        now["scale"] = scale = _scale(step, skip, rescaled)
        g = rank_gradient(rank, step, numel) * scale
        if step == skip and rank == 1:
            g[[0, 2040]] = float("inf")  # in both groups: the whole step is skipped, as GradScaler does
        first = state.sync(g[:2040].clone(), 0, False, params=[0, 1]).wait().double()
        second = state.sync(g[2040:].clone(), 1, True, params=[2, 3]).wait().double()
        average = torch.cat([first, second])
        if step != skip:
            applied += average / scale
        elif average.isfinite().all():  # NaN (compressed) or inf where it was (uncompressed)
            raise AssertionError(f"step {step}'s average should be non-finite on every rank")
    held = (
        torch.cat(
            [
                state.points[g].hand_over(rank, world).double()  # type: ignore[union-attr]
                if g in state.points
                else torch.zeros(n, dtype=torch.float64)  # uncompressed: nothing held back
                for g, n in ((0, 2040), (1, numel - 2040))
            ]
        )
        / now["scale"]
    )
    return {
        "applied": applied,
        "held": held,
        "owned_at_switch": owned_at_switch,
        "carried_in_place": carry and in_place,
        "collectives": [g["collective"] for g in state.stats()["groups"]],
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {
        "carried": run_ranks(_train, WORLD, args=(True,), timeout_s=120),
        "dropped": run_ranks(_train, WORLD, args=(False,), timeout_s=120),
        "skipped": run_ranks(_train, WORLD, args=(True, STEPS_EACH), timeout_s=120),
        "skipped, rescaled": run_ranks(_train, WORLD, args=(True, STEPS_EACH, True), timeout_s=120),
    }


def _wanted(numel: int, skip: int | None = None) -> torch.Tensor:
    return sum(
        sum(rank_gradient(r, step, numel).double() for r in range(WORLD)) / WORLD
        for step in range(2 * STEPS_EACH)
        if step != skip
    )


@pytest.mark.parametrize("case", ["carried", "skipped", "skipped, rescaled"])
def test_a_plan_adopted_with_carry_loses_nothing_the_old_plan_held_back(
    runs: dict[str, list[dict]], case: str
) -> None:
    carried = runs[case]
    second = "two-shot" if case == "carried" else "allreduce"
    assert all(out["collectives"] == ["two-shot", second] for out in carried)
    assert all(out["owned_at_switch"] > 0 for out in carried), "the owners' memories must count"
    assert all(out["carried_in_place"] for out in carried)
    for out in carried:
        assert torch.equal(out["applied"], carried[0]["applied"])  # every rank applied the same
    wanted = _wanted(carried[0]["applied"].numel(), None if case == "carried" else STEPS_EACH)
    held = sum(out["held"] for out in carried)
    torch.testing.assert_close(carried[0]["applied"] + held, wanted, rtol=0, atol=1e-5)


def test_without_carry_what_the_old_plan_held_back_is_lost(runs: dict[str, list[dict]]) -> None:
    # The reference that shows the first test can tell: the same run, its memories dropped.
    dropped = runs["dropped"]
    wanted = _wanted(dropped[0]["applied"].numel())
    held = sum(out["held"] for out in dropped)
    assert float((dropped[0]["applied"] + held - wanted).abs().max()) > 1e-3
