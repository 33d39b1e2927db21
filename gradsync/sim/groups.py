"""Groups: how backprop-ordered gradients are cut into the units that are exchanged together.

A grouping is a list of groups, each a list of consecutive indices into the gradients in
backprop order; together they cover every gradient once, in order. DDP's buckets are one
grouping; layer-wise (one group per tensor) and model-wise (one group) are MergeComp's extremes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

# DDP's defaults (torch.nn.parallel.DistributedDataParallel): after the first iteration, the
# reducer rebuilds its buckets in gradient-ready order, the first capped at 1 MiB so the first
# allreduce starts early, the rest at bucket_cap_mb = 25 MiB.
DDP_FIRST_BUCKET_NBYTES = 1 << 20
DDP_BUCKET_NBYTES = 25 << 20


def ddp(
    numels: Sequence[int],
    bucket_nbytes: int = DDP_BUCKET_NBYTES,
    first_bucket_nbytes: int = DDP_FIRST_BUCKET_NBYTES,
    element_nbytes: int = 4,
) -> list[list[int]]:
    """DDP's buckets: fill in order, closing a bucket once it holds at least its cap.

    Example:
        >>> ddp([200_000, 200_000, 10_000_000, 1], bucket_nbytes=25 << 20)
        [[0, 1], [2], [3]]
    """
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        current.append(index)
        filled += numel * element_nbytes
        if filled >= (first_bucket_nbytes if not groups else bucket_nbytes):
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def layerwise(count: int) -> list[list[int]]:
    """One group per tensor."""
    return [[i] for i in range(count)]


def single(count: int) -> list[list[int]]:
    """All tensors in one group."""
    return [list(range(count))] if count else []


def equal(numels: Sequence[int], count: int) -> list[list[int]]:
    """`count` groups of about equal size: each cut at the boundary nearest its share of the total.

    Fewer groups come back when there are fewer tensors than `count`.
    """
    if count < 1:
        raise ValueError(f"count={count} must be >= 1 group")
    count = min(count, len(numels)) or 1
    prefix = list(itertools.accumulate(numels, initial=0))  # prefix[b]: numel before boundary b
    total, cuts = prefix[-1], []
    for j in range(1, count):
        low, high = (cuts[-1] if cuts else 0) + 1, len(numels) - (count - j)  # room for the rest
        target = total * j / count
        best = min(range(low, high + 1), key=lambda b: (abs(prefix[b] - target), b))
        cuts.append(best)
    return from_cuts(len(numels), cuts)


def from_cuts(count: int, cuts: Sequence[int]) -> list[list[int]]:
    """Groups that start at index 0 and at each cut: from_cuts(5, [2, 4]) -> [[0, 1], [2, 3], [4]]."""
    bounds = [0, *cuts, count]
    if any(not 0 < c < count for c in cuts) or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cuts {list(cuts)} must be strictly increasing indices in (0, {count})")
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def check(groups: Sequence[Sequence[int]], count: int) -> None:
    """Raise ValueError unless `groups` cover 0..count-1 once, in order, each group consecutive."""
    flat = [i for group in groups for i in group]
    if flat != list(range(count)) or any(len(group) == 0 for group in groups):
        shown = [list(g)[:3] + (["..."] if len(g) > 3 else []) for g in groups[:4]]
        raise ValueError(
            f"groups {shown}{' ...' if len(groups) > 4 else ''} must cover the {count} gradients "
            "once each, in backprop order, as non-empty runs of consecutive indices"
        )
