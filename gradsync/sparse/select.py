"""The selector: which scheme syncs a tensor fastest, decided from what its rows look like.

Zen profiles the first iterations and compares its cost formulas for balanced parallelism and
hierarchical centralization; gradsync does that for all four schemes and keeps doing it. On a
decision step every rank's rows are allgathered (that step's exchange is agsparse, so the
measurement costs no extra round), and every rank computes from the same gathered rows:
  density        the mean fraction of rows per rank;
  overlap        |I_a & I_b| / min(|I_a|, |I_b|), the mean over pairs of ranks (Zen's C1);
  densification  the density of the union of m ranks' rows over one rank's, for m = 2, 4, ...,
                 n (Zen's C2): what balanced pulls and recursive doubling's rounds carry;
then predicts each scheme's time with the alpha-beta model of cost.py and takes the fastest.
Equal inputs give equal decisions on every rank, so no rank ever runs another scheme. The choice
holds for `every` steps, then the tensor is measured again.

The decisions depend on the gradients only, never on timings: the network they are priced on is a
fixed one (by default a 1 Gbit/s link with 50 us per message), so two runs with equal seeds choose
alike and sum alike, bit for bit. `calibrate` measures this group's network, for a Selector made
with it on purpose (the sparse benchmark).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..comm import Comm
from .cost import Network, Sparsity, seconds
from .rows import SparseRows

# Pairs of ranks whose overlap is measured: all pairs up to this many ranks, neighbours beyond.
_ALL_PAIRS_UP_TO = 16


@dataclass(frozen=True)
class Measured:
    """One tensor's sparsity over the ranks, as a decision step saw it."""

    sparsity: Sparsity
    overlap: float

    @property
    def density(self) -> float:
        return self.sparsity.density


def measure(parts: Sequence[SparseRows]) -> Measured:
    """Density, overlap and densification of every rank's rows (in rank order)."""
    first = parts[0]
    n, num_rows = len(parts), max(first.num_rows, 1)
    densities = [p.nnz / num_rows for p in parts]
    union_density = {1: statistics.fmean(densities)}
    for m in _group_sizes(n):
        groups = [parts[start : start + m] for start in range(0, n - m + 1, m)]
        union_density[m] = statistics.fmean(_union_size(g) / num_rows for g in groups)
    sparsity = Sparsity(
        num_rows=first.num_rows,
        width=first.width,
        value_nbytes=first.values.element_size(),
        union_density=union_density,
        max_density=max(densities),
    )
    return Measured(sparsity, _overlap(parts))


def calibrate(comm: Comm, device: torch.device, repeats: int = 3) -> Network:
    """The latency of one near-empty round of each collective the schemes use, and the
    bandwidth of a 4 MiB allreduce, measured on this group.

    Ranks time differently, so the slowest rank's times are taken: every rank then holds the
    same Network and makes the same decisions.
    """
    n = comm.world_size
    if n == 1:
        return Network()
    one = torch.zeros(1, device=device)
    partner = comm.rank ^ 1  # recursive doubling's first partner; the odd rank out sits it out
    collectives: dict[str, Callable[[], object]] = {
        "allreduce": lambda: comm.allreduce(one).wait(),
        "allgather": lambda: comm.allgather(one).wait(),
        "all_to_all": lambda: comm.all_to_all([one] * n, [1] * n).wait(),
        "sendrecv": lambda: comm.sendrecv(partner, one, 1) if partner < n else None,
    }
    large = torch.zeros(1 << 20, device=device)
    times = [_median_time(run, repeats) for run in collectives.values()]
    times.append(_median_time(lambda: comm.allreduce(large).wait(), repeats))
    slowest = _max_over_ranks(comm, torch.tensor(times, dtype=torch.float64, device=device))
    round_s = dict(zip(collectives, slowest, strict=False))
    ring_nbytes = 2 * (n - 1) / n * large.nbytes
    return Network(
        alpha_s=round_s["allreduce"] / (2 * (n - 1)),
        bytes_per_s=ring_nbytes / max(slowest[-1] - round_s["allreduce"], 1e-9),
        round_s=round_s,
    )


def _median_time(run: Callable[[], object], repeats: int) -> float:
    run()  # warm the connection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Choice:
    """A tensor's scheme and why: reported in state.stats()["sparse"]."""

    scheme: str
    decided_at_step: int
    measured: Measured | None  # None for a forced scheme
    predicted_s: dict[str, float] = field(default_factory=dict)

    def describe(self) -> dict[str, object]:
        row: dict[str, object] = {"scheme": self.scheme, "decided_at_step": self.decided_at_step}
        if self.measured is not None:
            sparsity = self.measured.sparsity
            n = max(sparsity.union_density)
            row.update(
                density=sparsity.density,
                overlap=self.measured.overlap,
                densification=sparsity.densification(n),
                predicted_s=dict(self.predicted_s),
            )
        return row


class Selector:
    """Per tensor key, the scheme of least predicted time; re-decided every `every` steps."""

    def __init__(self, every: int, network: Network | None = None) -> None:
        self.every = every
        self.network = network or Network()
        self.choices: dict[str, Choice] = {}

    def due(self, key: str, step: int) -> bool:
        """Whether `key` must be measured at `step` (the same answer on every rank)."""
        choice = self.choices.get(key)
        return choice is None or step - choice.decided_at_step >= self.every

    def decide(
        self, key: str, parts: Sequence[SparseRows], step: int, comm: Comm, dense_latency: bool = True
    ) -> Choice:
        """Measure every rank's rows and record the fastest scheme for `key` (dense_latency: see
        cost.seconds)."""
        measured = measure(parts)
        predicted = seconds(measured.sparsity, len(parts), self.network, dense_latency)
        scheme = min(predicted, key=predicted.__getitem__)  # a tie: the first in table order
        choice = Choice(scheme, step, measured, predicted)
        self.choices[key] = choice
        return choice


def _group_sizes(n: int) -> list[int]:
    """2, 4, ... up to n, and n itself: the unions balanced and recursive doubling move."""
    sizes = list(itertools.takewhile(lambda m: m <= n, (1 << i for i in range(1, 64))))
    return sizes if n in sizes or n == 1 else [*sizes, n]


def _union_size(parts: Sequence[SparseRows]) -> int:
    return torch.unique(torch.cat([p.indices for p in parts])).numel()


def _overlap(parts: Sequence[SparseRows]) -> float:
    n = len(parts)
    if n < 2:
        return 1.0
    if n <= _ALL_PAIRS_UP_TO:
        pairs = itertools.combinations(range(n), 2)
    else:
        pairs = ((r, r + 1) for r in range(n - 1))
    ratios = []
    for a, b in pairs:
        smaller = min(parts[a].nnz, parts[b].nnz)
        if smaller:
            shared = torch.isin(parts[a].indices, parts[b].indices, assume_unique=True).sum()
            ratios.append(int(shared) / smaller)
    return statistics.fmean(ratios) if ratios else 0.0


def _max_over_ranks(comm: Comm, values: torch.Tensor) -> list[float]:
    """The elementwise max over ranks, by an allgather (Comm's allreduce only sums)."""
    gathered = torch.stack(comm.allgather(values).wait())
    return gathered.max(dim=0).values.tolist()
