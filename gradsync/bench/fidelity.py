"""Simulator fidelity: predicted vs measured step time on the emulated network.

For each world size and bandwidth, a testbed of that many hosts is built and the ranks
(bench/fidelity_worker.py) first profile (gradsync.profile: compute timeline, codec costs,
collective fits), then train the workload under each strategy and time the steps. The simulator,
fed only the profile, predicts each strategy's step; the table compares. A configuration is
world size x bandwidth x strategy.

Example:
    >>> options = FidelityOptions(worlds=(2,), bandwidths=("1gbit",), strategies=("ddp", "fp16"))
    >>> document = run(options)
    >>> print(table(document))
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import testbed, workloads
from ..profile import Profile
from ..sim import engine, gantt, phases
from ..strategy import parse
from . import report, strategies, train


@dataclass(frozen=True)
class FidelityOptions:
    """What to measure and predict; every configuration trains the same workload and steps."""

    workload: str = "gpt-tiny"
    worlds: tuple[int, ...] = (2, 4)
    bandwidths: tuple[str, ...] = ("1gbit", "300mbit")
    latency: str = "0.2ms"
    # gradsync strategies compress from their third step (warmup=2, the least: DDP rebuilds its
    # buckets after the first), so every timed step is compressed.
    strategies: tuple[str, ...] = ("ddp", "fp16:warmup=2", "qsgd:warmup=2")
    warmup: int = 4  # untimed steps first
    steps: int = 10
    profile_steps: int = 5
    # Bytes per rank probed, up to DDP's 25 MiB buckets: a shaped link lets short bursts through
    # faster than its rate, so only large probes show the rate a bucket sees.
    collective_sizes: tuple[int, ...] = (4, 65536, 1 << 20, 8 << 20, 32 << 20)
    # fp32 elements per codec timing, weighted to the sizes of DDP's buckets (1 to 7M elements here):
    # per-element cost grows once a tensor leaves the caches, and the fit must hold for buckets.
    codec_sizes: tuple[int, ...] = (1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 23)
    seed: int = 0
    threads: int = 1
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.workload not in workloads.names():
            raise ValueError(
                f"unknown workload {self.workload!r}; choose one of {', '.join(workloads.names())}"
            )
        for world in self.worlds:
            if not 2 <= world <= testbed.MAX_HOSTS:
                raise ValueError(f"world size {world} must lie in [2, {testbed.MAX_HOSTS}] testbed hosts")
        for text in self.bandwidths:
            testbed.parse_bandwidth(text)
        for text in self.strategies:
            sim_text(text)  # raises ValueError naming a strategy the simulator cannot model
        if self.steps < 3 or self.warmup < 3:
            raise ValueError(f"steps={self.steps} and warmup={self.warmup} must be >= 3")


def sim_text(text: str) -> str:
    """The simulator's strategy for a training benchmark strategy: DDP is an fp32 allreduce (none),
    a gradsync codec exchanges as its payloads allow."""
    parsed = strategies.parse(text)
    if parsed.kind == "ddp":
        return "none"
    if parsed.kind != "gradsync" or parsed.config is None or parsed.config.sparse_scheme != "auto":
        raise ValueError(f"strategy {text!r} has no simulator model; use ddp or a gradsync codec")
    codec = parsed.config.compressor
    if codec in ("topk", "dgc", "threshold"):
        raise ValueError(f"strategy {text!r}: sparse payloads go to gradsync.sparse, which is not simulated")
    args = ":".join(f"{k}={v}" for k, v in sorted(parsed.config.compressor_args.items()))
    return parse(":".join(filter(None, [codec, args]))).text


def run(options: FidelityOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure and predict every configuration; one testbed at a time, each removed after use."""
    rows, cases = [], []
    for world in options.worlds:
        for bandwidth in options.bandwidths:
            with testbed.session(world, bandwidth, options.latency) as bed:
                say(f"{bed.describe()}: profiling, then {len(options.strategies)} strategies")
                raw = _run_ranks(options, train.on_testbed(bed), world)
            profile = Profile.from_json(json.dumps(raw["profile"]))
            case = {"world": world, "bandwidth": bandwidth, "profile": raw["profile"], "predicted": {}}
            for text in options.strategies:
                result = predict(profile, sim_text(text))
                measured = raw["measured"][text]["median_s"]
                case["predicted"][text] = result
                rows.append(
                    {
                        "world": world,
                        "bandwidth": bandwidth,
                        "strategy": text,
                        "simulated_as": sim_text(text),
                        "predicted_s": result.step_s,
                        "measured_s": measured,
                        "measured_steps_s": raw["measured"][text]["step_s"],
                        "error": (result.step_s - measured) / measured,
                    }
                )
                say(f"  {text}: predicted {result.step_s:.3f} s, measured {measured:.3f} s")
            cases.append(case)
    errors = [abs(r["error"]) for r in rows]
    document = {
        "meta": {"options": asdict(options), **report.provenance()},
        "rows": rows,
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "cases": [{**c, "predicted": {k: _brief(v) for k, v in c["predicted"].items()}} for c in cases],
    }
    document["_results"] = [(c["world"], c["bandwidth"], list(c["predicted"].values())) for c in cases]
    return document


