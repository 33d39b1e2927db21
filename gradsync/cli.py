"""Command line: `gradsync list | demo | simulate | bench kernels|train|sparse | testbed up|down|status`.

`python -m gradsync ...` works the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from . import compress
from .bench import kernels
from .config import SyncConfig

# Bits per element are quoted for a tensor of this many fp32 elements (4 MiB).
_LIST_NUMEL = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="every compressor with its flags and bits per element")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    demo = commands.add_parser(
        "demo", help="gpt-tiny on 4 ranks: plain DDP vs gradsync, on an emulated 1 Gbit/s network"
    )
    demo.add_argument("--steps", type=int, default=None, help="training steps per run (default: the demo's)")
    demo.add_argument("--loopback", action="store_true", help="skip the emulated network")
    bench = commands.add_parser("bench", help="benchmarks: kernels, train, sparse, sim, fidelity, plan")
    benches = bench.add_subparsers(dest="bench", required=True)
    # One entry per benchmark, each with its own parser for its own errors.
    bench_parsers = {
        "kernels": _add_bench_kernels(benches),
        "train": _add_bench_train(benches),
        "sparse": _add_bench_sparse(benches),
        "sim": _add_bench_sim(benches),
        "fidelity": _add_bench_fidelity(benches),
        "plan": _add_bench_plan(benches),
    }
    testbed_parser = _add_testbed(commands)
    simulate_parser = _add_simulate(commands)
    plan_parser = _add_plan(commands)
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list(args.json)
    if args.command == "simulate":
        return _simulate(args, simulate_parser)
    if args.command == "plan":
        return _plan(args, plan_parser)
    if args.command == "bench":
        run_bench = {
            "kernels": _bench_kernels,
            "train": _bench_train,
            "sparse": _bench_sparse,
            "sim": _bench_sim,
            "fidelity": _bench_fidelity,
            "plan": _bench_plan,
        }[args.bench]
        return run_bench(args, bench_parsers[args.bench])
    if args.command == "testbed":
        return _testbed(args, testbed_parser)
    from .demo import main as demo_main

    return demo_main(steps=args.steps, use_testbed=not args.loopback, parser=demo)


def describe(name: str) -> dict[str, object]:
    """What `gradsync list` shows for one registered compressor."""
    cls = compress.lookup(name)
    codec = compress.build(name)
    if cls.majority_vote:
        exchange = "vote"
    elif cls.rounds > 1:
        exchange = f"allreduce x{cls.rounds}"
    else:
        exchange = "allreduce" if cls.summable else "allgather"
    return {
        "name": name,
        "summable": cls.summable,
        "unbiased": cls.unbiased,
        "exchange": exchange,
        "fixed_size": cls.fixed_size,
        # What SyncConfig's error_feedback="auto" picks for it.
        "auto_feedback": SyncConfig(compressor=name).feedback_name,
        # The largest payload where its size depends on the data.
        "bits_per_element": 8 * codec.payload_bytes(_LIST_NUMEL) / _LIST_NUMEL,
        "parameters": {k: v for k, v in compress.parameters(name).items() if k != "seed"},
        "summary": " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()),
    }


def _list(as_json: bool) -> int:
    rows = [describe(name) for name in compress.names()]
    if as_json:
        print(json.dumps(rows, indent=2, default=repr))
        return 0
    columns = f"{'name':<10} {'summable':<9} {'unbiased':<9} {'exchange':<13} {'feedback':<9}"
    print(f"{columns} {'bits/elem':>10}  parameters")
    for r in rows:
        params = ", ".join(f"{k}={v!r}" for k, v in r["parameters"].items()) or "-"
        bits = f"{r['bits_per_element']:.3f}" if r["fixed_size"] else f"<={r['bits_per_element']:.1f}"
        print(
            f"{r['name']:<10} {r['summable']!s:<9} {r['unbiased']!s:<9} {r['exchange']:<13} "
            f"{r['auto_feedback']:<9} {bits:>10}  {params}"
        )
    print(
        f"\nbits/elem: payload bits per element of a {_LIST_NUMEL:,}-element fp32 tensor (fp32 = 32); "
        "<= marks a size that depends on the data.\nfeedback: what error_feedback='auto' picks. "
        "vote: majority vote, sign bits summed as small integers by one allreduce."
    )
    return 0


def _add_bench_kernels(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    kernels_parser = benches.add_parser(
        "kernels", help="compress + decompress time of every compressor, as a ratio to a plain copy"
    )
    kernels_parser.add_argument(
        "--numel", type=int, default=2**24, help="fp32 elements of the tensor (default 2**24)"
    )
    kernels_parser.add_argument(
        "--repeats", type=int, default=7, help="timed calls per variant; the median counts (default 7)"
    )
    kernels_parser.add_argument(
        "--only",
        type=_comma_list,
        default=None,
        help=f"comma-separated labels to run (default all): {','.join(kernels.variant_labels())}",
    )
    kernels_parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    kernels_parser.add_argument(
        "--json", default="runs/bench-kernels.json", help="where to write the results (default %(default)s)"
    )
    return kernels_parser


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _bench_kernels(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for flag, example in (("numel", 2**24), ("repeats", 5), ("threads", 1)):
        value = getattr(args, flag)
        if value < 1:
            parser.error(f"--{flag}={value} must be >= 1; pass e.g. --{flag}={example}")
    if args.only is not None:
        valid = kernels.variant_labels()
        unknown = [label for label in args.only if label not in valid]
        if unknown or not args.only:
            what = f"unknown label(s) {unknown}" if unknown else "no labels given"
            parser.error(f"--only: {what}; valid labels: {','.join(valid)}")
    results = kernels.run(
        numel=args.numel,
        repeats=args.repeats,
        labels=args.only,
        threads=args.threads,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(kernels.format_table(results, threads=args.threads))
    meta = kernels.metadata(args.numel, args.threads, args.repeats)
    path = kernels.write_json(results, meta, args.json)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _add_bench_train(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .bench.train import BenchOptions

    defaults = BenchOptions.__dataclass_fields__
    train = benches.add_parser(
        "train",
        help="real multi-process training of a workload under several strategies, side by side",
        description="Each strategy trains the same workload from the same seeds on the same data "
        "order, one process per rank (gloo). Writes results.json, results.md and PNG plots.",
    )
    train.add_argument("--workload", default=defaults["workload"].default, help="gpt-tiny, mlp-wide, ...")
    train.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload option, e.g. --option batch_size=8 (repeatable)",
    )
    train.add_argument("--world", type=int, default=defaults["world_size"].default, help="ranks (default 4)")
    train.add_argument(
        "--strategies",
        default="ddp,torch-fp16,torch-powersgd,topk",
        help="comma-separated: ddp, torch-fp16, torch-powersgd[:rank=R], or a gradsync compressor "
        "with options, e.g. topk:ratio=0.01 (default %(default)s)",
    )
    train.add_argument("--steps", type=int, default=defaults["steps"].default, help="steps per strategy")
    train.add_argument("--eval-every", type=int, default=defaults["eval_every"].default)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--tolerance", type=float, default=0.02, help="time-to-target tolerance on DDP's final loss (0.02)"
    )
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    train.add_argument("--timeout", type=float, default=1800, help="seconds per strategy before giving up")
    _add_network_options(train, train)
    train.add_argument("--out", default="runs/bench-train", help="output folder (default %(default)s)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    return train


def _add_network_options(parser: argparse.ArgumentParser, testbed_group: Any) -> None:
    """--testbed (into `testbed_group`, which may exclude --loopback) and the options of a
    testbed built for the run, shared by the benchmarks that run ranks."""
    testbed_group.add_argument(
        "--testbed",
        action="store_true",
        help="one rank per host of an emulated network (the one up, or one built for this run)",
    )
    parser.add_argument("--bandwidth", default="1gbit", help="per-link rate of a testbed built for the run")
    parser.add_argument("--latency", default="0.2ms", help="one-way latency of a testbed built for the run")
    parser.add_argument("--no-probe", action="store_true", help="skip the testbed's bandwidth probe")


def _bench_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench import train

    try:
        workload_options = dict(_key_value(item) for item in args.option)
        options = train.BenchOptions(
            workload=args.workload,
            workload_options=workload_options,
            world_size=args.world,
            strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
            steps=args.steps,
            eval_every=args.eval_every,
            seed=args.seed,
            tolerance=args.tolerance,
            threads=args.threads,
            timeout_s=args.timeout,
        )
        from . import workloads

        workloads.build(options.workload, seed=options.seed, **workload_options)  # bad options fail here
    except (KeyError, TypeError, ValueError) as err:
        parser.error(str(err).strip("'\""))
    return run_training_bench(
        options,
        args.testbed,
        args.bandwidth,
        args.latency,
        not args.no_probe,
        args.out,
        progress=not args.no_progress,
    )


def run_training_bench(
    options: Any,
    use_testbed: bool,
    bandwidth: str,
    latency: str,
    probe: bool,
    out: str,
    progress: bool = True,
) -> int:
    """Run the training benchmark (on a testbed when asked and possible), print and write results."""
    from .bench import report, train

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    from .testbed import TestbedError

    try:
        with contextlib.ExitStack() as stack:
            network = train.open_network(
                stack, use_testbed, options.world_size, bandwidth, latency, probe, say
            )
            document = train.run(options, network, progress=progress)
    except (ValueError, TestbedError, train.BenchError) as err:
        say(f"gradsync: error: {err}")  # the testbed, if one was built for the run, is gone already
        return 1
    print(report.table(document))
    for path in report.write(document, out):
        say(f"wrote {path}")
    return 0


def _add_bench_sparse(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .bench.sparse import SCHEMES, SparseBenchOptions

    defaults = SparseBenchOptions.__dataclass_fields__
    sparse = benches.add_parser(
        "sparse",
        help="the sparse exchange schemes timed on embedding-gradient and Zipf rows, and their traffic model",
        description="Every scheme of gradsync.sparse (and balanced with an index-range partition) "
        "exchanges the same rows, one process per rank (gloo); each input's sparsity is measured and "
        "each scheme's traffic modelled for 2 to --model-workers workers. Writes results.json, "
        "results.md and PNG plots.",
    )
    sparse.add_argument("--hosts", type=int, default=defaults["hosts"].default, help="ranks (default 8)")
    where = sparse.add_mutually_exclusive_group()
    where.add_argument("--loopback", action="store_true", help="all ranks on loopback (the default)")
    _add_network_options(sparse, where)
    sparse.add_argument(
        "--inputs",
        default=",".join(defaults["inputs"].default),
        help="comma-separated: embed-lm, zipf, with options as in zipf:rows=65536:width=8:density=0.02:s=1.2 "
        "or embed-lm:batch_size=128 (default %(default)s)",
    )
    sparse.add_argument(
        "--schemes", default=",".join(SCHEMES), help="comma-separated subset of %(default)s (default all)"
    )
    sparse.add_argument("--reps", type=int, default=defaults["reps"].default, help="timed exchanges (10)")
    sparse.add_argument("--warmup", type=int, default=defaults["warmup"].default, help="untimed first (2)")
    sparse.add_argument("--seed", type=int, default=0)
    sparse.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    sparse.add_argument(
        "--model-workers",
        type=int,
        default=defaults["model_workers"].default,
        help="the traffic model's largest worker count (default %(default)s)",
    )
    sparse.add_argument("--timeout", type=float, default=900, help="seconds per input before giving up")
    sparse.add_argument("--out", default="runs/bench-sparse", help="output folder (default %(default)s)")
    return sparse


def _bench_sparse(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import testbed
    from .bench import sparse

    try:
        options = sparse.SparseBenchOptions(
            hosts=args.hosts,
            inputs=tuple(_comma_list(args.inputs)),
            schemes=tuple(_comma_list(args.schemes)),
            reps=args.reps,
            warmup=args.warmup,
            seed=args.seed,
            threads=args.threads,
            model_workers=args.model_workers,
            timeout_s=args.timeout,
        )
        testbed.parse_bandwidth(args.bandwidth)
        testbed.parse_latency(args.latency)
        for text in options.inputs:
            sparse.Source(sparse.parse_input(text), options.seed)  # bad workload options fail here
    except (KeyError, TypeError, ValueError) as err:
        parser.error(str(err).strip("'\""))
    return run_sparse_bench(options, args.testbed, args.bandwidth, args.latency, not args.no_probe, args.out)


def run_sparse_bench(
    options: Any, use_testbed: bool, bandwidth: str, latency: str, probe: bool, out: str
) -> int:
    """Run the sparse exchange benchmark (on a testbed when asked and possible), print and write results."""
    from .bench import sparse, train
    from .testbed import TestbedError

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        with contextlib.ExitStack() as stack:
            network = train.open_network(stack, use_testbed, options.hosts, bandwidth, latency, probe, say)
            document = sparse.run(options, network, say)
    except (ValueError, TestbedError, train.BenchError) as err:
        say(f"gradsync: error: {err}")  # the testbed, if one was built for the run, is gone already
        return 1
    print(sparse.table(document))
    for path in sparse.write(document, out):
        say(f"wrote {path}")
    return 0


def _add_bench_sim(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sim = benches.add_parser(
        "sim",
        help="the simulator's speed at 1,024 and 16,384 workers and its predictions for every model",
        description="Times one simulated step of every model profile at scale, and tabulates the "
        "scaling factor per model, network and strategy. Writes results.json, results.md and a Gantt.",
    )
    sim.add_argument("--out", default="runs/bench-sim", help="output folder (default %(default)s)")
    return sim


def _bench_sim(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench import simulator

    document = simulator.run(simulator.SimBenchOptions())
    print(simulator.table(document))
    for path in simulator.write(document, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _add_bench_fidelity(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .bench.fidelity import FidelityOptions

    defaults = FidelityOptions.__dataclass_fields__
    fidelity = benches.add_parser(
        "fidelity",
        help="the simulator's predicted step time vs the measured one on the emulated network",
        description="For each world size and bandwidth: a testbed, a profile on its ranks, then "
        "measured training steps per strategy, each compared with the simulator's prediction from "
        "the profile alone. Needs root and iproute2 (the testbed). Writes results.json, results.md, plots.",
    )
    fidelity.add_argument("--workload", default=defaults["workload"].default)
    worlds, bandwidths = defaults["worlds"].default, defaults["bandwidths"].default
    fidelity.add_argument("--worlds", default=",".join(map(str, worlds)), help="e.g. %(default)s")
    fidelity.add_argument("--bandwidths", default=",".join(bandwidths), help="e.g. %(default)s")
    fidelity.add_argument("--latency", default=defaults["latency"].default)
    strategies = ",".join(defaults["strategies"].default)
    fidelity.add_argument("--strategies", default=strategies, help="as in bench train (%(default)s)")
    fidelity.add_argument("--steps", type=int, default=defaults["steps"].default, help="timed steps each")
    fidelity.add_argument("--out", default="runs/bench-fidelity", help="output folder (default %(default)s)")
    return fidelity


def _bench_fidelity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import testbed
    from .bench import fidelity, train

    try:
        options = fidelity.FidelityOptions(
            workload=args.workload,
            worlds=tuple(int(w) for w in _comma_list(args.worlds)),
            bandwidths=tuple(_comma_list(args.bandwidths)),
            latency=args.latency,
            strategies=tuple(_comma_list(args.strategies)),
            steps=args.steps,
        )
    except (KeyError, TypeError, ValueError) as err:
        parser.error(str(err).strip("'\""))
    reason = testbed.available()
    if reason is not None:
        print(f"gradsync: error: bench fidelity needs the emulated network: {reason}", file=sys.stderr)
        return 1

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        document = fidelity.run(options, say)
    except (ValueError, testbed.TestbedError, train.BenchError) as err:
        say(f"gradsync: error: {err}")
        return 1
    print(fidelity.table(document))
    for path in fidelity.write(document, args.out):
        say(f"wrote {path}")
    return 0


def _add_bench_plan(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bench = benches.add_parser(
        "plan",
        help="the planner against brute force and uniform strategies, and its decision time (simulated)",
        description="Quality against brute force on coarsened models, plans against every uniform "
        "strategy and MergeComp's layer-wise and one-group baselines, and decision times, on the "
        "simulator's model profiles. Writes results.json and README.md.",
    )
    bench.add_argument("--out", default="runs/bench-plan", help="output folder (default %(default)s)")
    bench.add_argument("--quick", action="store_true", help="two models, one cluster: a smoke run")
    return bench


def _bench_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench import planning

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    document = planning.run(planning.QUICK if args.quick else planning.Options(), say)
    command = "python -m gradsync bench plan" + (" --quick" if args.quick else "") + f" --out {args.out}"
    print(planning.table(document))
    for path in planning.write(document, args.out, command):
        say(f"wrote {path}")
    return 0


def _key_value(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--option {item!r} is not KEY=VALUE, e.g. --option batch_size=8")
    from .registry import parse_value

    return key, parse_value(value)


def _add_simulate(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .sim import cluster, models

    sim = commands.add_parser(
        "simulate",
        help="predict step time and scaling of a model on a cluster, per strategy",
        description="Simulates one training step (backward, compression, communication, overlap) "
        "for each strategy, prints step time and scaling factor, and draws the timelines.",
    )
    sim.add_argument("--model", default="bert-base", help=f"one of {', '.join(models.names())}")
    sim.add_argument("--profile", help="a profile measured by gradsync.profile (JSON) instead of --model")
    sim.add_argument("--nodes", type=int, default=8, help="machines (default 8)")
    sim.add_argument("--gpus-per-node", type=int, default=8, help="workers per machine (default 8)")
    sim.add_argument("--device", default="v100", help=f"one of {', '.join(cluster.DEVICES)}")
    sim.add_argument("--inter", default="25gbit", help="bandwidth between nodes, e.g. 25gbit, 100gbit")
    sim.add_argument("--intra", default="nvlink", choices=("nvlink", "pcie"), help="link inside a node")
    sim.add_argument("--precision", default="mixed", choices=cluster.PRECISIONS, help="compute precision")
    sim.add_argument("--batch", type=int, default=None, help="samples per worker (default: the model's)")
    sim.add_argument(
        "--strategy",
        action="append",
        default=[],
        help="comma-separated, repeatable: none, fp16, topk:ratio=0.01, qsgd:collective=two-level, "
        "none:scheme=auto, dgc:on=cpu ... (default none,fp16,topk:ratio=0.01)",
    )
    sim.add_argument(
        "--groups", default="ddp", help="ddp (25 MiB buckets), layerwise, single, or a number of equal groups"
    )
    sim.add_argument("--jitter", type=float, default=0.0, help="per-worker compute variation (e.g. 0.05)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--gantt", default="runs/simulate/gantt.png", help="timeline plot ('' for none)")
    sim.add_argument("--json", action="store_true", help="print the results as JSON")
    return sim


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import time

    from .sim import cluster, compute, engine, models, report

    texts = [s.strip() for item in args.strategy or ["none,fp16,topk:ratio=0.01"] for s in item.split(",")]
    try:
        if args.profile:
            from .profile import Profile

            profile = Profile.load(args.profile)
            work = profile.compute()
            where = profile.cluster()
        else:
            where = cluster.cluster(
                args.nodes, args.gpus_per_node, args.device, args.inter, args.intra, args.precision
            )
            work = compute.from_model(models.build(args.model), where.device, args.precision, args.batch)
        grouping = _grouping(args.groups, work.numels)
        started = time.perf_counter()
        results = [
            engine.simulate(work, where, text, grouping, args.jitter, args.seed) for text in texts if text
        ]
        elapsed = time.perf_counter() - started
    except (KeyError, TypeError, ValueError, OSError) as err:
        parser.error(str(err).strip("'\""))
    if args.json:
        print(json.dumps([report.to_dict(r) for r in results], indent=1))
    else:
        print(
            f"{work.name or 'profiled model'}: {work.num_params:,} parameters, {where.describe()}, "
            f"{work.batch_size} samples per worker; one worker alone: {work.step_s * 1e3:.1f} ms per step"
        )
        print(report.table(results))
        print(f"simulated {len(results)} strategies x {where.world_size} workers in {elapsed:.3f} s")
    if args.gantt:
        from .sim import gantt

        path = gantt.draw(results, args.gantt, f"{work.name}, {where.describe()}")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _add_plan(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .sim import cluster, models

    plan = commands.add_parser(
        "plan",
        help="make a per-group plan (groups, strategies, reasons): simulated, or measured on real ranks",
        description="Plans which strategy each group of gradients takes and how gradients are merged "
        "into groups. With --model or --profile, for a simulated cluster; with --workload, by training "
        "it with SyncConfig(plan='auto') on --world ranks, printing the plan adopted with its predicted "
        "and measured step.",
    )
    mode = plan.add_mutually_exclusive_group()
    mode.add_argument(
        "--model", help=f"plan a simulated model: one of {', '.join(models.names())} (default bert-base)"
    )
    mode.add_argument("--profile", help="plan from a profile measured by gradsync.profile (JSON)")
    mode.add_argument(
        "--workload", help="measure: train this workload (gpt-tiny, mlp-wide, ...) with plan='auto'"
    )
    plan.add_argument(
        "--compressor",
        default="topk:ratio=0.01",
        help="the codec the plan may use besides fp32, fp16 and bf16, with its arguments; 'none' for "
        "those only (default %(default)s)",
    )
    plan.add_argument(
        "--max-groups", type=int, default=64, help="most groups the schedule tries (default 64)"
    )
    plan.add_argument("--out", default="", help="write the plan as JSON here (SyncConfig(plan=PATH) runs it)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    simulated = plan.add_argument_group("a simulated cluster (--model)")
    simulated.add_argument("--nodes", type=int, default=8, help="machines (default 8)")
    simulated.add_argument("--gpus-per-node", type=int, default=8, help="workers per machine (default 8)")
    simulated.add_argument("--device", default="v100", help=f"one of {', '.join(cluster.DEVICES)}")
    simulated.add_argument("--inter", default="25gbit", help="bandwidth between nodes, e.g. 25gbit")
    simulated.add_argument("--intra", default="nvlink", choices=("nvlink", "pcie"), help="link inside a node")
    simulated.add_argument(
        "--precision", default="mixed", choices=cluster.PRECISIONS, help="compute precision"
    )
    simulated.add_argument(
        "--batch", type=int, default=None, help="samples per worker (default: the model's)"
    )
    measured = plan.add_argument_group("measured on real ranks (--workload)")
    measured.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    measured.add_argument("--steps", type=int, default=30, help="steps to train: planning takes the first 21")
    measured.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    _add_network_options(measured, measured)
    return plan


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`gradsync plan`: one function per mode; each returns the plan and what to say about it."""
    from .registry import parse_spec

    for note in _unused_plan_options(args, parser):
        print(f"gradsync plan: warning: {note}", file=sys.stderr)
    try:
        name, codec_args = parse_spec(args.compressor, "compressor")
        if args.max_groups < 1:
            raise ValueError(f"--max-groups {args.max_groups} must be >= 1 group")
        if args.workload:
            made = _plan_measured(args, name, codec_args)
            if made is None:
                return 1
            plan, notes = made
        else:
            plan, notes = _plan_simulated(args, name, codec_args)
    except (KeyError, TypeError, ValueError, OSError) as err:
        parser.error(str(err).strip("'\""))
    if args.out:
        plan.save(args.out)
        notes.append(f"wrote {args.out}")
    print(plan.to_json() if args.json else plan.describe())
    for note in notes:
        print(note, file=sys.stderr)
    return 0


