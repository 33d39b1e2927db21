"""Sparse exchange benchmark: gradsync.sparse's exact schemes timed on the same rows, one process
per rank, on loopback or one rank per host of the emulated network (gradsync.testbed).

Inputs: each rank's rows of one [num_rows, width] table, deterministic from the seed.
  embed-lm  the input-embedding gradient (32768 x 128) of one step's batch of the embed-lm
            workload with sparse=True; a rank's rows are its batch's distinct words. The
            vocabulary is numbered by frequency, so the hot rows sit at the lowest indices.
  zipf      generated rows: each rank draws `density` of the rows without replacement, row r
            with weight (r + 1)^-s (the hottest at the lowest indices), N(0, 1) values.
Options follow the input's name: `zipf:rows=65536:width=8:density=0.02:s=1.2`,
`embed-lm:batch_size=128` (any embed-lm workload option, and `step`).

Schemes: dense, agsparse, balanced (Zen's hash partition), recursive-doubling, and "range": balanced
with an index-range partition (parameter servers, OmniReduce), to show the imbalance hashing
removes. balanced and range get their partition built once per input, as the DDP router keeps
it (its owner table sorts every row).

Per input and scheme: warm-up exchanges, then `reps` timed ones, each after a barrier; a rep's
time is the slowest rank's. Every exchange's sum is checked against the dense scheme's
(torch.allclose, tight) and for equal bits on every rank. The runner also measures each input's
sparsity (density, overlap, densification, the hash and index-range owners' imbalance) and models
each scheme's traffic from 2 to `model_workers` workers with gradsync.sparse.cost, on the same
input drawn for that many workers.

Example:
    >>> options = SparseBenchOptions(hosts=2, inputs=("zipf:rows=4096:width=4",), reps=3)
    >>> document = run(options, train.loopback())
    >>> print(table(document))
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import workloads
from ..compress.base import check_int, check_real
from ..registry import parse_value
from ..sparse import HashPartition, Partition, RangePartition, SparseRows, cost
from ..sparse.hashing import imbalance, pull_index_nbytes
from ..testbed import MAX_HOSTS
from ..workloads.base import generator_for
from . import report, train

# Table order; "range" is balanced with an index-range partition.
SCHEMES = ("dense", "agsparse", "balanced", "recursive-doubling", "range")
MODELLED = ("dense", "agsparse", "balanced", "recursive-doubling")  # what cost.traffic covers
INPUT_KINDS = ("embed-lm", "zipf")
ZIPF_DEFAULTS: dict[str, Any] = {"rows": 2**20, "width": 16, "density": 0.015, "s": 1.1}
# batch_size 160 gives each rank 1.4% of the 32768 rows (1.2-1.5% over ranks and world sizes).
EMBED_LM_DEFAULTS: dict[str, Any] = {"batch_size": 160, "step": 0}
# torch.multinomial draws from at most 2**24 categories.
MAX_ZIPF_ROWS = 2**24
_REPO_ROOT = Path(__file__).resolve().parents[2]
# The issue's targets, on the testbed with 8 hosts at 1 Gbit/s.
TARGETS = {"vs_agsparse": 1.5, "vs_dense": 5.0, "hash_imbalance": 1.1, "range_imbalance": 3.0}
# Sum checks: float sums in another order differ in the last bits.
RTOL, ATOL_SCALE = 1e-5, 1e-6
# Worker counts the traffic model is evaluated at (up to model_workers), and the hosts'.
_MODEL_POINTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


# -- inputs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputSpec:
    """One input: its text as given (its label), its kind and its options, defaults filled in."""

    text: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)


def parse_input(text: str) -> InputSpec:
    """`zipf`, `zipf:rows=65536:width=8`, `embed-lm:batch_size=128`; ValueError naming the problem."""
    text = text.strip()
    kind, *pairs = text.split(":")
    if kind not in INPUT_KINDS:
        raise ValueError(
            f"unknown input {kind!r}; choose {' or '.join(INPUT_KINDS)}, with options as in "
            "zipf:rows=65536:width=8 or embed-lm:batch_size=128"
        )
    options = dict(ZIPF_DEFAULTS if kind == "zipf" else EMBED_LM_DEFAULTS)
    valid = sorted(options) if kind == "zipf" else sorted(_embed_lm_option_names())
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"input {text!r}: {pair!r} is not key=value, e.g. {kind}:{valid[0]}=...")
        if key not in valid:
            raise ValueError(f"input {text!r}: unknown option {key!r}; valid options: {', '.join(valid)}")
        options[key] = parse_value(value)
    spec = InputSpec(text, kind, options)
    try:
        if kind == "zipf":
            zipf_count(spec)
            check_int("width", options["width"], 1, why="values per row")
            check_real("s", options["s"], 0, float("inf"), "()", "the Zipf exponent, e.g. s=1.1")
        else:
            check_int("batch_size", options["batch_size"], 1, why="samples per rank")
            check_int("step", options["step"], 0, why="the training step whose batch is taken")
    except ValueError as err:
        raise ValueError(f"input {text!r}: {err}") from None
    return spec


def _embed_lm_option_names() -> set[str]:
    return (set(workloads.options("embed-lm")) - {"sparse"}) | {"step"}


def zipf_count(spec: InputSpec) -> int:
    """Rows each rank draws: round(density * rows), at least 1."""
    rows = check_int("rows", spec.options["rows"], 1, MAX_ZIPF_ROWS, why="torch.multinomial's limit")
    density = check_real("density", spec.options["density"], 0, 1, "(]", "the fraction of rows, e.g. 0.015")
    count = round(density * rows)
    if count < 1:
        raise ValueError(f"density={density:g} of rows={rows} is no row; raise density or rows")
    return count


def zipf_indices(num_rows: int, count: int, exponent: float, seed: int, rank: int) -> torch.Tensor:
    """`count` distinct rows of [0, num_rows), ascending: drawn without replacement, row r with
    weight (r + 1)^-exponent, from a generator seeded by (seed, rank) (never the global RNG)."""
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-exponent)
    generator = generator_for(seed, "sparse-bench-zipf-rows", rank)
    drawn = torch.multinomial(weights, count, replacement=False, generator=generator)
    return torch.sort(drawn).values


class Source:
    """An input's rows for any rank and world size. `indices` costs no gradient: for embed-lm
    they are the distinct words of the rank's batch, which are its gradient's rows."""

    def __init__(self, spec: InputSpec, seed: int) -> None:
        self.spec, self.seed = spec, seed
        self.workload: Any = None
        if spec.kind == "embed-lm":
            opts = {k: v for k, v in spec.options.items() if k != "step"}
            try:
                self.workload = workloads.build("embed-lm", seed=seed, sparse=True, **opts)
            except (TypeError, ValueError) as err:
                raise ValueError(f"input {spec.text!r}: {err}") from None
            self.num_rows, self.width = self.workload.vocab_size, self.workload.dim
        else:
            self.num_rows, self.width = spec.options["rows"], spec.options["width"]
            self.count = zipf_count(spec)
        self.value_nbytes = 4  # fp32

    def indices(self, rank: int, world_size: int) -> torch.Tensor:
        if self.workload is not None:
            inputs, _ = self.workload.batch(self.spec.options["step"], rank, world_size)
            return self.workload.touched_rows(inputs)
        return zipf_indices(self.num_rows, self.count, self.spec.options["s"], self.seed, rank)

    def rows(self, rank: int, world_size: int) -> SparseRows:
        """The rank's rows with their values: a real gradient for embed-lm."""
        if self.workload is not None:
            model = self.workload.model()  # the same weights on every rank
            inputs, targets = self.workload.batch(self.spec.options["step"], rank, world_size)
            self.workload.loss(model, inputs, targets).backward()
            return SparseRows.from_coo(model.embedding.weight.grad)
        generator = generator_for(self.seed, "sparse-bench-zipf-values", rank)
        values = torch.randn(self.count, self.width, generator=generator)
        return SparseRows(self.indices(rank, world_size), values, self.num_rows)

    def describe(self) -> str:
        table = f"{self.num_rows:,} x {self.width} fp32 ({self.num_rows * self.width * 4 / 1e6:.1f} MB)"
        if self.workload is not None:
            return (
                f"embed-lm's input-embedding gradient, {table}, batch {self.workload.batch_size} per rank "
                f"(step {self.spec.options['step']})"
            )
        o = self.spec.options
        return f"Zipf(s={o['s']:g}) rows, {table}, {self.count:,} rows ({o['density']:.2%}) per rank"


