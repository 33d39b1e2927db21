"""The planner: which strategy each group of gradients is exchanged by (Espresso's decision).

Given the compute timeline, a cluster and a grouping, it picks for every group one strategy from
the strategy space (`space`): none (fp32), fp16 or bf16 allreduce, or the user's compressor with each
collective it can use, on the device or offloaded to CPU threads where there is a GPU. Compression
pays only where it shortens the step: on a fast network, for small groups, or where a group's
transfer hides behind the backward pass anyway, fp32 wins.

The decision (Espresso, EuroSys'23, section 4.4), on the timeline of sim/quick.py:
  1. Every group starts as fp32. Groups are visited largest first; of equal sizes, the one
     nearest the output first (earliest in backprop order). That is the tie order.
  2. Before each visit, bubble pruning: where the network idles waiting for a later group's data,
     every fp32 group whose transfer ended before that bubble stays fp32 for good: compressing it
     would only widen the gap (and delay the backward pass). It is re-run after every decision,
     since each decision moves the bubbles.
  3. A visited group tries every strategy of the space that runs on the device, the others fixed,
     and keeps the one of least predicted step; a tie keeps the earlier in the space's order,
     which lists fp32 first and cheaper codecs before dearer ones.
  4. CPU offload (Espresso's Algorithm 2): groups compressed on the device are put in classes of
     equal size and strategy; within a class, offloading the groups farthest from the output is
     best (Lemma 1), so only the count per class matters. Every vector of counts is tried where
     there are at most OFFLOAD_EXACT_LIMIT of them; beyond that, one class at a time, largest
     groups first, each taking its best count given the counts chosen before it (one pass).

`decide` returns the strategies with the reason for each; `brute_force` enumerates every
assignment of small instances, the reference the tests and `gradsync bench plan` compare with.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from . import compress
from . import levels as codec_levels
from .sim import quick
from .sim.cluster import CPU_HOST, Cluster
from .sim.compute import Compute
from .strategy import NONE, Strategy, default_collective, parse, sums, two_shot

# Count vectors tried exactly by the offload step; larger instances go class by class.
OFFLOAD_EXACT_LIMIT = 1024
# Relative step difference below which two choices tie (the earlier in the space's order wins).
TIE = 1e-9
_CASTS = ("fp16", "bf16")


def space(
    cluster: Cluster,
    compressor: str | None = None,
    compressor_args: dict | None = None,
    levels: bool = False,
) -> list[Strategy]:
    """The strategies a group may take on `cluster`, none (fp32) first.

    none, fp16 and bf16 allreduce; then, for `compressor` (with its arguments), every exchange its
    payload allows: allreduce where ranks sum its payloads, two-shot where a shard's sum can be
    encoded again, allgather where each payload can be decoded alone, the sparse schemes
    (scheme=auto) where its payload is sparse rows, and two-level where nodes have several workers;
    and each of those offloaded to CPU threads where the workers compute on GPUs. With `levels`,
    all of that for every level of the codec (gradsync.levels: top-k's ratios, PowerSGD's ranks,
    int8 beside int4), for a planner that is given the measured errors to keep within a budget.
    On a measured cluster, only codecs whose cost the profile measured.

    Example:
        >>> from gradsync.sim import cluster
        >>> [s.text for s in space(cluster.cluster(1, 2), "topk", {"ratio": 0.01})][:4]
        ['none', 'fp16', 'bf16', 'topk:ratio=0.01']
    """
    found = [parse(NONE), *(parse(cast) for cast in _CASTS)]
    two_level = cluster.nodes > 1 and cluster.gpus_per_node > 1
    if compressor and compressor not in (*_CASTS, NONE):
        args = tuple(sorted((compressor_args or {}).items()))
        own = Strategy(compressor, args, default_collective(compressor))
        each = [own]
        if levels:
            each = [
                own if spec == own.spec else parse(spec)
                for spec in codec_levels.specs(compressor, compressor_args)
            ]
        for level in each:  # the levels of the codec (error-aware planning), or the user's alone
            found += _ways(level, two_level)
    if two_level:
        found += [replace(s, collective="two-level") for s in found[: 1 + len(_CASTS)]]
    if cluster.device.name != CPU_HOST.name:  # GPUs: a CPU thread is somewhere else to compress
        found += [replace(s, on="cpu") for s in found if s.compressed and s.codec not in _CASTS]
    if cluster.compression is not None:  # measured: only what was measured
        found = [s for s in found if not s.compressed or s.spec in cluster.compression]
    return found


def _ways(level: Strategy, two_level: bool) -> list[Strategy]:
    """Every exchange `level`'s codec (with its arguments) allows."""
    name, args = level.codec, level.args
    codec = type(compress.build(name, **dict(args)))
    ways = [Strategy(name, args, "allreduce")] if sums(codec) else []
    if two_shot(codec) and not codec.summable:  # summable payloads are simply allreduced
        ways.append(Strategy(name, args, "two-shot"))
    if codec.rounds == 1 and not codec.majority_vote:
        ways.append(Strategy(name, args, "allgather"))
    if codec.sparse_rows:
        ways.append(Strategy(name, args, "allgather", scheme="auto"))
    if two_level:
        ways.append(Strategy(name, args, "two-level"))
    return ways


