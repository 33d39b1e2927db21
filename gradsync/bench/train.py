"""Training benchmark: real multi-process training of one workload under several strategies.

Each strategy (bench/strategies.py) trains the same workload from the same seeds on the same
data order, one process per rank over torch.distributed (gloo), on loopback or one rank per host
of an emulated network (gradsync.testbed). Per run it measures step time (median, p90), samples
per second, bytes sent per step, the held-out metric against training wall-clock time, and the
time to reach the reference run's final metric; `report.write` turns that into JSON, Markdown and
PNG plots.

Example:
    >>> options = BenchOptions(workload="mlp-wide", world_size=2, strategies=("ddp", "topk"), steps=30)
    >>> document = run(options, loopback(), progress=False)
    >>> print(report.table(document))

At over 500 lines it is over the usual size because launching ranks (loopback or testbed), following
their output and summarising the runs are one job that every rank-running benchmark shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import testbed, workloads
from ..testbed import Testbed
from . import report, strategies
from .progress import ProgressBar

_REPO_ROOT = Path(__file__).resolve().parents[2]
_LOG_TAIL = 40  # lines of a failed rank's log shown in the error


class BenchError(RuntimeError):
    """A benchmark run failed; the message carries the failing ranks' logs."""


@dataclass(frozen=True)
class BenchOptions:
    """What to train and compare. Every strategy gets exactly the same workload and steps."""

    workload: str = "gpt-tiny"
    workload_options: dict[str, Any] = field(default_factory=dict)
    world_size: int = 4
    strategies: tuple[str, ...] = ("ddp", "torch-fp16", "torch-powersgd", "topk")
    steps: int = 100
    eval_every: int = 10  # steps between held-out evaluations (and one at the end)
    seed: int = 0
    # Time-to-target: the reference run's (DDP's) final metric, loosened by this fraction.
    tolerance: float = 0.02
    threads: int = 1  # torch threads per rank
    probe_steps: int = 5  # compute-only steps after training, for the step-time breakdown
    timeout_s: float = 1800.0  # per strategy; the ranks are killed past it
    # Train DDP first and stop it once its held-out loss fell less than this fraction over the
    # last quarter of its steps (at most `steps`); every strategy then trains as many steps.
    until_flat: float | None = None

    def __post_init__(self) -> None:
        _at_least("world_size", self.world_size, 1, "e.g. --world 4")
        _at_least("steps", self.steps, self.steady_from + 2, "the first steps are warm-up")
        _at_least("eval_every", self.eval_every, 1, "e.g. --eval-every 10")
        _at_least("threads", self.threads, 1, "e.g. --threads 1")
        _at_least("probe_steps", self.probe_steps, 1, "e.g. 5")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance={self.tolerance} must lie in [0, 1); e.g. 0.02 for 2%")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds")
        if self.until_flat is not None:
            if not 0 < self.until_flat < 1:
                raise ValueError(f"until_flat={self.until_flat} must lie in (0, 1); e.g. 0.02: under 2% fall")
            if not any(strategies.parse(text).kind == "ddp" for text in self.strategies):
                raise ValueError(
                    "until_flat stops DDP's run when its loss is flat: add ddp to the strategies"
                )
        for text in self.strategies:
            strategies.parse(text)  # raises ValueError naming the bad one
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies {list(self.strategies)} name one twice; name each once")
        if self.workload not in workloads.names():
            choices = ", ".join(workloads.names())
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {choices}")

    @property
    def steady_from(self) -> int:
        """First step counted in step times and bytes, the same for every strategy: after the
        longest warm-up among them (gradsync's and PowerSGD's fp32 steps; plan="auto" measures and
        confirms in its own) and one more, whose allocations are one-off."""
        return max(strategies.parse(text).warmup_steps for text in self.strategies) + 1


