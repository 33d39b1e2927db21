"""balanced: Zen's balanced parallelism. Every row has an owner (a shared hash); each rank pushes
its rows to their owners with one all_to_all, each owner sums what it received, and the owners
allgather their sums (Wang et al., OSDI 2025, section 3).

Per rank this moves (n - 1) / n of its own rows out and (n - 1) / n of the union back in, the
optimum Zen proves for any overlap, and the hash keeps every owner's share close to 1 / n even
when a few rows are hot. Owners name their rows with a hash bitmap over the rows they own
(hashing.encode_owned), so the pull's indices cost num_rows / 8 bytes in all, not per worker.

Rounds, each one all_to_all (every pair of ranks at once): the push counts, the push, the
owners' counts, the pull (each owner's frame to every rank: an allgather of uneven sizes).
"""

from __future__ import annotations

import torch

from ..comm import Comm
from .hashing import Partition, decode_owned, encode_owned, hash_partition, imbalance, pull_index_nbytes
from .result import SparseResult, Summed
from .rows import SparseRows, sum_rows, value_bytes, values_from_bytes

INDEX_NBYTES = 4  # pushed indices are int32 COO
COUNT_NBYTES = 8  # int64 counts
OWNER_SIZE_NBYTES = 24  # what each owner announces before the pull: (rows, rows pushed to it, flag)


def balanced(
    rows: SparseRows, comm: Comm, finite: bool = True, partition: Partition | None = None
) -> SparseResult:
    n, me = comm.world_size, comm.rank
    partition = partition or hash_partition(rows.num_rows, n, 0)
    _check_partition(partition, rows, n)
    row_nbytes = rows.width * rows.values.element_size()

    # Push: each row to its owner.
    order, send_counts = partition.split(rows.indices)
    recv_counts = _swap_counts(comm, send_counts, rows.values.device)
    indices, values = rows.indices.index_select(0, order), rows.values.index_select(0, order)
    frames = [
        torch.cat([i.to(torch.int32).view(torch.uint8), value_bytes(rows.like(i, v))])
        for i, v in zip(indices.split(send_counts), values.split(send_counts), strict=True)
    ]
    pushed = comm.all_to_all(frames, [c * (INDEX_NBYTES + row_nbytes) for c in recv_counts]).wait()
    received = [_unpush(rows, data, count) for data, count in zip(pushed, recv_counts, strict=True)]
    mine = sum_rows(received)  # in rank order: the same bits whoever sums
    owned = partition.owned(me, rows.values.device)

    # Pull: each owner's sum to every rank. An allgather of uneven sizes, done as one all_to_all
    # that sends the owner's frame to every rank: no padding to the largest owner, and every
    # pair moves at once instead of in the n - 1 steps of a ring.
    sizes = _to_every_rank(comm, [mine.nnz, sum(recv_counts), int(not finite)], rows.values.device)
    pull_nbytes = [
        pull_index_nbytes(partition.owned(owner).numel(), count) + count * row_nbytes
        for owner, (count, _, _) in enumerate(sizes)
    ]
    frame = torch.cat([encode_owned(mine.indices, owned), value_bytes(mine)])
    pulled = comm.all_to_all([frame] * n, pull_nbytes).wait()
    parts = [
        _unpull(rows, data, partition.owned(owner, rows.values.device), count) if owner != me else mine
        for owner, (data, (count, _, _)) in enumerate(zip(pulled, sizes, strict=True))
    ]

    sent = (
        COUNT_NBYTES * (n - 1)
        + sum(f.numel() for j, f in enumerate(frames) if j != me)
        + OWNER_SIZE_NBYTES * (n - 1)
        + frame.numel() * (n - 1)
    )
    return SparseResult(
        Summed(rows.num_rows, parts=parts),
        "balanced",
        all(flag == 0 for _, _, flag in sizes),
        sent,
        push_imbalance=imbalance([pushed_rows for _, pushed_rows, _ in sizes]),
        pull_imbalance=imbalance(pull_nbytes),
    )


def _swap_counts(comm: Comm, send_counts: list[int], device: torch.device) -> list[int]:
    """How many rows each rank will push here, given how many this rank pushes to each."""
    parts = list(torch.tensor(send_counts, dtype=torch.int64, device=device).split(1))
    return [int(c) for c in comm.all_to_all(parts, [1] * comm.world_size).wait()]


def _to_every_rank(comm: Comm, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's `values` (one length on all ranks), in rank order: an allgather in one step."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    received = comm.all_to_all([mine] * comm.world_size, [len(values)] * comm.world_size).wait()
    return [part.tolist() for part in received]


def _unpush(like: SparseRows, data: torch.Tensor, count: int) -> SparseRows:
    split = INDEX_NBYTES * count
    indices = data[:split].clone().view(torch.int32).long()  # clone: a slice may sit misaligned
    values = values_from_bytes(data[split:], count, like.width, like.values.dtype)
    return like.like(indices, values)


def _unpull(like: SparseRows, data: torch.Tensor, owned: torch.Tensor, count: int) -> SparseRows:
    split = pull_index_nbytes(owned.numel(), count)
    indices = decode_owned(data[:split], owned, count)
    values_nbytes = count * like.width * like.values.element_size()
    values = values_from_bytes(data[split : split + values_nbytes], count, like.width, like.values.dtype)
    return like.like(indices, values)


def _check_partition(partition: Partition, rows: SparseRows, n: int) -> None:
    if partition.num_rows != rows.num_rows or partition.num_owners != n:
        raise ValueError(
            f"the partition is for {partition.num_rows} rows over {partition.num_owners} owners, but the "
            f"tensor has {rows.num_rows} rows and the group {n} ranks: build it for this tensor and group"
        )
