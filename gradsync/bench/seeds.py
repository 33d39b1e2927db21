"""One training benchmark under several seeds: each strategy's final loss against DDP's, per seed.

A comparison at a fixed step count moves with the seed by more than the paired ± of one run says:
that ± counts the held-out predictions' noise, not the run's (on gpt-tiny at 200 steps PowerSGD
rank 4 ended +1.1% with seed 0 and +2.3% with seed 1, each ± 0.1). `gradsync bench seeds` gathers
`gradsync bench train` results of one workload and set-up made with different `--seed`s and gives,
for each strategy that ran under every seed, its final loss against DDP's of the same seed (the
same initial model and data order), the mean over seeds and their range, and how many seeds
reached DDP's loss and how much sooner.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .report import reference_name

# What must agree between the runs gathered: they differ in the seed and nothing else measured.
_SAME_OPTIONS = ("workload", "workload_options", "world_size", "steps", "eval_every", "tolerance", "threads")


def gather(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The results document of `documents` (bench train's, one per seed): per strategy run under
    every seed, its final loss against the reference's and its time-to-target speed-up, seed by
    seed. ValueError names what differs where the runs are not one set-up under several seeds.
    Each run's commit, date and command are kept in meta["sources"]; the caller adds the gathering's."""
    if len(documents) < 2:
        raise ValueError(f"{len(documents)} results given; gather at least 2, each from another --seed")
    first = documents[0]["meta"]
    seeds = [d["meta"]["options"]["seed"] for d in documents]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {seeds} repeat: each results file must come from another --seed")
    for document, seed in zip(documents[1:], seeds[1:], strict=True):
        meta = document["meta"]
        for key in _SAME_OPTIONS:
            if meta["options"][key] != first["options"][key]:
                raise ValueError(
                    f"the run with seed {seed} has {key}={meta['options'][key]!r} where seed "
                    f"{seeds[0]}'s has {first['options'][key]!r}: gather runs that differ only in --seed"
                )
        if meta["network"]["description"] != first["network"]["description"]:
            raise ValueError(
                f"the run with seed {seed} ran on {meta['network']['description']!r}, seed {seeds[0]}'s on "
                f"{first['network']['description']!r}: gather runs on one network"
            )
        if meta.get("reference") != first.get("reference"):
            raise ValueError(
                f"the run with seed {seed} is measured against {meta.get('reference')!r}, not "
                f"{first.get('reference')!r}"
            )
    runs = [{r["strategy"]: r for r in d["runs"]} for d in documents]
    common = [s for s in runs[0] if all(s in by_strategy for by_strategy in runs)]
    if not common:
        raise ValueError("no strategy ran under every seed: pass --strategies alike to each run")
    rows = []
    for strategy in common:
        per_seed = [by_strategy[strategy] for by_strategy in runs]
        rows.append(
            {
                "strategy": strategy,
                "label": per_seed[0]["label"],
                "final_loss": [r["final_loss"] for r in per_seed],
                "final_vs_reference": [r.get("final_vs_reference") for r in per_seed],
                "final_vs_reference_se": [r.get("final_vs_reference_se") for r in per_seed],
                "time_to_target_speedup": [r.get("time_to_target_speedup") for r in per_seed],
                "step_median_s": [r["step_median_s"] for r in per_seed],
            }
        )
    return {
        "meta": {
            "workload": first["workload"],
            "options": {key: first["options"][key] for key in _SAME_OPTIONS},
            "network": first["network"],
            "reference": first.get("reference"),
            "seeds": seeds,
            "sources": [
                {
                    "seed": seed,
                    "commit": d["meta"]["commit"],
                    "dirty": d["meta"]["dirty"],
                    "date": d["meta"]["date"],
                    "command": d["meta"]["command"],
                    "target_loss": d["meta"]["target_loss"],
                }
                for seed, d in zip(seeds, documents, strict=True)
            ],
        },
        "runs": rows,
    }


def table(document: dict[str, Any]) -> str:
    """One row per strategy: final loss against the reference's per seed, their mean and range,
    and the time-to-target speed-up per seed ("-" where that seed did not reach the target)."""
    meta = document["meta"]
    ddp = reference_name(meta)
    seeds = ", ".join(str(s) for s in meta["seeds"])
    lines = [
        f"| strategy | final vs {ddp}, seeds {seeds} | mean | range | reached {ddp}'s loss | "
        f"TTT vs {ddp}, seeds {seeds} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in document["runs"]:
        versus = [v for v in r["final_vs_reference"] if v is not None]
        reached = sum(s is not None for s in r["time_to_target_speedup"])
        if not versus:  # the reference itself
            lines.append(f"| {r['label']} | - | - | - | - | - |")
            continue
        speedups = ", ".join("-" if s is None else f"{s:.2f}x" for s in r["time_to_target_speedup"])
        lines.append(
            f"| {r['label']} | {', '.join(_percent(v) for v in versus)} | "
            f"{_percent(statistics.fmean(versus))} | {_percent(min(versus))} to {_percent(max(versus))} | "
            f"{reached} of {len(versus)} | {speedups} |"
        )
    return "\n".join(lines) + "\n\n" + conditions(document)


def conditions(document: dict[str, Any]) -> str:
    meta = document["meta"]
    options = meta["options"]
    ddp = reference_name(meta)
    sources = "; ".join(
        f"seed {s['seed']}: commit {s['commit'][:12]}{' with uncommitted changes' if s['dirty'] else ''}, "
        f"{s['date']}"
        for s in meta["sources"]
    )
    return (
        f"{meta['workload']}, {options['world_size']} ranks, {options['steps']} steps, on "
        f"{meta['network']['description']}. Each seed sets the initial model and the data order; every "
        f"strategy of a seed starts from that seed's model, and its final loss is set against {ddp}'s of "
        f"the same seed (in % of {ddp}'s). TTT vs {ddp}: training time to {ddp}'s final loss x "
        f"(1 + {options['tolerance']:g}) against {ddp}'s own, '-' where that seed's run did not reach it. "
        f"Runs: {sources}."
        + (f" Gathered by `{meta['command']}` at commit {meta['commit'][:12]}." if "command" in meta else "")
    )


def _percent(value: float) -> str:
    return f"{100 * value:+.1f}%"
