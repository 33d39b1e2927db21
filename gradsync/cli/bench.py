"""`gradsync bench ...`: one parser and one runner per benchmark.

Over 400 lines because it holds one short parser + runner pair for each of ten benchmarks, listed
in one table (BENCHES) at the bottom; splitting the pairs into files would scatter that table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ..bench import kernels


def _add_bench_kernels(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    kernels_parser = benches.add_parser(
        "kernels",
        help="compress + decompress time of every compressor, and its encode alone, as ratios to a copy",
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
        "--device",
        default="cpu",
        help="where the tensor lives: cpu, or cuda for the current GPU (default cpu)",
    )
    kernels_parser.add_argument(
        "--json",
        default="docs/bench-kernels/results.json",
        help="where to write the results (default %(default)s)",
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
    try:
        kernels.timing_device(args.device)
    except ValueError as error:
        parser.error(f"--device: {error}")
    results = kernels.run(
        numel=args.numel,
        repeats=args.repeats,
        labels=args.only,
        threads=args.threads,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        device=args.device,
    )
    document = kernels.to_json(results, kernels.metadata(args.numel, args.threads, args.repeats, args.device))
    print(kernels.table(document))  # the table `gradsync bench tables` publishes from the file
    path = kernels.write_json(document, args.json)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _add_bench_train(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..bench.train import BenchOptions

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
        default="ddp,torch-fp16,torch-powersgd,int4,topk",
        help="comma-separated: ddp, torch-fp16, torch-powersgd[:rank=R], a gradsync compressor "
        "with options, e.g. topk:ratio=0.01, auto, or diloco:sync_every=H (default %(default)s)",
    )
    train.add_argument("--steps", type=int, default=defaults["steps"].default, help="steps per strategy")
    train.add_argument(
        "--until-flat",
        type=float,
        default=None,
        metavar="FRACTION",
        help="train DDP first, at most --steps, and stop it once its held-out loss fell less than "
        "FRACTION over its last quarter of steps (e.g. 0.02); every strategy then trains as many",
    )
    train.add_argument("--eval-every", type=int, default=defaults["eval_every"].default)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--tolerance", type=float, default=0.02, help="time-to-target tolerance on DDP's final loss (0.02)"
    )
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    train.add_argument("--timeout", type=float, default=1800, help="seconds per strategy before giving up")
    add_network_options(train, train)
    train.add_argument("--out", default="runs/bench-train", help="output folder (default %(default)s)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    return train


def add_network_options(parser: argparse.ArgumentParser, testbed_group: Any) -> None:
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


def given(args: argparse.Namespace, parser: argparse.ArgumentParser, dests: Sequence[str]) -> list[str]:
    """The options (as --flags) among `dests` given a value other than their default: those to
    name as having no effect where the way chosen does not read them."""
    changed = [dest for dest in dests if getattr(args, dest) != parser.get_default(dest)]
    return [f"--{dest.replace('_', '-')}" for dest in changed]


def network_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[bool, str, str, bool]:
    """--testbed, --bandwidth, --latency and whether to probe; a warning for each testbed option
    given without --testbed (the ranks then run on loopback, which has no links to shape)."""
    if not args.testbed:
        for flag in given(args, parser, ("bandwidth", "latency", "no_probe")):
            print(
                f"gradsync bench: warning: {flag} has no effect without --testbed: the ranks run on loopback",
                file=sys.stderr,
            )
    return args.testbed, args.bandwidth, args.latency, not args.no_probe


def _bench_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..bench import report, train

    try:
        workload_options = dict(key_value(item) for item in args.option)
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
            until_flat=args.until_flat,
        )
        from .. import workloads

        workloads.build(options.workload, seed=options.seed, **workload_options)  # bad options fail here
    except (KeyError, TypeError, ValueError) as err:
        parser.error(str(err).strip("'\""))
    return train.run_and_report(
        lambda network: train.run(options, network, progress=not args.no_progress),
        options.world_size,
        *network_of(args, parser),
        report.table,
        report.write,
        args.out,
    )


def _add_bench_sparse(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..bench.sparse import SCHEMES, SparseBenchOptions

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
    add_network_options(sparse, where)
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
    from .. import testbed
    from ..bench import sparse, train

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
    return train.run_and_report(
        lambda network: sparse.run(options, network, _say),
        options.hosts,
        *network_of(args, parser),
        sparse.table,
        sparse.write,
        args.out,
    )


def _add_bench_script(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..bench.script import SYNCS, ScriptOptions

    defaults = ScriptOptions.__dataclass_fields__
    script = benches.add_parser(
        "script",
        help="a user's own DDP script, once per way of averaging gradients (the runtime benchmark)",
        description="Runs a training script as a user would (examples/train.py: plain DDP with one "
        "line for a torch hook or for gradsync) once per --sync way, one process per rank, and "
        "compares their step times. Writes results.json and results.md.",
    )
    script.add_argument(
        "--script", default=defaults["script"].default, help="the script (default %(default)s)"
    )
    script.add_argument("--syncs", default=",".join(SYNCS), help="comma-separated ways (default all)")
    script.add_argument("--world", type=int, default=defaults["world_size"].default, help="ranks (default 4)")
    script.add_argument("--steps", type=int, default=defaults["steps"].default, help="steps per run (60)")
    script.add_argument("--repeats", type=int, default=1, help="rounds of every way in turn (default 1)")
    where = script.add_mutually_exclusive_group()
    where.add_argument("--loopback", action="store_true", help="all ranks on loopback (the default)")
    add_network_options(script, where)
    script.add_argument("--out", default="runs/bench-script", help="output directory (default %(default)s)")
    return script


def _bench_script(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..bench import script, train

    try:
        options = script.ScriptOptions(
            script=args.script,
            syncs=tuple(_comma_list(args.syncs)),
            world_size=args.world,
            steps=args.steps,
            repeats=args.repeats,
        )
    except ValueError as err:
        parser.error(str(err))
    return train.run_and_report(
        lambda network: script.run(options, network, _say),
        options.world_size,
        *network_of(args, parser),
        script.table,
        script.write,
        args.out,
    )


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
    from ..bench import simulator

    document = simulator.run(simulator.SimBenchOptions())
    print(simulator.table(document))
    for path in simulator.write(document, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _add_bench_fidelity(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..bench.fidelity import FidelityOptions

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
    from .. import testbed
    from ..bench import fidelity, train

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
    from ..bench import planning

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    document = planning.run(planning.QUICK if args.quick else planning.Options(), say)
    command = "python -m gradsync bench plan" + (" --quick" if args.quick else "") + f" --out {args.out}"
    print(planning.table(document))
    for path in planning.write(document, args.out, command):
        say(f"wrote {path}")
    return 0


def key_value(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--option {item!r} is not KEY=VALUE, e.g. --option batch_size=8")
    from ..registry import parse_value

    return key, parse_value(value)


def _add_bench_seeds(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    seeds = benches.add_parser(
        "seeds",
        help="gather `bench train` runs made with other --seeds: each strategy's loss against DDP's by seed",
        description="Reads the results.json of `gradsync bench train` runs that differ only in --seed and "
        "writes, per strategy run under every seed, its final loss against DDP's of the same seed, the "
        "mean and range over seeds, and its time-to-target speed-up per seed (results.json, results.md).",
    )
    seeds.add_argument("results", nargs="+", help="results.json files of bench train, one per seed")
    seeds.add_argument("--out", default="runs/bench-seeds", help="output folder (default %(default)s)")
    return seeds


def _bench_seeds(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json
    from pathlib import Path

    from ..bench import report, seeds

    documents = []
    for path in args.results:
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            parser.error(f"{path}: {err}")
        try:
            seeds.check(document)
        except ValueError as err:
            parser.error(f"{path}: {err}")
        documents.append(document)
    try:
        document = seeds.gather(documents)
    except ValueError as err:
        parser.error(str(err))
    document["meta"] = {**report.provenance(), **document["meta"]}  # the gathering's commit and command
    print(seeds.table(document), flush=True)
    for path in report.write_results(document, args.out, seeds.table, lambda document, out: []):
        _say(f"wrote {path}")
    return 0


def _add_bench_tables(benches: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tables = benches.add_parser(
        "tables",
        help="rewrite the measured tables in README.md and docs/ from their results files",
        description="Every table between <!-- table RENDERER RESULTS.json --> and <!-- /table --> "
        "markers is rendered anew from its results file; --check only lists those that differ.",
    )
    tables.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    return tables


def _bench_tables(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..bench import tables

    if args.check:
        stale = [line for page in tables.pages() for line in tables.stale(page)]
        for line in stale:
            _say(line)
        return 1 if stale else 0
    for page in tables.pages():
        if tables.refresh(page):
            _say(f"rewrote the tables of {page.relative_to(tables.ROOT)}")
    return 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# Every benchmark: the function adding its parser, and the one running it.
BENCHES = {
    "kernels": (_add_bench_kernels, _bench_kernels),
    "train": (_add_bench_train, _bench_train),
    "sparse": (_add_bench_sparse, _bench_sparse),
    "sim": (_add_bench_sim, _bench_sim),
    "fidelity": (_add_bench_fidelity, _bench_fidelity),
    "plan": (_add_bench_plan, _bench_plan),
    "script": (_add_bench_script, _bench_script),
    "seeds": (_add_bench_seeds, _bench_seeds),
    "tables": (_add_bench_tables, _bench_tables),
}
