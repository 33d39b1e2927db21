"""The timeline simulator: one data-parallel training step, laid out in time on every worker.

Every worker runs the forward pass, then the backward pass, which makes each group's gradients
ready in backprop order. A ready group is exchanged by its strategy's phases (sim/phases.py):
  - work on the worker's device: compression at the moment the group is ready delays the rest
    of the backward pass (the device is busy; Espresso's compute contention); work that comes
    after a transfer (decoding) takes its time from the backward pass if that is still running,
    and queues after it otherwise;
  - work on a CPU thread (offloaded codecs): one thread per worker, first come first served;
  - transfers: collectives start in group order when every worker taking part has its input
    ready and the links are free (one collective at a time per link, as NCCL's and gloo's single
    communication stream); a flat collective takes every link, a two-level one the nodes' own
    intra-node links, then the links between nodes, then the intra-node links again.
The optimizer steps once the backward pass and every group's exchange are done.

Workers may differ: `jitter` scales each worker's compute by 1 + jitter * N(0, 1) from a seeded
generator, and a collective waits for its slowest worker. All workers are simulated as arrays,
so a step of 16,384 workers costs a few numpy operations per phase.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..strategy import Strategy, parse
from . import groups as grouping
from .cluster import Cluster
from .compute import Compute
from .phases import Phase, copy_phases, payload_nbytes, phases

# Gantt lanes of worker 0 and its node; CPU threads are lanes "cpu 0", "cpu 1", ...
COMPUTE, CODEC, CPU, NETWORK, INTRA, INTER = "compute", "codec", "cpu", "network", "intra-node", "inter-node"
LINK_LANES = (NETWORK, INTRA, INTER)
_LANE = {"device": CODEC, "cpu": CPU, "net": NETWORK, "intra": INTRA, "inter": INTER}


@dataclass(frozen=True)
class Span:
    """Something worker 0 (or its node's links) did from start_s to end_s."""

    lane: str
    label: str
    start_s: float
    end_s: float
    group: int | None = None


@dataclass(frozen=True)
class GroupTiming:
    """One group's exchange as worker 0 saw it."""

    index: int
    numel: int
    strategy: str
    payload_bytes: int
    ready_s: float  # its last gradient is ready on worker 0
    all_ready_s: float  # ... and on the slowest worker: no collective of it starts before
    start_s: float  # its first transfer starts
    done_s: float  # its exchange (decoding included) is done on worker 0


@dataclass(frozen=True)
class Result:
    """A simulated step: its time, the scaling factor and the timeline of worker 0."""

    step_s: float
    compute_s: float  # one worker alone: forward + backward + optimizer, nothing to exchange
    world_size: int
    batch_size: int
    spans: tuple[Span, ...]
    groups: tuple[GroupTiming, ...]
    cluster: str = ""
    strategy: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        """Throughput at n workers over n times one worker's: compute_s / step_s."""
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0

    @property
    def samples_per_s(self) -> float:
        return self.world_size * self.batch_size / self.step_s

    @property
    def communication_s(self) -> float:
        """Time worker 0's node had any link busy (the union of its transfers)."""
        return _union([(s.start_s, s.end_s) for s in self.spans if s.lane in LINK_LANES])


def simulate(
    compute: Compute,
    cluster: Cluster,
    strategy: Strategy | str | Sequence[Strategy | str] = "none",
    groups: Sequence[Sequence[int]] | None = None,
    jitter: float = 0.0,
    seed: int = 0,
    copied: Sequence[bool] | None = None,
) -> Result:
    """Simulate one step of `compute` on `cluster`, each group exchanged by its strategy.

    `strategy` is one strategy for every group or one per group; `groups` default to DDP's
    buckets (sim/groups.py). `copied[i]` says that group i is not one of DDP's buckets, so the
    hook copies its gradients out of the buckets when it is ready and the result back after
    (strategy.copy_phases); default: no group is copied.

    Example:
        >>> from gradsync.sim import cluster, compute, models
        >>> work = compute.from_model(models.build("bert-base"), cluster.device("v100"))
        >>> result = simulate(work, cluster.cluster(8, 8, "v100", "25gbit"), "fp16")
        >>> round(result.scaling, 2) < 1
        True
    """
    if jitter < 0:
        raise ValueError(f"jitter={jitter} must be >= 0 (a coefficient of variation, e.g. 0.05)")
    numels = compute.numels
    groups = grouping.ddp(numels) if groups is None else [list(g) for g in groups]
    grouping.check(groups, len(numels))
    per_group = _strategies(strategy, len(groups))
    workers, nodes, per_node = cluster.world_size, cluster.nodes, cluster.gpus_per_node
    rng = np.random.default_rng(seed)
    scale = np.clip(1 + jitter * rng.standard_normal(workers), 0.5, None) if jitter else np.ones(workers)

    group_numels = [sum(numels[i] for i in group) for group in groups]
    plans = [
        phases(s, n, cluster, [compute.gradients[i] for i in group if compute.gradients[i].density])
        for s, n, group in zip(per_group, group_numels, groups, strict=True)
    ]
    if copied is not None:
        if len(copied) != len(groups):
            raise ValueError(f"copied has {len(copied)} flags for {len(groups)} groups; give one per group")
        plans = [
            copy_phases(plan, n, cluster) if c else plan
            for plan, n, c in zip(plans, group_numels, copied, strict=True)
        ]
    spans: list[Span] = [Span(COMPUTE, "forward", 0.0, compute.forward_s * scale[0])]

    ready, device = _backward_pass(compute, groups, plans, scale, spans)
    threads = _Threads(workers, cluster.cpu_threads)
    transfer_ready = _offloaded_compression(plans, ready, threads, spans)

    # The exchanges, in group order: transfers, then decoding.
    links = _Links(nodes, per_node)
    done = np.zeros(workers)
    timings = []
    for index, plan in enumerate(plans):
        t = transfer_ready[index]
        first_transfer = None
        for phase in plan[len(_before_transfers(plan)) :]:
            lane = _LANE[phase.resource]
            if phase.resource == "device":
                start, t = device.run(t, phase.seconds)
                start0 = float(start[0])
            elif phase.resource == "cpu":
                start, t, thread = threads.run(t, phase.seconds)
                start0, lane = float(start[0]), f"{CPU} {thread}"
            else:
                start0, t = links.transfer(phase, t, _contended(phase, device.end))
                if phase.compute_slowdown:
                    device.end = _slowed(device.end, start0, t, phase.compute_slowdown)
                first_transfer = start0 if first_transfer is None else first_transfer
            spans.append(Span(lane, phase.label, start0, float(t[0]), index))
        done = np.maximum(done, t)
        payload = payload_nbytes(per_group[index], group_numels[index], cluster)
        started = first_transfer if first_transfer is not None else float(t[0])
        timings.append(
            GroupTiming(
                index,
                group_numels[index],
                per_group[index].text,
                payload,
                float(ready[index][0]),
                float(ready[index].max()),
                started,
                float(t[0]),
            )
        )

    if float(device.end[0]) > device.tail:
        spans.append(Span(COMPUTE, "backward", device.tail, float(device.end[0])))
    finish = np.maximum(np.maximum(device.end, device.after), done)
    step_end = finish + compute.optimizer_s * scale
    spans.append(Span(COMPUTE, "optimizer", float(finish[0]), float(step_end[0])))
    texts = {s.text for s in per_group}
    return Result(
        step_s=float(step_end.max()),
        compute_s=compute.step_s,
        world_size=workers,
        batch_size=compute.batch_size,
        spans=tuple(spans),
        groups=tuple(timings),
        cluster=cluster.describe(),
        strategy=texts.pop() if len(texts) == 1 else "per group",
        meta={"model": compute.name, "groups": len(groups), "jitter": jitter, "seed": seed},
    )


def _backward_pass(
    compute: Compute, groups: list[list[int]], plans: list[list[Phase]], scale: np.ndarray, spans: list[Span]
) -> tuple[list[np.ndarray], _Device]:
    """When each group is ready on each worker, and the device: the backward pass, delayed by the
    compression that runs on the device as each group becomes ready (in backprop order)."""
    forward_end = compute.forward_s * scale
    shift = np.zeros(len(scale))
    ready: list[np.ndarray] = []
    piece_start = float(forward_end[0])
    for index, (group, plan) in enumerate(zip(groups, plans, strict=True)):
        at = forward_end + compute.gradients[group[-1]].ready_s * scale + shift
        ready.append(at)
        spans.append(Span(COMPUTE, "backward", piece_start, float(at[0]), index))
        piece_start = float(at[0])
        for phase in _leading_device_work(plan):
            spans.append(Span(CODEC, phase.label, piece_start, piece_start + phase.seconds, index))
            piece_start += phase.seconds
            shift += phase.seconds
    return ready, _Device(forward_end + compute.backward_s * scale + shift, piece_start)


def _offloaded_compression(
    plans: list[list[Phase]], ready: list[np.ndarray], threads: _Threads, spans: list[Span]
) -> list[np.ndarray]:
    """When each group's first transfer may start: after its compression. Offloaded codecs go to
    the CPU threads first come first served, in ready order, ahead of the decoding of earlier
    groups, which is asked for only once their transfers are done."""
    transfer_ready = []
    for index, plan in enumerate(plans):
        lead = _leading_device_work(plan)
        t = ready[index] + sum(p.seconds for p in lead)
        for phase in _before_transfers(plan)[len(lead) :]:
            start, t, thread = threads.run(t, phase.seconds)
            spans.append(Span(f"{CPU} {thread}", phase.label, float(start[0]), float(t[0]), index))
        transfer_ready.append(t)
    return transfer_ready


class _Device:
    """Each worker's compute device once the backward pass is laid out: when that pass ends (later
    as work shares the device with it) and when the work queued after it ends."""

    def __init__(self, end: np.ndarray, tail: float) -> None:
        self.end = end
        self.after = np.zeros_like(end)
        self.tail = tail  # worker 0's last backward piece starts here (for the Gantt)

    def run(self, t: np.ndarray, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """Work asked for at `t` (decoding): it shares the device with the backward pass while
        that runs, and queues after it otherwise. (start, end) per worker."""
        stealing = t < self.end
        self.end = np.where(stealing, self.end + seconds, self.end)
        start = np.where(stealing, t, np.maximum(t, self.after))
        finish = start + seconds
        self.after = np.where(stealing, self.after, finish)
        return start, finish


class _Threads:
    """Each worker's CPU threads for offloaded codecs: the one free first takes the next job."""

    def __init__(self, workers: int, count: int) -> None:
        self.free = np.zeros((workers, count))
        self.rows = np.arange(workers)

    def run(self, t: np.ndarray, seconds: float) -> tuple[np.ndarray, np.ndarray, int]:
        """A job asked for at `t` (per worker): (start, end, worker 0's thread)."""
        thread = self.free.argmin(axis=1)
        start = np.maximum(t, self.free[self.rows, thread])
        end = start + seconds
        self.free[self.rows, thread] = end
        return start, end, int(thread[0])


class _Links:
    """When each node's intra-node links and the inter-node links are next free."""

    def __init__(self, nodes: int, per_node: int) -> None:
        self.nodes, self.per_node = nodes, per_node
        self.intra_free = np.zeros(nodes)
        self.inter_free = 0.0

    def transfer(
        self, phase: Phase, t: np.ndarray, seconds: Callable[[float], float] | None = None
    ) -> tuple[float, np.ndarray]:
        """One transfer whose inputs are ready at `t` (per worker): (start on worker 0, end per worker).

        `seconds(start)`, if given, is how long a transfer over every worker takes from `start`."""
        if phase.resource == "intra":
            node_ready = t.reshape(self.nodes, self.per_node).max(axis=1)
            start = np.maximum(node_ready, self.intra_free)
            self.intra_free = start + phase.seconds
            return float(start[0]), np.repeat(self.intra_free, self.per_node)
        # A flat collective, or the inter-node step of a two-level one: every worker takes part.
        start = max(float(t.max()), self.inter_free)
        if phase.resource == "net":  # it also crosses every node's intra-node links
            start = max(start, float(self.intra_free.max()))
        end = start + (seconds(start) if seconds is not None else phase.seconds)
        self.inter_free = end
        if phase.resource == "net":
            self.intra_free[:] = end
        return start, np.full(t.shape, end)


def _contended(phase: Phase, device_end: np.ndarray) -> Callable[[float], float] | None:
    """How long a transfer over every worker lasts from its start, where the part that overlaps the
    backward pass (until the slowest worker's ends) runs slower by the phase's transfer slowdown."""
    slowdown = phase.transfer_slowdown
    if not slowdown:
        return None
    busy_until = float(device_end.max())

    def seconds(start: float) -> float:
        shared = max(0.0, busy_until - start)  # wall time during which the compute still runs
        if phase.seconds * (1 + slowdown) <= shared:
            return phase.seconds * (1 + slowdown)
        return shared + (phase.seconds - shared / (1 + slowdown))

    return seconds


def _slowed(device_end: np.ndarray, start: float, end: np.ndarray, slowdown: float) -> np.ndarray:
    """When the backward pass ends if, from `start` to `end`, a transfer ran beside it and the
    compute went at 1 / (1 + slowdown) of its speed."""
    work = np.clip(device_end - start, 0.0, None)  # backward left at `start`, at full speed
    shared = end - start
    slow = work * (1 + slowdown)
    # Done during the transfer: all of it slowed. Else the transfer's span at the slow speed, the
    # rest at full speed afterwards.
    return np.where(
        work > 0,
        start + np.where(shared >= slow, slow, work + shared * slowdown / (1 + slowdown)),
        device_end,
    )


def _before_transfers(plan: list[Phase]) -> list[Phase]:
    """A group's phases before its first transfer: its compression, on the device or a CPU thread."""
    lead = []
    for phase in plan:
        if phase.resource not in ("device", "cpu"):
            break
        lead.append(phase)
    return lead


def _leading_device_work(plan: list[Phase]) -> list[Phase]:
    """The device phases before a group's first transfer: compression at ready time."""
    lead = []
    for phase in plan:
        if phase.resource != "device":
            break
        lead.append(phase)
    return lead


def _strategies(strategy: Strategy | str | Sequence[Strategy | str], count: int) -> list[Strategy]:
    if isinstance(strategy, (str, Strategy)):
        return [parse(strategy) if isinstance(strategy, str) else strategy] * count
    chosen = [parse(s) if isinstance(s, str) else s for s in strategy]
    if len(chosen) != count:
        raise ValueError(f"{len(chosen)} strategies given for {count} groups; give one, or one per group")
    return chosen


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total
