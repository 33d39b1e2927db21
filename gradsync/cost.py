"""The alpha-beta cost model of collectives: seconds as pure functions of bytes, ranks and links.

A message of S bytes over a link costs alpha + S / B: alpha seconds of latency per message on the
critical path, then 1 / B seconds per byte, B the link's one-way bandwidth in bytes per second.
A collective costs the alphas of the messages one after another on its critical path plus the
bytes through its busiest link divided by B. For n workers, S bytes per rank:

  ring allreduce          2 (n - 1) alpha + 2 (n - 1) / n * S / B   (reduce-scatter + allgather)
  tree allreduce          2 ceil(log2 n) alpha + 2 S / B            (pipelined reduce + broadcast)
  reduce-scatter          (n - 1) alpha + (n - 1) / n * S / B
  allgather (sizes s_i)   (n - 1) alpha + (sum s_i - min s_i) / B    equal sizes: (n - 1)(alpha + S / B)
  all-to-all              sum over n - 1 rounds of alpha + (largest message of the round) / B
                          uniform: (n - 1)(alpha + S / (n B))
  parameter server        push + pull, each alpha + max(S, workers * S / servers) / B;
                          servers colocated with the workers: alpha + (n - 1) / n * S / B each way
  hierarchical allreduce  intra reduce-scatter of S, inter ring allreduce of S / g, intra allgather
  hierarchical allgather  inter allgather of S, then intra allgather of nodes * S blocks

Every collective on one worker (n == 1) is free, nothing leaving the rank; only a parameter server
on separate machines still costs its round trip.

These are the textbook models: Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 2005) for the ring and pairwise-exchange algorithms,
the pipelined binary trees NCCL runs as its double binary tree (Sanders, Speck & Traeff 2009), and
BytePS's push-pull with separate or co-located servers (Jiang et al., OSDI 2020).
Simplifications, each because it is second order for gradient sizes (kilobytes to gigabytes) or
because the planner only compares schemes under one model:
- links are full duplex and the switch has full bisection bandwidth: a rank sends and receives at
  B at once, and disjoint pairs never slow each other;
- alpha is charged per message on the critical path, whatever its size; messages a rank posts at
  once (a push to every server) share one alpha;
- the reduction arithmetic is free: a GPU adds at memory bandwidth, far above any network's;
- pipelined algorithms (tree, variable-size allgather) move data in chunks small next to S, so the
  pipeline's fill time and the per-chunk alphas are left out; only the busiest link's bytes count.
A Link is ONE rank's share of its wire: where g ranks of a node cross one NIC at once, as the
hierarchical collectives' inter-node step does, pass Link(alpha, nic_bytes_per_s / g).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Link:
    """One rank's link: alpha_s = seconds per message (latency), bytes_per_s = bytes/s one way."""

    alpha_s: float  # seconds per message, before its first byte arrives
    bytes_per_s: float  # bytes per second, one way; the link is full duplex

    def __post_init__(self) -> None:
        # `not (x >= 0)` rather than `x < 0`: NaN fails it too.
        if not self.alpha_s >= 0:
            raise ValueError(
                f"Link(alpha_s={self.alpha_s!r}): must be >= 0 seconds per message; "
                "e.g. 25e-6 for TCP between nodes, 5e-6 within one"
            )
        if not self.bytes_per_s > 0:
            raise ValueError(
                f"Link(bytes_per_s={self.bytes_per_s!r}): must be > 0 bytes per second; "
                "e.g. 25e9 / 8 for 25 Gbit/s"
            )

    def transfer_s(self, nbytes: float) -> float:
        """One message of nbytes: alpha + nbytes / B."""
        return self.alpha_s + nbytes / self.bytes_per_s


def _check_count(value: int, name: str) -> None:
    if not value >= 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1 (a number of ranks); e.g. {name}=4")


