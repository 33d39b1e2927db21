"""Reports of a training benchmark: the Markdown table, the JSON document and the PNG plots."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..profile import machine, matmul_gflops, one_thread_copy_gbytes_per_s


def table(document: dict[str, Any]) -> str:
    """The comparison as a Markdown table, one row per strategy, with the run's conditions. The
    paired "final vs DDP" column appears where the runs measured it (documents since 02b3401)."""
    paired = any(r.get("final_vs_reference") is not None for r in document["runs"])
    versus = f" final vs {reference_name(document['meta'])} |" if paired else ""
    lines = [
        "| strategy | step median (s) | step p90 (s) | speed-up | samples/s | MB sent/step | "
        f"peak MB/step | wire MB/step | final eval loss |{versus} time to target (s) | TTT speed-up |",
        "|---|" + "---:|" * (11 if paired else 10),
    ]
    steady = document["meta"]["steady_from"]
    for r in document["runs"]:
        peak = max(r["sent_nbytes"][steady:], default=0)
        wire = _number(r["wire_bytes_per_step"], 1e-6, ".2f")
        ttt = _number(r["time_to_target_s"], 1, ".1f", missing="not reached")
        lines.append(
            f"| {r['label']} | {r['step_median_s']:.3f} | {r['step_p90_s']:.3f} | "
            f"{_times(r.get('step_speedup'))} | {r['samples_per_s']:.1f} | {r['bytes_per_step'] / 1e6:.2f} | "
            f"{peak / 1e6:.2f} | {wire} | {r['final_loss']:.4f} |{f' {_versus(r)} |' if paired else ''} "
            f"{ttt} | {_times(r.get('time_to_target_speedup'))} |"
        )
    return "\n".join(lines) + "\n\n" + conditions(document)


def headline(document: dict[str, Any]) -> str:
    """One sentence per run against DDP: when it reached DDP's final held-out loss (x 1 + the
    tolerance), in training time against DDP's own, or that it did not."""
    runs = document["runs"]
    target = document["meta"]["target_loss"]
    reference = next((r for r in runs if r["strategy"] == document["meta"].get("reference")), None)
    if reference is None or target is None:
        return "No DDP run, so no time to DDP's loss."
    ddp = reference_name(document["meta"])
    lines = []
    for r in runs:
        if r is reference:
            continue
        if r["time_to_target_s"] is None:
            lines.append(
                f"{r['label']}: did not reach {ddp}'s held-out loss {target:.4f} in {len(r['step_s'])} steps "
                f"(its final: {r['final_loss']:.4f})."
            )
        elif reference["time_to_target_s"] is None:  # DDP's noisy curve ended above its own target
            lines.append(
                f"{r['label']}: reached {target:.4f} after {r['time_to_target_s']:.1f} s; {ddp} did not."
            )
        else:
            lines.append(
                f"{r['label']}: reached {ddp}'s held-out loss {target:.4f} "
                f"after {r['time_to_target_s']:.1f} s "
                f"of training against {ddp}'s {reference['time_to_target_s']:.1f} s: "
                f"{r['time_to_target_speedup']:.2f}x sooner (step {r['steps_to_target']}; {ddp}'s "
                f"step {reference['steps_to_target']})."
            )
    return "\n".join(lines)


