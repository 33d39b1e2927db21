"""Regroup: sync one step's gradients in given groups of parameters, whatever DDP's buckets are.

Compression state belongs to a group of parameters: a plan's group (gradsync.plan), or a DDP
bucket as laid out when the state was made. DDP does not deliver a plan's groups at all, and not
always the saved buckets either: a freshly built DDP model's first iteration uses its initial
bucket layout, and only then rebuilds its buckets in gradient-ready order, the layout a
checkpointed state was saved with. So each group is cut out of whichever buckets hold its
parameters, concatenated in its own order, and synced with its own compression point as soon as
all its parameters have arrived. A bucket's future completes once every group it touches is done.

Every rank receives DDP's buckets in the same order, so groups complete, and issue their
collectives, in the same order on every rank: that of their last parameter's arrival (groups
completed by one bucket in index order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.futures import Future

from .comm import for_ddp, forward, then


class Regroup:
    """One step's worth of regrouping; feed it every bucket of the step, in DDP's order.

    add() takes a bucket and returns the groups it completes, each as one tensor to sync; the
    caller syncs them and hands each future back through synced(); bucket_result() is then the
    future of the bucket's averaged buffer.
    """

    def __init__(self, groups: Mapping[int, Sequence[int]]) -> None:
        self._groups = {index: tuple(params) for index, params in groups.items()}
        self._group_of = {param: index for index, params in self._groups.items() for param in params}
        self._arrived: dict[int, dict[int, torch.Tensor]] = {}  # group -> param -> gradient view
        # group -> the future of its average; on a GPU, one that records its value's stream, so
        # that whoever waits for it waits for the GPU's work too (made with the first bucket).
        self._results: dict[int, Future] = {}

    def add(
        self, buffer: torch.Tensor, params: Sequence[int], numels: Sequence[int], is_last: bool
    ) -> list[tuple[int, torch.Tensor]]:
        """Take one bucket (its flat buffer holds `params` in order); the groups it completes, in
        index order, each with its gradients concatenated in the group's own order."""
        flat = buffer.view(-1)
        if not self._results:
            devices = [buffer.device] if buffer.device.type == "cuda" else None
            self._results = {index: Future(devices=devices) for index in self._groups}
        touched: list[int] = []
        for param, (lo, hi) in _spans(params, numels).items():
            group = self._group_of.get(param)
            if group is None:
                raise ValueError(
                    f"parameter {param} (position in model.parameters()) is in no group of this gradsync "
                    f"state ({dict(self._groups)}): the model changed since the checkpoint; register "
                    "gradsync afresh for this model"
                )
            self._arrived.setdefault(group, {})[param] = flat[lo:hi]
            if group not in touched:
                touched.append(group)
        ready = sorted(g for g in touched if len(self._arrived[g]) == len(self._groups[g]))
        if is_last:
            self.check_complete()
        return [(group, torch.cat([self._arrived[group][p] for p in self._groups[group]])) for group in ready]

    def synced(self, group: int, future: Future) -> None:
        """The future of group `group`'s average, as its sync returned it."""
        forward(future, self._results[group])

    def bucket_result(self, buffer: torch.Tensor, params: Sequence[int], numels: Sequence[int]) -> Future:
        """The future of a bucket's averaged buffer: its parameters' slices of their groups' sums,
        once every group it touches is done."""
        spans = _spans(params, numels)
        touched = list(dict.fromkeys(self._group_of[param] for param in params))

        def assemble(_: Future) -> torch.Tensor:
            out = torch.empty_like(buffer.view(-1))
            for group in touched:
                synced = self._results[group].wait().view(-1)  # on a GPU: after its stream's work
                start = 0
                for param in self._groups[group]:
                    size = self._arrived[group][param].numel()
                    if param in spans:
                        lo, hi = spans[param]
                        out[lo:hi] = synced[start : start + size]
                    start += size
            return out.view_as(buffer)

        assembled = then(
            torch.futures.collect_all([self._results[g] for g in touched]), assemble, buffer.device
        )
        return for_ddp(assembled)

    def check_complete(self) -> None:
        """At the step's last bucket, every group must have all of its gradients: a group left
        out would go unsynced, and its parameters would keep this rank's own gradient."""
        for group, params in self._groups.items():
            missing = sorted(set(params) - set(self._arrived.get(group, {})))
            if missing:
                raise ValueError(
                    f"gradsync group {group} needs the gradients of parameters {missing}, which no "
                    "bucket of this step delivered (unused parameters?); register gradsync afresh"
                )


def _spans(params: Sequence[int], numels: Sequence[int]) -> dict[int, tuple[int, int]]:
    spans = {}
    offset = 0
    for param, numel in zip(params, numels, strict=True):
        spans[param] = (offset, offset + numel)
        offset += numel
    return spans
