"""Merge scheduling (MergeComp): how many groups to cut the gradients into, and where.

Merging gradients into fewer, larger groups pays a codec's and a collective's fixed costs fewer
times; cutting them into more groups lets exchanges start earlier, beside the backward pass.
MergeComp binary-searched one cut (two groups) on measured steps; here the number of groups and
every cut point are searched on the planner's timeline (sim/quick.py), each grouping with its own
per-group strategies (gradsync.planner.decide), so merging and choosing strategies are one search:

  1. counts: 1, 2, 3, 4, 6, 8, 12, ... groups up to `max_groups`, each cut into groups of about
     equal size (sim/groups.equal), and DDP's own buckets;
  2. cut points: from the best of those, every cut moves to the tensor boundaries `stride` away,
     `stride` halving from a quarter of a group down to one tensor, a move kept when it shortens
     the predicted step, until no move helps or `budget` groupings have been decided.

Everything is a pure function of the compute timeline and the cluster: the same inputs give the
same schedule, on every rank.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from . import levels, planner
from .sim import groups as grouping
from .sim.cluster import Cluster
from .sim.compute import Compute
from .strategy import Strategy

COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class Candidate:
    """A grouping with its per-group strategies and their predicted step."""

    label: str
    groups: tuple[tuple[int, ...], ...]
    decision: planner.Decision

    @property
    def step_s(self) -> float:
        return self.decision.step_s


@dataclass(frozen=True)
class Schedule:
    """The best grouping found, and every grouping the search decided, best first."""

    best: Candidate
    tried: tuple[Candidate, ...]
    seconds: float


def search(
    compute: Compute,
    cluster: Cluster,
    strategies: Sequence[Strategy],
    max_groups: int = 64,
    budget: int = 200,
    buckets: Sequence[Sequence[int]] | None = None,
    errors: levels.Errors | None = None,
) -> Schedule:
    """Search groupings of `compute`'s gradients, each with the planner's strategies (module
    docstring); at most `budget` groupings are decided. `buckets` are DDP's buckets (default:
    sim/groups.ddp's model of them): a group that is not one of them pays for its copies.
    `errors`: measured compression errors; each grouping's lossy levels are then kept within
    their budget (gradsync.levels).

    Example:
        >>> found = search(work, where, planner.space(where, "topk", {"ratio": 0.01}))
        >>> found.best.groups, [s.text for s in found.best.decision.strategies]
    """
    if max_groups < 1 or budget < 1:
        raise ValueError(f"max_groups={max_groups} and budget={budget} must both be >= 1")
    started = time.perf_counter()
    numels = compute.numels
    cache: dict = {}
    buckets = grouping.ddp(numels) if buckets is None else [list(b) for b in buckets]
    tried: dict[tuple[tuple[int, ...], ...], Candidate] = {}

    def consider(label: str, groups: list[list[int]]) -> Candidate:
        key = tuple(tuple(g) for g in groups)
        if key not in tried:
            problem = planner.Problem(compute, cluster, groups, strategies, cache, buckets, errors)
            decision = planner.decide(problem)
            tried[key] = Candidate(label, key, decision)
        return tried[key]

    if len(buckets) <= max_groups:
        consider("DDP's buckets", buckets)
    for count in COUNTS:
        if count > min(len(numels), max_groups) or len(tried) >= budget:
            break
        consider(f"{count} equal groups", grouping.equal(numels, count))

    best = min(tried.values(), key=lambda c: c.step_s)
    cuts = list(itertools.accumulate(len(g) for g in best.groups[:-1]))
    stride = max(1, len(numels) // (4 * len(best.groups)))
    while stride >= 1 and len(tried) < budget and cuts:
        improved = False
        for j in range(len(cuts)):
            low = cuts[j - 1] + 1 if j else 1
            high = cuts[j + 1] - 1 if j + 1 < len(cuts) else len(numels) - 1
            for moved in (cuts[j] - stride, cuts[j] + stride):
                if not low <= moved <= high or len(tried) >= budget:
                    continue
                trial = [*cuts[:j], moved, *cuts[j + 1 :]]
                candidate = consider(
                    f"{len(cuts) + 1} groups, cuts moved", grouping.from_cuts(len(numels), trial)
                )
                if candidate.step_s < best.step_s * (1 - planner.TIE):
                    best, cuts, improved = candidate, trial, True
                    break
        if not improved:
            stride //= 2
    ranked = tuple(sorted(tried.values(), key=lambda c: c.step_s))
    return Schedule(best, ranked, time.perf_counter() - started)
