"""The sparse exchange benchmark's report: Markdown tables, the JSON document and matplotlib plots.

Holds table (exchange times, the inputs' sparsity, the targets, the model's winners, and the run's
conditions), write (results.json, results.md and the PNGs via bench/report.py) and plots. It reads
only the results document, so a saved results.json renders the same report (integer keys turn into
strings in JSON; _by_int reads either).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import report
from .sparse_model import group_sizes, winner_ranges
from .sparse_results import TARGETS
from .sparse_schemes import MODELLED

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
        f"{report.cores_note(meta['machine'])}; gloo. Network: {network['description']}{probe}. {inputs} "
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
