"""What each sparse scheme costs: bytes each rank sends and latency steps, as pure functions of
the tensor's shape, the number of workers and how sparse the ranks' rows are.

The byte counts follow the implementations message by message (size exchanges, padding and
index formats included), so measured traffic can be checked against them; an alpha-beta model
turns them into seconds: alpha per latency step on the critical path, beta per byte sent.

Zen's analysis (section 2.3) in these terms, for n workers, M dense bytes and per-rank density d,
where d_m is the density of the union of m ranks' rows (densification gamma_m = d_m / d):
  dense         2 (n - 1) / n * M
  agsparse      (n - 1) * d * M * (1 + index overhead)
  balanced      (n - 1) / n * (d + d_n) * M, plus indices: 4-byte COO pushed, hash bitmap pulled
  recursive-doubling  sum over rounds i of min(d_{2^i} * M + indices, M)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..comm import allreduce_sent_nbytes
from ..cost import Link
from ..wire import index_nbytes
from .hashing import pull_index_nbytes

HEADER_NBYTES = 16  # recursive doubling: (rows, flag) before every message
AGSPARSE_SIZE_NBYTES = 16  # agsparse: (rows, flag) allgathered first
PUSH_COUNT_NBYTES = 8  # balanced: one int64 count to every other rank
OWNER_SIZE_NBYTES = 24  # balanced: (rows, rows pushed, flag) allgathered before the pull
INDEX_NBYTES = 4


@dataclass(frozen=True)
class Sparsity:
    """How sparse the ranks' rows of one [num_rows, width] tensor are, measured or modelled.

    union_density[m] is the fraction of rows in the union of m ranks' rows (mean over groups of m
    consecutive ranks), for the group sizes a scheme merges: 1, 2, 4, ... up to the number of
    workers, and the number of workers itself. union_density[1] is the per-rank density.
    """

    num_rows: int
    width: int
    value_nbytes: int  # bytes per value: 4 (fp32), 2 (fp16, bf16)
    union_density: Mapping[int, float]
    max_density: float | None = None  # the densest rank's (agsparse pads to it); default: the mean
    push_imbalance: float = 1.0  # balanced: max / mean rows pushed to an owner
    pull_imbalance: float = 1.0  # balanced: max / mean bytes an owner pulls out

    @property
    def density(self) -> float:
        return self.union_density[1]

    def densification(self, m: int) -> float:
        """gamma_m = d_m / d: how much larger the union of m ranks' rows is than one rank's."""
        return self.union_density[m] / self.density if self.density else 1.0

    def rows(self, m: int = 1) -> float:
        return self.union_density[m] * self.num_rows

    @property
    def dense_nbytes(self) -> int:
        return self.num_rows * self.width * self.value_nbytes

    def frame_nbytes(self, count: float) -> float:
        """Rows as one frame: indices (COO or bitmap, the smaller) and values."""
        count = round(count)
        return index_nbytes(self.num_rows, count) + count * self.width * self.value_nbytes


@dataclass(frozen=True)
class Network(Link):
    """A rank's link (gradsync.cost's alpha-beta Link), with the latency of each collective's
    round where measured. By default a 1 Gbit/s link with 50 us per message.

    A round costs alpha per message on its critical path (`round_steps`). Measured rounds
    (`round_s`: seconds of one near-empty round of each collective, at this group's size) replace
    that where known: real collectives differ from the model (on the emulated testbed a tiny
    all_to_all costs as much as 30 allreduce steps).
    """

    alpha_s: float = 50e-6
    bytes_per_s: float = 1e9 / 8
    round_s: Mapping[str, float] | None = None

    def latency_s(self, collective: str, n: int) -> float:
        if self.round_s is not None and collective in self.round_s:
            return self.round_s[collective]
        return self.alpha_s * round_steps(collective, n)

    def seconds(self, nbytes: float, rounds: Sequence[str], n: int) -> float:
        return sum(self.latency_s(c, n) for c in rounds) + nbytes / self.bytes_per_s


def traffic(sparsity: Sparsity, n: int) -> dict[str, float]:
    """Bytes on the critical path, per scheme, for n workers: what each rank sends, and for
    balanced the busiest owner's load, the rows pushed to it and the sum it pulls out (mean times
    the measured imbalance)."""
    return {
        "dense": dense_nbytes(sparsity, n),
        "agsparse": agsparse_nbytes(sparsity, n),
        "balanced": balanced_nbytes(sparsity, n),
        "recursive-doubling": doubling_nbytes(sparsity, n),
    }


def rounds(n: int) -> dict[str, tuple[str, ...]]:
    """The collectives each scheme runs one after the other, for n workers."""
    power = _power_below(n)
    swaps = 2 * int(math.log2(power)) + (4 if n != power else 0)  # a header and a body per message
    return {
        "dense": ("allreduce",),
        "agsparse": ("allgather", "allgather"),
        "balanced": ("all_to_all",) * 4,
        "recursive-doubling": ("sendrecv",) * swaps,
    }


def round_steps(collective: str, n: int) -> int:
    """Messages on a round's critical path: a ring allreduce 2 (n - 1), a ring allgather n - 1,
    an all_to_all 1 (every pair at once), a swap with a partner 1."""
    return {"allreduce": 2 * (n - 1), "allgather": n - 1, "all_to_all": 1, "sendrecv": 1}[collective]


def latency_steps(n: int) -> dict[str, int]:
    """Messages on each scheme's critical path: the sum of its rounds' steps."""
    return {name: sum(round_steps(c, n) for c in chain) for name, chain in rounds(n).items()}


def seconds(sparsity: Sparsity, n: int, network: Network, dense_latency: bool = True) -> dict[str, float]:
    """Predicted exchange time per scheme.

    dense_latency=False: the dense option costs its bytes only, as for a tensor whose dense
    exchange joins its neighbours' allreduce in the same bucket instead of a round of its own.
    """
    chains = rounds(n)
    if not dense_latency:
        chains["dense"] = ()
    return {name: network.seconds(nbytes, chains[name], n) for name, nbytes in traffic(sparsity, n).items()}


def fastest(sparsity: Sparsity, n: int, network: Network, dense_latency: bool = True) -> str:
    """The scheme of least predicted time; a tie goes to the first in table order."""
    predicted = seconds(sparsity, n, network, dense_latency)
    return min(predicted, key=predicted.__getitem__)


def dense_nbytes(s: Sparsity, n: int) -> float:
    return allreduce_sent_nbytes(s.dense_nbytes + s.value_nbytes, n)  # + the flag element


def agsparse_nbytes(s: Sparsity, n: int) -> float:
    densest = (s.max_density if s.max_density is not None else s.density) * s.num_rows
    return (n - 1) * (AGSPARSE_SIZE_NBYTES + s.frame_nbytes(densest))


def balanced_nbytes(s: Sparsity, n: int) -> float:
    row_nbytes = s.width * s.value_nbytes
    push = (n - 1) / n * s.rows() * (INDEX_NBYTES + row_nbytes) * s.push_imbalance
    owner_rows = s.rows(n) / n * s.pull_imbalance
    pull = pull_index_nbytes(round(s.num_rows / n), round(owner_rows)) + owner_rows * row_nbytes
    return (n - 1) * (PUSH_COUNT_NBYTES + OWNER_SIZE_NBYTES + pull) + push


def doubling_nbytes(s: Sparsity, n: int) -> float:
    power = _power_below(n)
    sizes = [1 << i for i in range(int(math.log2(power)))]
    if power != n:  # the busiest rank folds a partner's rows into its own, and sends it the total
        sizes = [*(2 * m for m in sizes), n]
    return sum(HEADER_NBYTES + min(s.frame_nbytes(s.rows(_known(s, m))), s.dense_nbytes) for m in sizes)


def _known(s: Sparsity, m: int) -> int:
    """The measured group size closest to m from above (densities only grow with m)."""
    return min((k for k in s.union_density if k >= m), default=max(s.union_density))


def _power_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)
