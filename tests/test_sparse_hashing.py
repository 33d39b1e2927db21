"""Partitions (Zen's hash, the index ranges), the hash bitmap that names an owner's rows, and
imbalance: determinism across instances, exact partitions of the rows, balance on skewed rows."""

from __future__ import annotations

import pytest
import torch

from gradsync.sparse import HashPartition, Partition, RangePartition
from gradsync.sparse.hashing import (
    decode_owned,
    encode_owned,
    imbalance,
    pull_index_format,
    pull_index_nbytes,
)

SHAPES = [
    (1, 1),
    (7, 3),
    (1000, 3),
    (4096, 8),
    (10, 16),
]  # (num_rows, num_owners); fewer rows than owners too


def partitions(num_rows: int, num_owners: int) -> list[Partition]:
    return [HashPartition(num_rows, num_owners, seed=0), HashPartition(num_rows, num_owners, seed=9),
            RangePartition(num_rows, num_owners)]  # fmt: skip


def test_hash_owner_is_the_same_for_every_instance_with_the_seed_and_differs_for_another() -> None:
    rows = torch.arange(5000)
    first = HashPartition(5000, 4, seed=0).owner_of(rows)
    assert torch.equal(first, HashPartition(5000, 4, seed=0).owner_of(rows))
    assert not torch.equal(first, HashPartition(5000, 4, seed=1).owner_of(rows))
    assert first.dtype == torch.int64 and int(first.min()) >= 0 and int(first.max()) < 4
    # The owner of a row does not depend on which other rows are asked about, nor on their order.
    sample = torch.tensor([4999, 3, 0, 3, 2500])
    assert torch.equal(HashPartition(5000, 4, seed=0).owner_of(sample), first[sample])


def test_hash_owner_follows_the_documented_multiply_add_shift_formula() -> None:
    """((a x + b) mod 2^64) div 2^32, scaled to the owners: in exact integers, not int64 wrap."""
    p = HashPartition(1 << 40, 5, seed=3)
    a, b = p._a % 2**64, p._b % 2**64  # the drawn constants, as unsigned
    assert a % 2 == 1
    rows = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**39 + 17, 2**40 - 1]
    expected = [(((a * x + b) % 2**64 >> 32) * 5) >> 32 for x in rows]
    assert p.owner_of(torch.tensor(rows)).tolist() == expected


@pytest.mark.parametrize(("num_rows", "num_owners"), SHAPES)
def test_owned_sets_partition_the_rows_consistently_with_owner_of(num_rows: int, num_owners: int) -> None:
    for p in partitions(num_rows, num_owners):
        owned = [p.owned(o) for o in range(num_owners)]
        for o, rows in enumerate(owned):
            assert rows.dtype == torch.int64
            assert bool((rows[1:] > rows[:-1]).all()), f"{p.name}: owner {o}'s rows are not ascending"
            assert bool((p.owner_of(rows) == o).all()), f"{p.name}: owned({o}) disagrees with owner_of"
        everything = torch.sort(torch.cat(owned)).values
        assert torch.equal(everything, torch.arange(num_rows)), f"{p.name}: not every row exactly once"


def test_range_partition_gives_contiguous_ranges_of_almost_equal_length() -> None:
    p = RangePartition(10, 4)
    assert [p.owned(o).tolist() for o in range(4)] == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
    assert p.owner_of(torch.arange(10)).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]


def test_hash_spreads_all_rows_evenly() -> None:
    p = HashPartition(1 << 16, 8, seed=0)
    loads = [p.owned(o).numel() for o in range(8)]
    assert imbalance(loads) < 1.05  # 8192 rows each, give or take a few standard deviations (~90)


def test_split_groups_by_owner_keeping_ascending_order() -> None:
    p = HashPartition(300, 3, seed=0)
    indices = torch.sort(torch.randperm(300, generator=torch.Generator().manual_seed(0))[:100]).values
    order, counts = p.split(indices)
    owners = p.owner_of(indices)
    assert counts == torch.bincount(owners, minlength=3).tolist()
    grouped = indices[order]
    for o, group in enumerate(grouped.split(counts)):
        assert torch.equal(group, indices[owners == o])  # ascending, as given