def conditions(document: dict[str, Any]) -> str:
    """What the table was measured on, in a few sentences."""
    meta = document["meta"]
    options, network = meta["options"], meta["network"]
    measured = network.get("measured_bits_per_s")
    probe = f"; an allreduce probe measured {measured / 1e9:.3f} Gbit/s bus bandwidth" if measured else ""
    target = meta["target_loss"]
    curve = meta.get("reference_curve") or {}
    ddp = reference_name(meta)
    noise = ""
    if curve.get("final_se"):
        noise = (
            f" {ddp}'s final held-out loss {curve['final_loss']:.4f} has a standard error of "
            f"{curve['final_se']:.4f} over the held-out predictions: the tolerance is "
            f"{meta['tolerance'] * curve['final_loss'] / curve['final_se']:.1f} of them."
        )
    paired = [
        se
        for r in document["runs"]
        if (se := r.get("final_vs_reference_se")) is not None and math.isfinite(se)
    ]
    if paired and max(paired) >= 5e-5:  # below 0.01%, as printed, there is no noise to speak of
        noise += (
            f" Final vs {ddp}: a run's final loss minus {ddp}'s, in % of {ddp}'s, ± the standard "
            "error of that difference over the same held-out predictions (paired: what both models "
            f"get wrong alike cancels); the largest here is {100 * max(paired):.2f}%, so the "
            f"tolerance is at least {meta['tolerance'] / max(paired):.1f} of them."
        )
    if curve.get("last_quarter_fall") is not None:
        noise += f" Over its last quarter of steps {ddp}'s loss fell {100 * curve['last_quarter_fall']:.1f}%."
    schedule = meta.get("schedule_steps")
    stopped = (
        f" (its learning-rate schedule spans {schedule})" if schedule and schedule != options["steps"] else ""
    )
    return (
        f"{meta['workload_description']}; {options['world_size']} ranks, {options['steps']} steps{stopped}, "
        f"{options['threads']} torch thread(s) per rank, on {cores_note(meta['machine'])}. "
        f"Network: {network['description']}{probe}. Step times and bytes count the "
        f"{options['steps'] - meta['steady_from']} steps from step {meta['steady_from']} on (after the "
        "fp32 warm-up). "
        "samples/s and MB sent/step are means over those steps; MB sent/step: bytes each rank hands "
        "to the network per step by the algorithm's count; peak MB/step: the most of them in one "
        "step; wire "
        "MB/step: bytes its interface transmitted (testbed only, TCP/IP included). "
        + (
            f"Target: {ddp}'s final eval loss x (1 + {meta['tolerance']:g}) = {target:.4f}; time to target "
            "is training wall-clock time (evaluations excluded) at the first evaluation at or below it."
            + noise
            if target is not None
            else "No DDP run, so no time-to-target."
        )
        + allocator_note(meta)
    )


def allocator_note(meta: dict[str, Any]) -> str:
    """The allocator settings every run inherited (allocator_env), as a caption says them; "" where
    none was set, or the document predates the record."""
    settings = meta.get("allocator_env")
    if not settings:
        return ""
    return f" Every run had {', '.join(f'{k}={v}' for k, v in settings.items())}."


def cores_note(machine: dict[str, Any]) -> str:
    """The machine as a caption says it: its cores, the CPU model and one thread's speeds, where the
    document recorded them (older documents name only the cores). CPU-bound steps move
    with the machine, not only with the code, so a caption that names it lets a reader tell the
    two apart."""
    model = machine.get("cpu_model") or machine.get("cpu")
    speeds = [
        f"{machine[key]} {unit}"
        for key, unit in (
            ("matmul_gflops_1_thread", "GFLOP/s matmul"),
            ("copy_gbytes_per_s_1_thread", "GB/s copy"),
        )
        if machine.get(key) is not None
    ]
    one_thread = f", one thread {' and '.join(speeds)}" if speeds else ""
    return f"{machine['cores']} cores" + (f" ({model}{one_thread})" if model else "")


def reference_name(meta: dict[str, Any]) -> str:
    """Whose loss the target is: DDP's, or FSDP2's where only FSDP2 runs were made."""
    return "FSDP2" if str(meta.get("reference", "")).startswith("fsdp") else "DDP"


_CODE = ("gradsync", "examples", "Makefile", "pyproject.toml")  # what a measurement depends on