@dataclass(frozen=True)
class Decision:
    """One strategy per group, why, and the planner's predicted step."""

    strategies: tuple[Strategy, ...]
    reasons: tuple[str, ...]
    step_s: float  # sim/quick.py's prediction
    fp32_step_s: float  # ... of fp32 for every group
    evaluations: int  # assignments laid out
    seconds: float  # time the decision took


class Problem:
    """A grouping on a cluster with its candidates' costs: what decide and brute_force search."""

    def __init__(
        self,
        compute: Compute,
        cluster: Cluster,
        groups: Sequence[Sequence[int]],
        strategies: Sequence[Strategy],
        cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] | None = None,
        buckets: Sequence[Sequence[int]] | None = None,
        errors: codec_levels.Errors | None = None,
    ) -> None:
        """`cache`, shared between problems of the same compute, cluster, strategies and buckets,
        keeps each group's costs by its (first, last) gradient: a grouping search re-costs only new
        groups. `buckets`: DDP's buckets; a group that is not one of them is copied out of them and
        back (strategy.copy_phases). None: no copies are counted."""
        if not strategies or strategies[0].compressed:
            raise ValueError("the strategy space must list fp32 first (planner.space does)")
        self.compute, self.cluster = compute, cluster
        self.groups = [list(g) for g in groups]
        self.space = list(strategies)
        self.numels = [sum(compute.gradients[i].numel for i in g) for g in self.groups]
        whole = None if buckets is None else {(b[0], b[-1]) for b in buckets}
        self.copied = [whole is not None and (g[0], g[-1]) not in whole for g in self.groups]
        self.ready = quick.ready_times(compute, self.groups)
        cache = {} if cache is None else cache
        rows = []
        for i, group in enumerate(self.groups):
            key = (group[0], group[-1])
            if key not in cache:
                cache[key] = self._cost(group, self.numels[i], self.copied[i])
            rows.append(cache[key])
        self.costs = np.array([costs for costs, _ in rows])  # (groups, space, 5)
        self.valid = np.array([valid for _, valid in rows])  # (groups, space)
        if errors is not None:  # each group's lossy codec at one level, within the error budget
            specs = [strategy.spec for strategy in self.space]
            self.valid = codec_levels.allowed(specs, self.groups, self.costs.sum(-1), self.valid, errors)
        self.columns = np.ascontiguousarray(np.moveaxis(self.costs, -1, 0))  # (5, groups, space)
        self._rows = np.arange(len(self.groups))
        self.evaluations = 0

    def _cost(self, group: list[int], numel: int, copied: bool) -> tuple[np.ndarray, np.ndarray]:
        """One group's cost vector under each strategy, and which strategies it may take."""
        sparse = [self.compute.gradients[t] for t in group if self.compute.gradients[t].density]
        costs = np.zeros((len(self.space), len(quick.COLUMNS)))
        valid = np.ones(len(self.space), dtype=bool)
        for j, strategy in enumerate(self.space):
            if strategy.scheme is not None and not strategy.compressed and not sparse:
                valid[j] = False  # no embedding rows to send sparsely
                continue
            costs[j] = quick.cost_vector(strategy, numel, self.cluster, sparse, copied)
        return costs, valid

    def layout(self, assignments: np.ndarray, offloads: bool = True) -> quick.Layout:
        """Lay out each row of `assignments` (rows, groups): indices into the space. `offloads`
        False promises that none of them offloads a codec to the CPU."""
        assignments = np.atleast_2d(assignments)
        self.evaluations += assignments.shape[0]
        columns = self.columns[:, self._rows, assignments]
        return quick.layout_columns(self.compute, self.ready, columns, self.cluster.cpu_threads, offloads)

    def step(self, assignment: np.ndarray) -> float:
        return float(self.layout(assignment).step_s[0])


