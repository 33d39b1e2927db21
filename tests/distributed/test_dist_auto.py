"""SyncConfig(plan="auto") on 2 real gloo ranks.

- It measures, plans, tries each candidate for real and adopts the fastest measured: the same
  plan on every rank, executed group by group, with every documented error-feedback form.
- A checkpoint taken in any phase resumes there: one taken while measuring measures afresh and
  plans; one taken while probing, at the first round's end or in the runoff goes on probing the
  same candidates in the same order; one taken after adoption continues the exact same trajectory,
  bit for bit. One whose plan is damaged on one rank is refused on both, and neither takes any of it.

Every runner-up is made close (RUNOFF_MARGIN infinite on the ranks), so that every run has a runoff,
and every candidate is probed (the fp32 one too, whose measured steps would otherwise stand for its
probe), so that the phases fall on known steps; whether real times call a runoff, and the fp32
candidate measured by the steps that measured the timeline, are tested in tests/test_autoplan.py and
tests/test_plan_execute.py.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from dist_harness import batch, config, ddp, flat_params, make_mlp, run_ranks, sgd
from torch import nn

import gradsync
from gradsync import autoplan, checkpoint, tuner
from gradsync.plan import Plan

WORLD = 2
CODEC = {"compressor": "topk", "compressor_args": {"ratio": 0.1}}
PROBE_FROM = max(tuner.PLANNED, config().warmup_steps)
ROUND = autoplan.CANDIDATES * tuner.STEPS_EACH  # the first round's steps (the model has 4 candidates)
ADOPTED_AT = PROBE_FROM + ROUND + 2 * tuner.STEPS_EACH  # a runoff, always (module docstring)
SAVE_AT = {
    "measuring": 3,
    "measured": tuner.PLANNED,  # after the measuring step, before the candidates are made
    "probing": PROBE_FROM + tuner.STEPS_EACH + 1,
    "round's end": PROBE_FROM + ROUND,
    "runoff": PROBE_FROM + ROUND + tuner.STEPS_EACH + 1,
    "adopted": ADOPTED_AT + 1,
}
STEPS = ADOPTED_AT + 4


def _steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    loss_fn = nn.CrossEntropyLoss()
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def _checkpoint(state: gradsync.SyncState, model: nn.Module, opt: torch.optim.Optimizer) -> bytes:
    out = io.BytesIO()
    torch.save({"gradsync": state.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, out)
    return out.getvalue()


def _probe_every_candidate() -> None:
    """On a rank: a runoff after every first round, and no candidate measured by the timeline's
    steps in place of its probe (module docstring)."""
    autoplan.RUNOFF_MARGIN = math.inf
    tuner.AutoState._ran_measuring = lambda self, plan, buckets: False  # type: ignore[method-assign]


def _auto_run(rank: int, world_size: int, feedback: str) -> dict[str, Any]:
    """Train STEPS steps with plan="auto", checkpointing at each SAVE_AT step."""
    _probe_every_candidate()
    model = ddp(make_mlp(0))
    state = gradsync.register(model, config(plan="auto", error_feedback=feedback, **CODEC))
    opt = sgd(model)
    saved, noted = {}, []
    for step in range(STEPS):
        if step in SAVE_AT.values():
            saved[step] = _checkpoint(state, model, opt)
        if step > ADOPTED_AT:
            noted.append(_noted(state))
        _steps(model, opt, rank, range(step, step + 1))
    stats = state.stats()
    return {
        "stats": stats,
        "plan": state.plan.to_dict(),
        "params": flat_params(model),
        "saved": saved,
        "noted": noted,
    }


def _noted(state: tuner.AutoState) -> tuple[int, int]:
    """What plan="auto" has noted of the steps so far: forward passes timed, steps indexed."""
    return len(state.timer.forward_start), len(state._forward)


def _restored_runs(rank: int, world_size: int, saved: list[dict[int, bytes]]) -> dict[Any, dict[str, Any]]:
    """From each of this rank's checkpoints, a fresh model and state trained on to STEPS."""
    _probe_every_candidate()
    out = {}
    for step, data in saved[rank].items():
        checkpoint = torch.load(io.BytesIO(data), weights_only=False)
        model = ddp(make_mlp(0))
        model.load_state_dict(checkpoint["model"])
        state = gradsync.register(model, config(plan="auto", **CODEC))
        state.load_state_dict(checkpoint["gradsync"])
        opt = sgd(model)
        opt.load_state_dict(checkpoint["opt"])
        restored = _noted(state)
        _steps(model, opt, rank, range(step, STEPS))
        stats = state.stats()
        out[step] = {
            "auto": stats["auto"],
            "plan": state.plan.to_dict() if state.plan else None,
            "params": flat_params(model),
            "noted": [restored, _noted(state)],
        }
    # The last, restored after adoption (its timer closed), rolled back in this process to the
    # measuring phase (a loss spike's rollback): it times, plans and adopts again.
    assert step == SAVE_AT["adopted"]
    checkpoint = torch.load(io.BytesIO(saved[rank][SAVE_AT["measuring"]]), weights_only=False)
    model.load_state_dict(checkpoint["model"])
    state.load_state_dict(checkpoint["gradsync"])
    opt.load_state_dict(checkpoint["opt"])
    _steps(model, opt, rank, range(SAVE_AT["measuring"], STEPS))
    out["rolled back"] = {"auto": state.stats()["auto"]}
    return out