# The options only one way of planning reads (argparse dests), and what each way uses instead.
_SIMULATED_CLUSTER = ("nodes", "gpus_per_node", "device", "inter", "intra", "precision", "batch")
_MEASURED_RUN = ("world", "steps", "threads", "testbed", "bandwidth", "latency", "no_probe")


def _unused_plan_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """A note for each option given a value that the chosen way of planning does not read."""
    if args.workload:
        ignored, why = (*_SIMULATED_CLUSTER, "max_groups"), "--workload plans on the real ranks it trains"
    elif args.profile:
        ignored, why = _SIMULATED_CLUSTER + _MEASURED_RUN, "--profile plans for the cluster it measured"
    else:
        ignored, why = _MEASURED_RUN, "these options are for --workload, which trains on real ranks"
    given = [dest for dest in ignored if getattr(args, dest) != parser.get_default(dest)]
    return [f"--{dest.replace('_', '-')} has no effect: {why}" for dest in given]


def _plan_simulated(args: argparse.Namespace, name: str, codec_args: dict[str, Any]) -> tuple[Any, list[str]]:
    from . import autoplan
    from .sim import cluster, compute, models

    if args.profile:
        from .profile import Profile

        profile = Profile.load(args.profile)
        work, where = profile.compute(), profile.cluster()
        params, model = [t.index for t in profile.tensors], f"profile:{work.name}"
    else:
        where = cluster.cluster(
            args.nodes, args.gpus_per_node, args.device, args.inter, args.intra, args.precision
        )
        work = compute.from_model(
            models.build(args.model or "bert-base"), where.device, args.precision, args.batch
        )
        params, model = None, f"sim:{work.name}"
    compressor = None if name == "none" else name
    made = autoplan.make(work, where, compressor, codec_args, model, params, args.max_groups)
    meta = made.meta
    notes = [
        f"{work.name}: {work.num_params:,} parameters on {where.describe()}; searched "
        f"{meta['groupings_tried']} groupings in {meta['search_s'] * 1e3:.0f} ms (the best one's "
        f"per-group decision: {meta['decision_s'] * 1e3:.1f} ms)"
    ]
    return made, notes


