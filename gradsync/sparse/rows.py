"""SparseRows: the form every sparse scheme exchanges, and the one way parts are summed.

A sparse gradient is a set of rows of a [num_rows, width] tensor: an embedding's touched rows
(width = the embedding dimension), or single elements of a flat tensor (width 1) for the output
of top-k, DGC or threshold. Indices are ascending and distinct, so every scheme can merge sets
by sorted union and encode them as COO or as a bitmap without reordering values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..wire import decode_indices, encode_indices, index_nbytes

# Indices cross the wire as int32.
MAX_ROWS = 2**31 - 1


@dataclass(frozen=True)
class SparseRows:
    """Rows `indices` (int64, ascending, distinct) of a [num_rows, width] tensor and their values.

    Example:
        >>> rows = SparseRows.from_dense(torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]))
        >>> rows.indices, rows.values
        (tensor([1]), tensor([[1., 2.]]))
    """

    indices: torch.Tensor
    values: torch.Tensor
    num_rows: int

    def __post_init__(self) -> None:
        if self.indices.dtype != torch.int64 or self.indices.dim() != 1:
            raise ValueError(
                f"indices must be a 1-D int64 tensor, got {self.indices.dtype} {tuple(self.indices.shape)}"
            )
        if self.values.dim() != 2 or self.values.shape[0] != self.indices.numel():
            raise ValueError(
                f"values must be 2-D with one row per index ({self.indices.numel()}), got "
                f"{tuple(self.values.shape)}"
            )
        if not 0 <= self.num_rows <= MAX_ROWS:
            raise ValueError(
                f"num_rows={self.num_rows} is out of range [0, {MAX_ROWS}]: indices cross the wire as "
                "int32; split the tensor into parts of fewer rows"
            )

    @property
    def width(self) -> int:
        return self.values.shape[1]

    @property
    def nnz(self) -> int:
        """Rows held (some may be all zeros, e.g. after a sum that cancelled)."""
        return self.indices.numel()

    @property
    def density(self) -> float:
        return self.nnz / self.num_rows if self.num_rows else 0.0

    @classmethod
    def from_dense(cls, dense: torch.Tensor) -> SparseRows:
        """The rows of a 2-D tensor (a 1-D one is a column) that hold anything but zeros.

        NaN and inf count as non-zero, so a non-finite gradient stays non-finite after the sum.
        """
        table = dense.view(-1, 1) if dense.dim() == 1 else dense
        if table.dim() != 2:
            raise ValueError(f"from_dense takes a 1-D or 2-D tensor, got shape {tuple(dense.shape)}")
        occupied = table.ne(0).any(dim=1) if table.shape[1] > 1 else table.view(-1).ne(0)
        indices = occupied.nonzero().squeeze(1)
        return cls(indices, table.index_select(0, indices), table.shape[0])

    @classmethod
    def from_pairs(cls, indices: torch.Tensor, values: torch.Tensor, num_rows: int) -> SparseRows:
        """Rows in any order, duplicates summed (in their given order): a coalesced SparseRows."""
        indices = indices.reshape(-1).long()
        if indices.numel():
            values = values.reshape(indices.numel(), -1)
        else:  # no rows: -1 would be ambiguous, so the width comes from the trailing dimensions
            values = values.reshape(0, math.prod(values.shape[1:]) if values.dim() > 1 else 1)
        check_range(indices, num_rows)
        if indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all()):
            return cls(indices, values, num_rows)
        unique, position = torch.unique(indices, sorted=True, return_inverse=True)
        summed = values.new_zeros(unique.numel(), values.shape[1])
        summed.index_add_(0, position, values)  # duplicates meet in their given order
        return cls(unique, summed, num_rows)

    @classmethod
    def from_coo(cls, coo: torch.Tensor) -> SparseRows:
        """A torch sparse COO tensor with one sparse dimension (nn.Embedding(sparse=True)'s grad)."""
        if coo.layout != torch.sparse_coo or coo.sparse_dim() != 1:
            raise ValueError(
                f"from_coo takes a sparse COO tensor with one sparse dimension, got layout {coo.layout} "
                f"with shape {tuple(coo.shape)}"
            )
        return cls.from_pairs(coo._indices()[0], coo._values(), coo.shape[0])

    def to_dense(self) -> torch.Tensor:
        """The [num_rows, width] tensor these rows stand for."""
        out = self.values.new_zeros(self.num_rows, self.width)
        out.index_copy_(0, self.indices, self.values)
        return out

    def to_coo(self, shape: Sequence[int]) -> torch.Tensor:
        """As a coalesced torch sparse COO tensor of `shape` (rows first)."""
        values = self.values.reshape(self.nnz, *shape[1:])
        return torch.sparse_coo_tensor(
            self.indices.view(1, -1), values, tuple(shape), is_coalesced=True, check_invariants=False
        )

    def like(self, indices: torch.Tensor, values: torch.Tensor) -> SparseRows:
        """Other rows of the same tensor."""
        return SparseRows(indices, values, self.num_rows)


def sum_rows(parts: Sequence[SparseRows]) -> SparseRows:
    """The sum of `parts`: the sorted union of their indices, each part added in the given order.

    Indices are distinct within a part, so each index_add_ has no colliding writes and the result
    has the same bits wherever it is computed from the same parts in the same order (on CUDA too,
    where colliding atomic adds would not). Equal to a dense sum; exactly so for integer values.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    for part in parts[1:]:
        if (
            part.num_rows != first.num_rows
            or part.width != first.width
            or part.values.dtype != first.values.dtype
        ):
            raise ValueError(
                f"cannot sum rows of [{part.num_rows}, {part.width}] {part.values.dtype} with rows of "
                f"[{first.num_rows}, {first.width}] {first.values.dtype}: the ranks passed different tensors"
            )
    union = torch.unique(torch.cat([p.indices for p in parts]), sorted=True)
    total = first.values.new_zeros(union.numel(), first.width)
    for part in parts:
        total.index_add_(0, torch.searchsorted(union, part.indices), part.values)
    return first.like(union, total)


def check_range(indices: torch.Tensor, num_rows: int) -> None:
    """IndexError unless every index lies in [0, num_rows): torch would wrap negative ones."""
    if indices.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(indices))
    if lo < 0 or hi >= num_rows:
        raise IndexError(
            f"row index {lo if lo < 0 else hi} is out of range [0, {num_rows}): the indices do not "
            f"belong to a tensor of {num_rows} rows"
        )


def value_bytes(rows: SparseRows) -> torch.Tensor:
    """The values as raw bytes (any float dtype), for a frame."""
    return rows.values.contiguous().view(-1).view(torch.uint8)


def values_from_bytes(data: torch.Tensor, count: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of value_bytes: `count` rows of `width` values of `dtype`."""
    if data.storage_offset() % dtype.itemsize or data.data_ptr() % dtype.itemsize:
        data = data.clone()  # a misaligned slice cannot be viewed as a wider type, even empty
    return data.view(dtype).view(count, width)


# -- frames: rows as bytes on the wire ---------------------------------------------------------
# A frame is the indices, encoded by wire.encode_indices (int32 COO or a bitmap over num_rows,
# the smaller for the count), then the values' bytes. The receiver knows the count from a size
# exchange and the tensor's shape and dtype from its own rows, so no header crosses the wire.


def frame_nbytes(like: SparseRows, count: int) -> int:
    """Bytes of the frame of `count` rows of `like`'s tensor."""
    return index_nbytes(like.num_rows, count) + count * like.width * like.values.element_size()


def to_frame(rows: SparseRows) -> torch.Tensor:
    return torch.cat([encode_indices(rows.indices, rows.num_rows), value_bytes(rows)])


def from_frame(like: SparseRows, frame: torch.Tensor, count: int) -> SparseRows:
    """The `count` rows of `like`'s tensor that `frame` carries (trailing padding ignored)."""
    split = index_nbytes(like.num_rows, count)
    indices = decode_indices(frame[:split], like.num_rows, count)
    values_nbytes = count * like.width * like.values.element_size()
    values = values_from_bytes(frame[split : split + values_nbytes], count, like.width, like.values.dtype)
    return like.like(indices, values)
