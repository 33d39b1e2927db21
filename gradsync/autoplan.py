"""Plans made from a compute timeline and a cluster: merge scheduling, then per-group strategies,
checked by the event simulator; and the candidates plan="auto" confirms on real steps.

Pure functions of numbers (the planning layer): gradsync.tuner measures the first steps of a run
and hands the numbers in as a Measured; gradsync plan and the benchmarks call make() directly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import levels, planner, schedule
from .config import AUTO_CASTS, NO_COMPRESSION, SyncConfig
from .plan import GroupPlan, Plan
from .sim import cluster as clusters
from .sim import engine
from .sim import groups as grouping
from .sim.cluster import Cluster
from .sim.compute import Compute
from .strategy import NONE, Strategy, parse

CANDIDATES = 4  # plans confirmed on real steps
# A plan predicted to step over this many times the best predicted plan's step is not tried: it
# could win only where the best's prediction was a third too short and its own a third too long at
# once, each the simulator's largest error against the testbed (33%, docs/simulator.md; median
# 12%), and its three real steps would each cost about that much more (fp32 on mlp-wide at 1
# Gbit/s: three times int4's step). The config's own fixed strategy is tried whatever its
# prediction, so that auto never adopts a plan that measured slower than it.
TRIED_WITHIN = 2.0
# A runner-up measured within this fraction of the fastest candidate is tried again against it: two
# counted steps each cannot tell apart plans closer than a step's noise on a busy host (a 1.3%
# difference once adopted int8 for a model whose int4 ran 12% faster once warmed up).
RUNOFF_MARGIN = 0.10


# The schedule's best groupings the event simulator checks before one becomes the plan.
CHECKED_CANDIDATES = 5


def make(
    compute: Compute,
    cluster: Cluster,
    compressor: str | None = None,
    compressor_args: Mapping[str, Any] | None = None,
    model: str = "",
    params: Sequence[int] | None = None,
    max_groups: int = 64,
    budget: int = 200,
) -> Plan:
    """The plan for `compute` on `cluster`: groups from the merge scheduler, strategies from the
    planner, chosen among fp32, fp16, bf16 and `compressor` (with its arguments) in every
    exchange it allows; the first of make_all's.

    Example:
        >>> from gradsync.sim import cluster, compute, models
        >>> where = cluster.cluster(8, 8, "v100", "25gbit")
        >>> work = compute.from_model(models.build("bert-base"), where.device)
        >>> print(make(work, where, "topk", {"ratio": 0.01}, model="sim:bert-base").describe())
    """
    return make_all(compute, cluster, compressor, compressor_args, model, params, max_groups, budget)[0]


def make_all(
    compute: Compute,
    cluster: Cluster,
    compressor: str | None = None,
    compressor_args: Mapping[str, Any] | None = None,
    model: str = "",
    params: Sequence[int] | None = None,
    max_groups: int = 64,
    budget: int = 200,
    buckets: Sequence[Sequence[int]] | None = None,
    errors: levels.Errors | None = None,
) -> list[Plan]:
    """Every plan the event simulator weighed, least predicted step first (ties: as found).

    The schedule's best few groupings (each with the planner's strategies) and every uniform
    strategy on DDP's buckets (as a fixed configuration runs) are laid out by the event simulator
    (sim/engine.py, which models what the planner's fast timeline leaves out: two-level
    pipelining, measured contention), so the first plan is never predicted slower than the best
    uniform strategy. Each plan's `alternatives` holds the predicted step of every option, and
    of `compressor` layer-wise and in one group (MergeComp's comparison). `params` maps each
    gradient (backprop order) to its position in model.parameters() (default: the same index);
    `model` is the model's signature(). `buckets` are DDP's real buckets as gradient indices, where
    known (default: sim/groups.ddp's model of them): uniform strategies are laid out on them, and
    every other group pays for the hook's copies out of them and back. `errors`: the measured
    compression errors of every level of `compressor` (gradsync.levels); with them, each group
    may take any level, and every plan keeps the total error within errors.budget, the error of
    `compressor` everywhere.
    """
    started = time.perf_counter()
    if buckets is None:
        buckets = grouping.ddp(compute.numels)
    else:
        buckets = [list(b) for b in buckets]
        grouping.check(buckets, len(compute.numels))
    whole = {(b[0], b[-1]) for b in buckets}

    def simulate(chosen: Strategy | list[Strategy], groups: list[list[int]]) -> float:
        copied = [(g[0], g[-1]) not in whole for g in groups]
        return engine.simulate(compute, cluster, chosen, groups, copied=copied).step_s

    strategies = planner.space(cluster, compressor, dict(compressor_args or {}), levels=errors is not None)
    found = schedule.search(compute, cluster, strategies, max_groups, budget, buckets, errors)
    searched_s = time.perf_counter() - started

    options: list[tuple[float, str, list[list[int]], list[Strategy], list[str]]] = []
    for rank, candidate in enumerate(found.tried[:CHECKED_CANDIDATES], start=1):
        groups = [list(g) for g in candidate.groups]
        chosen = list(candidate.decision.strategies)
        label = f"per-group plan {rank} ({candidate.label})"
        options.append((simulate(chosen, groups), label, groups, chosen, list(candidate.decision.reasons)))
    alternatives: dict[str, float] = {"per-group plan": min(option[0] for option in options)}
    has_rows = any(g.density for g in compute.gradients)
    everything = range(len(compute.gradients))
    for strategy in strategies:
        if strategy.scheme is not None and not strategy.compressed and not has_rows:
            continue  # no embedding rows to send sparsely
        if errors is not None and not errors.fits(strategy.spec, everything):
            continue  # a uniform level lossier than the budget allows
        step = simulate(strategy, buckets)
        label = f"{strategy.text}, DDP buckets"
        alternatives[label] = step
        reason = f"uniform {strategy.text} on DDP's buckets"
        options.append((step, label, buckets, [strategy] * len(buckets), [reason] * len(buckets)))
    if compressor and compressor != NONE:
        spec = ":".join([compressor, *(f"{k}={v}" for k, v in sorted((compressor_args or {}).items()))])
        codec = parse(spec)  # with its default exchange
        count = len(compute.numels)
        for label, groups in (
            ("layer-wise", grouping.layerwise(count)),
            ("one group", grouping.single(count)),
        ):
            alternatives[f"{codec.text}, {label}"] = simulate(codec, groups)
    index = list(params) if params is not None else list(range(len(compute.gradients)))
    meta = {
        "cluster": cluster.describe(),
        "model_name": compute.name,
        "compressor": compressor or "none",
        "compressor_args": dict(compressor_args or {}),
        "groupings_tried": len(found.tried),
        "search_s": searched_s,
        "decision_s": found.best.decision.seconds,
        "planner_step_s": found.best.step_s,
    }
    plans, seen = [], set()
    for step, label, groups, chosen, reasons in sorted(options, key=lambda option: option[0]):
        key = (tuple(map(tuple, groups)), tuple(chosen))
        if key in seen:
            continue  # the same plan found twice (a grouping the search and DDP share)
        seen.add(key)
        plan_groups = tuple(
            GroupPlan(
                tuple(index[i] for i in group),
                sum(compute.gradients[i].numel for i in group),
                strategy.text,
                reason,
                tuple(compute.gradients[i].name for i in group),
            )
            for group, strategy, reason in zip(groups, chosen, reasons, strict=True)
        )
        about = {**meta, "chosen": label}
        if errors is not None:  # the plan's measured compression error against its budget
            lossy = [(s.spec, g) for s, g in zip(chosen, groups, strict=True) if levels.is_lossy(s.spec)]
            about["error"] = math.fsum(errors.by_spec[spec][i] for spec, group in lossy for i in group)
            about["error_budget"] = errors.budget
        plans.append(Plan(model, cluster.world_size, plan_groups, step, None, alternatives, about))
    return plans


def codec_specs(config: SyncConfig) -> list[str]:
    """The codecs the strategy space may use: the casts and every level of the config's compressor
    (gradsync.levels), the config's own among them."""
    specs = list(AUTO_CASTS)
    if config.compressor not in (NO_COMPRESSION, *specs):
        specs += levels.specs(config.compressor, config.compressor_args)
    return specs


@dataclass(frozen=True)
class Measured:
    """What the first steps measured, the same on every rank: the planner's inputs."""

    compute: Compute
    cluster: clusters.Cluster
    params: tuple[int, ...]  # position in model.parameters() of each gradient, backprop order
    # Each level's compression error on each gradient (backprop order) and the budget, where
    # measured: the planner then keeps every plan's error within it.
    errors: levels.Errors | None = None


def candidates(
    measured: Measured,
    config: SyncConfig,
    model_signature: str,
    buckets: Sequence[Sequence[int]] | None = None,
) -> list[Plan]:
    """The plans to confirm on real steps, at most CANDIDATES of them: the best predicted plan, what
    the config runs without a plan (its compressor by its own exchange on DDP's buckets), the best
    that compresses and the best that does not (whichever of those the first ones are not), the
    best uniform strategy on DDP's buckets, and the next best predicted. So the measurement decides
    against the fixed configuration, and between compressing and not where the prediction could
    err that far: a plan predicted over TRIED_WITHIN times the best's step is left out (the fixed
    configuration never is). `buckets`: DDP's buckets, as parameter positions, where seen."""
    compressor = None if config.compressor == NO_COMPRESSION else config.compressor
    ranked = make_all(
        measured.compute,
        measured.cluster,
        compressor,
        dict(config.compressor_args),
        model=model_signature,
        params=measured.params,
        buckets=_as_gradients(buckets, measured.params),
        errors=measured.errors,
    )

    def compresses(plan: Plan) -> bool:
        return any(s.compressed for s in plan.strategies)

    # What the config runs without a plan: its compressor by its own exchange on every group.
    fixed = parse(levels.spec(config.compressor, config.compressor_args))
    own = next((p for p in ranked if all(s == fixed for s in p.strategies)), None)
    slowest_s = TRIED_WITHIN * (ranked[0].predicted_step_s or math.inf)
    worth = [p for p in ranked if p is own or (p.predicted_step_s or 0.0) <= slowest_s]
    picks = [
        worth[0],
        own,
        next((p for p in worth if compresses(p)), None),
        next((p for p in worth if not compresses(p)), None),  # fp32 on DDP's buckets, unless far slower
        next((p for p in worth if str(p.meta.get("chosen", "")).endswith("DDP buckets")), None),
        *worth[1:],
    ]
    chosen: list[Plan] = []
    for plan in picks:
        if plan is not None and plan not in chosen and len(chosen) < CANDIDATES:
            chosen.append(plan)
    return chosen


def runoff(measured_s: Sequence[float]) -> tuple[int, int] | None:
    """The two candidates to try again where the runner-up's measured time (each candidate's
    least) is within RUNOFF_MARGIN of the fastest's; None where one stands clear. They run in the
    reverse of their first order, so each has an earlier and a later turn: a run's first steps
    are its slowest, and the later turn would favour whoever has it twice."""
    ranked = sorted((t, c) for c, t in enumerate(measured_s) if math.isfinite(t))
    if len(ranked) < 2 or ranked[1][0] > ranked[0][0] * (1 + RUNOFF_MARGIN):
        return None
    pair = ranked[0][1], ranked[1][1]
    return max(pair), min(pair)


def _as_gradients(buckets: Sequence[Sequence[int]] | None, params: Sequence[int]) -> list[list[int]] | None:
    """DDP's buckets (parameter positions) as runs of gradient indices in the measured backprop
    order; None where they are not such runs (a gradient measured ready out of bucket order)."""
    if not buckets:
        return None
    where = {param: i for i, param in enumerate(params)}
    groups = sorted(([where.get(p, -1) for p in bucket] for bucket in buckets), key=lambda g: g[0])
    flat = [i for g in groups for i in g]
    return groups if flat == list(range(len(params))) else None