def _load_damaged_plan(rank: int, world_size: int, saved: list[dict[int, bytes]]) -> dict[str, Any]:
    """Rank 1's checkpoint taken after adoption, its plan damaged, loaded on every rank."""
    own, _ = checkpoint.own_part(torch.load(io.BytesIO(saved[rank][SAVE_AT["adopted"]]))["gradsync"], rank)
    if rank == 1:
        plan = {**own["auto"]["plan"], "groups": [{"params": [0]}]}  # no numel, no strategy
        own = {**own, "auto": {**own["auto"], "plan": plan}}
    state = gradsync.register(ddp(make_mlp(0)), config(plan="auto", **CODEC))
    with pytest.raises(ValueError) as refused:
        state.load_state_dict(checkpoint.pack(own, rank))
    # A part its checks themselves trip on (a list where a dict belongs) is refused alike.
    if rank == 1:
        own = {**own, "auto": {**own["auto"], "carry": ["not", "a", "dict"]}}
    with pytest.raises(ValueError) as tripped:
        state.load_state_dict(checkpoint.pack(own, rank))
    # A file of another run at the same step, sound in itself: its candidates tried in another
    # order (the ranks would exchange different plans' groups).
    own, _ = checkpoint.own_part(torch.load(io.BytesIO(saved[rank][SAVE_AT["adopted"]]))["gradsync"], rank)
    if rank == 1:
        own = {**own, "auto": {**own["auto"], "order": own["auto"]["order"][::-1]}}
    with pytest.raises(ValueError) as mixed:
        state.load_state_dict(checkpoint.pack(own, rank))
    taken = (state.step, state.plan, state.candidates, state.adopted_at, state.points)
    return {
        "message": str(refused.value),
        "tripped": str(tripped.value),
        "mixed": str(mixed.value),
        "taken": taken,
    }


@pytest.fixture(scope="module")
def auto_runs() -> list[dict[str, Any]]:
    return run_ranks(_auto_run, WORLD, args=("auto",), timeout_s=240)


