"""plan="auto"'s pieces in one process: the step timer's timeline, DDP's buckets as gradient runs,
the candidate set, the codec specs and the warm-up length. (End to end: tests/distributed/
test_dist_auto.py.)"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from gradsync import autoplan, tuner
from gradsync.config import SyncConfig
from gradsync.cost import LinearFit
from gradsync.plan import Plan
from gradsync.sim import cluster as clusters
from gradsync.sim.compute import Compute, Gradient
from gradsync.strategy import parse


def fit(fixed_s: float, per_unit_s: float) -> LinearFit:
    return LinearFit(fixed_s, per_unit_s, 0.0, 0.0, 2)


def test_the_timeline_is_the_median_over_steps_of_hand_fed_marks_and_the_least_gap_between_steps() -> None:
    timer = tuner.StepTimer(nn.Linear(2, 2))
    timer.close()
    # Three steps: forward from f0 to f1; parameter 0 ready at f1 + r0, parameter 1 at f1 + r1;
    # the exchange done at `synced`; the next step's forward at the next f0.
    steps = [(0.0, 0.1, 0.15, 0.3, 0.35), (1.0, 1.2, 1.25, 1.5, 1.6), (2.0, 2.1, 2.14, 2.3, 2.3)]
    for f0, f1, r0, r1, synced in steps:
        timer.forward_start.append(f0)
        timer.forward_end.append(f1)
        timer.ready.append({0: r0, 1: r1})
        timer.synced[len(timer.forward_start) - 1] = synced
    timer.forward_start.append(2.5)  # an evaluation's forward pass: not a training step
    timer.forward_start.append(3.0)  # the training step after the last measured one
    forward_s, backward_s, optimizer_s, ready = timer.timeline([0, 1, 2, 4])
    assert forward_s == pytest.approx(statistics.median([0.1, 0.2, 0.1]))
    assert backward_s == pytest.approx(statistics.median([0.2, 0.3, 0.2]))
    # From the later of the last gradient and the exchange's end to the next forward pass: the
    # least of the gaps to the next training step's forward pass (a longer gap holds something
    # else the script did: an evaluation).
    assert optimizer_s == pytest.approx(min([1.0 - 0.35, 2.0 - 1.6, 3.0 - 2.3]))
    assert ready[0] == pytest.approx(statistics.median([0.05, 0.05, 0.04]))
    assert ready[1] == pytest.approx(statistics.median([0.2, 0.3, 0.2]))


def test_the_timer_marks_real_steps_in_backprop_order_and_stops_when_closed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    timer = tuner.StepTimer(model)
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
    assert len(timer.forward_start) == len(timer.forward_end) == len(timer.ready) == 2
    marks = timer.ready[1]
    assert set(marks) == {0, 1, 2, 3}
    assert max(marks[2], marks[3]) <= min(marks[0], marks[1])  # the last layer's gradients first
    assert all(timer.forward_end[1] <= t for t in marks.values())
    timer.close()
    model(torch.randn(5, 8)).sum().backward()
    assert len(timer.forward_start) == 2


def test_ddp_buckets_become_runs_of_gradients_in_the_measured_order() -> None:
    params = (5, 4, 3, 2, 1, 0)  # gradient i is parameter params[i]
    assert autoplan._as_gradients([(5, 4), (3, 2, 1, 0)], params) == [[0, 1], [2, 3, 4, 5]]
    assert autoplan._as_gradients([(3, 2, 1, 0), (5, 4)], params) == [[0, 1], [2, 3, 4, 5]]
    assert autoplan._as_gradients([(5, 3), (4, 2, 1, 0)], params) is None  # not runs
    assert autoplan._as_gradients([], params) is None


def _measured(seconds_per_byte: float = 4e-8) -> autoplan.Measured:
    """Four gradients on 4 measured ranks whose network (at the default `seconds_per_byte` of an
    allreduce) is slow enough that compression pays for the large ones and not for the small."""
    numels = (1 << 10, 1 << 22, 1 << 10, 1 << 22)
    gradients = tuple(Gradient(f"p{i}", n, 0.01 * (i + 1)) for i, n in enumerate(numels))
    compute = Compute(0.02, 0.04, 0.005, gradients, name="hand-made")
    codec = {"compress": fit(1e-4, 2e-9), "decompress": fit(1e-4, 2e-9)}
    gather = fit(2e-4, 0.75 * seconds_per_byte)
    where = clusters.measured(
        4,
        {"allreduce": fit(2e-4, seconds_per_byte), "allgather": gather, "all_to_all": gather},
        {"fp16": codec, "bf16": codec, "topk:ratio=0.01": codec},
    )
    return autoplan.Measured(compute, where, (3, 2, 1, 0))


def _ranked(measured: autoplan.Measured) -> list[Plan]:
    return autoplan.make_all(
        measured.compute,
        measured.cluster,
        "topk",
        {"ratio": 0.01},
        "sig",
        (3, 2, 1, 0),
        buckets=[[0, 1], [2, 3]],
    )


def _compresses(plan: Plan) -> bool:
    return any(s.compressed for s in plan.strategies)


def _key(plan: Plan) -> tuple:
    """A plan as its groups and strategies (its meta holds the planner's own timings)."""
    return tuple((g.params, g.strategy) for g in plan.groups)


@pytest.mark.parametrize("seconds_per_byte", [4e-8, 4e-10])
def test_candidates_are_distinct_plans_the_best_predicted_and_the_fixed_configuration_first(
    seconds_per_byte: float,
) -> None:
    config = SyncConfig(compressor="topk", compressor_args={"ratio": 0.01}, plan="auto")
    measured = _measured(seconds_per_byte)
    found = autoplan.candidates(measured, config, "sig", buckets=[(3, 2), (1, 0)])
    ranked = _ranked(measured)
    assert 2 <= len(found) <= autoplan.CANDIDATES
    # The best predicted first (timings in meta aside, the same plan), then the config's own.
    assert (found[0].groups, found[0].predicted_step_s) == (ranked[0].groups, ranked[0].predicted_step_s)
    assert [g.strategy for g in found[1].groups] == ["topk:ratio=0.01"] * 2
    keys = [_key(p) for p in found]
    assert len(set(keys)) == len(keys)
    assert all(p.model == "sig" for p in found)
    # Groups are parameter positions: each plan covers parameters 0..3 once.
    assert all(sorted(q for g in p.groups for q in g.params) == [0, 1, 2, 3] for p in found)


def test_not_compressing_is_tried_where_predicted_close_and_left_out_where_far_slower() -> None:
    config = SyncConfig(compressor="topk", compressor_args={"ratio": 0.01}, plan="auto")
    # A fast network: fp32 is predicted within TRIED_WITHIN of the best, so a real step decides.
    fast = _measured(4e-10)
    best_s = _ranked(fast)[0].predicted_step_s
    plain = next(p for p in _ranked(fast) if not _compresses(p))
    assert plain.predicted_step_s <= autoplan.TRIED_WITHIN * best_s
    assert _key(plain) in map(_key, autoplan.candidates(fast, config, "sig", buckets=[(3, 2), (1, 0)]))
    # A slow one: every plan that does not compress is predicted far slower and is not tried;
    # the config's own strategy is, whatever its prediction.
    slow = _measured()
    ranked = _ranked(slow)
    worst_s = autoplan.TRIED_WITHIN * ranked[0].predicted_step_s
    assert all(p.predicted_step_s > worst_s for p in ranked if not _compresses(p))
    found = autoplan.candidates(slow, config, "sig", buckets=[(3, 2), (1, 0)])
    assert all(_compresses(p) and p.predicted_step_s <= worst_s for p in found[:1] + found[2:])
    with pytest.MonkeyPatch.context() as patch:  # a bound that leaves out the fixed configuration
        patch.setattr(autoplan, "TRIED_WITHIN", 1.0)
        found = autoplan.candidates(slow, config, "sig", buckets=[(3, 2), (1, 0)])
    own = next(p for p in ranked if all(g.strategy == "topk:ratio=0.01" for g in p.groups))
    assert own.predicted_step_s > ranked[0].predicted_step_s
    assert [_key(p) for p in found] == [_key(ranked[0]), _key(own)]


def test_codec_specs_name_codecs_as_strategies_do_and_warmup_covers_the_probes() -> None:
    config = SyncConfig(compressor="topk", compressor_args={"ratio": 0.01, "mode": "sampled"}, plan="auto")
    specs = autoplan.codec_specs(config)
    # The casts, then every level of top-k, finest first, the config's own among them, each named
    # as its strategy names it, with the config's other arguments kept.
    assert specs[:2] == ["fp16", "bf16"] and parse("topk:ratio=0.01:mode=sampled").spec in specs
    assert [parse(spec).spec for spec in specs] == specs
    ratios = [dict(parse(spec).args)["ratio"] for spec in specs[2:]]
    assert ratios == sorted(ratios, reverse=True) and len(ratios) > 1
    assert all(dict(parse(spec).args)["mode"] == "sampled" for spec in specs[2:])
    assert autoplan.codec_specs(SyncConfig(compressor="none", plan="auto")) == ["fp16", "bf16"]
    probing = (autoplan.CANDIDATES + 2) * tuner.STEPS_EACH  # a runoff of two included
    # Probing starts after the measured steps, or after the config's warm-up if that is longer.
    assert tuner.warmup_steps(config) == max(config.warmup_steps, tuner.PLANNED) + probing
    assert tuner.warmup_steps(SyncConfig(warmup_steps=2, plan="auto")) == tuner.PLANNED + probing


def test_a_runoff_retries_the_two_fastest_only_when_they_are_within_the_margin() -> None:
    margin = autoplan.RUNOFF_MARGIN
    # The two in the reverse of their first order, whichever leads: each has an early turn.
    assert autoplan.runoff([1.0, 0.9, 2.0, 0.9 * (1 + margin)]) == (3, 1)
    assert autoplan.runoff([0.9 * (1 + margin), 2.0, 0.9]) == (2, 0)
    assert autoplan.runoff([1.0, 0.9, 2.0, 0.9 * (1 + margin) * 1.001]) is None
    assert autoplan.runoff([0.5, 0.5]) == (1, 0)
    # A candidate never measured (inf) is no runner-up; one candidate needs no runoff.
    assert autoplan.runoff([0.5, math.inf]) is None and autoplan.runoff([0.5]) is None
