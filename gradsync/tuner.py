"""plan="auto": measure the model in its first steps, plan, try the best plans on real steps,
and keep the fastest.

What the hook does with SyncConfig(plan="auto"), step by step (steps as the hook counts them, from
registration or from a restored checkpoint's step r; r = 0 for a fresh run):

  steps r .. r+MEASURED  uncompressed on DDP's buckets, as any warm-up step; hooks note when each
                      step's forward pass starts and ends and when each gradient is ready
                      (`StepTimer`); steps r+2 .. are counted (r: DDP's first iteration, r+1: its
                      first on rebuilt buckets, slower by one-off allocations).
  step r+MEASURING    the measuring step, uncompressed: at its start every rank measures the
                      collectives and each codec of the strategy space; with the compute timeline,
                      the slowest rank's numbers make a measured cluster. As its buckets go by,
                      rank 0 compresses each gradient at every level of the compressor and notes
                      its error: the budget the planner keeps to (gradsync.levels). Every one-off
                      cost of measuring falls in this one step, already long, rather than lengthen
                      another.
  start of step r+PLANNED  gradsync.autoplan ranks the candidate plans from those numbers (rank
                      0's list, sent to all: every rank tries the same; a few ms and one gather).
  probing             from the later of that step and config.warmup_steps: each of at most
                      CANDIDATES candidates runs STEPS_EACH steps for real, one after the other;
                      a step's time is from its forward pass's start to its last exchange's end
                      (what a plan changes; on a GPU, once the GPU is done with it), plus the
                      least time seen from an exchange's end to the next forward pass (the
                      optimizer's, alike for every candidate): what every rank does between steps,
                      an evaluation say, is not counted. Each candidate's first step is not
                      counted (allocations). Where one candidate hands over to the next, what
                      its error memories hold back is carried into the next step's gradients:
                      nothing the compression held back is lost. The candidate that runs as the
                      measured steps ran (fp32 on DDP's buckets) is not run again: their times,
                      taken as a probe step's, are its measurement.
  runoff              where the runner-up's time is within autoplan.RUNOFF_MARGIN of the fastest's,
                      the two run STEPS_EACH steps each again, in reverse order (two counted
                      steps are few on a busy host, and a run's first steps are its slowest).
  adoption            at the start of the step after the last probe: the candidate of least
                      time (the slowest rank's least of all its counted steps) becomes the plan,
                      as a plan given in a file; where it is the one running, its codecs and
                      memories go on.

The candidates, their measured times and the adopted plan are agreed by every rank and recorded in
stats()["auto"] and in the checkpoint: a run resumed in any phase goes on from there (one resumed
before the candidates were made measures afresh), and a run given the adopted plan as a file runs
it from its first compressed step. Timings decide, so two fresh runs may adopt different plans.

(Over 400 lines: the step timer, what rank 0 measures and the state that runs the phases above
serve this one feature, and splitting them would spread its timeline over several modules.)
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real objects.

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from . import checkpoint, levels, profile
from .autoplan import CANDIDATES, Measured, candidates, codec_specs, runoff
from .comm import Comm, allgather_object, for_ddp, then
from .compress import PAST_WARMUP
from .config import SyncConfig
from .ddp import hook
from .plan import Plan, signature
from .sim import cluster as clusters
from .sim.compute import Compute, Gradient
from .strategy import Strategy
from .sync import SyncState, averaged

log = logging.getLogger("gradsync")

MEASURED = 4  # steps of a timeline measurement, the first two not counted
MEASURING = MEASURED + 1  # the measuring step (module docstring)
PLANNED = MEASURING + 1  # the first step a candidate can run
STEPS_EACH = 3  # probe steps per candidate; the first (allocations, codec set-up) is not counted
# Collective sizes (bytes per rank) and codec sizes (elements) for the start-up fits: fewer and
# smaller than gradsync.profile's defaults, to keep start-up short.
COLLECTIVE_NBYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
# A collective's next probe size is left out where the collective is bandwidth-bound already and
# that size would take longer than this (profile.measure_collectives). On 1 Gbit/s, every 4 MiB one.
LONGEST_PROBE_S = 0.025
CODEC_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20)
REPEATS = 3


def warmup_steps(config: SyncConfig) -> int:
    """Steps before the adopted plan runs in a fresh run, at most: measuring, then probing (a
    runoff included) from the later of PLANNED and config.warmup_steps."""
    return max(PLANNED, config.warmup_steps) + (CANDIDATES + 2) * STEPS_EACH


class StepTimer:
    """When each step's forward pass starts and ends and each gradient is ready, by hooks on the
    DDP model and its parameters; stop_gradients() removes all but the forward start's, close()
    that one too."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.averaged = averaged(model)  # those whose gradients DDP's buckets hold
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._start: RemovableHandle | None = None
        self._handles: list[RemovableHandle] = []
        self.reset()

    def reset(self) -> None:
        """Start afresh: nothing noted, every hook on (again, where stop_gradients() or close()
        removed them: a state restored in the same process to a phase that still times steps)."""
        self.close()
        self.forward_start: list[float] = []
        self.forward_end: list[float] = []
        self.ready: list[dict[int, float]] = []  # per step: parameter position -> when
        self.synced: dict[int, float] = {}  # forward pass -> when its step's last exchange completed
        self._start = self.model.register_forward_pre_hook(self._forward_started)
        self._handles = [self.model.register_forward_hook(self._forward_ended)]
        for index, p in enumerate(self.params):
            if index in self.averaged:
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

    def stop_gradients(self) -> None:
        """Stop timing the forward pass's end and each gradient: only step times are left to take."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close(self) -> None:
        self.stop_gradients()
        if self._start is not None:
            self._start.remove()
            self._start = None

    def timeline(self, steps: Sequence[int]) -> tuple[float, float, float, dict[int, float]]:
        """(forward_s, backward_s, optimizer_s, ready_s per parameter) of the training steps
        whose forward passes are `steps` (indices into forward_start, in order; the last only
        ends the one before it): medians over the steps, but optimizer_s.

        The backward pass runs from the forward pass's end to the last gradient; the optimizer
        from the later of that and the step's last exchange to the next step's forward pass: the
        least such gap, as what else a script does between steps (an evaluation, a checkpoint)
        only adds to it."""
        forward, backward, optimizer, ready = [], [], [], {}
        for k, following in itertools.pairwise(steps):
            started, ended, marks = self.forward_start[k], self.forward_end[k], self.ready[k]
            last = max(marks.values(), default=ended)
            forward.append(ended - started)
            backward.append(last - ended)
            optimizer.append(max(0.0, self.forward_start[following] - max(last, self.synced.get(k, last))))
            for index, mark in marks.items():
                ready.setdefault(index, []).append(mark - ended)
        return (
            statistics.median(forward),
            statistics.median(backward),
            min(optimizer, default=0.0),
            {index: statistics.median(times) for index, times in ready.items()},
        )


def measure(
    timer: StepTimer,
    comm: Comm,
    config: SyncConfig,
    names: Sequence[str],
    steps: Sequence[int],
) -> Measured:
    """The compute timeline of `steps` and this cluster's collective and codec costs; every number
    the slowest rank's (no errors: the planner's budget is added once they are taken). Every rank
    must call it at the same point."""
    device = timer.device
    forward_s, backward_s, optimizer_s, ready = timer.timeline(steps)
    values = [forward_s, backward_s, optimizer_s] + [ready.get(i, -1.0) for i in range(len(timer.params))]
    slowest = profile.slowest_rank(comm, values, device)
    forward_s, backward_s, optimizer_s = slowest[:3]
    # A parameter DDP averages that no rank saw a gradient for (unused in these steps) is still
    # in DDP's buckets, so the plan must hold it: as if ready when the backward pass ends.
    ready_s = {i: t if t >= 0 else backward_s for i, t in enumerate(slowest[3:]) if i in timer.averaged}
    order = sorted(ready_s, key=lambda i: (ready_s[i], i))
    gradients, last = [], 0.0
    for i in order:
        last = min(max(last, ready_s[i]), backward_s)  # ready order, within the backward pass
        gradients.append(Gradient(names[i], timer.params[i].numel(), last))
    compute = Compute(forward_s, backward_s, optimizer_s, tuple(gradients), name="auto")

    compression, hook = profile.fit_codecs(
        comm, codec_specs(config), CODEC_SIZES, REPEATS, config.seed, device
    )
    collectives = ["allreduce", "allgather", "all_to_all", "allreduce:float16", "allreduce:bfloat16"]
    fits = profile.probe_collectives(comm, COLLECTIVE_NBYTES, REPEATS, device, collectives, LONGEST_PROBE_S)
    (copy_bytes_per_s,) = profile.slowest_rank(
        comm, [-profile.copy_bandwidth(device, repeats=REPEATS)], device
    )  # the slowest's
    host = dataclasses.replace(clusters.CPU_HOST, memory_bytes_per_s=-copy_bytes_per_s)
    where = clusters.measured(
        comm.world_size, fits, compression, hook, name=f"{comm.world_size} measured ranks"
    )
    return Measured(compute, dataclasses.replace(where, device=host), tuple(order))


def lossy_specs(config: SyncConfig) -> list[str]:
    """The levels of the config's compressor whose errors the planner weighs (gradsync.levels)."""
    return [spec for spec in codec_specs(config) if levels.is_lossy(spec)]