def test_auto_measures_probes_and_executes_the_fastest_measured_candidate(auto_runs: list[dict]) -> None:
    first = auto_runs[0]
    assert all(r["plan"] == first["plan"] for r in auto_runs), "ranks adopted different plans"
    assert all(torch.equal(r["params"], first["params"]) for r in auto_runs)
    auto = first["stats"]["auto"]
    candidates = auto["candidates"]
    assert len(candidates) == autoplan.CANDIDATES, "SAVE_AT's steps are for a first round of 4"
    assert auto["measured_from_step"] == 0
    assert auto["probed_from_step"] == PROBE_FROM
    # Each candidate ran STEPS_EACH steps for real, its first not counted; then the two fastest by
    # the slowest rank's least again, in reverse order.
    first_round = [
        max(min(r["stats"]["auto"]["candidates"][c]["measured_s"][: tuner.STEPS_EACH - 1]) for r in auto_runs)
        for c in range(len(candidates))
    ]
    leaders = sorted(range(len(candidates)), key=lambda c: (first_round[c], c))[:2]
    assert auto["order"] == [*range(len(candidates)), max(leaders), min(leaders)]
    assert auto["adopted_at_step"] == ADOPTED_AT
    for c, candidate in enumerate(candidates):
        assert len(candidate["measured_s"]) == (tuner.STEPS_EACH - 1) * auto["order"].count(c)
    adopted = Plan.from_dict(first["plan"])
    labels = [c["label"] for c in candidates]
    assert adopted.meta["chosen"] in labels and auto["chosen"] == adopted.meta["chosen"]
    # The adopted plan is the one of least measured time (the slowest rank's, in its alternatives).
    measured = {
        k.removesuffix(" (measured)"): v for k, v in adopted.alternatives.items() if k.endswith("(measured)")
    }
    assert set(measured) == set(labels)
    assert adopted.measured_step_s == min(measured.values()) == measured[adopted.meta["chosen"]]
    # Rank 0 measured each top-k level's error on the model's own gradients; the plan keeps within
    # the error of top-k at the config's ratio everywhere (gradsync.levels).
    assert adopted.meta["error_budget"] > 0 and adopted.meta["error"] <= adopted.meta["error_budget"]
    # The hook executes exactly the adopted plan, group by group.
    groups = first["stats"]["groups"]
    assert [g["strategy"] for g in groups] == [g.parsed.text for g in adopted.groups]
    assert [g["codec"] for g in groups] == [g.parsed.codec for g in adopted.groups]


def test_auto_takes_an_explicit_error_feedback_form() -> None:
    # Its candidates include uncompressed plans and casts: "ef" applies to the groups it compresses.
    runs = run_ranks(_auto_run, WORLD, args=("ef",), timeout_s=240)
    assert runs[0]["stats"]["auto"]["adopted_at_step"] is not None
    assert all(torch.equal(r["params"], runs[0]["params"]) for r in runs)


