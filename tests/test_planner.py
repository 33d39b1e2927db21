"""The planner's timeline (sim/quick.py), the planner (Espresso's decision), merge scheduling and
plan.make: against the event engine, hand-made timelines with known answers, and brute force."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import nn

from gradsync import autoplan, plan, planner, schedule
from gradsync.cost import LinearFit
from gradsync.sim import cluster as clusters
from gradsync.sim import compute as computes
from gradsync.sim import engine, models, quick
from gradsync.sim import groups as grouping
from gradsync.sim.compute import Compute, Gradient
from gradsync.strategy import parse

# Strategies whose work all comes before or after their transfers (quick's exact case).
FLAT = [
    "none",
    "fp16",
    "topk:ratio=0.01",
    "qsgd:collective=allgather",
    "efsignsgd:collective=allgather",
    "topk:ratio=0.01:scheme=auto",
]
OFFLOADED = ["topk:ratio=0.01:on=cpu", "qsgd:collective=allgather:on=cpu"]


def fit(fixed_s: float, per_unit_s: float) -> LinearFit:
    return LinearFit(fixed_s, per_unit_s, 0.0, 0.0, 2)


def hand_made(numels: Sequence[int], ready: Sequence[float], backward_s: float | None = None) -> Compute:
    gradients = tuple(Gradient(f"g{i}", n, t) for i, (n, t) in enumerate(zip(numels, ready, strict=True)))
    return Compute(0.01, backward_s if backward_s is not None else ready[-1], 0.001, gradients)


def measured(
    allreduce: LinearFit, codec: LinearFit, topk: LinearFit | None = None, world: int = 4
) -> clusters.Cluster:
    """A measured cluster whose costs are exact lines: every collective by `allreduce` (allgather too)."""
    codecs = {"compress": codec, "decompress": codec}
    slow = {"compress": topk, "decompress": topk} if topk else codecs
    return clusters.measured(
        world,
        {"allreduce": allreduce, "allgather": allreduce},
        {"fp16": codecs, "bf16": codecs, "topk:ratio=0.01": slow},
    )


def decide(
    work: Compute, where: clusters.Cluster, groups: list[list[int]], codec: str = "topk"
) -> planner.Decision:
    return planner.decide(planner.Problem(work, where, groups, planner.space(where, codec, {"ratio": 0.01})))


def brute(work: Compute, where: clusters.Cluster, groups: list[list[int]], codec: str = "topk") -> float:
    return planner.brute_force(
        planner.Problem(work, where, groups, planner.space(where, codec, {"ratio": 0.01}))
    )[1]


# -- the planner's timeline is the engine's --------------------------------------------------------


@pytest.mark.parametrize("model", ["resnet50", "bert-base", "lstm"])
@pytest.mark.parametrize("nodes, gpus", [(8, 8), (4, 1), (1, 8)])
def test_the_quick_layout_equals_the_engine_for_flat_strategies(model: str, nodes: int, gpus: int) -> None:
    where = clusters.cluster(nodes, gpus, "v100", "25gbit")
    work = computes.from_model(models.build(model), where.device)
    groups = grouping.equal(work.numels, 12)
    space = [parse(s) for s in FLAT + OFFLOADED]
    rng = np.random.default_rng(nodes * 100 + gpus)
    rows, expected = [], []
    for _ in range(6):
        chosen = [space[i] for i in rng.integers(0, len(space), len(groups))]
        copied = [bool(c) for c in rng.integers(0, 2, len(groups))]
        expected.append(engine.simulate(work, where, chosen, groups, copied=copied).step_s)
        rows.append(
            [
                quick.cost_vector(s, sum(work.numels[i] for i in g), where, [], c)
                for s, g, c in zip(chosen, groups, copied, strict=True)
            ]
        )
    layout = quick.layout(work, quick.ready_times(work, groups), np.array(rows), where.cpu_threads)
    assert layout.step_s == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", ["qsgd", "int8", "efsignsgd"])
def test_a_two_shot_exchange_after_the_backward_pass_lays_out_as_in_the_engine(text: str) -> None:
    # The owner's decode and re-encode sit between the two transfers: quick holds them on the
    # network, the engine runs them on the device, which is idle once the backward pass is done.
    where = clusters.cluster(4, 1, "v100", "25gbit")
    work = computes.from_model(models.build("bert-base"), where.device)
    groups = [list(range(len(work.numels)))]  # one group: ready when the backward pass ends
    strategy = parse(text)
    assert strategy.collective == "two-shot"
    costs = [quick.cost_vector(strategy, sum(work.numels), where)]
    fast = quick.layout(work, quick.ready_times(work, groups), np.array(costs)).step_s[0]
    assert fast == pytest.approx(engine.simulate(work, where, strategy, groups).step_s, rel=1e-12)


def test_a_two_level_exchange_is_held_no_shorter_than_the_engine_pipelines_it() -> None:
    where = clusters.cluster(8, 8, "v100", "25gbit")
    work = computes.from_model(models.build("gpt2"), where.device)
    groups = grouping.equal(work.numels, 10)
    for text in ("none:collective=two-level", "topk:ratio=0.01:collective=two-level"):
        strategy = parse(text)
        costs = [quick.cost_vector(strategy, sum(work.numels[i] for i in g), where) for g in groups]
        fast = quick.layout(work, quick.ready_times(work, groups), np.array(costs)).step_s[0]
        assert fast >= engine.simulate(work, where, strategy, groups).step_s * (1 - 1e-12)


def test_a_hand_made_step_by_the_formulas() -> None:
    # Two groups, one worker's view: forward 10 ms; group 0 ready at 20 ms of backward, group 1 at
    # 50 ms (backward ends there). Group 0 compresses 5 ms on the device (so group 1 is ready at
    # 55 ms), sends 30 ms, decodes 2 ms; group 1 sends 10 ms, nothing else.
    work = hand_made([10, 10], [0.020, 0.050])
    costs = np.array([[0.005, 0, 0.030, 0.002, 0], [0, 0, 0.010, 0, 0]])
    layout = quick.layout(work, quick.ready_times(work, [[0], [1]]), costs)
    # Group 0: ready 30, compressed 35, sent 35..65; its decode asks at 65, after the backward
    # pass ended (10 + 50 + 5 = 65 -> not before it): queued, 65..67. Group 1: ready at 65 (60 + 5),
    # the link is free at 65: sent 65..75. Step: max(65, 67, 75) + optimizer 1 ms = 76 ms.
    assert layout.link_start_s[0] == pytest.approx([0.035, 0.065])
    assert layout.link_end_s[0] == pytest.approx([0.065, 0.075])
    assert layout.step_s[0] == pytest.approx(0.076)


# -- the decision on hand-made timelines -----------------------------------------------------------


def test_on_a_fast_network_nothing_is_compressed() -> None:
    # A 4 MB transfer costs 40 us + 4e6 * 1e-12 s; any codec costs at least 1 ms on the device.
    where = measured(allreduce=fit(1e-5, 1e-12), codec=fit(1e-3, 1e-9))
    work = hand_made([1 << 20, 1 << 20, 1 << 20], [0.01, 0.02, 0.03])
    groups = [[0], [1], [2]]
    found = decide(work, where, groups)
    assert all(not s.compressed for s in found.strategies)
    assert found.step_s == pytest.approx(brute(work, where, groups), rel=1e-12)


def test_on_a_slow_network_large_groups_are_compressed_as_brute_force_would() -> None:
    # 16 MB at 1e-8 s per byte is 0.17 s per group; codecs cost about a millisecond.
    where = measured(allreduce=fit(1e-4, 1e-8), codec=fit(1e-4, 1e-10))
    work = hand_made([1 << 22, 1 << 22], [0.05, 0.10])
    groups = [[0], [1]]
    found = decide(work, where, groups)
    assert all(s.compressed for s in found.strategies)
    assert found.step_s == pytest.approx(brute(work, where, groups), rel=1e-12)
    assert found.step_s < found.fp32_step_s / 3


def test_a_group_sent_before_a_network_bubble_stays_fp32_with_the_reason() -> None:
    # Group 0 (small) is ready at once and sent within milliseconds; group 1 (large) is ready only
    # at 1 s: the network idles in between, so compressing group 0 cannot help, and its device
    # time would only delay group 1.
    where = measured(allreduce=fit(1e-4, 1e-8), codec=fit(1e-3, 1e-10))
    work = hand_made([1 << 16, 1 << 22], [0.001, 1.0])
    found = decide(work, where, [[0], [1]])
    assert not found.strategies[0].compressed and found.strategies[1].compressed
    assert "before the network idles" in found.reasons[0]
    assert found.step_s == pytest.approx(brute(work, where, [[0], [1]]), rel=1e-12)


def test_strategies_that_tie_go_to_the_earlier_in_the_space() -> None:
    # fp16 and bf16 cost the same here (same codec fit, one allreduce fit for every dtype); top-k
    # is made dear, so a cast is best.
    where = measured(allreduce=fit(1e-4, 1e-8), codec=fit(1e-4, 1e-10), topk=fit(1.0, 0.0))
    work = hand_made([1 << 22], [0.05])
    found = decide(work, where, [[0]])
    assert [s.text for s in found.strategies] == ["fp16"]
    assert planner.space(where, "topk", {"ratio": 0.01}).index(parse("fp16")) < planner.space(
        where, "topk", {"ratio": 0.01}
    ).index(parse("bf16"))


def test_cpu_offload_takes_the_groups_farthest_from_the_output_and_never_hurts() -> None:
    # A GPU whose memory is slow (compression on it is dear) and a fast CPU with a fast host link.
    base = clusters.cluster(4, 1, "v100", "1gbit")
    device = dataclasses.replace(base.device, memory_bytes_per_s=2e9, pcie_bytes_per_s=1e12)
    where = dataclasses.replace(base, device=device, cpu_bytes_per_s=5e10, cpu_threads=1)
    work = hand_made([1 << 22] * 4, [0.01, 0.02, 0.03, 0.04])
    groups = [[0], [1], [2], [3]]
    problem = planner.Problem(work, where, groups, planner.space(where, "topk", {"ratio": 0.01}))
    found = planner.decide(problem)
    offloaded = [i for i, s in enumerate(found.strategies) if s.on == "cpu"]
    assert offloaded, "offloading pays here"
    # One class (equal sizes, one strategy): the offloaded are a suffix in backprop order.
    assert offloaded == list(range(len(groups) - len(offloaded), len(groups)))
    on_device = [s if s.on == "device" else dataclasses.replace(s, on="device") for s in found.strategies]
    device_only = engine.simulate(work, where, on_device, groups).step_s
    assert engine.simulate(work, where, list(found.strategies), groups).step_s <= device_only


@pytest.mark.parametrize("seed", range(40))
def test_the_decision_is_within_3_percent_of_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 6))
    numels = [int(n) for n in 10 ** rng.uniform(3, 7, count)]
    ready = np.cumsum(rng.uniform(0.001, 0.05, count)).tolist()
    work = hand_made(numels, ready, backward_s=ready[-1] + float(rng.uniform(0, 0.02)))
    if seed % 2:
        where = measured(
            allreduce=fit(float(10 ** rng.uniform(-5, -3)), float(10 ** rng.uniform(-10, -7.5))),
            codec=fit(float(10 ** rng.uniform(-5, -3)), float(10 ** rng.uniform(-10, -8))),
        )
    else:
        nodes, gpus = [(2, 4), (8, 1), (4, 8)][seed % 3]
        where = clusters.cluster(nodes, gpus, "v100", ["10gbit", "25gbit", "100gbit"][seed % 3])
    groups = grouping.layerwise(count)
    found = decide(work, where, groups)
    optimum = brute(work, where, groups)
    assert optimum * (1 - 1e-12) <= found.step_s <= optimum * 1.03


def test_the_space_follows_what_each_codec_and_cluster_allow() -> None:
    flat_gpus = clusters.cluster(1, 8, "v100", "25gbit")
    texts = [s.text for s in planner.space(flat_gpus, "topk", {"ratio": 0.01})]
    assert texts[:3] == ["none", "fp16", "bf16"]
    assert "topk:ratio=0.01:scheme=auto" in texts and "topk:ratio=0.01:collective=allreduce" not in texts
    assert not any("hierarchical" in t for t in texts)  # one node
    assert "topk:ratio=0.01:on=cpu" in texts  # GPUs: a CPU thread may compress
    summable = [s.text for s in planner.space(flat_gpus, "randk", {"ratio": 0.01})]
    assert "randk:ratio=0.01" in summable and "randk:ratio=0.01:collective=allgather" in summable
    assert not any(t.startswith("randk") and "sparse" in t for t in summable)
    two_level = [s.text for s in planner.space(clusters.cluster(2, 8, "v100", "25gbit"), "qsgd", {})]
    assert "qsgd:collective=two-level" in two_level and "none:collective=two-level" in two_level
    host = measured(allreduce=fit(1e-4, 1e-9), codec=fit(1e-4, 1e-9))
    on_host = [s.text for s in planner.space(host, "qsgd", {})]
    assert on_host == ["none", "fp16", "bf16"]  # qsgd was not measured; no offload on CPU hosts


# -- merge scheduling ------------------------------------------------------------------------------


def test_a_large_fixed_cost_per_exchange_makes_one_group_best() -> None:
    # Every collective costs 50 ms before its first byte; bytes are nearly free.
    where = measured(allreduce=fit(0.05, 1e-12), codec=fit(1e-3, 1e-12))
    work = hand_made([1 << 16] * 8, [0.001 * (i + 1) for i in range(8)])
    found = schedule.search(work, where, planner.space(where, "topk", {"ratio": 0.01}))
    assert len(found.best.groups) == 1
    assert found.best.step_s == min(c.step_s for c in found.tried)


def test_the_search_is_deterministic_bounded_and_never_worse_than_what_it_tried() -> None:
    where = clusters.cluster(4, 8, "v100", "25gbit")
    work = computes.from_model(models.build("resnet50"), where.device)
    space = planner.space(where, "topk", {"ratio": 0.01})
    first = schedule.search(work, where, space, max_groups=16, budget=30)
    again = schedule.search(work, where, space, max_groups=16, budget=30)
    assert first.best.groups == again.best.groups
    assert len(first.tried) <= 30 and all(len(c.groups) <= 16 for c in first.tried)
    assert first.best.step_s == min(c.step_s for c in first.tried)
    for bad in ({"max_groups": 0}, {"budget": 0}):
        with pytest.raises(ValueError, match="must both be >= 1"):
            schedule.search(work, where, space, **bad)


# -- plans -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["resnet50", "lstm", "deepfm"])
def test_a_plan_is_never_predicted_slower_than_any_uniform_strategy(model: str) -> None:
    where = clusters.cluster(4, 8, "v100", "25gbit")
    work = computes.from_model(models.build(model), where.device)
    made = autoplan.make(work, where, "topk", {"ratio": 0.01}, model=f"sim:{model}", budget=40)
    groups = [list(g.params) for g in made.groups]
    buckets = grouping.ddp(work.numels)
    whole = {(b[0], b[-1]) for b in buckets}
    copied = [(g[0], g[-1]) not in whole for g in groups]
    assert made.predicted_step_s == pytest.approx(
        engine.simulate(work, where, made.strategies, groups, copied=copied).step_s, rel=1e-12
    )
    for strategy in planner.space(where, "topk", {"ratio": 0.01}):
        uniform = engine.simulate(work, where, strategy, buckets).step_s
        assert made.predicted_step_s <= uniform * (1 + 1e-12), strategy.text


def test_a_plan_file_round_trips_and_describes_every_group(tmp_path) -> None:
    where = clusters.cluster(2, 4, "v100", "25gbit")
    work = computes.from_model(models.build("lstm"), where.device)
    made = autoplan.make(work, where, "qsgd", model="sim:lstm", budget=20)
    assert plan.Plan.from_json(made.to_json()) == made
    made.save(tmp_path / "plan.json")
    assert plan.Plan.load(tmp_path / "plan.json") == made
    text = made.describe()
    assert all(g.strategy in text and g.reason in text for g in made.groups)
    data = made.to_dict()
    with pytest.raises(ValueError, match=r"version 1 is not 2.*make the plan afresh"):
        plan.Plan.from_dict({**data, "version": 1})
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['groups'\]"):
        plan.Plan.from_dict({k: v for k, v in data.items() if k != "groups"})
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        plan.Plan.from_dict({**data, "groups": [{**data["groups"][0], "strategy": "zip"}]})
    # Fields of another type: named as such, not torn down by a bare TypeError or coerced.
    for broken in ({"groups": None}, {"alternatives": []}, {"meta": 5}):
        with pytest.raises(ValueError, match="not of the type a plan writes"):
            plan.Plan.from_dict({**data, **broken})
    for world_size in (2.9, True):
        with pytest.raises(ValueError, match=f"world_size {world_size} is not an integer"):
            plan.Plan.from_dict({**data, "world_size": world_size})


def test_check_refuses_a_plan_for_another_model_or_one_that_does_not_cover_it() -> None:
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    sizes = [p.numel() for p in net.parameters()]
    good = plan.Plan(plan.signature(net), 2, (plan.GroupPlan((3, 2, 1, 0), sum(sizes), "fp16"),))
    good.check(net, 2)
    other = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    with pytest.raises(ValueError, match="made for another model"):
        good.check(other, 2)
    missing = dataclasses.replace(good, groups=(plan.GroupPlan((3, 2, 1), sum(sizes[1:]), "fp16"),))
    with pytest.raises(ValueError, match=r"parameters \[0\] are in no group"):
        missing.check(net, 2)
    wrong = dataclasses.replace(good, groups=(plan.GroupPlan((3, 2, 1, 0), 7, "fp16"),))
    with pytest.raises(ValueError, match="says 7 elements"):
        wrong.check(net, 2)
    with pytest.raises(ValueError, match="made for 2 ranks but runs on 4"):
        good.check(net, 4)
    assert plan.signature(net) == plan.signature(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    assert torch.is_grad_enabled()
