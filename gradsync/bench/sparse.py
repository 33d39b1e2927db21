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

The benchmark lives in modules of one concern each; this one holds the options (SparseBenchOptions)
and the runner (run), and re-exports the others' names, so callers import everything from here:
  sparse_schemes  the scheme names, the partition each runs, the sum checks' tolerances
  sparse_inputs   the inputs: parse_input, InputSpec, Source (any rank's rows), the Zipf draw
  sparse_model    measured sparsity (measure, sparsity) and the traffic model (model)
  sparse_results  the results document: one input's section (summarize_input) and its targets
  sparse_report   the report: table, write, plots
The ranks run in bench/sparse_worker.py, which imports only sparse_schemes and sparse_inputs.

Example:
    >>> options = SparseBenchOptions(hosts=2, inputs=("zipf:rows=4096:width=4",), reps=3)
    >>> document = run(options, train.loopback())
    >>> print(table(document))
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..compress.base import check_int
from ..sparse import cost
from ..testbed import MAX_HOSTS
from . import report, train
from .sparse_inputs import (
    EMBED_LM_DEFAULTS,
    INPUT_KINDS,
    MAX_ZIPF_ROWS,
    ZIPF_DEFAULTS,
    InputSpec,
    Source,
    parse_input,
    zipf_count,
    zipf_indices,
)
from .sparse_model import (
    densification,
    densities,
    group_sizes,
    group_union_sizes,
    measure,
    model,
    model_points,
    overlap,
    owner_loads,
    partition_imbalance,
    sparsity,
    traffic_by_scheme,
    union_density,
    winner_ranges,
)
from .sparse_report import conditions, model_summary, plots, table, write
from .sparse_results import TARGETS, summarize_input, targets
from .sparse_schemes import ATOL_SCALE, MODELLED, RTOL, SCHEMES, base_scheme, partition_for

# What other modules and the tests import from here, wherever it is defined.
__all__ = [
    "ATOL_SCALE",
    "EMBED_LM_DEFAULTS",
    "INPUT_KINDS",
    "MAX_ZIPF_ROWS",
    "MODELLED",
    "RTOL",
    "SCHEMES",
    "TARGETS",
    "ZIPF_DEFAULTS",
    "InputSpec",
    "Source",
    "SparseBenchOptions",
    "base_scheme",
    "conditions",
    "densification",
    "densities",
    "group_sizes",
    "group_union_sizes",
    "measure",
    "model",
    "model_points",
    "model_summary",
    "overlap",
    "owner_loads",
    "parse_input",
    "partition_for",
    "partition_imbalance",
    "plots",
    "run",
    "source_state",
    "sparsity",
    "summarize_input",
    "table",
    "targets",
    "traffic_by_scheme",
    "union_density",
    "winner_ranges",
    "write",
    "zipf_count",
    "zipf_indices",
]

_REPO_ROOT = Path(__file__).resolve().parents[2]


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
        **report.provenance(),
        "source": {**source_before, "changed_during_run": source_state() != source_before},
        "load_average": {"before": load_before, "after": os.getloadavg()},
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
