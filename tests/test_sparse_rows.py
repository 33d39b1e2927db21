"""SparseRows, sum_rows, frames and Summed; and every scheme in a world of one (LocalComm).

References are dense tensors built here by other means (masks, index_add_ into float64 tables,
torch's own coalesce), never the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradsync import sparse
from gradsync.comm import LocalComm
from gradsync.sparse import HashPartition, SparseRows, Summed, sum_rows
from gradsync.sparse.rows import MAX_ROWS, frame_nbytes, from_frame, to_frame, values_from_bytes
from gradsync.wire import index_format

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_pairs(num_rows: int, count: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` indices drawn with replacement (so duplicated, unsorted) and small integer values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(num_rows, (count,), generator=g), torch.randint(
        -4, 5, (count, width), generator=g
    ).double()


def dense_of_pairs(indices: torch.Tensor, values: torch.Tensor, num_rows: int) -> torch.Tensor:
    table = torch.zeros(num_rows, values.shape[1], dtype=torch.float64)
    return table.index_add_(0, indices, values)


def random_rows(num_rows: int, count: int, width: int, seed: int, dtype=torch.float32) -> SparseRows:
    g = torch.Generator().manual_seed(seed)
    indices = torch.sort(torch.randperm(num_rows, generator=g)[:count]).values
    return SparseRows(indices, torch.randint(-4, 5, (count, width), generator=g).to(dtype), num_rows)


# -- construction ------------------------------------------------------------------------------------


def test_from_dense_keeps_every_row_with_a_non_zero_nan_or_inf() -> None:
    table = torch.zeros(8, 3)
    table[1, 2] = 5.0
    table[3, 0] = math.nan
    table[4, 1] = math.inf
    table[5, 2] = -math.inf
    table[6] = -0.0  # negative zero is zero
    table[7] = torch.tensor([1.0, math.nan, 0.0])
    rows = SparseRows.from_dense(table)
    expected = (~(table == 0).all(dim=1)).nonzero().view(-1)
    assert rows.indices.tolist() == expected.tolist() == [1, 3, 4, 5, 7]
    assert rows.indices.dtype == torch.int64 and rows.num_rows == 8 and rows.width == 3
    assert torch.equal(rows.values.nan_to_num(), table[expected].nan_to_num())
    assert torch.isnan(rows.values).sum() == 2
    assert torch.equal(rows.to_dense().nan_to_num(), table.nan_to_num())


def test_from_dense_takes_a_flat_tensor_as_one_column() -> None:
    flat = torch.tensor([0.0, 2.0, 0.0, math.nan, -1.0, 0.0], dtype=torch.float16)
    rows = SparseRows.from_dense(flat)
    assert rows.indices.tolist() == [1, 3, 4]
    assert rows.width == 1 and rows.values.dtype == torch.float16
    assert rows.nnz == 3 and rows.density == pytest.approx(0.5)
    assert torch.equal(rows.to_dense().view(-1).nan_to_num(), flat.nan_to_num())
    with pytest.raises(ValueError, match="1-D or 2-D"):
        SparseRows.from_dense(torch.zeros(2, 2, 2))


@pytest.mark.parametrize("width", [1, 3])
def test_from_pairs_sums_duplicates_and_sorts(width: int) -> None:
    indices, values = random_pairs(50, 200, width, seed=width)
    rows = SparseRows.from_pairs(indices, values, 50)
    assert rows.indices.tolist() == sorted(set(indices.tolist()))
    assert rows.nnz < 200  # duplicates were drawn, and merged
    assert torch.equal(rows.to_dense(), dense_of_pairs(indices, values, 50))


def test_from_pairs_takes_flat_values_sorted_input_and_no_rows() -> None:
    rows = SparseRows.from_pairs(torch.tensor([[7], [2]]), torch.tensor([1.0, 2.0]), 10)
    assert rows.indices.tolist() == [2, 7] and rows.values.tolist() == [[2.0], [1.0]]
    ascending = SparseRows.from_pairs(torch.tensor([1, 4]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 5)
    assert ascending.indices.tolist() == [1, 4] and ascending.values.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    for values, width in ((torch.zeros(0), 1), (torch.zeros(0, 4), 4), (torch.zeros(0, 2, 3), 6)):
        empty = SparseRows.from_pairs(torch.zeros(0, dtype=torch.int64), values, 10)
        assert (empty.nnz, empty.width, empty.density) == (0, width, 0.0)
        assert torch.equal(empty.to_dense(), torch.zeros(10, width))


@pytest.mark.parametrize("bad", [10, 11, -1])
def test_out_of_range_indices_raise_index_error_naming_the_index(bad: int) -> None:
    with pytest.raises(IndexError, match=rf"row index {bad} is out of range \[0, 10\)"):
        SparseRows.from_pairs(torch.tensor([3, bad, 0]), torch.ones(3, 2), 10)


def test_from_coo_coalesces_an_uncoalesced_tensor() -> None:
    indices, values = random_pairs(40, 100, 6, seed=3)
    for shape in ((40, 6), (40, 2, 3)):
        coo = torch.sparse_coo_tensor(
            indices.view(1, -1), values.view(100, *shape[1:]), shape, check_invariants=True
        )
        assert not coo.is_coalesced()
        rows = SparseRows.from_coo(coo)
        expected = coo.coalesce()
        assert torch.equal(rows.indices, expected.indices()[0])
        assert torch.equal(rows.values, expected.values().reshape(-1, 6))
        assert rows.width == 6 and rows.num_rows == 40
    flat_coo = torch.sparse_coo_tensor(indices.view(1, -1), values[:, 0], (40,), check_invariants=True)
    flat = SparseRows.from_coo(flat_coo)
    assert torch.equal(flat.to_dense(), dense_of_pairs(indices, values[:, :1], 40))


def test_from_coo_takes_an_empty_tensor_and_refuses_other_layouts() -> None:
    empty = torch.sparse_coo_tensor(
        torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, 5), (9, 5), check_invariants=True
    )
    rows = SparseRows.from_coo(empty)
    assert (rows.nnz, rows.width, rows.num_rows) == (0, 5, 9)
    with pytest.raises(ValueError, match="sparse COO tensor with one sparse dimension"):
        SparseRows.from_coo(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="one sparse dimension"):
        SparseRows.from_coo(torch.eye(3).to_sparse())  # two sparse dimensions


def test_constructor_refuses_malformed_rows() -> None:
    with pytest.raises(ValueError, match="1-D int64"):
        SparseRows(torch.tensor([1], dtype=torch.int32), torch.ones(1, 1), 4)
    with pytest.raises(ValueError, match="one row per index"):
        SparseRows(torch.tensor([1, 2]), torch.ones(3, 1), 4)
    with pytest.raises(ValueError, match="one row per index"):
        SparseRows(torch.tensor([1]), torch.ones(1), 4)
    with pytest.raises(ValueError, match="out of range"):
        SparseRows(torch.tensor([1]), torch.ones(1, 1), MAX_ROWS + 1)


# -- conversions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(30,), (30, 4), (30, 2, 2)])
def test_to_coo_and_back_round_trip(shape: tuple[int, ...]) -> None:
    width = math.prod(shape[1:])
    rows = random_rows(30, 12, width, seed=len(shape))
    coo = rows.to_coo(shape)
    assert coo.is_coalesced() and tuple(coo.shape) == shape
    assert torch.equal(coo.to_dense(), rows.to_dense().view(shape))
    back = SparseRows.from_coo(coo)
    assert torch.equal(back.indices, rows.indices) and torch.equal(back.values, rows.values)
    assert torch.equal(SparseRows.from_dense(rows.to_dense()).to_dense(), rows.to_dense())


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_rows_equals_the_dense_sum(dtype: torch.dtype) -> None:
    parts = [random_rows(64, count, 3, seed, dtype) for seed, count in enumerate([10, 40, 0, 64])]
    total = sum_rows(parts)
    expected = sum(p.to_dense().double() for p in parts)
    assert torch.equal(total.to_dense().double(), expected)
    union = torch.unique(torch.cat([p.indices for p in parts]))
    assert torch.equal(total.indices, union)  # rows that cancel to zero are kept
    assert sum_rows(parts[:1]) is parts[0]


def test_sum_rows_refuses_parts_of_other_tensors() -> None:
    base = random_rows(10, 3, 2, seed=0)
    others = {
        "rows": random_rows(11, 3, 2, seed=0),
        "width": random_rows(10, 3, 3, seed=0),
        "dtype": random_rows(10, 3, 2, seed=0, dtype=torch.float16),
    }
    for what, other in others.items():
        with pytest.raises(ValueError, match=r"cannot sum rows of .* the ranks passed different tensors"):
            sum_rows([base, other])
        with pytest.raises(ValueError, match=r"cannot sum rows"):
            sum_rows([other, base])
        assert what in others


# -- frames ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("count", "fmt"), [(0, "coo"), (5, "coo"), (40, "bitmap"), (1000, "bitmap")])
def test_frame_round_trip_in_both_index_formats(dtype: torch.dtype, count: int, fmt: str) -> None:
    rows = random_rows(1000, count, 3, seed=count, dtype=dtype)
    assert index_format(rows.num_rows, count) == fmt
    frame = to_frame(rows)
    assert frame.dtype == torch.uint8 and frame.numel() == frame_nbytes(rows, count)
    index_bytes = 4 * count if fmt == "coo" else 125
    assert frame.numel() == index_bytes + count * 3 * rows.values.element_size()
    # Padded after, and starting at an odd offset inside a larger buffer (as a slice of a
    # received buffer may): neither may change what comes out. (Not for no rows: wire's
    # decode_indices cannot view an empty misaligned slice as int32, see the report.)
    padded = torch.cat([frame, torch.full((9,), 255, dtype=torch.uint8)])
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), padded])[1:]
    for data in (frame, padded) if count == 0 else (frame, padded, shifted):
        back = from_frame(rows, data, count)
        assert torch.equal(back.indices, rows.indices)
        assert back.values.dtype == dtype
        assert (
            back.values.view(torch.uint8).numpy().tobytes() == rows.values.view(torch.uint8).numpy().tobytes()
        )


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_values_from_bytes_reads_misaligned_slices_empty_ones_too(dtype: torch.dtype) -> None:
    values = torch.arange(6, dtype=dtype).view(3, 2)
    data = values.view(-1).view(torch.uint8)
    buffer = torch.cat([torch.zeros(12, dtype=torch.uint8), data])  # 12: misaligned for 8 bytes
    for offset in (1, 3, 12):
        shifted = torch.cat([torch.zeros(offset, dtype=torch.uint8), data])
        assert torch.equal(values_from_bytes(shifted[offset:], 3, 2, dtype), values)
        assert values_from_bytes(buffer[offset:offset], 0, 2, dtype).shape == (0, 2)


# -- Summed ------------------------------------------------------------------------------------------


def test_summed_converts_between_parts_and_dense() -> None:
    first = random_rows(20, 6, 2, seed=1)
    others = torch.tensor([i for i in range(20) if i not in first.indices.tolist()][::3])
    second = SparseRows(others, torch.ones(others.numel(), 2), 20)
    summed = Summed(20, parts=[second, first])  # disjoint, out of order
    expected = first.to_dense() + second.to_dense()
    assert not summed.is_dense and summed.nnz == first.nnz + second.nnz
    assert torch.equal(summed.dense(), expected)
    rows = summed.rows()
    assert torch.equal(rows.indices, torch.sort(torch.cat([first.indices, second.indices])).values)
    assert torch.equal(rows.to_dense(), expected)
    out = torch.full((40,), 7.0)
    assert summed.into(out) is out and torch.equal(out.view(20, 2), expected)
    dense = Summed(20, dense=expected)
    assert dense.is_dense and dense.nnz == 20 and dense.dense() is expected
    assert torch.equal(dense.rows().indices, (expected != 0).any(dim=1).nonzero().view(-1))
    with pytest.raises(ValueError, match="either a dense tensor or sparse parts"):
        Summed(20)
    with pytest.raises(ValueError, match="either a dense tensor or sparse parts"):
        Summed(20, dense=expected, parts=[first])


# -- a world of one ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", sparse.names())
@pytest.mark.parametrize("count", [0, 7, 64])
def test_a_world_of_one_returns_the_input_for_every_scheme(scheme: str, count: int) -> None:
    rows = random_rows(64, count, 3, seed=count, dtype=torch.bfloat16)
    for finite in (True, False):
        result = sparse.exchange(rows, LocalComm(), scheme, finite=finite)
        assert result.scheme == scheme and result.finite == finite
        assert result.sent_nbytes == 0
        dense = result.total.dense()
        assert dense.dtype == torch.bfloat16
        assert (
            dense.view(torch.uint8).numpy().tobytes() == rows.to_dense().view(torch.uint8).numpy().tobytes()
        )
        if not result.total.is_dense:
            back = result.total.rows()
            assert torch.equal(back.indices, rows.indices) and torch.equal(back.values, rows.values)
        if scheme == "balanced":
            assert result.push_imbalance == result.pull_imbalance == 1.0


def test_exchange_refuses_unknown_schemes_and_misplaced_partitions() -> None:
    rows = random_rows(16, 4, 1, seed=0)
    with pytest.raises(KeyError, match="unknown sparse scheme 'ring'; available: dense, agsparse"):
        sparse.exchange(rows, LocalComm(), "ring")
    with pytest.raises(ValueError, match="'balanced' scheme only"):
        sparse.exchange(rows, LocalComm(), "dense", partition=HashPartition(16, 1, seed=0))
    with pytest.raises(ValueError, match="build it for this tensor and group"):
        sparse.exchange(rows, LocalComm(), "balanced", partition=HashPartition(17, 1, seed=0))
    with pytest.raises(ValueError, match="build it for this tensor and group"):
        sparse.exchange(rows, LocalComm(), "balanced", partition=HashPartition(16, 2, seed=0))


@pytest.mark.parametrize("scheme", sparse.names())
def test_rows_built_out_of_order_or_repeated_are_summed_as_their_pairs_by_every_scheme(scheme: str) -> None:
    indices, values = torch.tensor([5, 2, 9, 2]), torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    rows = SparseRows(indices, values, 12)  # the constructor does not sort (a pass on every payload)
    expected = torch.zeros(12, 1).index_add_(0, indices, values)
    result = sparse.exchange(rows, LocalComm(), scheme)
    assert torch.equal(result.total.dense(), expected)
