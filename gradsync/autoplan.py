"""plan="auto": measure the model in its first steps, plan, and confirm the plan on real steps.

What the hook does with SyncConfig(plan="auto"), step by step (steps as the hook counts them):

  step 0              DDP's first iteration (it rebuilds its buckets): fp32, nothing measured.
  steps 1..MEASURED   fp32 allreduce of DDP's buckets, as any warm-up step; module and gradient
                      hooks note when each step's forward pass starts and ends and when each
                      gradient is ready (`StepTimer`); steps 2.. are counted.
  end of step MEASURED  every rank measures the collectives (alpha-beta fits) and gradsync's hook
                      path around each codec of the strategy space (a world of one, synthetic
                      data); with the compute timeline, the slowest rank's numbers of each make a
                      measured cluster (`measure`), from which plan.make_all ranks the candidate
                      plans (rank 0's list, sent to all).
  the next steps      `_Probe`: each of at most CANDIDATES candidates (the best predicted, the
                      best uniform strategy, fp32 on DDP's buckets, ...) runs STEPS_EACH steps, in
                      turn (round robin), in the shadow: its exchange runs on copies of the
                      gradients with throwaway codec state and is timed from the step's forward
                      start to its last group's end;
                      the step itself gets the plain fp32 allreduce of DDP's buckets, issued once
                      the shadow is done, exactly as a warm-up step. So probing changes the timing
                      only: parameters, optimizer state and every random stream are those of a run
                      that was given the chosen plan from the start.
  after the probes    the candidate of least measured time (slowest rank's least of its steps
                      after the first, plus the measured optimizer time) becomes the plan;
                      compression by it starts once config.warmup_steps have passed, as with a
                      plan given in a file.

At most 1 + MEASURED + CANDIDATES * STEPS_EACH = 21 warm-up steps, of which 16 are measured steps of
candidate plans (the issue's bound: 50).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from . import ddp, profile
from . import plan as plans
from .comm import Comm, allgather_object, forward
from .config import NO_COMPRESSION, SyncConfig
from .cost import fit_linear
from .ddp import SyncState
from .sim import cluster as clusters
from .sim.compute import Compute, Gradient

log = logging.getLogger("gradsync")

MEASURED = 4  # steps up to which the compute timeline is measured, from step 2: step 1 is DDP's
# first on rebuilt buckets, slower by one-off allocations
CANDIDATES = 4  # plans confirmed on real steps
STEPS_EACH = 4  # shadow steps per candidate; the first (allocations, codec set-up) is not counted
# Collective sizes (bytes per rank) and codec sizes (elements) for the start-up fits: fewer and
# smaller than gradsync.profile's defaults, to keep start-up short.
COLLECTIVE_NBYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
CODEC_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20)
REPEATS = 3


def warmup_steps(config: SyncConfig) -> int:
    """Steps before the first compressed one: the config's, or as many as measuring and
    confirming take, whichever is more."""
    return max(config.warmup_steps, 1 + MEASURED + CANDIDATES * STEPS_EACH)


class StepTimer:
    """When each step's forward pass starts and ends and each gradient is ready, by hooks on the
    DDP model and its parameters; removed by close()."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self.params = list(model.parameters())
        self.forward_start: list[float] = []
        self.forward_end: list[float] = []
        self.ready: list[dict[int, float]] = []  # per step: parameter position -> when
        self.synced: dict[int, float] = {}  # step -> when its last exchange completed
        self._handles = [
            model.register_forward_pre_hook(self._forward_started),
            model.register_forward_hook(self._forward_ended),
        ]
        for index, p in enumerate(self.params):
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._ready_hook(index)))

    def _forward_started(self, *_: object) -> None:
        self.forward_start.append(time.perf_counter())
        self.ready.append({})

    def _forward_ended(self, *_: object) -> None:
        self.forward_end.append(time.perf_counter())

    def _ready_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            if self.ready:
                self.ready[-1][index] = time.perf_counter()

        return ready

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def timeline(self, steps: Sequence[int]) -> tuple[float, float, float, dict[int, float]]:
        """(forward_s, backward_s, optimizer_s, ready_s per parameter): medians over `steps`.

        The backward pass runs from the forward pass's end to the last gradient; the optimizer
        from the later of that and the step's last exchange to the next forward pass."""
        forward, backward, optimizer, ready = [], [], [], {}
        for k in steps:
            started, ended, marks = self.forward_start[k], self.forward_end[k], self.ready[k]
            last = max(marks.values(), default=ended)
            forward.append(ended - started)
            backward.append(last - ended)
            if k + 1 < len(self.forward_start):
                optimizer.append(max(0.0, self.forward_start[k + 1] - max(last, self.synced.get(k, last))))
            for index, mark in marks.items():
                ready.setdefault(index, []).append(mark - ended)
        return (
            statistics.median(forward),
            statistics.median(backward),
            statistics.median(optimizer) if optimizer else 0.0,
            {index: statistics.median(times) for index, times in ready.items()},
        )


