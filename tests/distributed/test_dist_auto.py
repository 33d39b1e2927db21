"""SyncConfig(plan="auto") on 2 real gloo ranks.

- It measures, plans and confirms within its warm-up: candidates probed STEPS_EACH steps each (at
  most 50 measured steps), one of them compressing nothing; the plan adopted is the one measured
  fastest, the same on every rank, and the hook then executes exactly it.
- Probing has no side effects: a run that planned by itself and a run given the adopted plan in a
  file, compressing from the same step, reach bit-identical parameters, also where the adopted
  plan compresses.
- A checkpoint carries the adopted plan: a restored run executes it without planning again.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from dist_harness import config, ddp, flat_params, make_mlp, run_ranks, sgd, train

import gradsync
from gradsync import autoplan
from gradsync.plan import GroupPlan, Plan, signature

WORLD = 2
STEPS = 24
CODEC = {"compressor": "topk", "compressor_args": {"ratio": 0.1}}


def _auto_run(rank: int, world_size: int, forced: dict[str, Any] | None) -> dict[str, Any]:
    """Train STEPS steps with plan="auto"; `forced`, a plan's dict, is then the only candidate."""
    if forced is not None:
        autoplan.candidates = lambda *args, **kwargs: [Plan.from_dict(forced)]
    model = ddp(make_mlp(0))
    state = gradsync.register(model, config(plan="auto", **CODEC))
    opt = sgd(model)
    train(model, opt, rank, range(STEPS))
    stats = state.stats()
    checkpoint = io.BytesIO()
    torch.save(state.state_dict(), checkpoint)
    return {
        "auto": stats["auto"],
        "groups": stats["groups"],
        "plan": state.plan.to_dict(),
        "params": flat_params(model),
        "state": checkpoint.getvalue(),
    }


def _planned_run(rank: int, world_size: int, plan: dict[str, Any], compress_from: int) -> torch.Tensor:
    model = ddp(make_mlp(0))
    gradsync.register(model, config(plan=Plan.from_dict(plan), warmup_steps=compress_from, **CODEC))
    opt = sgd(model)
    train(model, opt, rank, range(STEPS))
    return flat_params(model)


def _restored_run(rank: int, world_size: int, saved: bytes) -> dict[str, Any]:
    model = ddp(make_mlp(0))
    state = gradsync.register(model, config(plan="auto", **CODEC))
    state.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    train(model, sgd(model), rank, range(3))
    return {"plan": state.plan.to_dict() if state.plan else None, "auto": state.stats()["auto"]}


def test_auto_measures_plans_confirms_and_executes_the_fastest_measured_candidate() -> None:
    ranks = run_ranks(_auto_run, WORLD, args=(None,), timeout_s=180)
    first = ranks[0]
    assert all(r["plan"] == first["plan"] for r in ranks), "ranks adopted different plans"
    assert all(torch.equal(r["params"], first["params"]) for r in ranks)
    auto = first["auto"]
    candidates = auto["candidates"]
    assert 1 <= len(candidates) <= autoplan.CANDIDATES
    assert auto["planned_at_step"] == autoplan.MEASURED
    assert auto["adopted_at_step"] == autoplan.MEASURED + len(candidates) * autoplan.STEPS_EACH
    assert all(len(c["measured_s"]) == autoplan.STEPS_EACH for c in candidates)
    assert sum(len(c["measured_s"]) for c in candidates) <= 50
    assert auto["adopted_at_step"] < autoplan.warmup_steps(config(plan="auto"))
    # One candidate compresses nothing, so compression is adopted only where it measured faster.
    plans = [Plan.from_dict(p) for p in [first["plan"]]]
    adopted = plans[0]
    labels = [c["label"] for c in candidates]
    assert adopted.meta["chosen"] in labels and auto["chosen"] == adopted.meta["chosen"]
    # The adopted plan is the one of least measured time (the slowest rank's, in its alternatives).
    measured = {
        k.removesuffix(" (measured)"): v for k, v in adopted.alternatives.items() if k.endswith("(measured)")
    }
    assert set(measured) == set(labels)
    assert adopted.measured_step_s == min(measured.values()) == measured[adopted.meta["chosen"]]
    # The hook executes exactly the adopted plan, group by group.
    assert [g["strategy"] for g in first["groups"]] == [g.strategy for g in adopted.groups]
    assert [g["codec"] for g in first["groups"]] == [g.parsed.codec for g in adopted.groups]


def _compressed_plan() -> Plan:
    """make_mlp's parameters in two groups, both compressed by the config's codec."""
    model = make_mlp(0)
    params = list(model.parameters())
    groups = [((5, 4, 3, 2), "topk:ratio=0.1:exchange=allgather"), ((1, 0), "topk:ratio=0.1:exchange=sparse")]
    return Plan(
        signature(model),
        WORLD,
        tuple(GroupPlan(ps, sum(params[p].numel() for p in ps), text) for ps, text in groups),
        meta={"chosen": "forced"},
    )


def test_probing_has_no_side_effects_a_given_plan_reaches_the_same_bits() -> None:
    for forced in (None, _compressed_plan().to_dict()):
        auto = run_ranks(_auto_run, WORLD, args=(forced,), timeout_s=180)[0]
        compress_from = max(config().warmup_steps, auto["auto"]["adopted_at_step"] + 1)
        given = run_ranks(_planned_run, WORLD, args=(auto["plan"], compress_from), timeout_s=120)[0]
        assert torch.equal(auto["params"], given), f"forced={forced is not None}"
        if forced is not None:  # the adopted plan compressed: the check covered compression too
            assert {g["codec"] for g in auto["groups"]} == {"topk"}
            other = run_ranks(_planned_run, WORLD, args=(auto["plan"], compress_from + 1), timeout_s=120)[0]
            assert not torch.equal(auto["params"], other)


def test_a_checkpoint_carries_the_adopted_plan_and_a_restored_run_does_not_plan_again() -> None:
    saved = run_ranks(_auto_run, WORLD, args=(None,), timeout_s=180)[0]
    restored = run_ranks(_restored_run, WORLD, args=(saved["state"],), timeout_s=120)[0]
    assert restored["plan"] == saved["plan"]
    assert restored["auto"]["adopted_at_step"] == -1 and restored["auto"]["candidates"] == []