def zipf_worker_rows(num_rows: int, fraction: float, s: float, worker: int) -> torch.Tensor:
    """`fraction` of the rows, distinct, drawn with probability (rank + 1)^-s: row 0 the hottest."""
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow(-s)
    g = torch.Generator().manual_seed(worker)
    return torch.multinomial(weights, int(fraction * num_rows), replacement=False, generator=g)


def test_hash_balances_zipf_skewed_rows_where_index_ranges_do_not() -> None:
    num_rows, owners, workers = 2**20, 8, 8
    rows = [zipf_worker_rows(num_rows, 0.015, 1.1, w) for w in range(workers)]
    union = torch.unique(torch.cat(rows))
    for p, check in (
        (HashPartition(num_rows, owners, seed=0), lambda x: x <= 1.1),
        (RangePartition(num_rows, owners), lambda x: x >= 3),
    ):
        pushed = sum(torch.bincount(p.owner_of(r), minlength=owners) for r in rows)
        summed = torch.bincount(p.owner_of(union), minlength=owners)
        for what, loads in (("rows pushed", pushed), ("rows summed", summed)):
            value = imbalance(loads.tolist())
            assert check(value), f"{p.name}: imbalance of {what} per owner is {value:.2f}"


# -- the hash bitmap -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "partition", [HashPartition(1000, 3, seed=0), RangePartition(1000, 3)], ids=["hash", "range"]
)
def test_encode_owned_round_trips_in_both_formats(partition: Partition) -> None:
    g = torch.Generator().manual_seed(0)
    for owner in range(3):
        owned = partition.owned(owner)
        k = owned.numel()
        picks = {
            "empty": torch.zeros(0, dtype=torch.int64),
            "one": owned[-1:],
            "few": owned[torch.sort(torch.randperm(k, generator=g)[:5]).values],
            "half": owned[torch.sort(torch.randperm(k, generator=g)[: k // 2]).values],
            "full": owned,
        }
        for name, indices in picks.items():
            count = indices.numel()
            fmt = pull_index_format(k, count)
            assert fmt == ("hash-bitmap" if -(-k // 8) < 4 * count else "coo"), name
            encoded = encode_owned(indices, owned)
            assert encoded.dtype == torch.uint8 and encoded.numel() == pull_index_nbytes(k, count), name
            # At an odd offset inside a larger buffer too, as a slice of a received frame may be.
            shifted = torch.cat(
                [torch.zeros(1, dtype=torch.uint8), encoded, torch.zeros(3, dtype=torch.uint8)]
            )
            for data in (encoded, shifted[1 : 1 + encoded.numel()]):
                decoded = decode_owned(data, owned, count)
                assert decoded.dtype == torch.int64 and torch.equal(decoded, indices), f"{name} ({fmt})"
        assert pull_index_format(k, 5) == "coo" and pull_index_format(k, k // 2) == "hash-bitmap"


def test_pull_index_format_takes_the_bitmap_only_when_strictly_smaller() -> None:
    assert pull_index_nbytes(80, 2) == 8 and pull_index_format(80, 2) == "coo"  # 10 bitmap bytes
    assert pull_index_nbytes(80, 3) == 10 and pull_index_format(80, 3) == "hash-bitmap"
    assert pull_index_format(64, 2) == "coo"  # 8 bytes either way
    assert pull_index_nbytes(0, 0) == 0


def test_decode_owned_refuses_a_count_the_bitmap_does_not_match() -> None:
    owned = HashPartition(1000, 2, seed=0).owned(0)
    encoded = encode_owned(owned[:300], owned)
    with pytest.raises(ValueError, match="names 300 rows, but 299 values came with it"):
        decode_owned(encoded, owned, 299)


# -- imbalance -------------------------------------------------------------------------------------


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([5, 5, 5]) == 1.0
    assert imbalance([3, 1]) == 1.5
    assert imbalance([4, 0, 0, 0]) == 4.0
    assert imbalance([1.0, 2.0, 3.0]) == pytest.approx(1.5)
    assert imbalance([0, 0]) == 1.0


def test_partitions_refuse_no_owners_and_the_base_class_is_abstract() -> None:
    with pytest.raises(ValueError, match="num_owners=0 must be at least 1"):
        HashPartition(10, 0, seed=0)
    base = Partition(10, 2)
    with pytest.raises(NotImplementedError):
        base.owner_of(torch.arange(3))
    with pytest.raises(NotImplementedError):
        base.owned(0)