def decide(problem: Problem) -> Decision:
    """Espresso's greedy decision with bubble pruning, then the CPU offload (module docstring).

    Example:
        >>> decision = decide(Problem(work, where, groups, space(where, "topk", {"ratio": 0.01})))
        >>> [s.text for s in decision.strategies]
    """
    started = time.perf_counter()
    on_device = [j for j, s in enumerate(problem.space) if s.on == "device"]
    count = len(problem.groups)
    assignment = np.zeros(count, dtype=int)
    at = problem.layout(assignment, offloads=False)
    fp32_step = float(at.step_s[0])
    reasons = ["" for _ in range(count)]
    tried_at: dict[int, tuple[list[int], np.ndarray, int]] = {}  # group -> its trial, for its reason
    settled = np.zeros(count, dtype=bool)
    start, end = at.link_start_s[0], at.link_end_s[0]
    for group in sorted(range(count), key=lambda g: (-problem.numels[g], g)):
        _prune_before_bubbles(problem, assignment, start, end, settled, reasons)
        if settled[group]:
            continue
        choices = [j for j in on_device if problem.valid[group, j]]
        rows = np.repeat(assignment[None], len(choices), axis=0)
        rows[:, group] = choices
        tried = problem.layout(rows, offloads=False)
        best = _first_least(tried.step_s)
        assignment[group] = choices[best]
        settled[group] = True
        tried_at[group] = (choices, tried.step_s, best)
        start, end = tried.link_start_s[best], tried.link_end_s[best]
    for group, (choices, steps, best) in tried_at.items():  # worded once the decision is made
        reasons[group] = _reason(problem, choices, steps, best)
    _offload(problem, assignment, reasons)
    return Decision(
        tuple(problem.space[j] for j in assignment),
        tuple(reasons),
        problem.step(assignment),
        fp32_step,
        problem.evaluations,
        time.perf_counter() - started,
    )


def _prune_before_bubbles(
    problem: Problem,
    assignment: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    settled: np.ndarray,
    reasons: list[str],
) -> None:
    """Settle as fp32 every unsettled fp32 group whose transfer ends before the network's last
    idle gap (`start`, `end`: each group's transfer in the current layout): the link waits for
    later data anyway, so compressing such a group cannot shorten the step."""
    sends = np.flatnonzero(problem.columns[quick.NET, problem._rows, assignment] > 0)
    idle = np.flatnonzero(start[sends[1:]] > end[sends[:-1]] * (1 + TIE) + 1e-12)
    if not len(idle):
        return
    last_bubble = int(sends[idle[-1] + 1])
    candidates = sends[sends < last_bubble]
    for group in candidates[~settled[candidates] & (assignment[candidates] == 0)]:
        settled[group] = True
        reasons[group] = (
            f"fp32: its transfer ends at {1e3 * end[group]:.2f} ms, before the network idles waiting "
            f"for group {last_bubble} (sent from {1e3 * start[last_bubble]:.2f} ms); compressing it "
            "would only widen that gap"
        )


