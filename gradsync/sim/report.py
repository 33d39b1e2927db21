"""What `gradsync simulate` prints and writes: a table of strategies and the results as JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .engine import Result


def table(results: Sequence[Result]) -> str:
    """A Markdown table: step time, scaling factor, throughput and communication per strategy."""
    rows = [
        "| strategy | step (ms) | scaling | samples/s | link busy (ms) | payload / worker |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        sent = sum(g.payload_bytes for g in r.groups)
        rows.append(
            f"| {r.strategy} | {r.step_s * 1e3:.1f} | {r.scaling:.3f} | {r.samples_per_s:,.0f} | "
            f"{r.communication_s * 1e3:.1f} | {_nbytes(sent)} |"
        )
    return "\n".join(rows)


def to_dict(result: Result) -> dict[str, Any]:
    """A result as plain data: its numbers, groups and spans."""
    return {
        "strategy": result.strategy,
        "cluster": result.cluster,
        "world_size": result.world_size,
        "step_s": result.step_s,
        "compute_s": result.compute_s,
        "scaling": result.scaling,
        "samples_per_s": result.samples_per_s,
        "communication_s": result.communication_s,
        "groups": [asdict(g) for g in result.groups],
        "spans": [asdict(s) for s in result.spans],
        "meta": result.meta,
    }


def _nbytes(value: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"