@dataclass(frozen=True)
class Network:
    """Where the ranks run: loopback on this machine, or one rank per testbed host."""

    kind: str  # "loopback" or "testbed"
    description: str
    testbed: Testbed | None = None
    measured_bits_per_s: float | None = None  # allreduce bus bandwidth probed before the runs

    def command(self, rank: int, argv: list[str]) -> list[str]:
        return argv if self.testbed is None else self.testbed.hosts[rank].wrap(argv)

    def env(self, rank: int) -> dict[str, str]:
        if self.testbed is None:
            return {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
        host = self.testbed.hosts[rank]
        return {"MASTER_ADDR": self.testbed.hosts[0].address, "GLOO_SOCKET_IFNAME": host.ifname}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "description": self.description}
        if self.testbed is not None:
            out.update(
                configured_bits_per_s=self.testbed.bandwidth_bits_per_s,
                latency_ms=self.testbed.latency_ms,
                measured_bits_per_s=self.measured_bits_per_s,
            )
        return out


def loopback() -> Network:
    return Network("loopback", "loopback (127.0.0.1), unshaped")


def on_testbed(testbed: Testbed, measured_bits_per_s: float | None = None) -> Network:
    return Network("testbed", testbed.describe(), testbed, measured_bits_per_s)


def run(options: BenchOptions, network: Network, progress: bool = True) -> dict[str, Any]:
    """Train every strategy in turn; returns the results document (see `summarize`)."""
    if network.testbed is not None and len(network.testbed.hosts) < options.world_size:
        raise ValueError(
            f"the testbed has {len(network.testbed.hosts)} hosts but world_size={options.world_size}; "
            f"bring one up with --hosts {options.world_size}"
        )
    workload = workloads.build(options.workload, seed=options.seed, **options.workload_options)
    order = list(options.strategies)
    if options.until_flat is not None:  # DDP first: its flat curve decides everyone's steps
        order.sort(key=lambda text: strategies.parse(text).kind != "ddp")
    made = report.provenance()  # the code every rank is about to import, not what is there after
    raw: dict[str, dict[str, Any]] = {}
    schedule_steps = options.steps  # until_flat may shorten the runs, not their schedule
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as tmp:
        for index, text in enumerate(order):
            label = strategies.parse(text).label
            bar = ProgressBar(options.steps, label) if progress else None
            flat = options.until_flat if index == 0 else None
            raw[text] = _run_one(options, network, text, Path(tmp), index, bar, flat, schedule_steps)
            if flat is not None:
                options = dataclasses.replace(options, steps=len(raw[text]["step_s"]))
    meta = {
        "workload": options.workload,
        "workload_description": workload.describe(),
        "params": workload.num_params(),
        "options": asdict(options),
        # The learning-rate schedule's length: the steps asked for, also where until_flat stopped
        # the runs sooner (options.steps then says where).
        "schedule_steps": schedule_steps,
        "network": network.to_dict(),
        **made,
    }
    return summarize([raw[text] for text in options.strategies], meta, options)


