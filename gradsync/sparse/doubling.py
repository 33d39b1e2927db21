"""recursive-doubling: SparCML's recursive doubling, switching to dense once that is smaller
(Renggli et al., "SparCML: High-Performance Sparse Communication for Machine Learning", SC 2019).

In round i each rank swaps its partial sum with rank (rank XOR 2^i) and both add the two, so
after log2(n) rounds every rank holds the total. Partial sums grow as they merge (Zen's
densification), and each message goes as sparse rows or as the dense tensor, whichever is
smaller: the switch to dense happens by itself where the merged density makes sparse costlier.
With a number of ranks that is not a power of two, the ranks past the largest power of two
first hand their rows to a partner and get the total back at the end.

It wins where rows barely overlap across ranks and the number of ranks is small (Zen finds it
ahead only then); it is here so the selector can take it when it does.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from .result import SparseResult, Summed
from .rows import SparseRows, frame_nbytes, from_frame, sum_rows, to_frame

HEADER_NBYTES = 16  # (rows or DENSE, flag) as int64, before every message
DENSE = -1  # the header's row count for a message that carries the dense tensor


class _Partial:
    """A partial sum as it travels: sparse rows, or the dense table once that is smaller."""

    def __init__(self, rows: SparseRows | None, table: torch.Tensor | None, flag: int) -> None:
        self.rows, self.table, self.flag = rows, table, flag

    def wire_form(self, like: SparseRows) -> _Partial:
        """This partial in the form it is sent: both partners then merge the same operands."""
        if self.rows is not None and frame_nbytes(like, self.rows.nnz) >= _dense_nbytes(like):
            return _Partial(None, self.rows.to_dense(), self.flag)
        return self

    def encode(self) -> tuple[int, torch.Tensor]:
        if self.rows is not None:
            return self.rows.nnz, to_frame(self.rows)
        return DENSE, self.table.view(-1).view(torch.uint8)  # type: ignore[union-attr]


def recursive_doubling(rows: SparseRows, comm: Comm, finite: bool = True) -> SparseResult:
    n, me = comm.world_size, comm.rank
    power = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    sent = 0
    partial = _Partial(rows, None, 0 if finite else 1)
    if me >= power:  # hand my rows to my partner, then wait for the total
        sent += _send(comm, me - power, partial.wire_form(rows))
        total, _ = _receive(comm, me - power, rows)
        return _result(total, rows, sent)
    if me + power < n:  # take my partner's rows first
        theirs, _ = _receive(comm, me + power, rows)
        partial = _merge(partial, theirs)
    for distance in (1 << i for i in range(power.bit_length() - 1)):
        mine = partial.wire_form(rows)
        theirs, nbytes = _swap(comm, me ^ distance, mine, rows)
        sent += nbytes
        lower, upper = (mine, theirs) if me < me ^ distance else (theirs, mine)
        partial = _merge(lower, upper)  # lower rank first: the same bits on both partners
    # Every rank ends with the total in the same form, whether or not it sends it on: a dense
    # total lists every row (and as rows() only the non-zero ones), rows list the rows sent, and
    # an optimizer of sparse gradients (SparseAdam) steps the rows listed.
    partial = partial.wire_form(rows)
    if me + power < n:
        sent += _send(comm, me + power, partial)
    return _result(partial, rows, sent)


def _merge(lower: _Partial, upper: _Partial) -> _Partial:
    flag = lower.flag | upper.flag
    if lower.rows is not None and upper.rows is not None:
        return _Partial(sum_rows([lower.rows, upper.rows]), None, flag)
    if lower.table is not None and upper.table is not None:
        return _Partial(None, lower.table + upper.table, flag)
    # One of each: the rows go into a copy of the table, in the table-first order both use.
    table, rows = (lower.table, upper.rows) if lower.table is not None else (upper.table, lower.rows)
    merged = table.clone()  # type: ignore[union-attr]
    merged.index_add_(0, rows.indices, rows.values)  # type: ignore[union-attr]
    return _Partial(None, merged, flag)


def _swap(comm: Comm, peer: int, mine: _Partial, like: SparseRows) -> tuple[_Partial, int]:
    count, body = mine.encode()
    header = comm.sendrecv(peer, torch.tensor([count, mine.flag], device=body.device), 2)
    their_count, their_flag = header.tolist()
    data = comm.sendrecv(peer, body, _body_nbytes(like, their_count))
    return _decode(like, data, their_count, their_flag), HEADER_NBYTES + body.numel()


def _send(comm: Comm, peer: int, partial: _Partial) -> int:
    """One-way: the peer receives with _receive. Returns the bytes sent."""
    count, body = partial.encode()
    comm.sendrecv(peer, torch.tensor([count, partial.flag], device=body.device), 0)
    comm.sendrecv(peer, body, 0)
    return HEADER_NBYTES + body.numel()


def _receive(comm: Comm, peer: int, like: SparseRows) -> tuple[_Partial, int]:
    empty = torch.empty(0, dtype=torch.int64, device=like.values.device)
    count, flag = comm.sendrecv(peer, empty, 2).tolist()
    data = comm.sendrecv(peer, empty.view(torch.uint8), _body_nbytes(like, count))
    return _decode(like, data, count, flag), 0


def _decode(like: SparseRows, data: torch.Tensor, count: int, flag: int) -> _Partial:
    if count == DENSE:
        table = data.clone().view(like.values.dtype).view(like.num_rows, like.width)
        return _Partial(None, table, flag)
    return _Partial(from_frame(like, data, count), None, flag)


def _body_nbytes(like: SparseRows, count: int) -> int:
    return _dense_nbytes(like) if count == DENSE else frame_nbytes(like, count)


def _dense_nbytes(like: SparseRows) -> int:
    return like.num_rows * like.width * like.values.element_size()


def _result(partial: _Partial, like: SparseRows, sent: int) -> SparseResult:
    if partial.rows is not None:
        total = Summed(like.num_rows, parts=[partial.rows])
    else:
        total = Summed(like.num_rows, dense=partial.table)
    return SparseResult(total, "recursive-doubling", partial.flag == 0, sent)
