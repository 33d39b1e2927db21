"""The sparse exchange benchmark's analysis of rows: measured sparsity and each scheme's modelled traffic.

Holds pure functions of the ranks' row sets (index tensors): density, overlap, union densities and
densification, the owners' load and imbalance under a partition (measure, sparsity), and the traffic
model that feeds those into gradsync.sparse.cost for every scheme, range included (traffic_by_scheme,
model), from 2 workers up. They need no process group and no network, so the runner computes them on
the rows it draws itself, and tests can check them on hand-made sets.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from ..sparse import HashPartition, Partition, RangePartition, cost
from ..sparse.hashing import imbalance, pull_index_nbytes
from .sparse_schemes import MODELLED

# Worker counts the traffic model is evaluated at (up to model_workers), and the hosts'.
_MODEL_POINTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


# -- measured sparsity (pure) ---------------------------------------------------------------------


def densities(sets: Sequence[torch.Tensor], num_rows: int) -> list[float]:
    """Each rank's fraction of the rows."""
    return [s.numel() / num_rows for s in sets]


def overlap(sets: Sequence[torch.Tensor]) -> float:
    """|I_a & I_b| / min(|I_a|, |I_b|), the mean over pairs of ranks (Zen's C1); pairs with an
    empty set are left out; 1.0 for one rank, 0.0 if every pair has an empty set."""
    if len(sets) < 2:
        return 1.0
    ratios = []
    for a, b in itertools.combinations(sets, 2):
        smaller = min(a.numel(), b.numel())
        if smaller:
            ratios.append(int(torch.isin(a, b, assume_unique=True).sum()) / smaller)
    return statistics.fmean(ratios) if ratios else 0.0


