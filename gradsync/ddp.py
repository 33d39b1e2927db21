"""The DDP communication hook: DDP's buckets mapped to gradsync's groups.

Without a plan, every DDP bucket is a group, exchanged by config.compressor (small buckets and
warm-up steps uncompressed). With a plan (SyncState.use_plan), the steps from the first
compressed one on are cut into the plan's groups (gradsync.regroup), each exchanged by its own
strategy; a group laid out exactly as a bucket is synced in the bucket itself. A state restored
into a fresh DDP model follows the layout it was saved with, whatever buckets DDP builds first.

No `from __future__ import annotations` here: DDP checks the hook's annotations as real objects.
"""

import logging

import torch
import torch.distributed as dist
from torch.futures import Future

from .regroup import Regroup
from .sync import SyncState

log = logging.getLogger("gradsync")


def hook(state: SyncState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one bucket with compression and error feedback."""
    try:
        return _hook(state, bucket)
    except BaseException:
        # A step that raised leaves no half-made regrouping, nor a count of arrivals, to the next.
        state._regroup, state._first_arrivals = None, set()
        raise


def _hook(state: SyncState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    index, is_last = bucket.index(), bucket.is_last()
    local_step = state._local_steps
    if state._initial_iterations > 1 and local_step == 0:
        # Under static_graph, DDP's first iteration hands every bucket as index 0 and none as the
        # last where it has several (parameters of two dtypes). The step ends once every parameter
        # DDP averages has arrived, where the model says how many (nowhere else: is_last is DDP's
        # own word); without it (register_comm_hook, which always waits two iterations), once a
        # parameter arrives again, unannounced.
        ids = {id(p) for p in bucket.parameters()}
        if not state._first_arrivals.isdisjoint(ids):
            state._end_unannounced_step()
            local_step = state._local_steps
        else:
            state._first_arrivals |= ids
            if state._averaged is not None:
                is_last = is_last or len(state._first_arrivals) >= state._averaged
            if is_last:
                state._first_arrivals = set()
    first_iteration = local_step < state._initial_iterations  # DDP's initial buckets, rebuilt later
    if is_last:
        state._local_steps += 1
    buffer = bucket.buffer()
    if buffer.is_sparse:  # a sparse gradient (nn.Embedding(sparse=True)) has a bucket of its own
        if is_last:
            state._regroup = None  # a regrouped step's dense groups all arrived before it
        (param,) = bucket.parameters()
        key = f"param {state._param_index[id(param)]}" if state._param_index else f"bucket {index}"
        return state.sync_rows(buffer, key, is_last)
    if state._param_index is None:  # installed by register_comm_hook, not register(): buckets only
        if state.config.plan is not None:
            # A plan's groups are sets of parameters; without the model there are only buckets
            # (and a plan file, dict or "auto" is read by register(), which checks it).
            raise ValueError(
                f"SyncConfig(plan={_shown(state.config.plan)}) on a SyncState made without the model "
                "(register_comm_hook, a framework's ddp_comm_state): its groups are sets of the model's "
                "parameters, and this state sees DDP's buckets only; use gradsync.register(ddp_model, "
                "config), or drop plan"
            )
        if first_iteration:  # every parameter is in some bucket of DDP's first iteration
            state._watch(bucket.parameters())
        return state.sync(buffer, index, is_last, compress=not first_iteration)
    params = tuple(state._param_index[id(p)] for p in bucket.parameters())
    state._ddp_layout[index] = (local_step, params)
    if state.plan is not None:
        return _planned(state, bucket, params, is_last, local_step)
    if state._regroup is None and not first_iteration and index in state._layout_checked:
        return _in_place(state, buffer, index, is_last, params, local_step)
    if state._regroup is None:
        if first_iteration and not state.layout:
            # Nothing saved to follow, and compression state must be keyed by the rebuilt buckets
            # to come: this step goes uncompressed (only a state saved before it saw a rebuilt
            # bucket can get here past its warm-up).
            return state.sync(buffer, index, is_last, compress=False, params=params)
        if not first_iteration and _laid_out_as_saved(state, index, params):
            state._layout_checked.add(index)
            return _in_place(state, buffer, index, is_last, params, local_step)
        # DDP's buckets differ from those the state was made for (the first iteration of a fresh
        # DDP model after a restore, or another bucket_cap_mb): sync the saved groups instead, for
        # this step, but for those synced in their buckets already.
        done = state._in_place[1] if state._in_place[0] == local_step else set()
        rest = {group: params for group, params in state.layout.items() if group not in done}
        log.info(
            "gradsync: DDP's bucket %d is not laid out as the saved state's groups: step %d syncs %d "
            "saved group(s), cut out of DDP's buckets",
            *(index, state.step, len(rest)),
        )
        state._regroup = Regroup(rest)
    return _regrouped(state, bucket, params, is_last)


def _in_place(
    state: SyncState,
    buffer: torch.Tensor,
    index: int,
    is_last: bool,
    params: tuple[int, ...],
    local_step: int,
) -> Future[torch.Tensor]:
    """Bucket `index`, laid out as the saved group of that index, synced in itself; recorded, so
    that a later bucket of the step that is not laid out as saved regroups the other groups only."""
    if state._in_place[0] != local_step:
        state._in_place = (local_step, set())
    state._in_place[1].add(index)
    return state.sync(buffer, index, is_last, params=params)


def _planned(
    state: SyncState, bucket: dist.GradBucket, params: tuple[int, ...], is_last: bool, local_step: int
) -> Future[torch.Tensor]:
    """The hook under a plan: warm-up steps average DDP's buckets uncompressed; from the first
    compressed step on, the plan's groups are cut out of the buckets and each exchanged by its own
    strategy. The plan's groups do not depend on DDP's buckets, so a state restored past warm-up
    compresses the first iteration of a fresh DDP model too.

    A group laid out exactly as one of DDP's buckets (as the hook saw them the step before) is
    synced in the bucket itself, sparing the copies out of and back into it; the others go
    through one Regroup per step."""
    if state._regroup is None:
        if state.step < state.config.warmup_steps:
            return state.sync(bucket.buffer(), bucket.index(), is_last, compress=False, params=params)
        # This step's first bucket, and the last step's others where DDP had rebuilt them by then
        # (it rebuilds after its first iterations; a bucket of an earlier layout may be gone).
        if local_step < state._initial_iterations:
            current: set[int] = set()  # DDP's initial buckets, rebuilt later
        elif local_step == state._initial_iterations:
            current = {local_step}
        else:
            current = {local_step, local_step - 1}
        buckets = {group for seen, group in state._ddp_layout.values() if seen in current}
        state._direct = {group: index for index, group in state.layout.items() if group in buckets}
        direct = set(state._direct.values())
        state._regroup = Regroup({i: g for i, g in state.layout.items() if i not in direct})
    if params in state._direct:
        future = state.sync(bucket.buffer(), state._direct[params], is_last, params=params)
        if is_last:
            state._regroup.check_complete()
            state._regroup = None
        return future
    return _regrouped(state, bucket, params, is_last)


def _regrouped(state: SyncState, bucket: dist.GradBucket, params: tuple[int, ...], is_last: bool) -> Future:
    """A bucket's share of this step's regrouping: the groups it completes are synced, and its
    future completes once every group it touches is done."""
    regroup = state._regroup
    assert regroup is not None
    buffer = bucket.buffer()
    numels = [p.numel() for p in bucket.parameters()]
    ready = regroup.add(buffer, params, numels, is_last)
    for k, (group, part) in enumerate(ready):
        last = is_last and k == len(ready) - 1
        regroup.synced(group, state.sync(part, group, last, params=state.layout[group]))
    if is_last:
        state._regroup = None
    return regroup.bucket_result(buffer, params, numels)


def _shown(plan: object) -> str:
    """A plan as an error names it: a file or "auto" as given, a Plan or dict by its kind."""
    return repr(plan) if isinstance(plan, str) else f"<{type(plan).__name__}>"


def _laid_out_as_saved(state: SyncState, index: int, params: tuple[int, ...]) -> bool:
    """Whether bucket `index` holds what the state's layout says; records it if the layout is new."""
    saved = state.layout.get(index)
    if saved is None:
        known = {param for group in state.layout.values() for param in group}
        if known.isdisjoint(params):
            state.layout[index] = params
            return True
        return False
    return saved == params
