"""Error-aware levels: how lossy each group's codec may be (L-GreCo's choice, on gradsync's costs).

A codec comes in levels: top-k's ratio, PowerSGD's rank, QSGD's levels, 8 or 4 bits. Where a
uniform level is what the user asked for, groups differ in what a level costs them (a small group
pays a collective's latency whatever it sends) and in what it loses (some layers' gradients are
nearly low-rank, others are not). L-GreCo (Alimohammadi et al., "L-GreCo: Layerwise-Adaptive
Gradient Compression for Efficient and Accurate Deep Learning", MLSys 2024) picks a level per layer
that minimises the total cost while the total compression error stays within that of the uniform
level, by a dynamic program over the error, discretized.

Here the error of each level on each gradient is measured on the model's own gradients (plan="auto"
does so in its first steps: gradsync.tuner), a group's error is the sum over its gradients, and a
group's cost under a level is what the planner's timeline charges its exchange (every resource's
seconds, gradsync.sim.quick). `choose` returns each group's level; the planner then decides
per group among that level and the exact exchanges (fp32, fp16, bf16), which add no error worth
counting, so the plan it makes stays within the budget.

Pure functions of numbers: the planning layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import compress
from .strategy import NONE

# Each codec's levels, finest first: the argument that sets how much it sends, and its values.
# A codec of a family (int8, int4) has its siblings as levels.
LADDERS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "topk": ("ratio", (0.1, 0.03, 0.01, 0.003, 0.001)),
    "randk": ("ratio", (0.1, 0.03, 0.01, 0.003, 0.001)),
    "dgc": ("ratio", (0.01, 0.003, 0.001, 0.0003)),
    "qsgd": ("levels", (127, 31, 7, 3, 1)),
    "powersgd": ("rank", (32, 16, 8, 4, 2, 1)),
}
FAMILIES: tuple[tuple[str, ...], ...] = (("int8", "int4"),)
# Error steps per budget in the dynamic program: a group's error is rounded up to a step, so the
# plan's measured error never exceeds the budget, and levels whose errors differ by less than a
# thousandth of it may tie.
STEPS = 1000
EXACT = "exact"  # a group exchanged without a lossy codec (fp32 or a cast): no error counted


def specs(name: str, args: Mapping[str, Any] | None = None) -> list[str]:
    """The levels of codec `name` as strategy specs, finest first; the one with `args` (the
    user's) among them, with the user's other arguments kept in every level.

    Example:
        >>> specs("topk", {"ratio": 0.01})
        ['topk:ratio=0.1', 'topk:ratio=0.03', 'topk:ratio=0.01', 'topk:ratio=0.003', 'topk:ratio=0.001']
    """
    args = dict(args or {})
    own = spec(name, args)
    if name in LADDERS:
        key, values = LADDERS[name]
        mine = args.get(key, compress.parameters(name)[key])
        ordered = sorted({*values, mine}, reverse=True)  # a larger value sends more: finest first
        return [own if value == mine else spec(name, {**args, key: value}) for value in ordered]
    for family in FAMILIES:
        if name in family:
            return [own if member == name else member for member in family]
    return [own]


def spec(name: str, args: Mapping[str, Any]) -> str:
    """The strategy spec of codec `name` with `args`: `topk:ratio=0.01` (as Strategy.spec)."""
    return ":".join([name, *(f"{k}={v}" for k, v in sorted(args.items()))])


@dataclass(frozen=True)
class Errors:
    """Measured compression errors: for each level (a spec), the squared error ||g - C(g)||^2 of
    each gradient (in the order of the planner's gradients), and the budget: the total error of
    the uniform level the user asked for."""

    by_spec: Mapping[str, tuple[float, ...]]
    budget: float

    def of(self, spec: str, gradients: Sequence[int]) -> float:
        """The error of `spec` on a group of `gradients`: the sum of its gradients' errors."""
        errors = self.by_spec[spec]
        return math.fsum(errors[i] for i in gradients)

    def fits(self, spec: str, gradients: Sequence[int]) -> bool:
        """Whether `spec` on all of `gradients` stays within the budget (exact specs always do;
        a lossy one that was not measured never does)."""
        if not is_lossy(spec):
            return True
        return spec in self.by_spec and self.of(spec, gradients) <= self.budget


def choose(costs: np.ndarray, errors: np.ndarray, budget: float) -> np.ndarray:
    """Each group's option (column) of least total cost whose total error stays within `budget`.

    `costs` and `errors` are (groups, options); option 0 must be exact (no error): it always fits,
    so there is always an answer. A dynamic program over the error in STEPS steps of the budget,
    each group's error rounded up (so the total never exceeds the budget); infinite costs mark
    options a group cannot take. Ties keep the earlier option.

    Example:
        >>> choose(np.array([[3.0, 1.0], [3.0, 1.0]]), np.array([[0.0, 1.0], [0.0, 1.0]]), 1.0)
        array([1, 0])
    """
    groups, options = costs.shape
    if budget <= 0:
        units = np.where(errors > 0, STEPS + 1, 0)
    else:
        units = np.ceil(np.clip(errors / budget, 0, 2) * STEPS - 1e-9).astype(int)
    # best[k]: least cost of the groups so far with at most k steps of error; choice[g, k] the
    # option group g took in it.
    best = np.zeros(STEPS + 1)
    choice = np.zeros((groups, STEPS + 1), dtype=int)
    for g in range(groups):
        trial = np.full((options, STEPS + 1), np.inf)
        for o in range(options):
            u = units[g, o]
            if u <= STEPS and np.isfinite(costs[g, o]):
                trial[o, u:] = best[: STEPS + 1 - u] + costs[g, o]
        choice[g] = np.argmin(trial, axis=0)  # the first least: earlier options win ties
        best = trial[choice[g], np.arange(STEPS + 1)]
    picked = np.zeros(groups, dtype=int)
    k = STEPS
    for g in reversed(range(groups)):
        picked[g] = choice[g, k]
        k -= units[g, picked[g]]
    return picked


def is_lossy(spec: str) -> bool:
    """Whether a strategy's codec counts against the budget: everything but fp32 and the casts."""
    return spec.split(":")[0] not in (NONE, "fp16", "bf16")


def allowed(
    spec_of: Sequence[str],
    groups: Sequence[Sequence[int]],
    costs: np.ndarray,
    valid: np.ndarray,
    errors: Errors,
) -> np.ndarray:
    """`valid` (groups, strategies) narrowed so that each group's lossy strategies are those of one
    level, chosen by `choose` within errors.budget: `spec_of[j]` is strategy j's codec spec,
    `costs[g, j]` what group g's exchange by strategy j costs. The exact strategies stay open to
    every group. A lossy spec that was not measured is open to none."""
    lossy = list(dict.fromkeys(s for s in spec_of if is_lossy(s)))
    options = [EXACT, *lossy]
    option_of = np.array([options.index(s) if is_lossy(s) else 0 for s in spec_of])
    open_costs = np.where(valid, costs, np.inf)
    option_costs = np.full((len(groups), len(options)), np.inf)
    option_errors = np.zeros((len(groups), len(options)))
    for o, level in enumerate(options):
        members = option_of == o
        if members.any():
            option_costs[:, o] = open_costs[:, members].min(axis=1)
        if level != EXACT:
            if level not in errors.by_spec:
                option_costs[:, o] = np.inf
                continue
            option_errors[:, o] = [errors.of(level, group) for group in groups]
    picked = choose(option_costs, option_errors, errors.budget)
    return valid & ((option_of[None, :] == 0) | (option_of[None, :] == picked[:, None]))