def codec_specs(config: SyncConfig) -> list[str]:
    """The codecs the strategy space may use: the casts and the config's compressor."""
    specs = ["fp16", "bf16"]
    if config.compressor not in (NO_COMPRESSION, *specs):
        args = [f"{k}={v}" for k, v in sorted(config.compressor_args.items())]  # as Strategy.spec
        specs.append(":".join([config.compressor, *args]))
    return specs


@dataclass(frozen=True)
class Measured:
    """What the first steps measured, the same on every rank: the planner's inputs."""

    compute: Compute
    cluster: clusters.Cluster
    params: tuple[int, ...]  # position in model.parameters() of each gradient, backprop order


def measure(
    timer: StepTimer, comm: Comm, config: SyncConfig, names: Sequence[str], steps: Sequence[int]
) -> Measured:
    """The compute timeline of `steps` and this cluster's collective and codec costs; every number
    the slowest rank's. Every rank must call it at the same point."""
    device = timer.params[0].device if timer.params else torch.device("cpu")
    forward_s, backward_s, optimizer_s, ready = timer.timeline(steps)
    values = [forward_s, backward_s, optimizer_s] + [ready.get(i, -1.0) for i in range(len(timer.params))]
    slowest = profile.slowest_rank(comm, values, device)
    forward_s, backward_s, optimizer_s = slowest[:3]
    # A trainable parameter no rank saw a gradient for (unused in these steps) is still in DDP's
    # buckets, so the plan must hold it: as if ready when the backward pass ends.
    ready_s = {
        i: t if t >= 0 else backward_s
        for i, t in enumerate(slowest[3:])
        if t >= 0 or timer.params[i].requires_grad
    }
    order = sorted(ready_s, key=lambda i: (ready_s[i], i))
    gradients, last = [], 0.0
    for i in order:
        last = min(max(last, ready_s[i]), backward_s)  # ready order, within the backward pass
        gradients.append(Gradient(names[i], timer.params[i].numel(), last))
    compute = Compute(forward_s, backward_s, optimizer_s, tuple(gradients), name="auto")

    specs = codec_specs(config)
    compression, hook = {}, {}
    for spec in specs:
        fits = profile.measure_compression(spec, CODEC_SIZES, REPEATS, config.seed, device)
        slowest = profile.slowest_rank(comm, fits["compress"] + fits["decompress"], device)
        half = len(CODEC_SIZES)
        compression[spec] = {
            "compress": fit_linear(CODEC_SIZES, slowest[:half]),
            "decompress": fit_linear(CODEC_SIZES, slowest[half:]),
        }
        path = profile.hook_config(spec)
        sizes = sorted({max(n, path.min_compress_numel) for n in CODEC_SIZES})
        timed = profile.measure_hook(path, sizes, REPEATS, config.seed, device)
        slowest = profile.slowest_rank(comm, timed["before"] + timed["after"], device)
        hook[spec] = {
            "before": fit_linear(sizes, slowest[: len(sizes)]),
            "after": fit_linear(sizes, slowest[len(sizes) :]),
        }
    collectives = ["allreduce", "allgather", "all_to_all", "allreduce:float16", "allreduce:bfloat16"]
    fits = profile.probe_collectives(comm, COLLECTIVE_NBYTES, REPEATS, device, collectives)
    (copy_Bps,) = profile.slowest_rank(comm, [-copy_bandwidth(device)], device)  # the slowest's
    host = dataclasses.replace(clusters.CPU_HOST, memory_Bps=-copy_Bps)
    where = clusters.measured(
        comm.world_size, fits, compression, hook, name=f"{comm.world_size} measured ranks"
    )
    return Measured(compute, dataclasses.replace(where, device=host), tuple(order))