def predict(profile: Profile, strategy_text: str) -> engine.Result:
    """The simulator's step for one strategy, fed only the profile."""
    work = profile.compute()
    where = profile.cluster()
    return engine.simulate(work, where, strategy_text)


def hooked(options: FidelityOptions) -> dict[str, str]:
    """The codecs the profile must measure, each with the strategy whose hook path it times:
    {codec spec: strategy text}."""
    specs: dict[str, str] = {}
    for text in options.strategies:
        parsed = parse(sim_text(text))
        if parsed.compressed:
            specs.setdefault(parsed.spec, text)
    return specs


def collectives(options: FidelityOptions) -> list[str]:
    """The collectives to probe: fp32 allreduce and allgather, and a sum in every other payload dtype."""
    names = ["allreduce", "allgather"]
    for text in options.strategies:
        parsed = parse(sim_text(text))
        dtype = phases.payload_dtype(parsed)
        if parsed.collective == "allreduce" and dtype != "float32" and f"allreduce:{dtype}" not in names:
            names.append(f"allreduce:{dtype}")
    return names


def _run_ranks(options: FidelityOptions, network: train.Network, world: int) -> dict[str, Any]:
    job = {
        "workload": options.workload,
        "workload_options": {},
        "seed": options.seed,
        "strategies": list(options.strategies),
        "hooked": hooked(options),
        "collectives": collectives(options),
        "collective_sizes": list(options.collective_sizes),
        "codec_sizes": list(options.codec_sizes),
        "warmup": options.warmup,
        "steps": options.steps,
        "profile_steps": options.profile_steps,
        "threads": options.threads,
        "timeout_s": options.timeout_s,
    }
    with tempfile.TemporaryDirectory(prefix="gradsync-fidelity-") as tmp:
        name = f"fidelity on {world} ranks"
        return train.run_job(network, "gradsync.bench.fidelity_worker", job, world, Path(tmp) / "job", name)


def _brief(result: engine.Result) -> dict[str, Any]:
    return {"step_s": result.step_s, "communication_s": result.communication_s, "groups": len(result.groups)}


def table(document: dict[str, Any]) -> str:
    """Markdown: predicted vs measured per configuration, and the median absolute error."""
    lines = [
        "| world | bandwidth | strategy | simulated as | predicted (s) | measured (s) | error |",
        "|---:|---|---|---|---:|---:|---:|",
    ]
    for r in document["rows"]:
        lines.append(
            f"| {r['world']} | {r['bandwidth']} | {r['strategy']} | {r['simulated_as']} | "
            f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error'] * 100:+.1f}% |"
        )
    lines.append("")
    lines.append(
        f"Median absolute error {document['median_abs_error'] * 100:.1f}% over {len(document['rows'])} "
        f"configurations (max {document['max_abs_error'] * 100:.1f}%)."
    )
    return "\n".join(lines)


def write(document: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """results.json, results.md, predicted-vs-measured.png and one Gantt per world x bandwidth."""
    results = document.pop("_results", [])

    def draw(doc: dict[str, Any], out: Path) -> list[Path]:
        paths = [_scatter(doc, out / "predicted-vs-measured.png")]
        for world, bandwidth, predicted in results:
            name = f"gantt-{world}ranks-{bandwidth}.png"
            paths.append(
                gantt.draw(
                    predicted, out / name, f"{doc['meta']['options']['workload']}, {world} ranks, {bandwidth}"
                )
            )
        return paths

    return report.write_results(document, out_dir, table, draw)


def _scatter(document: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    rows = document["rows"]
    for text in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == text]
        ax.scatter([r["measured_s"] for r in mine], [r["predicted_s"] for r in mine], label=text)
    top = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=1)
    ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="grey", alpha=0.15, label="±15%")
    ax.set(xlabel="measured step (s)", ylabel="predicted step (s)", xlim=(0, top), ylim=(0, top))
    ax.set_title(f"median |error| {document['median_abs_error'] * 100:.1f}%", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