def _plan_measured(
    args: argparse.Namespace, name: str, codec_args: dict[str, Any]
) -> tuple[Any, list[str]] | None:
    from .bench import train
    from .plan import Plan
    from .testbed import TestbedError

    spec = ":".join([f"auto:compressor={name}", *(f"{k}={v}" for k, v in codec_args.items())])
    options = train.BenchOptions(
        workload=args.workload,
        world_size=args.world,
        strategies=(spec,),
        steps=args.steps,
        eval_every=args.steps,
        threads=args.threads,
    )

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        with contextlib.ExitStack() as stack:
            network = train.open_network(
                stack, args.testbed, options.world_size, args.bandwidth, args.latency, not args.no_probe, say
            )
            document = train.run(options, network, progress=False)
    except (TestbedError, train.BenchError) as err:
        say(f"gradsync: error: {err}")
        return None
    (run,) = document["runs"]
    steady = run["step_median_s"]
    made = Plan.from_dict(run["plan"])
    shadow = made.measured_step_s
    made = made.with_measured(steady)
    counted = options.steps - options.steady_from
    notes = [
        f"{args.workload} on {args.world} ranks, {network.description}: predicted step "
        f"{made.predicted_step_s * 1e3:.1f} ms; measured {steady * 1e3:.1f} ms (median of the {counted} "
        f"steps after planning), {shadow * 1e3:.1f} ms when confirmed in the shadow"
    ]
    return made, notes


