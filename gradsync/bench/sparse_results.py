"""The sparse exchange benchmark's results document: one input's section, and the targets it meets.

Holds summarize_input, which turns the ranks' raw measurements, the measured sparsity and the
modelled traffic into one input's section of the document (times, bytes, checks, speed-ups), and
targets, which scores a section against the issue's targets. Both are pure, so the report can be
rebuilt from a saved document and tests can check them without running ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from . import train

# The targets, on the testbed with 8 hosts at 1 Gbit/s.
TARGETS = {"vs_agsparse": 1.5, "vs_dense": 5.0, "hash_imbalance": 1.1, "range_imbalance": 3.0}


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


def _median_or_none(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None