def summarize(raw: list[dict[str, Any]], meta: dict[str, Any], options: BenchOptions) -> dict[str, Any]:
    """Per-run statistics and time-to-target from rank 0's raw measurements. Pure.

    Step times and bytes (means; the step's median and p90 too) count steady steps only (from
    `options.steady_from`). The target is the reference run's (DDP's, else FSDP2's own) final
    held-out loss times (1 + tolerance); a run reaches it at its first evaluation after step 0 at
    or below it, and its time-to-target is the training wall-clock time of that evaluation. Each
    run's final loss is compared with the reference's over the same held-out predictions
    (`paired_difference`); the per-prediction losses are not kept in the document.
    """
    references = [r for r in raw if strategies.parse(r["strategy"]).is_reference]
    reference = min(references, key=lambda r: strategies.parse(r["strategy"]).kind != "ddp", default=None)
    target = reference["evals"][-1]["loss"] * (1 + options.tolerance) if reference else None
    reference_losses = reference.get("final_prediction_losses") if reference else None
    runs = []
    for r in raw:
        steady = r["step_s"][options.steady_from :]
        step_median = statistics.median(steady)
        compression = [c for c in r["compression_s"][options.steady_from :] if c is not None]
        compute = statistics.median(r["compute_s"])
        compression_s = statistics.median(compression) if compression else None
        # After some training: a run whose start is within the tolerance of DDP's end (DDP barely
        # learned) has not reached DDP's loss "in 0 s".
        reached = next(
            (e for e in r["evals"] if target is not None and e["step"] > 0 and e["loss"] <= target), None
        )
        versus = (
            None if r is reference else paired_difference(r.get("final_prediction_losses"), reference_losses)
        )
        runs.append(
            {
                **{k: v for k, v in r.items() if k != "final_prediction_losses"},
                "step_median_s": step_median,
                "step_p90_s": quantile(steady, 0.9),
                # Throughput and bytes are means: a strategy that syncs every H steps (DiLoCo) has
                # a median step of compute alone and a median of no bytes at all.
                "step_mean_s": statistics.fmean(steady),
                "samples_per_s": r["samples_per_step"] / statistics.fmean(steady),
                "bytes_per_step": statistics.fmean(r["sent_nbytes"][options.steady_from :]),
                "final_loss": r["evals"][-1]["loss"],
                "final_accuracy": r["evals"][-1].get("accuracy"),
                "breakdown_s": {
                    "compute": min(compute, step_median),
                    "compression": compression_s,
                    # What the step spends beyond its compute and gradsync's own codec time:
                    # exposed communication (and, for torch's hooks, their compression too).
                    "communication": max(0.0, step_median - compute - (compression_s or 0.0)),
                },
                "time_to_target_s": reached["wall_s"] if reached else None,
                "steps_to_target": reached["step"] if reached else None,
                # (final loss - the reference's) / the reference's, and that difference's
                # standard error over the held-out predictions, paired: the same ones, both models.
                "final_vs_reference": versus[0] if versus else None,
                "final_vs_reference_se": versus[1] if versus else None,
            }
        )
    if reference is not None:
        base = next(run for run in runs if run["strategy"] == reference["strategy"])
        for run_ in runs:
            run_["step_speedup"] = base["step_median_s"] / run_["step_median_s"]
            ttt, base_ttt = run_["time_to_target_s"], base["time_to_target_s"]
            run_["time_to_target_speedup"] = base_ttt / ttt if ttt and base_ttt else None
    meta = {
        **meta,
        "steady_from": options.steady_from,
        "reference": reference["strategy"] if reference else None,
        "target_loss": target,
        "tolerance": options.tolerance,
        "reference_curve": _curve(reference["evals"]) if reference else None,
    }
    return {"meta": meta, "runs": runs}


def paired_difference(
    losses: Sequence[float] | None, reference: Sequence[float] | None
) -> tuple[float, float] | None:
    """How much higher one model's held-out loss is than the reference's, relative to the
    reference's, and the standard error of that, over the same predictions: the mean and the
    standard error of the per-prediction differences, each divided by the reference's mean loss.

    Pairing removes what the two models share (the same hard predictions), which independent
    held-out draws would not. None where either has no per-prediction losses, they differ in
    number (not the same predictions), any is not finite (a diverged run), or the reference's
    mean is not positive.
    """
    if not losses or not reference or len(losses) != len(reference) or len(losses) < 2:
        return None
    if not all(math.isfinite(x) for x in losses) or not all(math.isfinite(x) for x in reference):
        return None
    scale = statistics.fmean(reference)
    if scale <= 0:
        return None
    difference = [a - b for a, b in zip(losses, reference, strict=True)]
    se = statistics.stdev(difference) / math.sqrt(len(difference))
    return statistics.fmean(difference) / scale, se / scale


def _curve(evals: list[dict[str, Any]]) -> dict[str, float | None]:
    """How settled the reference's held-out curve is, and how noisy its last point: the loss's
    standard error over held-out predictions, and its fall over the last quarter of the steps."""
    final = evals[-1]
    return {
        "final_loss": final["loss"],
        "final_se": final.get("loss_se"),
        "last_quarter_fall": last_quarter_fall(evals),
    }


