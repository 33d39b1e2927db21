"""Regroup syncs saved groups of parameters whatever buckets DDP delivers them in."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm import completed
from gradsync.regroup import Regroup

NUMELS = {0: 3, 1: 2, 2: 4, 3: 1, 4: 5, 5: 2}  # parameter position -> numel


class RecordingSync:
    """A sync that scales group g by (g + 1), so each output shows which group carried it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, torch.Tensor]] = []

    def __call__(self, flat: torch.Tensor, group: int, ends_step: bool):
        self.calls.append((group, ends_step, flat.clone()))
        return completed(flat * (group + 1))


def grads(params: tuple[int, ...]) -> dict[int, torch.Tensor]:
    return {p: torch.arange(NUMELS[p], dtype=torch.float32) + 10 * p for p in params}


def bucket(params: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...], list[int]]:
    g = grads(params)
    return torch.cat([g[p] for p in params]), params, [NUMELS[p] for p in params]


def feed(regroup: Regroup, sync: RecordingSync, params: tuple[int, ...], is_last: bool):
    """One bucket through the regrouping, as the hook does: the groups it completes are synced,
    and the bucket's future assembles their results."""
    buffer, params, numels = bucket(params)
    ready = regroup.add(buffer, params, numels, is_last)
    for k, (group, part) in enumerate(ready):
        regroup.synced(group, sync(part, group, is_last and k == len(ready) - 1))
    return regroup.bucket_result(buffer, params, numels)


def test_groups_cut_across_buckets_are_synced_whole_in_their_saved_order() -> None:
    groups = {0: (5, 4, 3), 1: (2, 1, 0)}
    sync = RecordingSync()
    regroup = Regroup(groups)
    buckets = [(4, 5), (2, 3), (0, 1)]  # every bucket straddles the groups' boundaries
    futures = []
    for i, params in enumerate(buckets):
        futures.append((bucket(params)[0], params, feed(regroup, sync, params, i == len(buckets) - 1)))

    # Each group went to sync once, concatenated in its saved order; only the last ends the step.
    assert [(g, last) for g, last, _ in sync.calls] == [(0, False), (1, True)]
    for group, _, flat in sync.calls:
        g = grads(groups[group])
        assert torch.equal(flat, torch.cat([g[p] for p in groups[group]]))
    # Each bucket's result holds its own parameters, as their groups' syncs returned them.
    for buffer, params, future in futures:
        expected = []
        for p in params:
            group = 0 if p in groups[0] else 1
            expected.append(grads((p,))[p] * (group + 1))
        assert torch.equal(future.wait(), torch.cat(expected))
        assert future.wait().shape == buffer.shape


def test_a_bucket_waits_for_a_group_completed_by_a_later_bucket() -> None:
    regroup, sync = Regroup({0: (0, 1, 2, 3, 4, 5)}), RecordingSync()
    first = feed(regroup, sync, (0, 1, 2), is_last=False)
    assert not first.done()  # its group still lacks parameters 3, 4, 5
    last = feed(regroup, sync, (3, 4, 5), is_last=True)
    assert first.done() and last.done()
    assert torch.equal(first.wait(), bucket((0, 1, 2))[0])


def test_an_unknown_parameter_is_refused_with_a_clear_error() -> None:
    regroup = Regroup({0: (0, 1)})
    with pytest.raises(ValueError, match=r"parameter 2 .* is in no group"):
        regroup.add(*bucket((1, 2)), is_last=False)


def test_a_group_left_incomplete_at_the_last_bucket_is_refused() -> None:
    regroup = Regroup({0: (0, 1), 1: (2, 3), 2: (4,)})
    regroup.add(*bucket((0, 1, 2)), is_last=False)
    with pytest.raises(ValueError, match=r"group 1 needs the gradients of parameters \[3\]"):
        regroup.add(*bucket((4,)), is_last=True)