def _check_nbytes(nbytes: float, name: str = "nbytes") -> None:
    if not nbytes >= 0:
        raise ValueError(f"{name}={nbytes!r} must be >= 0 bytes; pass a message size")


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring allreduce (reduce-scatter then allgather): 2 (n-1) alpha + 2 (n-1)/n * S / B."""
    _check_nbytes(nbytes)
    _check_count(n, "n")
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.bytes_per_s


def tree_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Pipelined binary-tree reduce then broadcast (NCCL's double binary tree):
    2 ceil(log2 n) alpha + 2 S / B.

    Each phase crosses the tree's depth ceil(log2 n) once (one alpha per level) and pushes all S
    bytes through the busiest link. Left out: the pipeline's fill time (depth x one chunk's time)
    and the alpha of every chunk after the first, both small when chunks are small next to S; and
    the overlap of reduce and broadcast that the double tree's full-duplex links would allow.
    """
    _check_nbytes(nbytes)
    _check_count(n, "n")
    if n == 1:
        return 0.0
    depth = int(n - 1).bit_length()  # ceil(log2 n), exact in integers
    return 2 * depth * link.alpha_s + 2 * nbytes / link.bytes_per_s


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of S bytes into n parts: (n-1) alpha + (n-1)/n * S / B."""
    _check_nbytes(nbytes)
    _check_count(n, "n")
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.bytes_per_s


def allgather_s(sizes: Sequence[float], link: Link) -> float:
    """Ring allgather, rank i contributing sizes[i] bytes: (n-1) alpha + (sum(sizes) - min(sizes)) / B.

    Rank i sends to i + 1. Block j leaves rank j and is forwarded n - 1 hops, over the links out of
    j, j + 1, ..., j - 2, so the only link it never crosses is the one out of j - 1: the link out
    of rank i carries every block but its successor's, sum - sizes[i + 1] bytes. With blocks
    forwarded in chunks as they arrive (no lock-step rounds) the busiest link, sum - min, bounds
    the time. Equal sizes m give (n-1)(alpha + m / B). A caller that pads every block to the
    largest (torch's all_gather needs equal sizes) should pass the padded sizes.
    """
    n = len(sizes)
    _check_count(n, "len(sizes)")
    smallest = min(sizes)
    _check_nbytes(smallest, "min(sizes)")
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha_s + (sum(sizes) - smallest) / link.bytes_per_s


def allgather_equal_s(nbytes: float, n: int, link: Link) -> float:
    """Ring allgather of n blocks of nbytes each: (n-1)(alpha + S / B)."""
    _check_nbytes(nbytes)
    _check_count(n, "n")
    return (n - 1) * (link.alpha_s + nbytes / link.bytes_per_s)


def all_to_all_s(send_nbytes: Sequence[Sequence[float]], link: Link) -> float:
    """Pairwise-exchange all-to-all, send_nbytes[i][j] bytes from rank i to rank j:
    sum over rounds k = 1 .. n-1 of alpha + max_i max(sent_i, received_i) / B.

    In round k rank i sends send_nbytes[i][(i + k) % n] and receives from (i - k) % n; the diagonal
    stays local. A round lasts as long as its slowest rank.
    """
    n = len(send_nbytes)
    lengths = [len(row) for row in send_nbytes]
    if n == 0 or any(length != n for length in lengths):
        raise ValueError(
            f"send_nbytes has {n} rows of lengths {lengths}; it must be square, n x n for n ranks "
            "(row i: the bytes rank i sends to each rank, its own entry included)"
        )
    bytes_on_wire = 0.0
    for k in range(1, n):
        # What rank i receives in round k is what rank i - k sends, so the largest message of the
        # round is both the most any rank sends and the most any rank receives.
        largest = max(send_nbytes[i][(i + k) % n] for i in range(n))
        _check_nbytes(largest, f"send_nbytes (largest of round {k})")
        bytes_on_wire += largest
    return (n - 1) * link.alpha_s + bytes_on_wire / link.bytes_per_s


def all_to_all_uniform_s(nbytes: float, n: int, link: Link) -> float:
    """All-to-all where each rank splits nbytes evenly over the n ranks: (n-1)(alpha + S / (n B))."""
    _check_nbytes(nbytes)
    _check_count(n, "n")
    return (n - 1) * (link.alpha_s + nbytes / (n * link.bytes_per_s))


def reduce_scatter_allgather_s(nbytes: float, n: int, link: Link) -> float:
    """Reduce-scatter of S then allgather of the S / n parts; equals ring_allreduce_s:
    (n-1) alpha + (n-1)/n S / B + (n-1)(alpha + S / (n B))."""
    return reduce_scatter_s(nbytes, n, link) + allgather_equal_s(nbytes / n, n, link)


def parameter_server_s(
    nbytes: float,
    workers: int,
    servers: int,
    link: Link,
    pull_nbytes: float | None = None,
    colocated: bool = False,
) -> float:
    """Push S to the servers, pull P back (default P = S), the model sharded evenly over `servers`.

    Separate servers (each on a link like a worker's): a worker sends S and a server takes
    workers * S / servers, so each way costs alpha + max(S, workers * S / servers) / B; the server
    in-link binds whenever workers > servers.
    Colocated (servers == workers, each rank also serves a shard, as BytePS co-located): a rank
    sends every shard but its own and receives its shard from every other rank, all at once, so
    each way costs alpha + (n-1)/n * S / B: the ring allreduce's bytes with 2 alphas instead of
    2 (n-1). Free on one worker.
    """
    _check_nbytes(nbytes)
    _check_count(workers, "workers")
    _check_count(servers, "servers")
    pull = nbytes if pull_nbytes is None else pull_nbytes
    _check_nbytes(pull, "pull_nbytes")
    if colocated:
        if servers != workers:
            raise ValueError(
                f"colocated=True needs servers == workers (every worker serves one shard), got "
                f"workers={workers}, servers={servers}; set servers={workers} or colocated=False"
            )
        if workers == 1:
            return 0.0
        share = (workers - 1) / workers
        return 2 * link.alpha_s + share * (nbytes + pull) / link.bytes_per_s
    fan_in = max(1.0, workers / servers)  # bytes through the busiest link per byte a worker sends
    return 2 * link.alpha_s + fan_in * (nbytes + pull) / link.bytes_per_s


def hierarchical_allreduce_s(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link) -> float:
    """Two-level allreduce over nodes x g ranks (g = per_node): reduce_scatter_s(S, g, intra)
    + ring_allreduce_s(S / g, nodes, inter) + allgather_equal_s(S / g, g, intra).

    After the intra-node reduce-scatter each local rank owns S / g of its node's sum and runs its
    own inter-node ring over it, all g rings at once: `inter` is one rank's share of the NIC.
    """
    _check_count(nodes, "nodes")
    _check_count(per_node, "per_node")
    part = nbytes / per_node
    return (
        reduce_scatter_s(nbytes, per_node, intra)
        + ring_allreduce_s(part, nodes, inter)
        + allgather_equal_s(part, per_node, intra)
    )


def hierarchical_allgather_s(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link) -> float:
    """Two-level allgather of S bytes from each of nodes x g ranks (g = per_node):
    allgather_equal_s(S, nodes, inter) + allgather_equal_s(nodes * S, g, intra)
    = (nodes-1)(alpha_inter + S / B_inter) + (g-1)(alpha_intra + nodes * S / B_intra).

    The g local ranks split the inter-node step: local rank l gathers the blocks of rank l of
    every node, all g rings at once (`inter` is one rank's share of the NIC), then the node's
    ranks allgather those nodes * S collections among themselves.
    """
    _check_count(nodes, "nodes")
    _check_count(per_node, "per_node")
    return allgather_equal_s(nbytes, nodes, inter) + allgather_equal_s(nodes * nbytes, per_node, intra)


@dataclass(frozen=True)
class LinearFit:
    """t = fixed_s + per_unit_s * x, fitted to measurements, with the fit's error."""

    fixed_s: float  # seconds at x = 0: latency, launch; >= 0
    per_unit_s: float  # seconds per unit of x (a byte, an element); >= 0
    rel_error: float  # median relative error |pred - meas| / meas over the measured points
    max_rel_error: float  # largest of those relative errors
    points: int  # how many measurements the fit saw

    def __call__(self, x: float) -> float:
        """The fitted time at x: fixed_s + per_unit_s * x."""
        return self.fixed_s + self.per_unit_s * x

    def to_dict(self) -> dict[str, float]:
        """JSON-friendly; LinearFit.from_dict inverts it exactly."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinearFit:
        """The fit that to_dict wrote: every field's key, no others."""
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in data]
        if missing:
            raise ValueError(
                f"a LinearFit dict lacks {missing}; expected the keys of LinearFit.to_dict(): {names}"
            )
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"a LinearFit dict has unknown keys {unknown}; expected only {names}")
        floats = {name: float(data[name]) for name in names if name != "points"}
        return cls(**floats, points=int(data["points"]))


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least-squares t = a + b x weighted by 1 / y^2, with a, b >= 0.

    The weights make it minimise the relative errors: measured times span decades (4 B to 64 MiB),
    and an unweighted fit follows the largest sizes and ignores the small ones, where the fixed
    cost shows. A negative coefficient is unphysical: it is clamped to 0 and the other refitted
    alone. Since every y > 0 and x >= 0, at most one of them can come out negative.

    Example:
        >>> fit = fit_linear([1e3, 1e6], [2e-4 + 1e-6, 2e-4 + 1e-3])
        >>> round(fit.fixed_s, 9), round(fit.per_unit_s, 15)
        (0.0002, 1e-09)
    """
    _check_points(xs, ys)
    weights = [1.0 / (y * y) for y in ys]
    total = sum(weights)
    # Centred on the weighted means: the raw normal equations subtract products of x^2 (~1e15)
    # and lose the small sizes to cancellation.
    x_mean = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    y_mean = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    spread = sum(w * (x - x_mean) ** 2 for w, x in zip(weights, xs, strict=True))
    per_unit = sum(w * (x - x_mean) * (y - y_mean) for w, x, y in zip(weights, xs, ys, strict=True)) / spread
    fixed = y_mean - per_unit * x_mean
    if fixed < 0:  # proportional fit: minimise sum w (b x - y)^2
        fixed = 0.0
        moment = sum(w * x * y for w, x, y in zip(weights, xs, ys, strict=True))
        per_unit = moment / sum(w * x * x for w, x in zip(weights, xs, strict=True))
    elif per_unit < 0:  # constant fit: the weighted mean
        per_unit = 0.0
        fixed = y_mean
    errors = [abs(fixed + per_unit * x - y) / y for x, y in zip(xs, ys, strict=True)]
    return LinearFit(fixed, per_unit, statistics.median(errors), max(errors), len(xs))


def _check_points(xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"fit_linear got {len(xs)} xs and {len(ys)} ys; pass one time per size")
    if len(set(xs)) < 2:
        raise ValueError(
            f"fit_linear needs >= 2 distinct xs to fit a line, got {len(xs)} points at {sorted(set(xs))}; "
            "measure at least two sizes"
        )
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if not 0 <= x < math.inf:
            raise ValueError(f"xs[{i}]={x!r} must be a finite size >= 0")
        if not 0 < y < math.inf:
            raise ValueError(f"ys[{i}]={y!r} must be a finite time > 0 seconds; drop failed measurements")
