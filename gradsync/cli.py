"""Command line: `gradsync list | demo | bench kernels` (python -m gradsync works the same)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

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
    demo = commands.add_parser("demo", help="train a small model with 2 ranks: plain DDP vs gradsync")
    demo.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    bench = commands.add_parser("bench", help="benchmarks: kernels")
    benches = bench.add_subparsers(dest="bench", required=True)
    # One entry per benchmark, each with its own parser for its own errors.
    bench_parsers = {"kernels": _add_bench_kernels(benches)}
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list(args.json)
    if args.command == "bench":
        run_bench = {"kernels": _bench_kernels}[args.bench]
        return run_bench(args, bench_parsers[args.bench])
    if args.steps < 20:
        parser.error(f"--steps={args.steps} is too short: warm-up alone takes 10 steps; use >= 20")
    from .demo import main as demo_main  # imports torch.multiprocessing only when needed

    return demo_main(steps=args.steps)


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