def error_levels(gradients: Mapping[int, torch.Tensor], config: SyncConfig) -> dict[int, dict[str, float]]:
    """Per parameter position, each level's squared compression error on its gradient."""
    specs = lossy_specs(config)
    found = profile.compression_errors(list(gradients.values()), specs, config.seed)
    return {param: {spec: found[spec][k] for spec in specs} for k, param in enumerate(gradients)}


def budget(
    config: SyncConfig, errors: Mapping[int, Mapping[str, float]] | None, order: Sequence[int]
) -> levels.Errors | None:
    """The errors in the planner's gradient order, the config's own level the budget's measure
    (gradsync.levels.Errors). None where nothing lossy is planned or nothing was measured. A
    gradient without finite measured errors keeps the config's level."""
    specs = lossy_specs(config)
    if not errors or not specs:
        return None
    own = levels.spec(config.compressor, config.compressor_args)

    def error(param: int, spec: str) -> float:
        measured = errors.get(param)
        # A gradient with NaN or inf says nothing of what compression loses.
        if measured is None or not all(math.isfinite(v) for v in measured.values()):
            return 0.0 if spec == own else math.inf
        return measured[spec]

    return levels.Errors({spec: tuple(error(param, spec) for param in order) for spec in specs}, own)


class AutoState(SyncState):
    """A SyncState that makes its plan in the first steps (module docstring); returned by
    gradsync.register for SyncConfig(plan="auto")."""

    def __init__(self, config: SyncConfig, comm: Comm, model: DistributedDataParallel) -> None:
        super().__init__(config, comm, model)
        self.model_signature = signature(model)
        self.names = profile.parameter_names(model)
        self.numels = [p.numel() for p in model.parameters()]
        self.timer = StepTimer(model)
        self.measure_from = 0  # the first step of the timeline measurement
        self.candidates: list[Plan] = []
        self.probe_from: int | None = None  # the first probe step, once the candidates are made
        self.order: list[int] = []  # the candidate tried in each probe slot of STEPS_EACH steps
        self.probe_s: dict[int, list[float]] = {}  # candidate -> its counted steps' seconds
        # The least time from a probe step's last exchange to the next forward pass: the
        # optimizer's (and, under gradient accumulation, the micro-batches' before the one that
        # syncs), added to every candidate's measured step alike.
        self.between_s = math.inf
        self.adopted_at: int | None = None  # the step the adopted plan first ran
        self._started = -1  # the newest step whose start was handled
        self._forward: dict[int, int] = {}  # step -> the timer's index of its forward pass
        # What the measuring step measured: the cluster and timeline, then, as its buckets go by,
        # rank 0's compression errors per parameter position and level (the planner's budget).
        self._measurement: Measured | None = None
        self._errors: dict[int, dict[str, float]] = {}
        self._closed = False

    @property
    def done(self) -> bool:
        return self.adopted_at is not None

    def close(self) -> None:
        super().close()
        self.timer.close()
        self._closed = True  # a later restore leaves the model without timers too

    def start_step(self, step: int, last_bucket: Future | None = None) -> None:
        """At a step's first bucket: note its forward pass, and plan, probe or adopt where due."""
        if step == self._started:
            return
        self._started = step
        if self.done:  # the timer is closed: nothing more to note, nor to keep
            return
        self._forward[step] = len(self.timer.forward_start) - 1
        if self.measuring(step):
            self._measure(range(self.measure_from + 2, step + 1))  # this step's start ends the last
        elif self.probe_from is None and step == self.measure_from + PLANNED:
            self._make_candidates()
        if self.probe_from is None or step < self.probe_from:
            return
        probed = step - 1 - self.probe_from  # the probe step that just ended
        index = self._forward.get(step - 1)
        synced = self.timer.synced.get(index) if index is not None else None
        counted = probed % STEPS_EACH and synced is not None  # not a candidate's first step
        if 0 <= probed < len(self.order) * STEPS_EACH and counted:
            seconds = synced - self.timer.forward_start[index]  # type: ignore[operator]
            self.probe_s.setdefault(self.order[probed // STEPS_EACH], []).append(seconds)
            self.between_s = min(self.between_s, self.timer.forward_start[self._forward[step]] - synced)
        slot, into = divmod(step - self.probe_from, STEPS_EACH)
        measured = None  # the candidates' times, where taken at the first round's end
        # The first round's end: every slot so far a different candidate (a runoff repeats two).
        if slot == len(self.order) == len(set(self.order)) and into == 0:
            measured = self._measured_s()
            self.order.extend(runoff(measured) or ())
        if slot >= len(self.order):
            self._adopt(step, measured or self._measured_s())
        elif into == 0 and (slot == 0 or self.order[slot] != self.order[slot - 1]):
            self.use_plan(self.candidates[self.order[slot]], carry=True)

    def stats(self) -> dict[str, Any]:
        """As SyncState.stats(), and under "auto" what plan="auto" measured and chose."""
        return {
            **super().stats(),
            "auto": {
                "measured_from_step": self.measure_from,
                "probed_from_step": self.probe_from,
                "order": list(self.order),
                "adopted_at_step": self.adopted_at,
                # A counted step's measured_s runs from its forward pass to its last exchange's
                # end; with between_s (this rank's least gap to the next forward pass), a step.
                "between_s": self.between_s if math.isfinite(self.between_s) else None,
                "candidates": [
                    {
                        "label": p.meta.get("chosen"),
                        "predicted_s": p.predicted_step_s,
                        "measured_s": self.probe_s.get(c, []),
                    }
                    for c, p in enumerate(self.candidates)
                ],
                "chosen": self.plan.meta.get("chosen") if self.done and self.plan is not None else None,
            },
        }

    def _own_state(self) -> dict[str, Any]:
        """As SyncState's, with the planning so far: the candidates, their times, the
        plan in use and what is carried into the next step."""
        plan = self.plan.to_dict() if self.plan is not None else None  # type: ignore[attr-defined]
        auto = {
            "measure_from": self.measure_from,
            "candidates": [p.to_dict() for p in self.candidates],
            "probe_from": self.probe_from,
            "order": list(self.order),
            "probe_s": {c: list(times) for c, times in self.probe_s.items()},
            "between_s": self.between_s,
            "adopted_at": self.adopted_at,
            "plan": plan,
            "carry": {p: t.clone() for p, t in self._carry.items()},
            # The loss scale and learning rates it is held at (SyncState._follow_carry).
            "carry_at": [self._carry_at[0], None if self._carry_at[1] is None else list(self._carry_at[1])],
        }
        return {**super()._own_state(), "auto": auto}

    def _shared_digest(self, state: Mapping[str, Any]) -> str | None:
        # Rank 0's candidates, their order and the plan adopted are every rank's; the times and
        # what is carried are each rank's own.
        auto = state["auto"]
        shared = [
            auto.get(key)
            for key in ("measure_from", "candidates", "probe_from", "order", "adopted_at", "plan")
        ]
        return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()

    def _state_problems(self, state: Mapping[str, Any]) -> list[str]:
        problems = super()._state_problems(state)
        if "auto" not in state:
            problems.append("it lacks 'auto': it was not saved by a run with SyncConfig(plan='auto')")
        elif checkpoint.non_finite(list(state["auto"].get("carry", {}).values())):
            problems.append(
                "what it carries into the next step holds NaN or inf: it would poison every later "
                "step; resume from an earlier checkpoint"
            )
        return problems

    def _prepare_restore(
        self, state: Mapping[str, Any], strategies: Sequence[Strategy] | None = None
    ) -> Callable[[], None]:
        auto = state["auto"]
        candidates = [Plan.from_dict(p) for p in auto["candidates"]]
        plan = Plan.from_dict(auto["plan"]) if auto["plan"] is not None else None
        # A checkpoint of a version without runoffs tried the candidates in their order.
        order = list(auto.get("order", range(len(candidates))))
        probe_s = {int(c): list(times) for c, times in auto["probe_s"].items()}
        probe_from, adopted_at = auto["probe_from"], auto["adopted_at"]
        # Older checkpoints timed whole steps, from one forward pass to the next: nothing is added.
        between_s = auto.get("between_s", 0.0 if probe_s else math.inf)
        carry = {int(p): t.clone() for p, t in auto["carry"].items()}
        # Older checkpoints did not say: taken as held at the scale and rates of the next step.
        scale, rates = auto.get("carry_at", (None, None))
        carry_at = (scale, None if rates is None else tuple(rates))
        # The points saved are those of the plan in use (none: config.compressor's, measuring).
        restore = super()._prepare_restore(state, list(plan.strategies) if plan is not None else [])

        def assign() -> None:
            self.candidates, self.order, self.probe_s = candidates, order, probe_s
            self.probe_from, self.between_s, self.adopted_at = probe_from, between_s, adopted_at
            # Saved before the candidates were made (no probe_from): measured afresh from here.
            self.measure_from = state["step"] if probe_from is None else auto.get("measure_from", 0)
            if plan is not None:
                self.use_plan(plan)
            else:
                self.plan, self._strategies = None, []
            restore()  # the points of the plan in use, and the step
            self._carry, self._carry_at = carry, carry_at
            self._started = -1
            self._measurement, self._errors = None, {}  # a measuring step is measured afresh
            # A step before the restore's is never counted as one after it; the timer's hooks are
            # as the phase restored has them (_adopt closes it, _measure keeps the forward pass's
            # start), also where an earlier phase in this process removed them.
            self._forward.clear()
            if not self._closed:
                self.timer.reset()
                if self.done:
                    self.timer.close()
                elif probe_from is not None:
                    self.timer.stop_gradients()

        return assign

    def _strategy(self, group: int, numel: int, step: int, compress: bool) -> Strategy:
        if self.plan is None:  # measuring: nothing is compressed before a candidate runs
            return self._uncompressed
        return super()._strategy(group, numel, step, compress)

    def _compressed_before(self, step: int) -> int:
        # A candidate is timed as it will run once warmed up: a sparsifier's warm-up keeps a
        # quarter of the entries at first, PowerSGD's 16 times the rank, and timing that would
        # rule them out. The adopted plan's codecs, made once planning is done, take up the
        # warm-up where training stands.
        return super()._compressed_before(step) if self.done else PAST_WARMUP

    def note_errors(self, bucket: dist.GradBucket) -> None:
        """Each level's compression error on each gradient of `bucket`, before it is exchanged."""
        if bucket.buffer().is_sparse or not lossy_specs(self.config):
            return
        params = [self._param_index[id(p)] for p in bucket.parameters()]
        # A gradient with NaN or inf (an AMP overflow step) is kept as measured: budget() gives it
        # the config's own level, as a gradient that was not measured.
        self._errors.update(error_levels(dict(zip(params, bucket.gradients(), strict=True)), self.config))

    def measuring(self, step: int) -> bool:
        """Whether `step` is the measuring step (module docstring)."""
        return self.probe_from is None and step == self.measure_from + MEASURING

    def _measure(self, steps: Sequence[int]) -> None:
        indices = [self._forward[k] for k in steps if k in self._forward]
        self._measurement = measure(self.timer, self._comm(), self.config, self.names, indices)
        self._errors = {}
        self.timer.stop_gradients()

    def _make_candidates(self) -> None:
        assert self._measurement is not None, "the measuring step comes first"
        comm = self._comm()
        found = dataclasses.replace(
            self._measurement, errors=budget(self.config, self._errors, self._measurement.params)
        )
        # DDP's buckets of the last step (at a step's start, before its first bucket is noted).
        latest = max((seen for seen, _ in self._ddp_layout.values()), default=None)
        buckets = [group for i, (seen, group) in sorted(self._ddp_layout.items()) if seen == latest]
        # Every rank plans from the same numbers; rank 0's list is taken so that no rounding
        # difference can make ranks probe, or adopt, different plans. Where rank 0's planning
        # fails, every rank raises its error: the others would otherwise wait in the gather.
        mine: list[dict[str, Any]] | str = []
        if comm.rank == 0:
            try:
                mine = [p.to_dict() for p in candidates(found, self.config, self.model_signature, buckets)]
            except Exception as error:
                mine = f"{type(error).__name__}: {error}"
        lists = allgather_object(comm, mine, self.timer.device)
        if isinstance(lists[0], str):
            raise RuntimeError(f"gradsync plan='auto': planning failed on rank 0, so everywhere: {lists[0]}")
        self.candidates = [Plan.from_dict(p) for p in lists[0]]
        self.probe_from = max(self._started, self.config.warmup_steps)
        # A candidate the measured steps ran already (fp32 on DDP's buckets) is not run again:
        # their times are its measurement. On a slow link its probe steps were planning's slowest
        # (examples/train.py at 1 Gbit/s: three of 1.3 to 1.5 s against the adopted plan's 0.6 s).
        ran = [c for c, plan in enumerate(self.candidates) if self._ran_measuring(plan, buckets)]
        # The counted steps of the timeline (_measure's, but the last, which only ends them), each
        # timed as a probe step is.
        timed = [self._forward.get(k) for k in range(self.measure_from + 2, self.measure_from + MEASURING)]
        synced, started = self.timer.synced, self.timer.forward_start
        measured_s = [synced[i] - started[i] for i in timed if i is not None and i in synced]
        self.probe_s = {c: list(measured_s) for c in ran}
        self.order = [c for c in range(len(self.candidates)) if c not in ran]
        self._measurement, self._errors = None, {}
        log.info(
            "gradsync plan='auto': %d candidates, tried from step %d", len(self.candidates), self.probe_from
        )

    def _ran_measuring(self, plan: Plan, buckets: Sequence[Sequence[int]]) -> bool:
        """Whether `plan` is what the measured steps ran: every DDP bucket a group, uncompressed
        (on a model without embedding tables the sparse scheme sends nothing, so none is named)."""
        plain = Strategy()
        ran = all(s == self._uncompressed or (s == plain and not self._embeddings) for s in plan.strategies)
        return ran and {frozenset(g.params) for g in plan.groups} == {frozenset(b) for b in buckets}

    def _measured_s(self) -> list[float]:
        """Each candidate's measured step: the slowest rank's least of its counted steps (load
        from elsewhere only ever adds time), and the least time between a step's exchange and the
        next forward pass (the optimizer's, alike for every candidate). Every rank must call it at
        the same step."""
        counted = [min(self.probe_s.get(c) or [math.inf]) for c in range(len(self.candidates))]
        between = self.between_s if math.isfinite(self.between_s) else 0.0
        *slowest, between = profile.slowest_rank(self._comm(), [*counted, between], self.timer.device)
        return [t + between for t in slowest]

    def _adopt(self, step: int, slowest: Sequence[float]) -> None:
        """Take the candidate of least measured time (`slowest`: _measured_s()); earlier candidates
        win ties."""
        best = min(range(len(slowest)), key=lambda c: (slowest[c], c))
        measured = {
            f"{p.meta.get('chosen')} (measured)": t for p, t in zip(self.candidates, slowest, strict=True)
        }
        chosen = self.candidates[best].with_measured(slowest[best], **measured)
        running = self.plan is not None and self.plan.groups == chosen.groups
        self.adopted_at = step
        if running:  # the same groups and strategies: what they hold goes on, nothing is carried
            self.plan = chosen
            for point in self.points.values():
                self._set_warmup(point, step)  # as a codec made at adoption would stand
        else:
            self.use_plan(chosen, carry=True)
        self.timer.close()
        log.info("gradsync plan='auto' adopted at step %d:\n%s", step, chosen.describe())


def auto_hook(state: AutoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook under plan="auto": the start of each step plans, probes or adopts;
    the bucket itself goes through gradsync's hook."""
    state.start_step(state.step)
    if state.rank == 0 and state.measuring(state.step):
        state.note_errors(bucket)
    future = hook(state, bucket)
    # Planning: when the step's exchange ended (its index: the step was counted as its last
    # bucket went in). Nothing is added to the hook once a plan is adopted.
    index = state._forward.get(state.step - 1) if bucket.is_last() and not state.done else None
    if index is not None:

        def synced(average: torch.Tensor) -> torch.Tensor:
            if average.is_cuda:  # the callback runs once the work is queued, not done
                torch.cuda.current_stream(average.device).synchronize()
            state.timer.synced[index] = time.perf_counter()
            return average

        # Chained, not a done-callback: DDP's wait may return before a callback of its future runs.
        return for_ddp(then(future, synced, bucket.buffer().device))
    return future
