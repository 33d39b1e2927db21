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
# Error steps per budget in the dynamic program: what a group's level loses beyond the user's level
# on it is rounded up to a step, so the plan's measured error never exceeds the budget, and levels
# whose errors differ by less than a thousandth of it may tie.
STEPS = 1000
EXACT = "exact"  # a group exchanged without a lossy codec (fp32 or a cast): no error counted


def specs(name: str, args: Mapping[str, Any] | None = None) -> list[str]:
    """The levels of codec `name` as strategy specs, finest first; the one with `args` (the
    user's) among them. A ladder's levels keep the user's other arguments; a family's siblings
    (int8 beside int4) take their own defaults.

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
    each gradient (in the order of the planner's gradients), and `own`, the level the user asked
    for, whose total over every gradient is the budget. A gradient that was not measured has
    error 0 at `own` and infinite error at every other level: it keeps the user's level."""

    by_spec: Mapping[str, tuple[float, ...]]
    own: str

    @property
    def budget(self) -> float:
        return math.fsum(self.by_spec[self.own])

    def of(self, spec: str, gradients: Sequence[int]) -> float:
        """The error of `spec` on a group of `gradients`: the sum of its gradients' errors (0 for
        the exact exchanges, infinite for a lossy level that was not measured)."""
        if not is_lossy(spec):
            return 0.0
        errors = self.by_spec.get(spec)
        return math.inf if errors is None else math.fsum(errors[i] for i in gradients)

    def fits(self, spec: str, gradients: Sequence[int]) -> bool:
        """Whether `spec` on `gradients` loses no more than the user's level on them."""
        return self.of(spec, gradients) <= self.of(self.own, gradients)


def choose(costs: np.ndarray, errors: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Each group's option (column) of least total cost whose total error stays within the total of
    `reference`, the user's level's error on each group.

    `costs` and `errors` are (groups, options); infinite costs mark options a group cannot take.
    The program runs over each option's error minus the group's reference, in STEPS steps of the
    budget, rounded up: the total never exceeds the budget, and the user's own level everywhere
    (0 steps a group) always fits, as does any option losing no more than it. Non-finite errors
    never fit. Ties keep the earlier option.

    Example:
        >>> costs, errors = np.array([[3.0, 1.0], [3.0, 1.0]]), np.array([[0.0, 1.0], [0.0, 1.0]])
        >>> choose(costs, errors, reference=np.array([0.5, 0.5]))
        array([1, 0])
    """
    groups, options = costs.shape
    budget = float(np.sum(reference))
    delta = errors - reference[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled = delta / budget * STEPS if budget > 0 else np.where(delta > 0, np.inf, 0.0)
    scaled = np.where(np.isfinite(scaled), scaled, STEPS + 1)
    units = np.ceil(np.clip(scaled, -STEPS, STEPS + 1) - 1e-9).astype(int)
    # best[STEPS + s]: least cost of the groups so far whose error totals s steps over the budget's
    # share so far (s in -STEPS .. STEPS: beyond STEPS no later credit can bring it back within);
    # choice[g, STEPS + s] the option group g took there.
    width = 2 * STEPS + 1
    best = np.full(width, np.inf)
    best[STEPS] = 0.0
    choice = np.zeros((groups, width), dtype=int)
    for g in range(groups):
        trial = np.full((options, width), np.inf)
        for o in range(options):
            u = int(units[g, o])
            if abs(u) <= STEPS and np.isfinite(costs[g, o]):
                if u >= 0:
                    trial[o, u:] = best[: width - u] + costs[g, o]
                else:
                    trial[o, :u] = best[-u:] + costs[g, o]
        choice[g] = np.argmin(trial, axis=0)  # the first least: earlier options win ties
        best = trial[choice[g], np.arange(width)]
    k = int(np.argmin(best[: STEPS + 1]))  # within the budget: s <= 0
    if not np.isfinite(best[k]):
        raise ValueError(
            "no option fits every group: give each group one that loses no more than its reference"
        )
    picked = np.zeros(groups, dtype=int)
    for g in reversed(range(groups)):
        picked[g] = choice[g, k]
        k -= int(units[g, picked[g]])
    return picked


def is_lossy(spec: str) -> bool:
    """Whether a strategy's codec counts against the budget: everything but fp32 and the casts
    (and EXACT, which stands for them in `allowed`)."""
    return spec.split(":")[0] not in (NONE, "fp16", "bf16", EXACT)


def allowed(
    spec_of: Sequence[str],
    groups: Sequence[Sequence[int]],
    costs: np.ndarray,
    valid: np.ndarray,
    errors: Errors,
) -> np.ndarray:
    """`valid` (groups, strategies) narrowed so that each group's lossy strategies are those of one
    level, chosen by `choose` within errors.budget (the user's level on every group fits):
    `spec_of[j]` is strategy j's codec spec, `costs[g, j]` what group g's exchange by strategy j
    costs. The exact strategies stay open to every group; a lossy spec that was not measured is
    open to none."""
    lossy = list(dict.fromkeys(s for s in spec_of if is_lossy(s)))
    options = [EXACT, *lossy]
    option_of = np.array([options.index(s) if is_lossy(s) else 0 for s in spec_of])
    open_costs = np.where(valid, costs, np.inf)
    option_costs = np.full((len(groups), len(options)), np.inf)
    for o in range(len(options)):
        members = option_of == o
        if members.any():
            option_costs[:, o] = open_costs[:, members].min(axis=1)
    option_errors = np.array([[errors.of(level, group) for level in options] for group in groups])
    reference = np.array([errors.of(errors.own, group) for group in groups])
    picked = choose(option_costs, option_errors, reference)
    return valid & ((option_of[None, :] == 0) | (option_of[None, :] == picked[:, None]))
