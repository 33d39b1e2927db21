"""The runtime benchmark: a user's own DDP training script, run as it is, once per way of averaging
gradients, on emulated hosts (`gradsync bench script`, `make bench-runtime`).

The script (examples/train.py by default) is what a user writes: plain DDP, and one line for a
PyTorch communication hook or for gradsync with the settings written first. Each way runs the same
steps from the same seeds; `repeats` rounds run every way in turn (A B C, A B C), so that drift in
the machine's load lands on all of them alike. The document holds every step's time; the table
gives each way's median step after warm-up, its p90 and its speed-up against DDP and torch's fp16
hook, and `targets` checks the runtime's goals against them. Where the script records it (`cpu_s`,
as examples/train.py does), the CPU time rank 0's process spent per step, every thread counted:
what a way costs the machine, which on hosts that share cores is part of its step time.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import tuner
from ..compress.powersgd import RANK_WARMUP_STEPS
from ..compress.sparse import SPARSITY_WARMUP_STEPS
from ..config import SyncConfig
from . import report
from .train import Network, follow_ranks, launch_ranks, master_port, quantile

# torch's bf16 hook is left out: it refuses anything but CUDA with NCCL, or XPU (gloo on CPU
# raises at register_comm_hook); name it in `syncs` on such machines.
SYNCS = (
    "ddp",
    "torch-fp16",
    "torch-powersgd",
    "gradsync",
    "gradsync-topk",
    "gradsync-fp16",
    "gradsync-bf16",
    "gradsync-powersgd",
    "gradsync-auto",
)
FIRST_STEPS = 60  # plan="auto" is judged on its median over the first 60 steps, planning included
# Steps plan="auto" spends measuring and trying candidates with the config the script writes.
AUTO_PLANNING_STEPS = tuner.warmup_steps(SyncConfig(plan="auto"))
# Ways whose first compressed steps differ by design, and by how many steps: top-k's sparsity
# warm-up and PowerSGD's rank warm-up send more over them; plan="auto" measures and tries
# candidates after the fp32 warm-up.
# Such a way runs that many steps more, and its steady steps are counted from after the warm-up
# (its first FIRST_STEPS steps still include it).
LONGER_WARMUP = {
    "gradsync-topk": SPARSITY_WARMUP_STEPS,
    "gradsync-powersgd": RANK_WARMUP_STEPS,
    "gradsync-auto": AUTO_PLANNING_STEPS - SyncConfig().warmup_steps,
}


@dataclass(frozen=True)
class ScriptOptions:
    """What to run and how often."""

    script: str = "examples/train.py"
    syncs: tuple[str, ...] = SYNCS
    world_size: int = 4
    steps: int = FIRST_STEPS
    # Steps counted from here: well after gradsync's warm-up (2 steps) and torch PowerSGD's start
    # (step 2) and the allocations of the first compressed steps; later by LONGER_WARMUP for the
    # ways it names.
    steady_from: int = 15
    repeats: int = 1
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if not Path(self.script).is_file():
            raise ValueError(f"script {self.script!r} is not a file; give the path of a training script")
        if self.world_size < 1 or self.repeats < 1:
            raise ValueError(f"world_size={self.world_size} and repeats={self.repeats} must be >= 1")
        if self.steps < self.steady_from + 5:
            raise ValueError(
                f"steps={self.steps} leaves fewer than 5 steps after steady_from={self.steady_from}; "
                f"run at least {self.steady_from + 5}"
            )
        if len(set(self.syncs)) != len(self.syncs) or not self.syncs:
            raise ValueError(f"syncs {list(self.syncs)}: name each way once, at least one")

    def steady_from_for(self, sync: str) -> int:
        """The first step counted in `sync`'s steady median."""
        return self.steady_from + LONGER_WARMUP.get(sync, 0)

    def steps_for(self, sync: str) -> int:
        """The steps `sync` runs: as many steady ones as every other way."""
        return self.steps + LONGER_WARMUP.get(sync, 0)


