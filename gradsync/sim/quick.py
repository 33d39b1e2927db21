"""The planner's timeline: the simulator's layout of one step, for many assignments at once.

The planner (gradsync.planner) weighs thousands of per-group strategy assignments; the event
simulator (sim/engine.py) takes milliseconds for each. This module lays out the same step as array
operations over groups, for a batch of assignments (rows) at once, in tens of microseconds:

  - each group's compression on the device runs when the group is ready and delays the rest of
    the backward pass: ready_i = forward + r_i + (device compression of the groups before i);
  - offloaded compression and decoding run on the worker's CPU threads, first come first served;
  - transfers run one at a time in group order: end_i = max(start_i, end_{i-1}) + transfer_i,
    a max-plus recurrence, solved as cumsum + maximum.accumulate;
  - decoding on the device shares it with the backward pass while that runs (lengthening it) and
    queues after it otherwise. Since transfers end in group order, the decodes that share the
    device are a prefix of the groups, found with one comparison.

For flat collectives, without jitter or measured contention, this is exactly the layout the
engine computes (tests/test_sim_quick.py checks it). It simplifies three things the engine models:
a two-level exchange holds the network for the sum of its phases (the engine pipelines its intra-
and inter-node steps); a two-shot exchange holds it through the owner's decode and re-encode
between its two transfers (the engine queues them on the device, behind any backward pass still
running); and measured contention between transfers and compute is left out. The
planner's final prediction comes from the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..strategy import Strategy
from .cluster import Cluster
from .compute import Compute, Gradient
from .phases import copy_phases, phases

# The columns of a cost vector: seconds of one group's exchange on each resource, in the order the
# engine lays them out.
DEVICE_PRE, CPU_PRE, NET, DEVICE_POST, CPU_POST = range(5)
COLUMNS = ("device_pre", "cpu_pre", "net", "device_post", "cpu_post")


def cost_vector(
    strategy: Strategy, numel: int, cluster: Cluster, sparse: Sequence[Gradient] = (), copied: bool = False
) -> np.ndarray:
    """The five costs (COLUMNS) of exchanging one group of `numel` elements by `strategy`: work
    before its first transfer on the device, then on a CPU thread; everything from its first
    transfer to its last (the network's time); work after it on the device or on a CPU thread.
    `copied`: the group is cut out of DDP's buckets and copied back (strategy.copy_phases)."""
    out = np.zeros(len(COLUMNS))
    steps = phases(strategy, numel, cluster, sparse)
    if copied:
        steps = copy_phases(steps, numel, cluster)
    transfers = [i for i, p in enumerate(steps) if p.resource not in ("device", "cpu")]
    if not transfers:
        return out
    first, last = transfers[0], transfers[-1]
    for i, phase in enumerate(steps):
        if i < first:
            out[DEVICE_PRE if phase.resource == "device" else CPU_PRE] += phase.seconds
        elif i <= last:
            out[NET] += phase.seconds
        else:
            out[DEVICE_POST if phase.resource == "device" else CPU_POST] += phase.seconds
    return out


@dataclass(frozen=True)
class Layout:
    """One step per row of assignments: its time, and when each group's transfer ran."""

    step_s: np.ndarray  # (rows,)
    link_start_s: np.ndarray  # (rows, groups): when the group's first transfer starts
    link_end_s: np.ndarray  # (rows, groups): when its last transfer ends


def ready_times(compute: Compute, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """When each group's last gradient is ready, from the start of the backward pass."""
    return np.array([compute.gradients[group[-1]].ready_s for group in groups])


def layout(compute: Compute, ready_s: np.ndarray, costs: np.ndarray, cpu_threads: int = 2) -> Layout:
    """Lay out one step for each row of `costs` (rows, groups, 5): group i of row r costs
    costs[r, i] (see cost_vector). `ready_s` is ready_times(compute, groups)."""
    costs = np.asarray(costs, dtype=float)
    if costs.ndim == 2:
        costs = costs[None]
    return layout_columns(compute, ready_s, np.ascontiguousarray(np.moveaxis(costs, -1, 0)), cpu_threads)


def layout_columns(
    compute: Compute, ready_s: np.ndarray, columns: np.ndarray, cpu_threads: int = 2, offloads: bool = True
) -> Layout:
    """layout() with the costs as columns (5, rows, groups): the planner's hot path. `offloads`
    False promises that no group runs anything on CPU threads, which saves looking."""
    device_pre, cpu_pre, net, device_post, cpu_post = columns
    shift = np.cumsum(device_pre, axis=1)
    compressed = shift + (compute.forward_s + ready_s)  # ready, then compressed on the device
    backward_end = shift[:, -1] + (compute.forward_s + compute.backward_s)

    offloads = offloads and bool(cpu_pre.any() or cpu_post.any())
    threads = _Threads(len(net), cpu_threads) if offloads else None
    transfer_ready = threads.run_all(compressed, cpu_pre) if threads else compressed

    # Transfers in group order, one at a time; a group with nothing to send does not wait for them.
    sent = np.cumsum(net, axis=1)
    sends = net > 0
    if sends.all():  # the usual case: every group sends something
        link_end = sent + np.maximum.accumulate(transfer_ready - (sent - net), axis=1)
    else:
        lead = np.maximum.accumulate(np.where(sends, transfer_ready - (sent - net), -np.inf), axis=1)
        link_end = np.where(sends, sent + lead, transfer_ready)

    # After the transfers: decoding on a CPU thread, then work on the device (decoding, or the
    # copy back into DDP's buckets), each asked for when what comes before it ends.
    asked = link_end
    if threads is not None:
        asked = threads.run_all(link_end, cpu_post)
    if threads is not None and (cpu_post * device_post).any():
        finish = _device_in_order(asked, device_post, backward_end)  # asks out of group order
    else:
        finish = _device_after(asked, device_post, backward_end)
    return Layout(finish + compute.optimizer_s, link_end - net, link_end)


def _device_after(asked: np.ndarray, seconds: np.ndarray, backward_end: np.ndarray) -> np.ndarray:
    """When each row's step is done: device work of `seconds` asked for at `asked`, in group
    order, where `asked` does not decrease along a row, after the backward pass that ends at
    `backward_end` as far as it is known.

    Work asked for while the backward pass (lengthened by the work before) still runs shares the
    device with it, so it ends before the pass does; the rest queues after it, one at a time.
    Since the asks do not decrease, the sharing groups are a prefix, found with one comparison;
    and only the queue's end matters, a max-plus recurrence's last value."""
    idle = seconds == 0
    before = np.cumsum(seconds, axis=1) - seconds
    sharing = np.logical_and.accumulate((asked - before < backward_end[:, None]) | idle, axis=1)
    queued = ~sharing & ~idle
    queue_cost = seconds * queued
    queue_before = np.cumsum(queue_cost, axis=1) - queue_cost
    queue_end = np.where(queued, asked - queue_before, -np.inf).max(axis=1) + queue_cost.sum(axis=1)
    backward_end = backward_end + (seconds * sharing).sum(axis=1)
    return np.maximum(np.maximum(backward_end, queue_end), asked.max(axis=1))


def _device_in_order(asked: np.ndarray, seconds: np.ndarray, backward_end: np.ndarray) -> np.ndarray:
    """_device_after for asks in any order: one group at a time, as the engine's device does."""
    done, after = asked.max(axis=1), np.zeros(len(asked))
    for group in np.flatnonzero(seconds.any(axis=0)):
        t, s = asked[:, group], seconds[:, group]
        sharing = (t < backward_end) & (s > 0)
        finish = np.where(sharing, t, np.maximum(t, after)) + s
        backward_end = np.where(sharing, backward_end + s, backward_end)
        after = np.where((s > 0) & ~sharing, finish, after)
        done = np.maximum(done, finish)
    return np.maximum(backward_end, done)


class _Threads:
    """Each row's CPU threads: the one free first takes the next job, as the engine's do."""

    def __init__(self, rows: int, count: int) -> None:
        self.free = np.zeros((rows, count))
        self.rows = np.arange(rows)

    def run_all(self, asked: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """Jobs asked for at `asked` (rows, groups) lasting `seconds`, in group order; their ends
        (the asked time where a group has no job)."""
        end = asked.copy()
        for group in np.flatnonzero(seconds.any(axis=0)):
            busy = seconds[:, group] > 0
            thread = self.free.argmin(axis=1)
            start = np.maximum(asked[:, group], self.free[self.rows, thread])
            finish = start + seconds[:, group]
            self.free[self.rows, thread] = np.where(busy, finish, self.free[self.rows, thread])
            end[:, group] = np.where(busy, finish, asked[:, group])
        return end
