"""Simulator benchmark: how fast it runs at scale, and what it predicts for the model profiles.

Two parts:
  scale        wall time of one simulated step of every model profile at 1,024 and 16,384
               workers (the best of `repeats`), jitter on, so every worker is simulated, with
               DDP's buckets and with one group per tensor (the most groups a plan can have);
  predictions  the scaling factor of every model profile at 8 nodes x 8 GPUs under each strategy,
               at 25 and 100 Gbit/s between nodes: where compression pays and where it hurts.

Example:
    >>> document = run(SimBenchOptions(models=("resnet50",), scale_workers=(64,)))
    >>> print(table(document))
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..sim import cluster, compute, engine, gantt, groups, models
from . import report


@dataclass(frozen=True)
class SimBenchOptions:
    """Which models, clusters and strategies; the defaults are README's."""

    models: tuple[str, ...] = tuple(models.names())
    device: str = "v100"
    nodes: int = 8
    gpus_per_node: int = 8
    inters: tuple[str, ...] = ("25gbit", "100gbit")
    # Compute in mixed precision (today's default) and in fp32 (the V100-era runs Espresso measured):
    # the slower the compute, the more of the exchange the backward pass hides.
    precisions: tuple[str, ...] = ("mixed", "fp32")
    strategies: tuple[str, ...] = (
        "none",
        "fp16",
        "topk:ratio=0.01",
        "qsgd",
        "efsignsgd",
        "fp16:collective=two-level",
        "none:scheme=auto",
    )
    scale_workers: tuple[int, ...] = (1024, 16384)
    scale_strategy: str = "fp16"
    jitter: float = 0.02
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in self.models:
            models.build(name)  # KeyError listing the names
        for workers in self.scale_workers:
            if workers % self.gpus_per_node:
                raise ValueError(
                    f"scale_workers {workers} must be a multiple of gpus_per_node={self.gpus_per_node}"
                )


def run(options: SimBenchOptions) -> dict[str, Any]:
    """Time the simulator at scale and tabulate its predictions."""
    device = cluster.device(options.device)
    scale = []
    for name in options.models:
        work = compute.from_model(models.build(name), device)
        layout = {"ddp": groups.ddp(work.numels), "layerwise": groups.layerwise(len(work.numels))}
        for workers, grouping in itertools.product(options.scale_workers, layout):
            nodes = workers // options.gpus_per_node
            where = cluster.cluster(nodes, options.gpus_per_node, options.device, "100gbit")
            seconds = []
            for _ in range(options.repeats):
                started = time.perf_counter()
                result = engine.simulate(
                    work, where, options.scale_strategy, layout[grouping], options.jitter
                )
                seconds.append(time.perf_counter() - started)
            scale.append(
                {
                    "model": name,
                    "workers": workers,
                    "grouping": grouping,
                    "groups": len(result.groups),
                    "seconds": min(seconds),
                    "scaling": result.scaling,
                }
            )
    predictions = []
    for name, precision in itertools.product(options.models, options.precisions):
        work = compute.from_model(models.build(name), device, precision)
        for inter in options.inters:
            where = cluster.cluster(
                options.nodes, options.gpus_per_node, options.device, inter, precision=precision
            )
            for text in options.strategies:
                result = engine.simulate(work, where, text)
                predictions.append(
                    {
                        "model": name,
                        "precision": precision,
                        "inter": inter,
                        "strategy": text,
                        "step_s": result.step_s,
                        "compute_s": result.compute_s,
                        "scaling": result.scaling,
                    }
                )
    return {
        "meta": {"options": asdict(options), **report.provenance()},
        "scale": scale,
        "predictions": predictions,
    }


def table(document: dict[str, Any]) -> str:
    """Markdown: simulation time at scale, then scaling factors per model, network and strategy."""
    options = document["meta"]["options"]
    lines = ["| model | workers | grouping | groups | simulated in (s) |", "|---|---:|---|---:|---:|"]
    for row in document["scale"]:
        cells = [row["model"], f"{row['workers']:,}", row["grouping"], row["groups"], f"{row['seconds']:.4f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    strategies = options["strategies"]
    lines += [
        "",
        f"Scaling factor at {options['nodes']} x {options['gpus_per_node']} {options['device'].upper()} "
        f"(throughput over {options['nodes'] * options['gpus_per_node']} x one GPU's; best per row in bold):",
        "",
        "| model | compute | between nodes | " + " | ".join(strategies) + " |",
        "|---|---|---|" + "---:|" * len(strategies),
    ]
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    for p in document["predictions"]:
        rows.setdefault((p["model"], p["precision"], p["inter"]), {})[p["strategy"]] = p["scaling"]
    for (model, precision, inter), by_strategy in rows.items():
        best = max(by_strategy.values())
        cells = [f"**{v:.2f}**" if v == best else f"{v:.2f}" for v in (by_strategy[s] for s in strategies)]
        lines.append(f"| {model} | {precision} | {inter} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(document: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """results.json, results.md and a Gantt of BERT-base's strategies at the slowest network."""
    options = document["meta"]["options"]

    def draw(doc: dict[str, Any], out: Path) -> list[Path]:
        name = "bert-base" if "bert-base" in options["models"] else options["models"][0]
        where = cluster.cluster(
            options["nodes"], options["gpus_per_node"], options["device"], options["inters"][0]
        )
        work = compute.from_model(models.build(name), where.device)
        results = [engine.simulate(work, where, text) for text in options["strategies"]]
        return [gantt.draw(results, out / f"gantt-{name}.png", f"{name}, {where.describe()}")]

    return report.write_results(document, out_dir, table, draw)