def copy_bandwidth(device: torch.device, numel: int = 1 << 24) -> float:
    """Bytes per second one copy moves through memory (read and write), as the hook's copies of
    a group out of DDP's buckets and back: the median of REPEATS concatenations of two halves."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    halves = [x[: numel // 2], x[numel // 2 :]]
    torch.cat(halves)  # the allocator's first time
    seconds = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        torch.cat(halves)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return 2 * x.nbytes / statistics.median(seconds)


def candidates(
    measured: Measured,
    config: SyncConfig,
    model_signature: str,
    buckets: Sequence[Sequence[int]] | None = None,
) -> list[plans.Plan]:
    """The plans to confirm on real steps, at most CANDIDATES of them: the best predicted plan, the
    best that compresses and the best that does not (whichever of those the first is not), the best
    uniform strategy on DDP's buckets, and the next best predicted. So the measurement decides
    between compressing and not, even where the prediction errs. `buckets`: DDP's buckets, as
    parameter positions, where seen."""
    compressor = None if config.compressor == NO_COMPRESSION else config.compressor
    ranked = plans.make_all(
        measured.compute,
        measured.cluster,
        compressor,
        dict(config.compressor_args),
        model=model_signature,
        params=measured.params,
        buckets=_as_gradients(buckets, measured.params),
    )

    def compresses(plan: plans.Plan) -> bool:
        return any(s.compressed for s in plan.strategies)

    picks = [
        ranked[0],
        next((p for p in ranked if compresses(p)), None),
        next((p for p in ranked if not compresses(p)), None),  # fp32 on DDP's buckets at worst
        next((p for p in ranked if str(p.meta.get("chosen", "")).endswith("DDP buckets")), None),
        *ranked[1:],
    ]
    chosen: list[plans.Plan] = []
    for plan in picks:
        if plan is not None and plan not in chosen and len(chosen) < CANDIDATES:
            chosen.append(plan)
    return chosen


def _as_gradients(buckets: Sequence[Sequence[int]] | None, params: Sequence[int]) -> list[list[int]] | None:
    """DDP's buckets (parameter positions) as runs of gradient indices in the measured backprop
    order; None where they are not such runs (a gradient measured ready out of bucket order)."""
    if not buckets:
        return None
    where = {param: i for i, param in enumerate(params)}
    groups = sorted(([where.get(p, -1) for p in bucket] for bucket in buckets), key=lambda g: g[0])
    flat = [i for g in groups for i in g]
    return groups if flat == list(range(len(params))) else None


class Auto:
    """The hook's driver under plan="auto" until a plan is adopted (module docstring)."""

    def __init__(self, state: SyncState, model: DistributedDataParallel) -> None:
        self.state = state
        self.model_signature = plans.signature(model)
        self.names = profile.parameter_names(model)
        self.timer = StepTimer(model)
        self.device = self.timer.params[0].device if self.timer.params else torch.device("cpu")
        self.timer_step: dict[int, int] = {}  # hook step -> the timer's index of its forward pass
        self.buckets: dict[int, tuple[int, ...]] = {}  # DDP's rebuilt buckets: index -> parameters
        self.candidates: list[plans.Plan] = []
        self.measured: dict[int, list[float]] = {}  # candidate -> its shadow steps' seconds
        self.planned_at: int | None = None  # the step at whose end the candidates were made
        self.adopted_at: int | None = None  # the step after whose end the plan was adopted
        self.shadows: dict[int, SyncState] = {}  # candidate -> its throwaway state, while probing
        self._probe: _Probe | None = None  # the step being probed
        self.optimizer_s = 0.0  # as measured, added to each probe's time

    @property
    def done(self) -> bool:
        return self.adopted_at is not None

    def hook(self, bucket: dist.GradBucket, is_last: bool) -> Future[torch.Tensor]:
        """One DDP bucket of a step before the plan is adopted."""
        state, step = self.state, self.state.step
        self.timer_step.setdefault(step, len(self.timer.forward_start) - 1)
        if self.planned_at is None:
            if step >= 1:  # DDP's buckets as rebuilt after its first iteration
                param_index = state._param_index or {}
                self.buckets[bucket.index()] = tuple(param_index[id(p)] for p in bucket.parameters())
            future = state.sync(bucket.buffer(), bucket.index(), is_last, may_compress=False)
            if is_last:  # collectives complete in order: the last bucket's ends the step's exchange
                index = self.timer_step[step]
                future.add_done_callback(lambda _: self.timer.synced.__setitem__(index, time.perf_counter()))
            if is_last and step == MEASURED:
                self._make_candidates(range(2, MEASURED + 1))
                self.planned_at = step
            return future
        if self._probe is None:
            # Round robin, so that a burst of load elsewhere, or the planning's own allocations,
            # spreads over the candidates rather than landing on one.
            self._probe = _Probe(self, (step - self.planned_at - 1) % len(self.candidates), step)
        future = self._probe.add(bucket, is_last)
        if is_last:
            self.measured.setdefault(self._probe.candidate, []).append(self._probe.seconds())
            self._probe = None
            if step - self.planned_at >= len(self.candidates) * STEPS_EACH:
                self._adopt(step)
        return future

    def _make_candidates(self, steps: Sequence[int]) -> None:
        comm = self.state._comm()
        timer_steps = [self.timer_step[k] for k in steps if k in self.timer_step]
        found = measure(self.timer, comm, self.state.config, self.names, timer_steps)
        self.optimizer_s = found.compute.optimizer_s
        buckets = [self.buckets[i] for i in sorted(self.buckets)]
        mine = candidates(found, self.state.config, self.model_signature, buckets) if comm.rank == 0 else []
        # Every rank plans from the same numbers; rank 0's list is taken so that no rounding
        # difference can make ranks probe, or adopt, different plans.
        lists = allgather_object(comm, [p.to_dict() for p in mine], self.device)
        self.candidates = [plans.Plan.from_dict(p) for p in lists[0]]

    def _adopt(self, step: int) -> None:
        """Take the candidate of least measured time (the slowest rank's least of its steps after
        the first: load from elsewhere only ever adds time); earlier candidates win ties."""
        counted = [self.measured[c][1:] or self.measured[c] for c in range(len(self.candidates))]
        slowest = profile.slowest_rank(self.state._comm(), [min(t) for t in counted], self.device)
        best = min(range(len(slowest)), key=lambda c: (slowest[c], c))
        measured = {
            f"{p.meta.get('chosen')} (measured)": t for p, t in zip(self.candidates, slowest, strict=True)
        }
        chosen = self.candidates[best].with_measured(slowest[best], **measured)
        self.adopted_at = step
        self.state.use_plan(chosen)
        self.timer.close()
        self.shadows = {}
        log.info("gradsync plan='auto' adopted after step %d:\n%s", step, chosen.describe())

    def restore(self, plan: plans.Plan) -> None:
        """Adopt a plan this run made before (a checkpoint's): nothing to measure or confirm."""
        self.adopted_at = -1
        self.state.use_plan(plan)
        self.timer.close()

    def stats(self) -> dict[str, Any]:
        """What plan="auto" measured and chose."""
        return {
            "planned_at_step": self.planned_at,
            "adopted_at_step": self.adopted_at,
            "candidates": [
                {
                    "label": p.meta.get("chosen"),
                    "predicted_s": p.predicted_step_s,
                    "measured_s": self.measured.get(c, []),
                }
                for c, p in enumerate(self.candidates)
            ],
            "chosen": self.state.plan.meta.get("chosen") if self.done and self.state.plan else None,
        }


