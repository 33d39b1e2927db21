"""Who owns which row: Zen's hash partition, the index-range partition it improves on, and the
hash bitmap that encodes an owner's rows against its precomputed row set.

Zen (Wang et al., "Zen: Empowering Distributed Training with Sparsity-driven Data
Synchronization", OSDI 2025) balances sparse synchronization by giving each row to an owner
through a universal hash h0 whose seed every rank shares. Frequent rows are spread over all
owners, so skewed indices (an embedding's common words) load every owner about equally, where
an index-range partition gives the owner of the lowest indices most of the work.

Hash bitmap: owner i's row set I_i = {r : h0(r) = i} is known to every rank in advance, sorted.
Owner i then names a subset of I_i with |I_i| bits, one per member: over all owners that is
num_rows / 8 bytes, whatever the number of workers (a plain bitmap per owner would cost n times
that). Where the subset is small, 4-byte COO indices are smaller and are used instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property, lru_cache

import torch

from ..wire import pack_bits, packed_nbytes, unpack_bits


class Partition:
    """Assigns each row of [0, num_rows) to one of `num_owners` owners, the same on every rank."""

    name = "partition"

    def __init__(self, num_rows: int, num_owners: int) -> None:
        if num_owners < 1:
            raise ValueError(f"num_owners={num_owners} must be at least 1")
        self.num_rows = num_rows
        self.num_owners = num_owners

    def owner_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The owner (int64 in [0, num_owners)) of each index."""
        raise NotImplementedError(f"{type(self).__name__} must implement owner_of")

    def owned(self, owner: int, device: torch.device | None = None) -> torch.Tensor:
        """Every row `owner` owns, ascending (int64), on `device` (default the CPU): where the
        indices they are matched with live."""
        raise NotImplementedError(f"{type(self).__name__} must implement owned")

    def split(self, indices: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """A stable order that groups `indices` by owner, and the group sizes in owner order.

        Indices ascending on input stay ascending within each owner's group.
        """
        owners = self.owner_of(indices)
        order = torch.sort(owners, stable=True).indices
        counts = torch.bincount(owners, minlength=self.num_owners)
        return order, counts.tolist()


class HashPartition(Partition):
    """Zen's h0: multiply-add-shift universal hashing (Dietzfelbinger, "Universal hashing and
    k-wise independent random variables via integer arithmetic without primes", STACS 1996).

    h(x) = ((a x + b) mod 2^64) div 2^32 with a odd and b drawn from `seed`; the owner is the
    top of h scaled to num_owners, (h n) div 2^32, so any number of owners gets an even share.

    Example:
        >>> p = HashPartition(num_rows=10, num_owners=2, seed=0)
        >>> p.owner_of(torch.arange(10))  # the same on every rank with seed 0
    """

    name = "hash"

    def __init__(self, num_rows: int, num_owners: int, seed: int) -> None:
        super().__init__(num_rows, num_owners)
        generator = torch.Generator().manual_seed(seed)
        a, b = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, generator=generator).tolist()
        self._a, self._b = a | 1, b
        self._rows_on: dict[torch.device, torch.Tensor] = {}  # _rows_by_owner's rows on other devices

    def owner_of(self, indices: torch.Tensor) -> torch.Tensor:
        # int64 products wrap modulo 2^64, as the hash wants; >> is arithmetic, hence the mask.
        hashed = (indices.long() * self._a + self._b >> 32) & 0xFFFFFFFF
        return (hashed * self.num_owners) >> 32

    def owned(self, owner: int, device: torch.device | None = None) -> torch.Tensor:
        rows, offsets = self._rows_by_owner
        if device is not None and device.type != "cpu":  # copied to a GPU once, not at every pull
            on_device = self._rows_on.get(device)
            if on_device is None:  # (setdefault would copy at every call, to keep the first copy)
                on_device = self._rows_on[device] = rows.to(device)
            rows = on_device
        return rows[offsets[owner] : offsets[owner + 1]]

    @cached_property
    def _rows_by_owner(self) -> tuple[torch.Tensor, list[int]]:
        # Every row once, grouped by owner and ascending within a group, and where each group
        # starts; computed on first use and kept (8 bytes per row), since every pull decodes
        # against it.
        order, counts = self.split(torch.arange(self.num_rows))
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        return order, offsets


@lru_cache(maxsize=16)
def hash_partition(num_rows: int, num_owners: int, seed: int) -> HashPartition:
    """The HashPartition for these numbers, built once: its row table is a sort of every row."""
    return HashPartition(num_rows, num_owners, seed)


class RangePartition(Partition):
    """Contiguous index ranges of (almost) equal length, owner i getting the i-th: the partition
    of parameter servers and OmniReduce, kept to measure the imbalance hashing removes."""

    name = "range"

    def owner_of(self, indices: torch.Tensor) -> torch.Tensor:
        return indices.long() * self.num_owners // max(self.num_rows, 1)

    def owned(self, owner: int, device: torch.device | None = None) -> torch.Tensor:
        return torch.arange(self._first_row(owner), self._first_row(owner + 1), device=device)

    def _first_row(self, owner: int) -> int:
        # The smallest r with r * n // num_rows >= owner.
        return -(-owner * self.num_rows // self.num_owners)


def pull_index_format(owned_count: int, count: int) -> str:
    """How an owner names `count` of its `owned_count` rows: "hash-bitmap" where its
    ceil(owned_count / 8) bytes are fewer than COO's 4 per row, else "coo". Every rank knows
    both numbers, so no tag crosses the wire."""
    return "hash-bitmap" if packed_nbytes(owned_count, 1) < 4 * count else "coo"


def pull_index_nbytes(owned_count: int, count: int) -> int:
    if pull_index_format(owned_count, count) == "hash-bitmap":
        return packed_nbytes(owned_count, 1)
    return 4 * count


def encode_owned(indices: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """Ascending `indices`, all in the ascending set `owned`, as uint8 bytes in the smaller format."""
    if pull_index_format(owned.numel(), indices.numel()) == "coo":
        return indices.to(torch.int32).view(torch.uint8)
    members = torch.zeros(owned.numel(), dtype=torch.bool, device=indices.device)
    members[torch.searchsorted(owned, indices)] = True
    return pack_bits(members, 1)


def decode_owned(encoded: torch.Tensor, owned: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of encode_owned: the `count` ascending int64 indices."""
    if pull_index_format(owned.numel(), count) == "coo":
        if encoded.storage_offset() % 4 or encoded.data_ptr() % 4:
            encoded = encoded.clone()  # a misaligned slice cannot be viewed as int32, even empty
        indices = encoded.view(torch.int32).long()
    else:
        indices = owned[unpack_bits(encoded, 1, owned.numel()).nonzero().squeeze(1)]
    if indices.numel() != count:
        raise ValueError(
            f"owner's index encoding names {indices.numel()} rows, but {count} values came with it"
        )
    return indices


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads: 1.0 is perfect balance, n is all on one rank (1.0 if all 0)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0