def test_a_checkpoint_resumes_plan_auto_in_the_phase_it_was_taken(auto_runs: list[dict]) -> None:
    saved_run = auto_runs[0]
    restored = run_ranks(_restored_runs, WORLD, args=([r["saved"] for r in auto_runs],), timeout_s=240)[0]
    auto = saved_run["stats"]["auto"]
    # Taken while measuring: measures afresh from the restored step, then plans and adopts.
    measuring = restored[SAVE_AT["measuring"]]["auto"]
    assert measuring["measured_from_step"] == SAVE_AT["measuring"]
    assert measuring["adopted_at_step"] is not None and restored[SAVE_AT["measuring"]]["plan"] is not None
    # Taken once measured but before planning (what the measuring step found is not saved): the
    # same, its candidates made a measuring step later than the saved run's.
    measured = restored[SAVE_AT["measured"]]["auto"]
    assert measured["measured_from_step"] == SAVE_AT["measured"]
    assert measured["probed_from_step"] == SAVE_AT["measured"] + tuner.PLANNED > auto["probed_from_step"]
    # The same in the process that had adopted: its timer's hooks are back, its steps timed anew.
    rolled = restored["rolled back"]["auto"]
    assert rolled["measured_from_step"] == SAVE_AT["measuring"]
    assert rolled["adopted_at_step"] == measuring["adopted_at_step"]
    assert all(0 < t < 60 for c in rolled["candidates"] for t in c["measured_s"])
    # Taken while probing: the same candidates in the same order, the counted times kept, adopted
    # once the rest are tried. The runoff's pair is the resumed run's to pick where the checkpoint
    # came before it was picked (the times after the checkpoint are the resumed run's own, and the
    # time of the step just before it is taken only at the next step's start: lost).
    labels = [c["label"] for c in auto["candidates"]]
    for phase in ("probing", "round's end", "runoff"):
        resumed = restored[SAVE_AT[phase]]["auto"]
        assert [c["label"] for c in resumed["candidates"]] == labels, phase
        # Slots whose counted times were all taken before the checkpoint.
        tried = (SAVE_AT[phase] - PROBE_FROM - 1) // tuner.STEPS_EACH
        for c in range(min(tried, len(labels))):
            saved_s = auto["candidates"][c]["measured_s"][: tuner.STEPS_EACH - 1]
            assert resumed["candidates"][c]["measured_s"][: tuner.STEPS_EACH - 1] == saved_s, phase
        assert resumed["order"][: len(labels)] == list(range(len(labels))), phase
        if phase == "runoff":
            assert resumed["order"] == auto["order"]
        assert resumed["adopted_at_step"] == ADOPTED_AT, phase
    # Taken after adoption: the same plan, and the exact same trajectory; and, as in a run that
    # adopted by itself, nothing more is noted of the steps that follow (it would grow forever).
    adopted = restored[SAVE_AT["adopted"]]
    assert adopted["plan"] == saved_run["plan"]
    assert adopted["auto"]["adopted_at_step"] == auto["adopted_at_step"]
    assert torch.equal(adopted["params"], saved_run["params"])
    assert adopted["noted"][0] == adopted["noted"][1]


def test_a_plan_damaged_on_one_rank_is_refused_on_every_rank_and_none_takes_any_of_it(
    auto_runs: list[dict],
) -> None:
    runs = run_ranks(_load_damaged_plan, WORLD, args=([r["saved"] for r in auto_runs],), timeout_s=120)
    for rank, run in enumerate(runs):
        assert "nothing was loaded" in run["message"], run["message"]
        assert "rank 1: its saved state cannot be rebuilt (ValueError: plan group 0" in run["message"]
        assert "rank 1: it is not a whole gradsync state (AttributeError" in run["tripped"], run["tripped"]
        assert "all ranks: the ranks' states were saved by different runs" in run["mixed"], run["mixed"]
        assert run["taken"] == (0, None, [], None, {}), f"rank {rank} took part of the checkpoint"


def test_nothing_more_is_noted_of_the_steps_once_a_plan_is_adopted(auto_runs: list[dict]) -> None:
    for run in auto_runs:
        assert len(run["noted"]) == STEPS - ADOPTED_AT - 1 > 1
        assert set(run["noted"]) == {run["noted"][0]}


def _planning_fails_on_rank_0(rank: int, world_size: int) -> str | None:
    def fails(*args: Any, **kwargs: Any) -> list[Plan]:
        raise ValueError("no option fits the error budget")

    tuner.candidates = fails  # only rank 0 plans
    model = ddp(make_mlp(0))
    gradsync.register(model, config(plan="auto", **CODEC))
    opt = sgd(model)
    try:
        _steps(model, opt, rank, range(PROBE_FROM + 1))
    except RuntimeError as error:
        return str(error)
    return None


def test_planning_that_fails_on_rank_0_raises_on_every_rank_instead_of_leaving_them_waiting() -> None:
    for rank, raised in enumerate(
        run_ranks(_planning_fails_on_rank_0, WORLD, timeout_s=120, pg_timeout_s=30)
    ):
        assert raised is not None and "planning failed on rank 0" in raised, (rank, raised)
        assert "no option fits the error budget" in raised, (rank, raised)
