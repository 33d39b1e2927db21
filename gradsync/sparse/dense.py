"""dense: the sparse rows scattered into a zero tensor, then one allreduce of all of it.

Costs 2 (n - 1) / n of the dense tensor per rank whatever the density: the reference every
sparse scheme must match, and the winner once the summed rows cover most of the tensor.
"""

from __future__ import annotations

from ..comm import Comm, allreduce_sent_nbytes
from .result import SparseResult, Summed
from .rows import SparseRows


def dense(rows: SparseRows, comm: Comm, finite: bool = True) -> SparseResult:
    numel = rows.num_rows * rows.width
    # One element past the table carries the flag, so a non-finite rank costs no extra collective.
    frame = rows.values.new_zeros(numel + 1)
    table = frame[:numel].view(rows.num_rows, rows.width)
    table.index_copy_(0, rows.indices, rows.values)
    frame[numel] = 0 if finite else 1
    summed = comm.allreduce(frame).wait()
    sent = allreduce_sent_nbytes(frame.nbytes, comm.world_size)
    return SparseResult(Summed(rows.num_rows, dense=table), "dense", bool(summed[numel] == 0), sent)