def group_union_sizes(sets: Sequence[torch.Tensor], num_rows: int, m: int) -> list[int]:
    """The union size of each whole group of m consecutive ranks (ranks 0..m-1, m..2m-1, ...)."""
    groups = len(sets) // m
    if groups == 0:
        return []
    keys = torch.cat([s.long() + (i // m) * num_rows for i, s in enumerate(sets[: groups * m])])
    return torch.bincount(torch.unique(keys) // num_rows, minlength=groups).tolist()


def union_density(sets: Sequence[torch.Tensor], num_rows: int, m: int) -> float:
    """d_m: the fraction of rows in the union of m consecutive ranks' rows, mean over groups."""
    sizes = group_union_sizes(sets, num_rows, m)
    if not sizes:
        raise ValueError(f"union of m={m} ranks' rows asked of {len(sets)} ranks; m must be <= {len(sets)}")
    return statistics.fmean(sizes) / num_rows


def group_sizes(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n: the unions balanced pulls and recursive doubling's rounds carry."""
    powers = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return powers if n in powers else [*powers, n]


def densification(sets: Sequence[torch.Tensor], num_rows: int, sizes: Sequence[int]) -> dict[int, float]:
    """gamma_m = d_m / d for each m in `sizes` (d = d_1, the mean per-rank density)."""
    d = union_density(sets, num_rows, 1)
    return {m: union_density(sets, num_rows, m) / d if d else 1.0 for m in sizes}


def owner_loads(sets: Sequence[torch.Tensor], partition: Partition) -> tuple[list[int], list[int]]:
    """Per owner: rows pushed to it (over all ranks, duplicates counted), rows it then holds (the
    union of what it received): what balanced's push and pull carry."""
    n = partition.num_owners
    everything = torch.cat([s.long() for s in sets])
    pushed = torch.bincount(partition.owner_of(everything), minlength=n)
    held = torch.bincount(partition.owner_of(torch.unique(everything)), minlength=n)
    return pushed.tolist(), held.tolist()


def partition_imbalance(
    sets: Sequence[torch.Tensor], partition: Partition, row_nbytes: int
) -> tuple[float, float]:
    """(push, pull) imbalance, max / mean, as balanced reports them: of the rows pushed to each
    owner, and of the bytes each owner's pull frame takes (its index encoding included)."""
    pushed, held = owner_loads(sets, partition)
    owned = torch.bincount(
        partition.owner_of(torch.arange(partition.num_rows)), minlength=partition.num_owners
    )
    pull = [pull_index_nbytes(int(o), h) + h * row_nbytes for o, h in zip(owned.tolist(), held, strict=True)]
    return imbalance(pushed), imbalance(pull)


def sparsity(
    sets: Sequence[torch.Tensor],
    num_rows: int,
    width: int,
    value_nbytes: int,
    partition: Partition | None = None,
) -> cost.Sparsity:
    """cost.Sparsity of these ranks' rows: union densities at 1, 2, 4, ..., n, the densest rank,
    and `partition`'s push and pull imbalance (default: balanced's hash, seed 0)."""
    n = len(sets)
    partition = partition or HashPartition(num_rows, n, seed=0)
    push, pull = partition_imbalance(sets, partition, width * value_nbytes)
    return cost.Sparsity(
        num_rows=num_rows,
        width=width,
        value_nbytes=value_nbytes,
        union_density={m: union_density(sets, num_rows, m) for m in group_sizes(n)},
        max_density=max(densities(sets, num_rows)),
        push_imbalance=push,
        pull_imbalance=pull,
    )


def measure(sets: Sequence[torch.Tensor], num_rows: int, width: int, value_nbytes: int) -> dict[str, Any]:
    """The sparsity report of the exchanged rows (n = len(sets) ranks)."""
    n = len(sets)
    row_nbytes = width * value_nbytes
    per_rank = densities(sets, num_rows)
    hash_push, hash_pull = partition_imbalance(sets, HashPartition(num_rows, n, seed=0), row_nbytes)
    range_push, range_pull = partition_imbalance(sets, RangePartition(num_rows, n), row_nbytes)
    sizes = group_sizes(n)
    return {
        "workers": n,
        "density": per_rank,
        "density_mean": statistics.fmean(per_rank),
        "overlap": overlap(sets),
        "union_density": {m: union_density(sets, num_rows, m) for m in sizes},
        "densification": densification(sets, num_rows, sizes),
        "hash": {"push_imbalance": hash_push, "pull_imbalance": hash_pull},
        "range": {"push_imbalance": range_push, "pull_imbalance": range_pull},
    }


# -- the traffic model (pure) ---------------------------------------------------------------------


def model_points(max_workers: int, hosts: int) -> list[int]:
    """Worker counts the model is evaluated at: 2, 3, 4, 6, 8, ... up to max_workers, and hosts."""
    return sorted({n for n in _MODEL_POINTS if n <= max_workers} | {max_workers, hosts} - {0, 1})


def traffic_by_scheme(
    sets: Sequence[torch.Tensor], num_rows: int, width: int, value_nbytes: int, network: cost.Network
) -> dict[str, Any]:
    """Modelled bytes each rank sends and seconds, per scheme (range too), for n = len(sets)."""
    n = len(sets)
    hashed = sparsity(sets, num_rows, width, value_nbytes)
    ranged = sparsity(sets, num_rows, width, value_nbytes, RangePartition(num_rows, n))
    nbytes = cost.traffic(hashed, n)
    nbytes["range"] = cost.balanced_nbytes(ranged, n)
    seconds = cost.seconds(hashed, n, network)
    seconds["range"] = network.seconds(nbytes["range"], cost.rounds(n)["balanced"], n)
    return {
        "workers": n,
        "density": hashed.density,
        "densification": hashed.densification(n),
        "push_imbalance": hashed.push_imbalance,
        "pull_imbalance": hashed.pull_imbalance,
        "range_push_imbalance": ranged.push_imbalance,
        "range_pull_imbalance": ranged.pull_imbalance,
        "bytes": nbytes,
        "seconds": seconds,
        "least_bytes": min(MODELLED, key=nbytes.__getitem__),
        "fastest": cost.fastest(hashed, n, network),
    }


def model(
    sets: Sequence[torch.Tensor],
    num_rows: int,
    width: int,
    value_nbytes: int,
    workers: Sequence[int],
    network: cost.Network,
) -> list[dict[str, Any]]:
    """traffic_by_scheme for the first n sets, for each n in `workers` (each <= len(sets))."""
    if max(workers) > len(sets):
        raise ValueError(
            f"the model asks for {max(workers)} workers but only {len(sets)} ranks' rows were drawn"
        )
    return [traffic_by_scheme(sets[:n], num_rows, width, value_nbytes, network) for n in workers]


def winner_ranges(points: Sequence[dict[str, Any]], key: str = "least_bytes") -> list[tuple[int, int, str]]:
    """Consecutive worker counts with the same winner, as (first n, last n, scheme)."""
    ranges: list[tuple[int, int, str]] = []
    for point in points:
        n, winner = point["workers"], point[key]
        if ranges and ranges[-1][2] == winner:
            ranges[-1] = (ranges[-1][0], n, winner)
        else:
            ranges.append((n, n, winner))
    return ranges