def _reason(problem: Problem, choices: list[int], steps: np.ndarray, best: int) -> str:
    chosen = problem.space[choices[best]].text
    order = np.argsort(steps, kind="stable")
    runner = next((k for k in order if k != best), None)
    text = f"{chosen}: step {1e3 * steps[best]:.2f} ms when chosen"
    if choices[best] != 0 and 0 in choices:
        text += f" (fp32: {1e3 * steps[choices.index(0)]:.2f} ms)"
    if runner is not None:
        text += f"; next best {problem.space[choices[runner]].text} {1e3 * steps[runner]:.2f} ms"
    return text


def _first_least(steps: np.ndarray) -> int:
    """The first index whose step ties the least (the earlier choice wins a tie)."""
    least = float(steps.min())
    return int(np.flatnonzero(steps <= least * (1 + TIE))[0])


def _offload(problem: Problem, assignment: np.ndarray, reasons: list[str]) -> None:
    """Move the best number of each size class's device-compressed groups to CPU threads."""
    place = {replace(s, on="device"): j for j, s in enumerate(problem.space) if s.on == "cpu"}
    offloaded = {j: place[s] for j, s in enumerate(problem.space) if s.on == "device" and s in place}
    classes: dict[tuple[int, int], list[int]] = {}
    for group, j in enumerate(assignment):
        if j in offloaded:
            classes.setdefault((problem.numels[group], int(j)), []).append(group)
    if not classes:
        return
    # Lemma 1: within a class, offload those farthest from the output (last in backprop order).
    members = [sorted(groups, reverse=True) for groups in classes.values()]
    numels = [numel for numel, _ in classes]

    def rows_for(vectors: list[tuple[int, ...]]) -> np.ndarray:
        rows = np.repeat(assignment[None], len(vectors), axis=0)
        for r, vector in enumerate(vectors):
            for groups, q in zip(members, vector, strict=True):
                for group in groups[:q]:
                    rows[r, group] = offloaded[int(assignment[group])]
        return rows

    sizes = [len(groups) + 1 for groups in members]
    if math.prod(sizes) <= OFFLOAD_EXACT_LIMIT:
        vectors = list(itertools.product(*(range(size) for size in sizes)))
        steps = problem.layout(rows_for(vectors)).step_s
        best = vectors[_first_least(steps)]
    else:  # one class at a time, largest first: the best count given the counts chosen before
        best = tuple(0 for _ in sizes)
        for c in sorted(range(len(sizes)), key=lambda c: -numels[c]):
            vectors = [(*best[:c], q, *best[c + 1 :]) for q in range(sizes[c])]
            best = vectors[_first_least(problem.layout(rows_for(vectors)).step_s)]
    device_step = problem.step(assignment)
    final = rows_for([best])[0]
    step = problem.step(final)
    for group in np.flatnonzero(final != assignment):
        reasons[group] = (
            f"{problem.space[final[group]].text}: offloaded to a CPU thread, the step {1e3 * device_step:.2f}"
            f" -> {1e3 * step:.2f} ms; " + reasons[group]
        )
    assignment[:] = final


def brute_force(problem: Problem) -> tuple[tuple[Strategy, ...], float]:
    """The best assignment by trying every one: (strategies, predicted step). Exponential: small
    instances only (len(strategies) ** len(groups) assignments)."""
    per_group = [np.flatnonzero(problem.valid[g]) for g in range(len(problem.groups))]
    total = math.prod(len(c) for c in per_group)
    if total > 2_000_000:
        raise ValueError(
            f"{total:,} assignments are too many to enumerate; brute force is for small instances"
        )
    best_step, best_row = math.inf, None
    everything = itertools.product(*per_group)
    while batch := list(itertools.islice(everything, 4096)):
        rows = np.array(batch)
        steps = problem.layout(rows).step_s
        k = int(steps.argmin())
        if steps[k] < best_step:
            best_step, best_row = float(steps[k]), rows[k]
    assert best_row is not None
    return tuple(problem.space[j] for j in best_row), best_step
