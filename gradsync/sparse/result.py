"""What a sparse exchange returns: the sum over ranks, and what it cost this rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import SparseRows


class Summed:
    """The sum over ranks in the form a scheme ended with: a dense [num_rows, width] tensor, or
    disjoint ascending parts (one per owner for `balanced`, one for the others). Converting only
    when asked saves the sort that merging parts costs where the caller wants a dense tensor."""

    def __init__(
        self, num_rows: int, dense: torch.Tensor | None = None, parts: list[SparseRows] | None = None
    ):
        if (dense is None) == (parts is None):
            raise ValueError("Summed takes either a dense tensor or sparse parts")
        self.num_rows = num_rows
        self._dense = dense
        self._parts = parts

    @property
    def is_dense(self) -> bool:
        return self._dense is not None

    @property
    def nnz(self) -> int:
        """Rows of the union of every rank's rows (num_rows once dense)."""
        if self._parts is None:
            return self.num_rows
        return sum(part.nnz for part in self._parts)

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """Write the sum into `out` ([num_rows, width] or its flat view) and return it."""
        table = out.view(self.num_rows, -1)
        if self._dense is not None:
            table.copy_(self._dense)
            return out
        table.zero_()
        for part in self._parts:  # type: ignore[union-attr]
            table.index_copy_(0, part.indices, part.values.to(table.dtype))
        return out

    def dense(self) -> torch.Tensor:
        if self._dense is not None:
            return self._dense
        part = self._parts[0]  # type: ignore[index]
        return self.into(part.values.new_empty(self.num_rows, part.width))

    def rows(self) -> SparseRows:
        """As one ascending SparseRows (a dense sum keeps only its non-zero rows)."""
        if self._dense is not None:
            return SparseRows.from_dense(self._dense)
        parts = self._parts
        if len(parts) == 1:  # type: ignore[arg-type]
            return parts[0]  # type: ignore[index]
        indices = torch.cat([p.indices for p in parts])  # type: ignore[union-attr]
        order = torch.sort(indices).indices  # the parts are disjoint: no ties
        values = torch.cat([p.values for p in parts]).index_select(0, order)  # type: ignore[union-attr]
        return SparseRows(indices.index_select(0, order), values, self.num_rows)


@dataclass
class SparseResult:
    """One rank's view of one sparse exchange."""

    total: Summed  # the sum over ranks: the same bits on every rank
    scheme: str
    finite: bool  # False when some rank flagged its input as not finite
    sent_nbytes: int  # bytes this rank sent, every round and size exchange included
    push_imbalance: float | None = None  # balanced only: max / mean of rows pushed to each owner
    pull_imbalance: float | None = None  # balanced only: max / mean of the owners' pull bytes
