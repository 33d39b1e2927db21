"""The sparse exchange benchmark's schemes: their names, what each runs, and how its sums are checked.

Holds the scheme names in table order, the ones the traffic model covers, the gradsync.sparse scheme
and partition each benchmark scheme runs, and the sum checks' tolerances. They are shared by the
runner (bench/sparse.py), each rank (bench/sparse_worker.py), the traffic model and the report, so
they live apart from all of them: each rank imports what it runs without the runner and the report.
"""

from __future__ import annotations

from ..sparse import HashPartition, Partition, RangePartition

# Table order; "range" is balanced with an index-range partition.
SCHEMES = ("dense", "agsparse", "balanced", "recursive-doubling", "range")
MODELLED = ("dense", "agsparse", "balanced", "recursive-doubling")  # what cost.traffic covers
# Sum checks: float sums in another order differ in the last bits.
RTOL, ATOL_SCALE = 1e-5, 1e-6


def partition_for(scheme: str, num_rows: int, n: int) -> Partition | None:
    """The partition the benchmark passes: a hash (seed 0) for balanced, index ranges for range."""
    if scheme == "balanced":
        return HashPartition(num_rows, n, seed=0)
    if scheme == "range":
        return RangePartition(num_rows, n)
    return None


def base_scheme(scheme: str) -> str:
    """The gradsync.sparse scheme a benchmark scheme runs."""
    return "balanced" if scheme == "range" else scheme
