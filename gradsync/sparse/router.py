"""The router: how the hook syncs one tensor's sparse rows, by the configured scheme or, for
"auto", by the selector's choice, and what it reports in state.stats()["sparse"].

Tensors are named by keys that outlive DDP's bucket rebuilds ("param 3": a parameter's position
in model.parameters(); "group 1": a compressed group's payload), so a choice follows its tensor.
Every call is a collective: all ranks make it for the same key at the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm
from . import run_scheme
from .agsparse import gather
from .cost import Sparsity, fastest
from .hashing import hash_partition
from .result import SparseResult, Summed
from .rows import SparseRows, sum_rows
from .select import Choice, Selector

AUTO = "auto"


@dataclass(frozen=True)
class Table:
    """An embedding's [num_rows, width] gradient at `offset` in a group's flat tensor."""

    key: str  # "param 3": its position in model.parameters()
    offset: int
    num_rows: int
    width: int

    @property
    def numel(self) -> int:
        return self.num_rows * self.width

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.num_rows, self.width)


class Router:
    """One SyncState's sparse exchanges: a forced scheme, or the selector's per tensor."""

    def __init__(self, scheme: str, every: int, seed: int) -> None:
        self.scheme = scheme
        self.seed = seed
        self.selector = Selector(every)
        self.last: dict[str, dict[str, Any]] = {}  # per key: the newest exchange, for stats()

    def sync(
        self,
        key: str,
        rows: SparseRows,
        comm: Comm,
        step: int,
        finite: bool = True,
        in_bucket: bool = False,
        scheme: str | None = None,
    ) -> SparseResult:
        """The sum of `rows` over the ranks, by this key's scheme: `scheme` where given (a plan's),
        else the router's. `in_bucket`: the tensor is one of an uncompressed group's, so going
        dense costs it no round of its own (it joins its neighbours' allreduce)."""
        scheme = scheme or self.scheme
        if scheme != AUTO:
            result = self._run(scheme, rows, comm, finite)
        elif self.selector.due(key, step):
            # The decision step's exchange is the allgather the measurement needs anyway.
            parts, finite, sent = gather(rows, comm, finite)
            self.selector.decide(key, parts, step, comm, dense_latency=not in_bucket)
            result = SparseResult(Summed(rows.num_rows, parts=[sum_rows(parts)]), "agsparse", finite, sent)
        else:
            result = self._run(self.selector.choices[key].scheme, rows, comm, finite)
        self._record(key, step, rows, result)
        return result

    def choose_tables(
        self, tables: Sequence[Table], flat: torch.Tensor, comm: Comm, step: int, scheme: str | None = None
    ) -> list[bool]:
        """Which of an uncompressed group's embedding tables go as rows (True), the others joining
        the group's allreduce. A forced scheme takes every table. "auto" measures each table's
        density on its decision steps (one allreduce of the counts of non-zero rows, so that every
        rank decides alike): a table where no sparse scheme could beat dense goes dense; the others
        are gathered and decided by the selector. Between decisions, each keeps its choice.
        `scheme`: a group's own (a plan's), else the router's."""
        scheme = scheme or self.scheme
        if scheme != AUTO:
            return [scheme != "dense"] * len(tables)
        due = [t for t in tables if self.selector.due(t.key, step)]
        by_rows: dict[str, bool] = {}
        if due:
            counts = torch.tensor(
                [float(t.view(flat).ne(0).any(dim=1).sum()) for t in due], dtype=torch.float64
            )
            mean_rows = comm.allreduce(counts.to(flat.device)).wait().cpu() / comm.world_size
            for table, rows in zip(due, mean_rows.tolist(), strict=True):
                density = rows / table.num_rows
                by_rows[table.key] = not self.choose_dense(
                    table.key, density, table.view(flat), comm.world_size, step
                )
        return [
            by_rows[t.key] if t.key in by_rows else self.selector.choices[t.key].scheme != "dense"
            for t in tables
        ]

    def choose_dense(self, key: str, density: float, table: torch.Tensor, n: int, step: int) -> bool:
        """For "auto": whether `key`, a [num_rows, width] `table` of an uncompressed bucket whose
        rows are non-zero at mean density `density`, goes dense without measuring more.

        Even with perfect overlap (no densification) a sparse scheme cannot beat dense here, where
        dense costs only its bytes since it joins the bucket's allreduce; so there is nothing to
        gather. The decision is recorded like any other.
        """
        num_rows, width = table.shape
        best_case = Sparsity(num_rows, width, table.element_size(), {m: density for m in _sizes(n)})
        if fastest(best_case, n, self.selector.network, dense_latency=False) != "dense":
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
        return {"choices": {k: (c.scheme, c.decided_at_step) for k, c in self.selector.choices.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.selector.choices = self.saved_choices(state)

    @staticmethod
    def saved_choices(state: dict[str, Any]) -> dict[str, Choice]:
        """The choices a state_dict() holds. Schemes sum in different orders, so a resumed run
        must keep the original's choices to continue its exact trajectory."""
        return {key: Choice(scheme, at, None) for key, (scheme, at) in state["choices"].items()}

    def _run(self, scheme: str, rows: SparseRows, comm: Comm, finite: bool) -> SparseResult:
        partition = (
            hash_partition(rows.num_rows, comm.world_size, self.seed) if scheme == "balanced" else None
        )
        return run_scheme(rows, comm, scheme, finite, partition)

    def _record(self, key: str, step: int, rows: SparseRows, result: SparseResult) -> None:
        self.last[key] = {
            "step": step,
            "exchanged_by": result.scheme,
            "rows": rows.nnz,
            "union_rows": result.total.nnz,
            "num_rows": rows.num_rows,
            "sent_nbytes": result.sent_nbytes,
            "push_imbalance": result.push_imbalance,
            "pull_imbalance": result.pull_imbalance,
        }


def _sizes(n: int) -> list[int]:
    return sorted({1, n, *(1 << i for i in range(n.bit_length()))} - {0})