def last_quarter_fall(evals: Sequence[dict[str, Any]]) -> float | None:
    """How much the held-out loss fell over the last quarter of the steps evaluated, as a fraction
    of the last loss; None with too few evaluations to say (fewer than 4 after the first)."""
    final = evals[-1]
    quarter = next((e for e in evals if e["step"] >= 0.75 * final["step"]), final)
    if quarter is final or len(evals) < 5:
        return None
    return (quarter["loss"] - final["loss"]) / final["loss"]


# -- running one strategy --------------------------------------------------------------------------


def _run_one(
    options: BenchOptions,
    network: Network,
    strategy: str,
    tmp: Path,
    index: int,
    bar: ProgressBar | None,
    until_flat: float | None = None,
    schedule_steps: int | None = None,
) -> dict[str, Any]:
    spec = {
        "workload": options.workload,
        "workload_options": options.workload_options,
        "seed": options.seed,
        "strategy": strategy,
        "steps": options.steps,
        "steady_from": options.steady_from,
        "eval_every": options.eval_every,
        "threads": options.threads,
        "probe_steps": options.probe_steps,
        "timeout_s": options.timeout_s,
        "until_flat": until_flat,
        "schedule_steps": schedule_steps or options.steps,
    }
    name = f"strategy {strategy!r}"
    result = run_job(
        network, "gradsync.bench.worker", spec, options.world_size, tmp / f"run{index}", name, bar
    )
    if bar is not None:
        bar.close()
    return result


def run_job(
    network: Network,
    worker: str,
    job: dict[str, Any],
    world_size: int,
    stem: Path,
    name: str,
    bar: ProgressBar | None = None,
) -> dict[str, Any]:
    """Run `python -m worker` on every rank with `job` (written to `stem`.json, with its `out`
    added) and return what rank 0 wrote; BenchError naming `name` if a rank fails or job["timeout_s"]
    runs out. Rank logs go to `stem`-rank<i>.log."""
    out = stem.with_name(f"{stem.name}-result.json")
    spec_path = stem.with_name(f"{stem.name}.json")
    spec_path.write_text(json.dumps({**job, "out": str(out)}))
    argv = [sys.executable, "-m", worker, str(spec_path)]
    logs = [stem.with_name(f"{stem.name}-rank{rank}.log") for rank in range(world_size)]
    with launch_ranks(network, argv, world_size, master_port(network), logs) as procs:
        follow_ranks(procs, logs, job["timeout_s"], bar, name)
    return json.loads(out.read_text())