def partition_for(scheme: str, num_rows: int, n: int) -> Partition | None:
    """The partition the benchmark passes: a hash (seed 0) for balanced, index ranges for range."""
    if scheme == "balanced":
        return HashPartition(num_rows, n, seed=0)
    if scheme == "range":
        return RangePartition(num_rows, n)
    return None


def base_scheme(scheme: str) -> str:
    """The gradsync.sparse scheme a benchmark scheme runs."""
    return "balanced" if scheme == "range" else scheme


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


# -- summary (pure) -------------------------------------------------------------------------------


def summarize_input(
    raw: dict[str, Any], measured: dict[str, Any], at_hosts: dict[str, Any], points: list[dict[str, Any]]
) -> dict[str, Any]:
    """One input's section of the document from the ranks' raw measurements (raw), the sparsity of
    the exchanged rows (measured), the model at the hosts' count on those rows (at_hosts) and the
    model curve (points)."""
    schemes = []
    for s in raw["schemes"]:
        sent = s["sent_nbytes"]
        wire = s.get("wire_bytes")
        schemes.append(
            {
                "scheme": s["scheme"],
                "median_s": statistics.median(s["seconds"]),
                "p90_s": train.quantile(s["seconds"], 0.9),
                "seconds": s["seconds"],
                "cpu_median_s": statistics.median(s["cpu_seconds"]),
                "cpu_user_median_s": _median_or_none(s.get("cpu_user_seconds")),
                "cpu_system_median_s": _median_or_none(s.get("cpu_system_seconds")),
                "bytes_sent_mean": statistics.fmean(sent),
                "bytes_sent_max": max(sent),
                "sent_nbytes": sent,
                "model_bytes": at_hosts["bytes"].get(s["scheme"]),
                "predicted_s": at_hosts["seconds"].get(s["scheme"]),
                "wire_bytes_mean": statistics.fmean(wire) if wire else None,
                "push_imbalance": s.get("push_imbalance"),
                "pull_imbalance": s.get("pull_imbalance"),
                "checks": s["checks"],
                "max_error": s["max_error"],
            }
        )
    by_name = {s["scheme"]: s for s in schemes}
    balanced = by_name.get("balanced")
    for s in schemes:
        s["balanced_speedup"] = s["median_s"] / balanced["median_s"] if balanced else None
    return {
        "input": raw["input"],
        "description": raw.get("description"),
        "num_rows": raw["num_rows"],
        "width": raw["width"],
        "value_nbytes": raw["value_nbytes"],
        "rank_rows": raw["rank_rows"],
        "setup_s": raw.get("setup_s"),
        "schemes": schemes,
        "sparsity": measured,
        "model_at_hosts": at_hosts,
        "model": points,
        "targets": targets(by_name, measured),
    }