def provenance() -> dict[str, Any]:
    """What a published number needs beside it: the commit it was measured at (and whether the code
    had uncommitted changes: the package, examples, Makefile and pyproject; results written into
    docs/ by earlier benchmarks of the same round do not count), the machine, the command and the
    date."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    # A copy of the tree whose .git is missing or older (a lent GPU machine's) is told its commit
    # by GRADSYNC_COMMIT; whether it had changes is then unknown (None).
    head = git("rev-parse", "HEAD").strip()
    told = os.environ.get("GRADSYNC_COMMIT", "")
    known = bool(head) and head.startswith(told)  # "" and an abbreviated HEAD are HEAD
    if told and not known:
        print(
            f"gradsync: recording commit {told} (GRADSYNC_COMMIT), not git's {head or 'none'}",
            file=sys.stderr,
        )
    return {
        "commit": head if known else told or "unknown",
        "dirty": bool(git("status", "--porcelain", "--", *_CODE).strip()) if known else None,
        # One core's speeds beside the name (gradsync.profile.host says why).
        "machine": {
            **machine(),
            "matmul_gflops_1_thread": round(matmul_gflops(), 1),
            "copy_gbytes_per_s_1_thread": round(one_thread_copy_gbytes_per_s(), 1),
        },
        "command": " ".join(["gradsync", *sys.argv[1:]]) if sys.argv else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "allocator_env": allocator_env(),
    }


def allocator_env() -> dict[str, str]:
    """The settings of this process's environment that change the CPU memory allocator (glibc's
    MALLOC_* tunables, a preloaded malloc), which every rank a benchmark starts inherits: how
    often fresh tensors are paid for in page faults, a part of a step's CPU time on the CPU."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith("MALLOC_") or name in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }


def tree_note(dirty: bool | None) -> str:
    """What a caption says after the commit: the tree had changes, or is a copy whose changes
    nobody checked (provenance's None), or nothing (clean)."""
    if dirty is None:
        return " (a copy of the tree: uncommitted changes not checked)"
    return " (with uncommitted changes)" if dirty else ""


def write(document: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """results.json, results.md and the plots in `out_dir`; returns the paths written."""
    return write_results(document, out_dir, table, plots)


def write_results(
    document: dict[str, Any],
    out_dir: str | Path,
    markdown: Callable[[dict[str, Any]], str],
    draw: Callable[[dict[str, Any], Path], list[Path]],
) -> list[Path]:
    """A benchmark's results.json, results.md (`markdown` of the document) and the plots `draw`
    makes, in `out_dir`; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(document, indent=1))
    paths[1].write_text(markdown(document) + "\n")
    return paths + draw(document, out)


def plots(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """metric-vs-time.png (held-out loss against training wall-clock) and step-breakdown.png."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    meta, runs = document["meta"], document["runs"]
    title = f"{meta['workload']}, {meta['options']['world_size']} ranks, {meta['network']['description']}"

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in runs:
        wall, loss = [e["wall_s"] for e in r["evals"]], [e["loss"] for e in r["evals"]]
        ax.plot(wall, loss, marker=".", label=r["label"])
    if meta["target_loss"] is not None:
        ax.axhline(meta["target_loss"], color="grey", linestyle="--", linewidth=1, label="target")
    ax.set(xlabel="training wall-clock time (s)", ylabel="held-out loss", title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    curve = out_dir / "metric-vs-time.png"
    fig.tight_layout()
    fig.savefig(curve, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 0.6 * len(runs) + 1.5))
    labels = [r["label"] for r in runs]
    left = [0.0] * len(runs)
    for part, color in (("compute", "#4c72b0"), ("compression", "#dd8452"), ("communication", "#55a868")):
        widths = [r["breakdown_s"][part] or 0.0 for r in runs]
        ax.barh(labels, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set(xlabel="seconds per step (median)", title=title)
    ax.legend(fontsize=8)
    breakdown = out_dir / "step-breakdown.png"
    fig.tight_layout()
    fig.savefig(breakdown, dpi=110)
    plt.close(fig)
    return [curve, breakdown]


def _versus(run: dict[str, Any]) -> str:
    """The final loss against the reference's, in percent, with its paired standard error."""
    difference, se = run.get("final_vs_reference"), run.get("final_vs_reference_se")
    return "-" if difference is None else f"{100 * difference:+.1f}% ± {100 * se:.2f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _number(value: float | None, scale: float, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value * scale, spec)