@contextlib.contextmanager
def launch_ranks(
    network: Network, argv: list[str], world_size: int, port: int, logs: list[Path]
) -> Iterator[list[subprocess.Popen]]:
    """Start one process per rank; whatever happens (error, Ctrl-C), none outlives the block."""
    procs: list[subprocess.Popen] = []
    base_env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    try:
        for rank in range(world_size):
            env = {**base_env, **network.env(rank), "RANK": str(rank)}
            log = logs[rank].open("w")
            procs.append(
                subprocess.Popen(
                    network.command(rank, argv),
                    env=env,
                    stdout=subprocess.PIPE if rank == 0 else log,
                    stderr=log,
                    text=True,
                    start_new_session=True,  # Ctrl-C reaches us, and we stop them ourselves
                )
            )
            log.close()
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def follow_ranks(
    procs: list[subprocess.Popen], logs: list[Path], timeout_s: float, bar: ProgressBar | None, name: str
) -> None:
    """Show rank 0's per-step lines until every rank exits; raise if one fails or time runs out.

    `name` is what runs, as the messages call it: "strategy 'topk'", "input 'zipf'"."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read_rank0() -> None:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read_rank0, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    stdout_open = True
    while True:
        failed = [rank for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            raise BenchError(_failure(name, failed, procs, logs))
        if not stdout_open and all(p.poll() == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{name} ran past timeout_s={timeout_s:.0f}; raise --timeout")
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            stdout_open = False
        elif bar is not None and line.startswith("{"):
            event = json.loads(line)
            bar.update(event["step"], f"{event['step_s']:.2f} s/step  loss {event['loss']:.3f}")


def _failure(name: str, failed: list[int], procs: list[subprocess.Popen], logs: list[Path]) -> str:
    codes = [procs[rank].returncode for rank in failed]
    parts = [f"{name}: rank(s) {failed} exited with code(s) {codes}"]
    for rank in failed:
        text = logs[rank].read_text(errors="replace") if logs[rank].exists() else ""
        tail = "\n".join(text.splitlines()[-_LOG_TAIL:])
        parts.append(f"--- rank {rank} log (last {_LOG_TAIL} lines) ---\n{tail}")
    return "\n".join(parts)


def master_port(network: Network) -> int:
    if network.testbed is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return testbed.free_port(network.testbed.hosts[0])  # rank 0's namespace has its own ports


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _at_least(name: str, value: int, low: int, hint: str) -> None:
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}; {hint}")


def open_network(
    stack: contextlib.ExitStack,
    use_testbed: bool,
    hosts: int,
    bandwidth: str = "1gbit",
    latency: str = "0.2ms",
    probe: bool = True,
    say: Callable[[str], None] = print,
    fallback: bool = False,
) -> Network:
    """Where to run: a testbed (the one already up if it has enough hosts, else one built for this
    run and removed when `stack` closes). Where none can be built, a TestbedError naming why, or
    with `fallback` (the demo, which must run anywhere) loopback with a warning. A benchmark asked
    for a testbed fails instead, so that loopback numbers never land where link-bound ones belong
    (`make bench-runtime` writes each network's results to its own folder)."""
    if not use_testbed:
        return loopback()
    reason = testbed.available()
    if reason is not None and not fallback:
        raise testbed.TestbedError(
            f"--testbed asked for an emulated network and none can be built here: {reason}; run as "
            "root with iproute2, or leave out --testbed to run on loopback"
        )
    if reason is not None:
        say(
            f"WARNING: no emulated network ({reason}); running on loopback instead, where the "
            "network is not the bottleneck and compression shows its cost, not its gain"
        )
        return loopback()
    bed = testbed.current()
    if bed is not None and len(bed.hosts) >= hosts:
        say(f"using the testbed that is up: {bed.describe()} (--bandwidth/--latency apply to new ones)")
    elif bed is not None:
        raise ValueError(
            f"the testbed that is up has {len(bed.hosts)} hosts, fewer than the {hosts} ranks; run "
            f"`gradsync testbed down`, or `gradsync testbed up --hosts {hosts}`"
        )
    else:
        bed = stack.enter_context(testbed.session(hosts, bandwidth, latency))
        say(f"testbed built for this run: {bed.describe()}; removed when the run ends")
    measured = None
    if probe:
        measured = testbed.probe(bed)
        say(describe_probe(measured, bed))
    return on_testbed(bed, measured)


def describe_probe(measured_bits_per_s: float, bed: Testbed) -> str:
    return (
        f"allreduce probe: {measured_bits_per_s / 1e9:.3f} Gbit/s bus bandwidth achieved "
        f"(configured {bed.bandwidth_bits_per_s / 1e9:g} Gbit/s per link)"
    )


def run_and_report(
    start: Callable[[Network], dict[str, Any]],
    hosts: int,
    use_testbed: bool,
    bandwidth: str,
    latency: str,
    probe: bool,
    table: Callable[[dict[str, Any]], str],
    write: Callable[[dict[str, Any], str], Sequence[Path]],
    out: str,
    fallback: bool = False,
) -> int:
    """Run a benchmark, `start(network)`, on `hosts` testbed hosts when asked (on loopback where
    none can be built only with `fallback`, see open_network); print its `table` and `write` its
    files to `out`. 0, or 1 with the error printed."""

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        with contextlib.ExitStack() as stack:
            network = open_network(stack, use_testbed, hosts, bandwidth, latency, probe, say, fallback)
            document = start(network)
    except (ValueError, testbed.TestbedError, BenchError) as err:
        say(f"gradsync: error: {err}")  # the testbed, if one was built for the run, is gone already
        return 1
    print(table(document))
    for path in write(document, out):
        say(f"wrote {path}")
    return 0