def targets(by_name: dict[str, dict[str, Any]], measured: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for one input: value, threshold and whether it is met (None if a scheme
    it needs was not run)."""
    out: dict[str, Any] = {}
    balanced = by_name.get("balanced")
    for key, other in (("vs_agsparse", "agsparse"), ("vs_dense", "dense")):
        value = by_name[other]["balanced_speedup"] if balanced and other in by_name else None
        out[key] = {
            "value": value,
            "at_least": TARGETS[key],
            "met": None if value is None else value >= TARGETS[key],
        }
    imb = [balanced.get("push_imbalance"), balanced.get("pull_imbalance")] if balanced else [None]
    worst = None if None in imb else max(imb)
    out["hash_imbalance"] = {
        "value": worst,
        "at_most": TARGETS["hash_imbalance"],
        "met": None if worst is None else worst <= TARGETS["hash_imbalance"],
    }
    ranged = measured["range"]
    skew = max(ranged["push_imbalance"], ranged["pull_imbalance"])
    out["range_imbalance"] = {
        "value": skew,
        "at_least": TARGETS["range_imbalance"],
        "met": skew >= TARGETS["range_imbalance"],
    }
    return out


# -- reports (pure, but for the files) ------------------------------------------------------------


def table(document: dict[str, Any]) -> str:
    """Markdown: exchange times per input and scheme, the inputs' sparsity, the targets, the model's
    winners, and the conditions."""
    hosts = document["meta"]["options"]["hosts"]
    lines = [
        f"Exchange of one sparse gradient on {hosts} ranks: median and p90 of the slowest rank's time; "
        "speed-up = that scheme's median / balanced's.",
        "",
        "| input | scheme | median (s) | p90 (s) | balanced speed-up | predicted (s) | MB sent/rank "
        "(mean / max) | model MB | wire MB/rank | CPU s/rank (user / sys) | push imb. | pull imb. |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for section in document["inputs"]:
        for s in section["schemes"]:
            lines.append(
                f"| {section['input']} | {s['scheme']} | {s['median_s']:.4f} | {s['p90_s']:.4f} | "
                f"{_times(s['balanced_speedup'])} | {_num(s['predicted_s'], 1, '.4f')} | "
                f"{s['bytes_sent_mean'] / 1e6:.3f} / "
                f"{s['bytes_sent_max'] / 1e6:.3f} | {_num(s['model_bytes'], 1e-6, '.3f')} | "
                f"{_num(s['wire_bytes_mean'], 1e-6, '.3f')} | {_cpu(s)} | "
                f"{_num(s['push_imbalance'], 1, '.3f')} | {_num(s['pull_imbalance'], 1, '.3f')} |"
            )
    sizes = group_sizes(hosts)[1:]
    lines += [
        "",
        "Sparsity of the exchanged rows: density per rank, overlap (|I_a & I_b| / min, mean over pairs), "
        "densification gamma_m = d_m / d, and the owners' imbalance (max / mean) under the hash and an "
        "index-range partition.",
        "",
        "| input | table | density/rank (mean, min-max) | overlap | "
        + " | ".join(f"gamma_{m}" for m in sizes)
        + " | hash push / pull | range push / pull |",
        "|---|---|---:|---:|" + "---:|" * len(sizes) + "---:|---:|",
    ]
    for section in document["inputs"]:
        sp = section["sparsity"]
        gammas = " | ".join(f"{_by_int(sp['densification'], m):.2f}" for m in sizes)
        lines.append(
            f"| {section['input']} | {section['num_rows']:,} x {section['width']} | {sp['density_mean']:.2%} "
            f"({min(sp['density']):.2%}-{max(sp['density']):.2%}) | {sp['overlap']:.3f} | {gammas} | "
            f"{sp['hash']['push_imbalance']:.3f} / {sp['hash']['pull_imbalance']:.3f} | "
            f"{sp['range']['push_imbalance']:.2f} / {sp['range']['pull_imbalance']:.2f} |"
        )
    lines += [
        "",
        "Targets (the issue's, for 8 hosts at 1 Gbit/s):",
        "",
        "| input | balanced vs agsparse (>= 1.5x) | balanced vs dense (>= 5x) | hash imbalance (<= 1.1) | "
        "range imbalance (>= 3x) |",
        "|---|---:|---:|---:|---:|",
    ]
    for section in document["inputs"]:
        t = section["targets"]
        cells = [
            _target(t["vs_agsparse"], "x"),
            _target(t["vs_dense"], "x"),
            _target(t["hash_imbalance"], "", ".3f"),
            _target(t["range_imbalance"], "x"),
        ]
        lines.append(f"| {section['input']} | " + " | ".join(cells) + " |")
    lines += ["", "Traffic model (gradsync.sparse.cost on each input drawn for up to that many workers):", ""]
    for section in document["inputs"]:
        lines.append(f"- {section['input']}: " + model_summary(section["model"]))
    return "\n".join(lines) + "\n\n" + conditions(document)


def model_summary(points: Sequence[dict[str, Any]]) -> str:
    """One line: who sends the fewest bytes over which worker counts, and balanced vs agsparse."""
    spans = "; ".join(
        f"{scheme} at n={lo}" if lo == hi else f"{scheme} at n={lo}-{hi}"
        for lo, hi, scheme in winner_ranges(points)
    )
    fastest = "; ".join(
        f"{scheme} at n={lo}" if lo == hi else f"{scheme} at n={lo}-{hi}"
        for lo, hi, scheme in winner_ranges(points, "fastest")
    )
    ratio = [(p["workers"], p["bytes"]["agsparse"] / p["bytes"]["balanced"]) for p in points]
    ahead = [n for n, r in ratio if r >= TARGETS["vs_agsparse"]]
    where = f"from n={ahead[0]}" if ahead else "at no n modelled"
    ratios = ", ".join(f"{r:.2f}x at n={n}" for n, r in ratio if n in (2, 8, 32, 128) or n == ratio[-1][0])
    gammas = ", ".join(
        f"{p['densification']:.1f} at n={p['workers']}" for p in points if p["workers"] in (8, 32, 128)
    )
    return (
        f"fewest bytes: {spans}. Fastest by the alpha-beta model: {fastest}. agsparse / balanced bytes: "
        f"{ratios} (>= 1.5x {where}); densification gamma_n: {gammas}."
    )


def conditions(document: dict[str, Any]) -> str:
    meta = document["meta"]
    options, network = meta["options"], meta["network"]
    measured = network.get("measured_bits_per_s")
    probe = f"; an allreduce probe measured {measured / 1e9:.3f} Gbit/s bus bandwidth" if measured else ""
    inputs = " ".join(f"{s['input']}: {s['description']}; {_calibrated(s)}." for s in document["inputs"])
    model_alpha_us = meta["model_network"]["alpha_s"] * 1e6
    return (
        f"{options['hosts']} ranks, one process each with {options['threads']} torch thread(s), on "
        f"{meta['machine']['cores']} cores; gloo. Network: {network['description']}{probe}. {inputs} "
        f"Each scheme: {options['warmup']} warm-up exchange(s), then {options['reps']} timed, each after a "
        "barrier; a rep's time is the slowest rank's. The time is the exchange() call (the sum in the form "
        "the scheme ends with); every exchange's sum is checked against dense's and for equal bits on every "
        "rank. balanced and range get their partition built once per input. MB sent: bytes each rank "
        "hands to the network by the algorithm's count; model MB: gradsync.sparse.cost on the same rows; "
        "predicted: cost.seconds on them with the rounds and bandwidth gradsync.sparse.select.calibrate "
        f"measured on the ranks (the traffic model's fastest scheme takes alpha = {model_alpha_us:.0f} us); "
        "wire MB: bytes its interface transmitted (testbed only, TCP/IP included); CPU s: process CPU time "
        "per exchange (user / system: gloo's threads and the kernel's network stack included), median of "
        "the mean over ranks."
    )


def write(document: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """results.json, results.md, sparse-times.png and sparse-model.png in `out_dir`."""
    return report.write_results(document, out_dir, table, plots)


_COLORS = {
    "dense": "#4c72b0",
    "agsparse": "#dd8452",
    "balanced": "#55a868",
    "recursive-doubling": "#c44e52",
    "range": "#8172b3",
}


def plots(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """sparse-times.png (median exchange time per scheme, p90 as a whisker) and sparse-model.png
    (modelled bytes per worker against workers, one panel per input, the fewest-bytes scheme
    shaded, the measured bytes at the hosts' count marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, sections = document["meta"], document["inputs"]
    hosts = meta["options"]["hosts"]

    fig, axes = plt.subplots(1, len(sections), figsize=(5.2 * len(sections), 4.2), squeeze=False)
    for ax, section in zip(axes[0], sections, strict=True):
        names = [s["scheme"] for s in section["schemes"]]
        medians = [s["median_s"] for s in section["schemes"]]
        whiskers = [s["p90_s"] - s["median_s"] for s in section["schemes"]]
        bars = ax.bar(names, medians, yerr=[[0] * len(names), whiskers], capsize=3)
        for bar, name, s in zip(bars, names, section["schemes"], strict=True):
            bar.set_color(_COLORS.get(name, "grey"))
            top = (bar.get_x() + bar.get_width() / 2, s["p90_s"])  # above the whisker
            ax.annotate(
                _times(s["balanced_speedup"]),
                top,
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_yscale("log")
        ax.set(ylabel="exchange time, median (s)", title=f"{section['input']}, {hosts} ranks")
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{meta['network']['description']}; labels: balanced's speed-up", fontsize=9)
    times = out_dir / "sparse-times.png"
    fig.tight_layout()
    fig.savefig(times, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(sections), figsize=(6.2 * len(sections), 4.6), squeeze=False)
    for ax, section in zip(axes[0], sections, strict=True):
        points = section["model"]
        workers = [p["workers"] for p in points]
        for name in (*MODELLED, "range"):
            ax.plot(
                workers,
                [p["bytes"][name] / 1e6 for p in points],
                label=name,
                color=_COLORS[name],
                linestyle="--" if name == "range" else "-",
                marker=".",
            )
        _shade_winners(ax, points)
        for s in section["schemes"]:
            ax.plot(
                [hosts],
                [s["bytes_sent_mean"] / 1e6],
                marker="x",
                color=_COLORS.get(s["scheme"], "grey"),
                linestyle="none",
                markersize=9,
            )
        ax.plot([], [], marker="x", color="black", linestyle="none", label=f"measured ({hosts} ranks)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="workers", ylabel="MB sent per worker (model)", title=section["input"])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Modelled traffic per worker; shading: the scheme that sends the fewest bytes", fontsize=9)
    curves = out_dir / "sparse-model.png"
    fig.tight_layout()
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    return [times, curves]


def _shade_winners(ax: Any, points: Sequence[dict[str, Any]]) -> None:
    workers = [p["workers"] for p in points]
    # Each point's band reaches halfway (geometrically) to its neighbours.
    edges = (
        [workers[0] / 1.15] + [(a * b) ** 0.5 for a, b in itertools.pairwise(workers)] + [workers[-1] * 1.15]
    )
    for i, point in enumerate(points):
        ax.axvspan(edges[i], edges[i + 1], color=_COLORS[point["least_bytes"]], alpha=0.12, linewidth=0)
    for lo, hi, scheme in winner_ranges(points):
        wide = hi / lo >= 4  # room for the name across; else it stands upright
        ax.annotate(
            scheme,
            ((lo * hi) ** 0.5, 0.02),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="bottom",
            fontsize=7,
            color=_COLORS[scheme],
            rotation=0 if wide else 90,
        )


def _calibrated(section: dict[str, Any]) -> str:
    network = section["model_at_hosts"]["network"]
    rounds = ", ".join(
        f"{name} {seconds * 1e3:.1f} ms" for name, seconds in (network.get("round_s") or {}).items()
    )
    return f"calibrated rounds ({rounds or 'none'}), {network['bytes_per_s'] * 8 / 1e9:.3f} Gbit/s"


def _cpu(s: dict[str, Any]) -> str:
    split = s.get("cpu_user_median_s"), s.get("cpu_system_median_s")
    detail = "" if None in split else f" ({split[0]:.3f} / {split[1]:.3f})"
    return f"{s['cpu_median_s']:.3f}{detail}"


def _median_or_none(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None, scale: float, spec: str) -> str:
    return "-" if value is None else format(value * scale, spec)


def _by_int(mapping: dict[Any, float], key: int) -> float:
    """mapping[key] whether the keys are ints or (after JSON) strings."""
    return mapping[key] if key in mapping else mapping[str(key)]


def _target(t: dict[str, Any], unit: str, spec: str = ".2f") -> str:
    if t["value"] is None:
        return "-"
    mark = "met" if t["met"] else "MISSED"
    return f"{t['value']:{spec}}{unit} ({mark})"


# -- running --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseBenchOptions:
    """What to time. Every scheme gets exactly the same rows of each input."""

    hosts: int = 8
    inputs: tuple[str, ...] = ("embed-lm", "zipf")
    schemes: tuple[str, ...] = SCHEMES
    reps: int = 10
    warmup: int = 2
    seed: int = 0
    threads: int = 1  # torch threads per rank
    model_workers: int = 128  # the traffic model goes from 2 to this many workers
    timeout_s: float = 900.0  # per input; the ranks are killed past it

    def __post_init__(self) -> None:
        check_int(
            "hosts",
            self.hosts,
            2,
            MAX_HOSTS,
            why="ranks, one per host; an exchange needs two, e.g. --hosts 8",
        )
        check_int("reps", self.reps, 1, why="timed exchanges per scheme, e.g. --reps 10")
        check_int("warmup", self.warmup, 0, why="untimed exchanges per scheme first, e.g. --warmup 2")
        check_int("seed", self.seed, 0, why="seeds are non-negative, e.g. --seed 0")
        check_int("threads", self.threads, 1, why="torch threads per rank, e.g. --threads 1")
        check_int(
            "model_workers", self.model_workers, 2, 4096, why="the model's largest worker count, e.g. 128"
        )
        if self.model_workers < self.hosts:
            raise ValueError(
                f"model_workers={self.model_workers} is below hosts={self.hosts}; the model must cover the "
                f"measured point, e.g. --model-workers {max(128, self.hosts)}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds, e.g. --timeout 900")
        if not self.inputs:
            raise ValueError(
                f"no input given; name some of {', '.join(INPUT_KINDS)}, e.g. --inputs embed-lm,zipf"
            )
        for text in self.inputs:
            parse_input(text)
        _no_repeats("inputs", [parse_input(t).text for t in self.inputs])
        unknown = [s for s in self.schemes if s not in SCHEMES]
        if unknown or not self.schemes:
            what = f"unknown scheme(s) {unknown}" if unknown else "no scheme given"
            raise ValueError(f"{what}; choose among {','.join(SCHEMES)}")
        _no_repeats("schemes", list(self.schemes))


def _no_repeats(what: str, items: list[str]) -> None:
    repeated = sorted({x for x in items if items.count(x) > 1})
    if repeated:
        raise ValueError(f"{what} {items} name {repeated} more than once; name each once")


def run(
    options: SparseBenchOptions, network: train.Network, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Time every scheme on every input over `network`, then measure and model each input; returns
    the results document (see `summarize_input`)."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    if network.testbed is not None and len(network.testbed.hosts) < options.hosts:
        raise ValueError(
            f"the testbed has {len(network.testbed.hosts)} hosts but --hosts is {options.hosts}; "
            f"bring one up with `gradsync testbed up --hosts {options.hosts}`"
        )
    bandwidth_bits_per_s = network.measured_bits_per_s or (
        network.testbed.bandwidth_bits_per_s if network.testbed else 1e9
    )
    net = cost.Network(bytes_per_s=bandwidth_bits_per_s / 8)
    sections = []
    load_before = os.getloadavg()  # other work on the machine skews the times: recorded
    source_before = source_state()
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-sparse-") as tmp:
        for index, text in enumerate(options.inputs):
            spec = parse_input(text)
            say(
                f"[{index + 1}/{len(options.inputs)}] {spec.text}: {len(options.schemes)} schemes x "
                f"({options.warmup} warm-up + {options.reps} timed) exchanges on {options.hosts} ranks"
            )
            started = time.perf_counter()
            raw = _run_input(options, network, spec, Path(tmp), index)
            say(f"    exchanged in {time.perf_counter() - started:.0f} s; measuring and modelling the input")
            source = Source(spec, options.seed)
            host_sets = [source.indices(rank, options.hosts) for rank in range(options.hosts)]
            _check_same_rows(spec, raw, host_sets)
            args = (source.num_rows, source.width, source.value_nbytes)
            measured = measure(host_sets, *args)
            # Predicted times at the hosts' count: alpha and bandwidth as the ranks calibrated them.
            calibrated = cost.Network(**raw["calibrated"])
            at_hosts = {**traffic_by_scheme(host_sets, *args, calibrated), "network": raw["calibrated"]}
            model_sets = [
                source.indices(rank, options.model_workers) for rank in range(options.model_workers)
            ]
            points = model(model_sets, *args, model_points(options.model_workers, options.hosts), net)
            raw = {**raw, "description": source.describe()}
            sections.append(summarize_input(raw, measured, at_hosts, points))
    meta = {
        "options": asdict(options),
        "network": network.to_dict(),
        "model_network": {"alpha_s": net.alpha_s, "bytes_per_s": net.bytes_per_s},
        "machine": train.machine(),
        "source": {**source_before, "changed_during_run": source_state() != source_before},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "command": " ".join(sys.argv) if sys.argv and sys.argv[0] else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return {"meta": meta, "inputs": sections}


def source_state() -> dict[str, Any]:
    """The code measured: git commit, files modified since, and a digest of gradsync/sparse/*.py
    (read-only git calls; None where git is unavailable)."""
    sparse_dir = _REPO_ROOT / "gradsync" / "sparse"
    digest = hashlib.sha256()
    for path in sorted(sparse_dir.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    state: dict[str, Any] = {"sparse_sha256": digest.hexdigest(), "commit": None, "modified": None}
    git = ["git", "--no-optional-locks", "-C", str(_REPO_ROOT)]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        state["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            [*git, "status", "--porcelain", "--", "gradsync"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        state["modified"] = [line[3:] for line in status.splitlines()]
    return state


def _run_input(
    options: SparseBenchOptions, network: train.Network, spec: InputSpec, tmp: Path, index: int
) -> dict[str, Any]:
    job = {
        "input": spec.text,
        "seed": options.seed,
        "schemes": list(options.schemes),
        "reps": options.reps,
        "warmup": options.warmup,
        "threads": options.threads,
        "timeout_s": options.timeout_s,
    }
    name = f"input {spec.text!r}"
    return train.run_job(
        network, "gradsync.bench.sparse_worker", job, options.hosts, tmp / f"input{index}", name
    )


def _check_same_rows(spec: InputSpec, raw: dict[str, Any], sets: Sequence[torch.Tensor]) -> None:
    """The runner measures and models the rows the ranks exchanged, or says they differ."""
    mine = [{"rows": s.numel(), "index_sum": int(s.sum())} for s in sets]
    if mine != raw["rank_rows"]:
        raise train.BenchError(
            f"input {spec.text!r}: the ranks exchanged rows {raw['rank_rows']} but the runner draws {mine}; "
            "the input is not deterministic across processes"
        )
