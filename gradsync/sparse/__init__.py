"""Sparse gradient synchronization: four exact schemes and the selector that picks among them.

A sparse gradient is a set of rows (SparseRows): an embedding's touched rows, or the entries a
sparsifying compressor kept. Every scheme returns the same sum as a dense allreduce of the same
tensors, on every rank with the same bits:
  dense         scatter into a zero tensor, one allreduce
  agsparse      allgather every rank's rows (AGsparse)
  balanced      push rows to hash-chosen owners, owners allgather their sums (Zen)
  recursive-doubling  partners swap partial sums, switching to dense when smaller (SparCML)

Example:
    >>> from gradsync import sparse
    >>> rows = sparse.SparseRows.from_coo(embedding.weight.grad)
    >>> result = sparse.exchange(rows, comm, "balanced")
    >>> result.total.rows()  # the sum over ranks, as SparseRows
"""

from __future__ import annotations

from collections.abc import Callable

from ..comm import Comm
from ..registry import lookup
from .agsparse import agsparse
from .balanced import balanced
from .dense import dense
from .doubling import recursive_doubling
from .hashing import HashPartition, Partition, RangePartition
from .result import SparseResult, Summed
from .rows import SparseRows, sum_rows

Scheme = Callable[..., SparseResult]

SCHEMES: dict[str, Scheme] = {
    "dense": dense,
    "agsparse": agsparse,
    "balanced": balanced,
    "recursive-doubling": recursive_doubling,
}

__all__ = [
    "SCHEMES",
    "HashPartition",
    "Partition",
    "RangePartition",
    "SparseResult",
    "SparseRows",
    "Summed",
    "exchange",
    "names",
    "sum_rows",
]


def names() -> list[str]:
    """Every scheme name, in table order."""
    return list(SCHEMES)


def exchange(
    rows: SparseRows, comm: Comm, scheme: str, finite: bool = True, partition: Partition | None = None
) -> SparseResult:
    """Sum `rows` over the ranks of `comm` by `scheme`; blocks until the sum is here.

    `finite=False` flags this rank's input as not finite (the result's `finite` is then False on
    every rank). `partition` (balanced only) assigns rows to owners; by default the HashPartition
    with seed 0, the same on every rank. Every rank must pass rows of the same tensor shape and
    dtype and the same scheme. Rows built by hand out of order, or repeated, are sorted and their
    duplicates summed first (SparseRows.from_pairs): refused on one rank, they would leave the
    others waiting in the exchange.
    """
    rows = SparseRows.from_pairs(rows.indices, rows.values, rows.num_rows)  # as it is where in order
    return run_scheme(rows, comm, scheme, finite, partition)


def run_scheme(
    rows: SparseRows, comm: Comm, scheme: str, finite: bool = True, partition: Partition | None = None
) -> SparseResult:
    """exchange() for rows known ascending and distinct (the router's: from_coo's and the
    sparsifiers' payloads), which it does not check: on a GPU each check waits for the device."""
    run = lookup(SCHEMES, "sparse scheme", scheme)
    if scheme == "balanced":
        return run(rows, comm, finite, partition)
    if partition is not None:
        raise ValueError(f"partition is for the 'balanced' scheme only, not {scheme!r}; leave it out")
    return run(rows, comm, finite)
