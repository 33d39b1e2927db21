"""One training benchmark under several seeds: each strategy's final loss against DDP's, per seed.

A comparison at a fixed step count moves with the seed by more than the paired ± of one run says:
that ± counts the held-out predictions' noise, not the run's (on gpt-tiny at 200 steps PowerSGD
rank 4 ended +1.1% with seed 0 and +2.3% with seed 1, each ± 0.1). `gradsync bench seeds` gathers
`gradsync bench train` results of one workload and set-up made with different `--seed`s and gives,
for each strategy that ran under every seed, its final loss against DDP's of the same seed (the
same initial model and data order), the mean over seeds and their range, and how many seeds
reached the time-to-target target and how much sooner.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .report import reference_name, tree_note

# What must agree between the runs gathered: they differ in the seed and nothing else measured.
# With until_flat, "steps" is where each seed's DDP went flat, and may differ.
_SAME_OPTIONS = (
    "workload",
    "workload_options",
    "world_size",
    "eval_every",
    "tolerance",
    "threads",
    "until_flat",
)


def check(document: Any) -> None:
    """ValueError naming what is missing where `document` is not bench train's results."""
    if not isinstance(document, dict) or not isinstance(document.get("meta"), dict):
        raise ValueError("not the results.json of a `gradsync bench train` run (no meta)")
    meta = document["meta"]
    options = meta.get("options", {})
    for key in ("seed", "steps", *_SAME_OPTIONS):
        if key not in options:
            raise ValueError(f"not the results.json of a `gradsync bench train` run (no meta.options.{key})")
    for key in ("network", "reference", "commit", "date", "command", "target_loss"):
        if key not in meta:
            raise ValueError(f"not the results.json of a `gradsync bench train` run (no meta.{key})")
    if not meta["reference"]:
        raise ValueError("a run without a DDP reference has no loss to compare with: add ddp to --strategies")
    if not isinstance(document.get("runs"), list):
        raise ValueError("not the results.json of a `gradsync bench train` run (no runs)")


def gather(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The results document of `documents` (bench train's, one per seed): per strategy run under
    every seed, its final loss against the reference's and its time-to-target speed-up, seed by
    seed. ValueError names what differs where the runs are not one set-up under several seeds.
    Each run's commit, date and command are kept in meta["sources"]; the caller adds the gathering's."""
    if len(documents) < 2:
        raise ValueError(f"{len(documents)} results given; gather at least 2, each from another --seed")
    for document in documents:
        check(document)
    first = documents[0]["meta"]
    seeds = [d["meta"]["options"]["seed"] for d in documents]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {seeds} repeat: each results file must come from another --seed")
    same = [*_SAME_OPTIONS, *(() if first["options"]["until_flat"] else ("steps",))]
    for document, seed in zip(documents[1:], seeds[1:], strict=True):
        meta = document["meta"]
        differing = [
            (key, meta["options"][key], first["options"][key])
            for key in same
            if meta["options"][key] != first["options"][key]
        ]
        differing += [
            (key, meta.get(key), first.get(key))
            for key in ("reference", "schedule_steps")
            if meta.get(key) != first.get(key)
        ]
        if meta["network"]["description"] != first["network"]["description"]:
            differing.append(("network", meta["network"]["description"], first["network"]["description"]))
        if differing:
            key, value, expected = differing[0]
            raise ValueError(
                f"the run with seed {seed} has {key}={value!r} where seed {seeds[0]}'s has {expected!r}: "
                "gather runs that differ only in --seed"
            )
    runs = [{r["strategy"]: r for r in d["runs"]} for d in documents]
    common = [s for s in runs[0] if all(s in by_strategy for by_strategy in runs)]
    if not common:
        ran = "; ".join(f"seed {seed}: {', '.join(r)}" for seed, r in zip(seeds, runs, strict=True))
        raise ValueError(f"no strategy ran under every seed ({ran}): pass the same --strategies to each run")
    rows = []
    for strategy in common:
        per_seed = [by_strategy[strategy] for by_strategy in runs]
        labels = {r["label"] for r in per_seed}  # plan="auto"'s names the plan it adopted
        rows.append(
            {
                "strategy": strategy,
                "label": per_seed[0]["label"] if len(labels) == 1 else strategy,
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
            "options": {key: first["options"][key] for key in same},
            "network": first["network"],
            "reference": first["reference"],
            "seeds": seeds,
            "sources": [
                {
                    "seed": seed,
                    "steps": d["meta"]["options"]["steps"],
                    "commit": d["meta"]["commit"],
                    "dirty": d["meta"].get("dirty", False),
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
    """One row per strategy: final loss against the reference's per seed (with its paired ±), the
    mean and range over seeds, and per seed the time-to-target speed-up."""
    meta = document["meta"]
    ddp = reference_name(meta)
    seeds = ", ".join(str(s) for s in meta["seeds"])
    lines = [
        f"| strategy | final vs {ddp}, seeds {seeds} | mean | range | reached the target | "
        f"TTT vs {ddp}, seeds {seeds} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in document["runs"]:
        if r["strategy"] == meta["reference"]:
            lines.append(f"| {r['label']} | (the reference) | | | | |")
            continue
        paired = zip(r["final_vs_reference"], r["final_vs_reference_se"], strict=True)
        per_seed = ", ".join(
            "n/a" if v is None else f"{_percent(v)} ± {100 * (se or 0):.2f}" for v, se in paired
        )
        versus = [v for v in r["final_vs_reference"] if v is not None]
        summary = (
            f"{_percent(statistics.fmean(versus))} | {_percent(min(versus))} to {_percent(max(versus))}"
            if versus
            else "n/a | n/a"
        )
        reached = sum(s is not None for s in r["time_to_target_speedup"])
        speedups = ", ".join("not reached" if s is None else f"{s:.2f}x" for s in r["time_to_target_speedup"])
        lines.append(
            f"| {r['label']} | {per_seed} | {summary} | {reached} of {len(meta['seeds'])} | {speedups} |"
        )
    return "\n".join(lines) + "\n\n" + conditions(document)


def conditions(document: dict[str, Any]) -> str:
    meta = document["meta"]
    options = meta["options"]
    ddp = reference_name(meta)
    steps = sorted({s["steps"] for s in meta["sources"]})
    commits = {s["commit"] for s in meta["sources"]}
    sources = "; ".join(
        f"seed {s['seed']}: commit {s['commit'][:12]}{tree_note(s['dirty'])}, {s['date']}"
        for s in meta["sources"]
    )
    return (
        f"{meta['workload']}, {options['world_size']} ranks, {' or '.join(map(str, steps))} steps, on "
        f"{meta['network']['description']}. Each seed sets the initial model and the data order; every "
        f"strategy of a seed starts from that seed's model, and its final held-out loss is set against "
        f"{ddp}'s of the same seed, in % of {ddp}'s, ± the standard error of that difference over the "
        f"held-out predictions (the run's own noise is the spread between seeds). Mean and range over "
        f"the seeds with a paired measurement ('n/a': none, e.g. a run that diverged). The target is "
        f"each seed's {ddp} final loss x (1 + {options['tolerance']:g}); TTT vs {ddp}: training time to "
        f"it against {ddp}'s own. "
        + (
            "The seeds' runs were measured at different commits: they compare where the code they ran "
            "is the same. "
            if len(commits) > 1
            else ""
        )
        + f"Runs: {sources}."
        + (f" Gathered by `{meta['command']}` at commit {meta['commit'][:12]}." if "command" in meta else "")
    )


def _percent(value: float) -> str:
    return f"{100 * value:+.1f}%"
