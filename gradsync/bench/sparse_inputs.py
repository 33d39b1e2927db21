"""The sparse exchange benchmark's inputs: an input's text parsed, and any rank's rows drawn from it.

Holds InputSpec and parse_input (the `zipf:rows=65536:width=8` and `embed-lm:batch_size=128` texts,
their defaults and checks), the Zipf row draw, and Source, which gives any rank's rows for any world
size, deterministically from the seed. Each rank (bench/sparse_worker.py) builds its own rows from
the input's text and the seed, and the runner draws the same rows again to measure and model them;
both import this module, so the two sides cannot draw differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import workloads
from ..compress.base import check_int, check_real
from ..registry import parse_value
from ..sparse import SparseRows
from ..workloads.base import generator_for

INPUT_KINDS = ("embed-lm", "zipf")
ZIPF_DEFAULTS: dict[str, Any] = {"rows": 2**20, "width": 16, "density": 0.015, "s": 1.1}
# batch_size 160 gives each rank 1.4% of the 32768 rows (1.2-1.5% over ranks and world sizes).
EMBED_LM_DEFAULTS: dict[str, Any] = {"batch_size": 160, "step": 0}
# torch.multinomial draws from at most 2**24 categories.
MAX_ZIPF_ROWS = 2**24


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