def run(options: ScriptOptions, network: Network, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every way, `repeats` times in turn; the document of every step's time (see summarize)."""
    raw: dict[str, list[list[float]]] = {sync: [] for sync in options.syncs}
    cpu: dict[str, list[list[float]]] = {sync: [] for sync in options.syncs}
    plans: dict[str, list[str | None]] = {sync: [] for sync in options.syncs}
    tried: dict[str, list[Any]] = {sync: [] for sync in options.syncs}
    params = None
    made = report.provenance()  # the code every run is about to import, not what is there after
    with tempfile.TemporaryDirectory(prefix="gradsync-script-") as tmp:
        for round_ in range(options.repeats):
            for sync in options.syncs:
                found = _run_one(options, network, sync, Path(tmp) / f"{sync}-{round_}")
                raw[sync].append(found["step_s"])
                cpu[sync].append(found.get("cpu_s", []))  # a script may not record it
                plans[sync].append(found.get("plan"))  # what plan="auto" adopted, where it says
                tried[sync].append(found.get("tried"))  # and the candidates it tried
                params = found["params"]
                steady = found["step_s"][options.steady_from_for(sync) :]
                say(f"{sync} (round {round_ + 1}): median step {statistics.median(steady):.3f} s")
    meta = {
        **made,
        "options": asdict(options),
        "network": network.to_dict(),
        "params": params,
    }
    return summarize(raw, meta, options, cpu, plans, tried)


def _run_one(options: ScriptOptions, network: Network, sync: str, stem: Path) -> dict[str, Any]:
    out = stem.with_name(f"{stem.name}.json")
    steps = str(options.steps_for(sync))
    argv = [sys.executable, options.script, "--sync", sync, "--steps", steps, "--json", str(out)]
    logs = [stem.with_name(f"{stem.name}-rank{rank}.log") for rank in range(options.world_size)]
    with launch_ranks(network, argv, options.world_size, master_port(network), logs) as procs:
        follow_ranks(procs, logs, options.timeout_s, None, f"--sync {sync}")
    return json.loads(out.read_text())


def summarize(
    raw: dict[str, list[list[float]]],
    meta: dict[str, Any],
    options: ScriptOptions,
    cpu: dict[str, list[list[float]]] | None = None,
    plans: dict[str, list[str | None]] | None = None,
    tried: dict[str, list[Any]] | None = None,
) -> dict[str, Any]:
    """Per way: the median and p90 step after its steady_from, over every round; the median of
    the first FIRST_STEPS steps; the p90 of plan="auto"'s planning steps; where `cpu` holds rank
    0's CPU seconds of each step, their median after its steady_from (else None); where `plans`
    names the plan a way adopted in each round (plan="auto"), those; and where `tried` holds the
    candidates it tried in each round (label, rank 0's counted steps), those. Pure."""
    runs = []
    for sync, rounds in raw.items():
        start = options.steady_from_for(sync)
        steady = [s for steps in rounds for s in steps[start:]]
        cpu_steady = [s for steps in (cpu or {}).get(sync, []) for s in steps[start:]]
        first = [s for steps in rounds for s in steps[:FIRST_STEPS]]
        # Step 0 is start-up; AUTO_PLANNING_STEPS bounds planning (without a runoff it ends sooner).
        planning = [s for steps in rounds for s in steps[1:AUTO_PLANNING_STEPS]]
        runs.append(
            {
                "sync": sync,
                "step_s": rounds,
                "median_s": statistics.median(steady),
                "p90_s": quantile(steady, 0.9),
                "first_median_s": statistics.median(first),
                "planning_p90_s": quantile(planning, 0.9) if sync == "gradsync-auto" else None,
                "cpu_median_s": statistics.median(cpu_steady) if cpu_steady else None,
                "adopted": [p for p in (plans or {}).get(sync, []) if p] or None,
                "tried": [t for t in (tried or {}).get(sync, []) if t] or None,
            }
        )
    by_sync = {r["sync"]: r for r in runs}
    for r in runs:
        for base in ("ddp", "torch-fp16"):
            r[f"vs_{base}"] = by_sync[base]["median_s"] / r["median_s"] if base in by_sync else None
    later = {sync: options.steady_from_for(sync) for sync in raw if sync in LONGER_WARMUP}
    meta = {
        **meta,
        "first_steps": FIRST_STEPS,
        "auto_planning_steps": AUTO_PLANNING_STEPS,
        "steady_from_by_way": later,
    }
    return {"meta": meta, "runs": runs}


def targets(document: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(goal, what was measured, met) for each of the runtime's goals this document can judge: on
    a slow network (at most 2 Gbit/s) the speed-ups, elsewhere the cost of gradsync where
    compressing does not pay."""
    runs = {r["sync"]: r for r in document["runs"]}
    network = document["meta"]["network"]
    rate = network.get("measured_bits_per_s") or network.get("configured_bits_per_s")  # None: loopback
    slow = rate is not None and rate <= 2e9
    found: list[tuple[str, str, bool]] = []

    def ratio(goal: str, sync: str, base: str, at_least: float) -> None:
        if sync in runs and base in runs:
            value = runs[base]["median_s"] / runs[sync]["median_s"]
            found.append((goal, f"{value:.2f}x", value >= at_least))

    def at_most(goal: str, sync: str, base: str, limit: float, field: str = "median_s") -> None:
        if sync in runs and base in runs and runs[sync][field] is not None:
            value = runs[sync][field] / runs[base]["median_s"]
            found.append((goal, f"{value:.2f}x", value <= limit))

    if slow:
        for sync in ("gradsync", "gradsync-topk"):
            ratio(f"{sync}: >= 3x faster per step than DDP", sync, "ddp", 3.0)
            ratio(f"{sync}: >= 1.5x faster than torch's fp16 hook", sync, "torch-fp16", 1.5)
        at_most("gradsync-fp16: step <= torch's fp16 hook's", "gradsync-fp16", "torch-fp16", 1.0)
        at_most("gradsync-bf16: step <= torch's bf16 hook's", "gradsync-bf16", "torch-bf16", 1.0)
        at_most(
            "gradsync-powersgd: step <= torch's PowerSGD hook's", "gradsync-powersgd", "torch-powersgd", 1.0
        )
        fixed = [r for s, r in runs.items() if s != "gradsync-auto"]
        # Judged only where its rounds ran FIRST_STEPS steps: a shorter run's "first steps" are
        # all of them, planning weighing more than the goal means.
        long_enough = "gradsync-auto" in runs and all(
            len(steps) >= FIRST_STEPS for steps in runs["gradsync-auto"]["step_s"]
        )
        if long_enough and fixed:
            best = min(fixed, key=lambda r: r["median_s"])
            value = runs["gradsync-auto"]["first_median_s"] / best["median_s"]
            found.append(
                (
                    f"gradsync-auto: median of its first {FIRST_STEPS} steps within 5% of the best fixed "
                    f"way's step ({best['sync']})",
                    f"{value:.2f}x",
                    value <= 1.05,
                )
            )
    else:
        at_most("gradsync: step <= 1.05x DDP's where compressing does not pay", "gradsync", "ddp", 1.05)
        at_most("gradsync-auto: step <= 1.05x DDP's", "gradsync-auto", "ddp", 1.05)
    at_most(
        "gradsync-auto: p90 of its planning steps <= 1.5x DDP's step",
        "gradsync-auto",
        "ddp",
        1.5,
        "planning_p90_s",
    )
    return found


def _later(meta: dict[str, Any]) -> str:
    """The ways whose steady steps start later (LONGER_WARMUP), as the caption names them."""
    later = meta.get("steady_from_by_way") or {}  # documents from before LONGER_WARMUP name none
    return "".join(f" ({sync} from step {start}, after its warm-up)" for sync, start in later.items())


def table(document: dict[str, Any]) -> str:
    """The ways as a Markdown table, the goals met or missed, and the conditions."""
    lines = [
        "| way | median step (s) | p90 (s) | vs DDP | vs torch fp16 | first 60 steps, median (s) "
        "| CPU per step, rank 0 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in document["runs"]:
        lines.append(
            f"| {r['sync']} | {r['median_s']:.3f} | {r['p90_s']:.3f} | {_times(r['vs_ddp'])} | "
            f"{_times(r['vs_torch-fp16'])} | {r['first_median_s']:.3f} | {_seconds(r.get('cpu_median_s'))} |"
        )
    goals = targets(document)
    if goals:
        lines += ["", "| goal | measured | met |", "|---|---:|---|"]
        lines += [f"| {goal} | {value} | {'yes' if met else '**no**'} |" for goal, value, met in goals]
    return "\n".join(lines) + "\n\n" + conditions(document)


def conditions(document: dict[str, Any]) -> str:
    meta = document["meta"]
    options, network = meta["options"], meta["network"]
    measured = network.get("measured_bits_per_s")
    probe = f" (an allreduce probe measured {measured / 1e9:.3f} Gbit/s)" if measured else ""
    return (
        f"`{options['script']}` ({meta['params'] / 1e6:.1f}M parameters), {options['world_size']} ranks "
        f"of one torch thread, {options['steps']} steps, {options['repeats']} round(s) of every way in turn; "
        f"medians over the steps from step {options['steady_from']} on{_later(meta)}; CPU: the time "
        "every thread of rank 0's process spent per step (compute, hook, communication library). "
        f"Network: {network['description']}"
        f"{probe}. Machine: {report.cores_note(meta['machine'])} shared by all ranks (CPU work weighs "
        f"more than on real hosts), torch {meta['machine']['torch']}; commit {meta['commit'][:12]}"
        f"{report.tree_note(meta['dirty'])}, {meta['date']}.{report.allocator_note(meta)}{_adopted(document)}"
    )


def _adopted(document: dict[str, Any]) -> str:
    """The plans a way adopted (plan="auto"), round by round, where the script recorded them."""
    return "".join(
        f" {r['sync']} adopted {'; '.join(f'{p!r} (round {k})' for k, p in enumerate(r['adopted'], 1))}."
        for r in document["runs"]
        if r.get("adopted")
    )


def write(document: dict[str, Any], out_dir: str | Path) -> list[Path]:
    return report.write_results(document, out_dir, table, lambda *_: [])


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