class _Probe:
    """One probe step: a candidate plan run by the hook's own code (ddp._planned) on a copy of each
    of the step's buckets, with throwaway state, then the step's own fp32 allreduce of DDP's
    buckets. Every candidate pays the same one copy per bucket; a group laid out as a bucket is
    then synced in place and the others are cut out and copied back, as they would run."""

    def __init__(self, auto: Auto, candidate: int, step: int) -> None:
        self.auto, self.candidate, self.step = auto, candidate, step
        real = auto.state
        shadow = auto.shadows.get(candidate)
        if shadow is None:
            config = dataclasses.replace(real.config, plan=auto.candidates[candidate], warmup_steps=2)
            shadow = auto.shadows[candidate] = SyncState(config, real._comm())
            shadow._ranks_agree = True  # the real state's check covers the same ranks
            shadow._param_index, shadow._param_shapes = real._param_index, real._param_shapes
            shadow._ddp_layout = dict(auto.buckets)  # as seen in the measured steps
            shadow.step = 2  # past its warm-up: it compresses from its first step
        self.shadow = shadow
        self.pending: list[tuple[torch.Tensor, int, Future]] = []  # the real buckets, synced last
        self.shadowed: list[Future] = []
        self.done_at: list[float] = []

    def add(self, bucket: dist.GradBucket, is_last: bool) -> Future[torch.Tensor]:
        shadowed = ddp._planned(self.shadow, _Copied(bucket), is_last, first_iteration=False)
        shadowed.add_done_callback(lambda _: self.done_at.append(time.perf_counter()))
        self.shadowed.append(shadowed)
        result: Future[torch.Tensor] = Future()
        self.pending.append((bucket.buffer(), bucket.index(), result))
        if is_last:
            torch.futures.wait_all(self.shadowed)  # the candidate's whole exchange first, alone
            for k, (buffer, index, out) in enumerate(self.pending):
                real = self.auto.state.sync(buffer, index, k == len(self.pending) - 1, may_compress=False)
                forward(real, out)
        return result

    def seconds(self) -> float:
        """The step as the candidate would run it: from its forward start to the candidate's last
        group done, plus the optimizer's time as measured (the real exchange that follows in a
        probe step is not counted)."""
        forward_start = self.auto.timer.forward_start[self.auto.timer_step[self.step]]
        return max(self.done_at) - forward_start + self.auto.optimizer_s


class _Copied:
    """A DDP bucket whose buffer is a copy: what a shadow may change without touching training."""

    def __init__(self, bucket: dist.GradBucket) -> None:
        self._bucket, self._buffer = bucket, bucket.buffer().clone()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._bucket.index()

    def parameters(self) -> list[torch.Tensor]:
        return self._bucket.parameters()
