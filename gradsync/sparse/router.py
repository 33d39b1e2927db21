"""The router: how the DDP hook syncs one tensor's sparse rows, by the configured scheme or, for
"auto", by the selector's choice, and what it reports in state.stats()["sparse"].

Tensors are named by keys that outlive DDP's bucket rebuilds ("param 3": a parameter's position
in model.parameters(); "bucket 1": a compressed bucket's payload), so a choice follows its tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..comm import Comm
from . import exchange
from .agsparse import gather
from .cost import Network, Sparsity, fastest
from .hashing import hash_partition
from .result import SparseResult, Summed
from .rows import SparseRows, sum_rows
from .select import Choice, Selector

AUTO = "auto"


class Router:
    """One SyncState's sparse exchanges: a forced scheme, or the selector's per tensor."""

    def __init__(self, scheme: str, every: int, seed: int) -> None:
        self.scheme = scheme
        self.seed = seed
        self.selector = Selector(every)
        self.last: dict[str, dict[str, Any]] = {}  # per key: the newest exchange, for stats()

    def sync(
        self, key: str, rows: SparseRows, comm: Comm, step: int, finite: bool = True, in_bucket: bool = False
    ) -> SparseResult:
        """The sum of `rows` over the ranks, by this key's scheme. `in_bucket`: the tensor is one
        of an uncompressed bucket's, so going dense costs it no round of its own (it joins its
        neighbours' allreduce)."""
        if self.scheme != AUTO:
            result = self._run(self.scheme, rows, comm, finite)
        elif self.selector.due(key, step):
            # The decision step's exchange is the allgather the measurement needs anyway.
            parts, finite, sent = gather(rows, comm, finite)
            self.selector.decide(key, parts, step, comm, dense_latency=not in_bucket)
            result = SparseResult(Summed(rows.num_rows, parts=[sum_rows(parts)]), "agsparse", finite, sent)
        else:
            result = self._run(self.selector.choices[key].scheme, rows, comm, finite)
        self._record(key, step, rows, result)
        return result

    def choose_dense(self, key: str, density: float, table: torch.Tensor, n: int, step: int) -> bool:
        """For "auto": whether `key`, a [num_rows, width] `table` of an uncompressed bucket whose
        rows are non-zero at mean density `density`, goes dense without measuring more.

        Even with perfect overlap (no densification) a sparse scheme cannot beat dense here, where
        dense costs only its bytes since it joins the bucket's allreduce; so there is nothing to
        gather. The decision is recorded like any other.
        """
        num_rows, width = table.shape
        best_case = Sparsity(num_rows, width, table.element_size(), {m: density for m in _sizes(n)})
        if fastest(best_case, n, self.selector.network or Network(), dense_latency=False) != "dense":
            return False
        self.selector.choices[key] = Choice("dense", step, None)
        return True

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per key: its scheme and why (density, overlap, densification at the last decision) and
        the newest exchange (rows, union, bytes sent, push and pull imbalance)."""
        out = {}
        for key, last in self.last.items():
            choice = self.selector.choices.get(key)
            decided = choice.describe() if choice is not None and self.scheme == AUTO else {}
            out[key] = {**decided, **last}
        return out

    def state_dict(self) -> dict[str, Any]:
        network = self.selector.network
        return {
            "choices": {k: (c.scheme, c.decided_at_step) for k, c in self.selector.choices.items()},
            "network": None if network is None else dataclasses.asdict(network),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Schemes sum in different orders, so a resumed run must keep the original's choices to
        # continue its exact trajectory, and its network to make the same next ones.
        self.selector.choices = {k: Choice(s, at, None) for k, (s, at) in state["choices"].items()}
        network = state["network"]
        self.selector.network = None if network is None else Network(**network)

    def _run(self, scheme: str, rows: SparseRows, comm: Comm, finite: bool) -> SparseResult:
        partition = (
            hash_partition(rows.num_rows, comm.world_size, self.seed) if scheme == "balanced" else None
        )
        return exchange(rows, comm, scheme, finite, partition)

    def _record(self, key: str, step: int, rows: SparseRows, result: SparseResult) -> None:
        self.last[key] = {
            "step": step,
            "exchanged_by": result.scheme,
            "rows": rows.nnz,
            "union_rows": result.total.nnz,
            "num_rows": rows.num_rows,
            "bytes_sent": result.bytes_sent,
            "push_imbalance": result.push_imbalance,
            "pull_imbalance": result.pull_imbalance,
        }


def _sizes(n: int) -> list[int]:
    return sorted({1, n, *(1 << i for i in range(n.bit_length()))} - {0})