def _grouping(text: str, numels: list[int]) -> list[list[int]]:
    from .sim import groups

    if text == "ddp":
        return groups.ddp(numels)
    if text == "layerwise":
        return groups.layerwise(len(numels))
    if text == "single":
        return groups.single(len(numels))
    if text.isdigit() and int(text) >= 1:
        return groups.equal(numels, int(text))
    raise ValueError(f"--groups {text!r} must be ddp, layerwise, single or a number of groups >= 1")


def _add_testbed(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bed = commands.add_parser("testbed", help="an emulated multi-host network (Linux namespaces, tc)")
    actions = bed.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="build N hosts joined by a bridge, each link shaped")
    up.add_argument("--hosts", type=int, default=4, help="hosts (default 4)")
    up.add_argument("--bandwidth", default="1gbit", help="per-link rate, e.g. 1gbit, 100mbit (default 1gbit)")
    up.add_argument("--latency", default="0.2ms", help="one-way host-to-host latency (default 0.2ms)")
    up.add_argument("--no-probe", action="store_true", help="skip the allreduce bandwidth probe")
    actions.add_parser("down", help="remove every gradsync namespace, link and qdisc")
    actions.add_parser("status", help="what is up")
    return bed


def _testbed(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import testbed

    if args.action == "down":
        removed = testbed.down()
        print(f"removed {', '.join(removed)}" if removed else "no testbed was up")
        return 0
    if args.action == "status":
        print(testbed.format_status())
        return 0
    reason = testbed.available()
    if reason is not None:
        print(f"cannot build a testbed: {reason}", file=sys.stderr)
        return 1
    if args.hosts < 2:
        parser.error(f"--hosts={args.hosts} must be >= 2: a network needs two ends")
    try:
        bed = testbed.up(args.hosts, args.bandwidth, args.latency)
    except ValueError as err:
        parser.error(str(err))
    print(f"up: {bed.describe()}")
    if not args.no_probe:
        from .bench.train import describe_probe

        print(describe_probe(testbed.probe(bed), bed))
    print("run `gradsync bench train --testbed ...` on it; `gradsync testbed down` removes it")
    return 0
