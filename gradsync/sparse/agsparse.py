"""agsparse: every rank allgathers every rank's rows and sums them all (AGsparse; Horovod's and
PyTorch's IndexedSlices path).

One round, but each rank receives n - 1 sets of rows: traffic grows linearly with the number of
workers, whatever their overlap.
"""

from __future__ import annotations

import torch

from ..comm import Comm, allgather_sent_nbytes, allgather_sizes
from .result import SparseResult, Summed
from .rows import SparseRows, frame_nbytes, from_frame, sum_rows, to_frame

SIZE_NBYTES = 16  # the (rows, flag) pair of int64 every rank announces first


def agsparse(rows: SparseRows, comm: Comm, finite: bool = True) -> SparseResult:
    parts, finite, sent = gather(rows, comm, finite)
    return SparseResult(Summed(rows.num_rows, parts=[sum_rows(parts)]), "agsparse", finite, sent)


def gather(rows: SparseRows, comm: Comm, finite: bool = True) -> tuple[list[SparseRows], bool, int]:
    """Every rank's rows in rank order, whether every rank's input was finite, and the bytes sent."""
    n = comm.world_size
    sizes = allgather_sizes(comm, [rows.nnz, int(not finite)], rows.values.device)
    # Frames are padded to the longest: allgather moves equal sizes.
    longest = max(frame_nbytes(rows, count) for count, _ in sizes)
    frame = torch.zeros(longest, dtype=torch.uint8, device=rows.values.device)
    mine = to_frame(rows)
    frame[: mine.numel()] = mine
    gathered = comm.allgather(frame).wait()
    parts = [from_frame(rows, data, count) for data, (count, _) in zip(gathered, sizes, strict=True)]
    sent = allgather_sent_nbytes(SIZE_NBYTES, n) + allgather_sent_nbytes(frame.numel(), n)
    return parts, all(flag == 0 for _, flag in sizes), sent
