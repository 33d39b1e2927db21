"""Command line: `gradsync list | demo | simulate | bench kernels|train|sparse | testbed up|down|status`.

`python -m gradsync ...` works the same.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Sequence

import torch

from .. import __version__, compress
from ..config import SyncConfig
from ..strategy import default_collective
from . import plan, simulate, testbed
from .bench import BENCHES

COMMANDS = {"simulate": simulate, "plan": plan, "testbed": testbed}
# Benchmarks that draw plots once they have measured: without matplotlib they would train for
# minutes and then fail, so they check first.
_PLOTTING = ("train", "sparse", "sim", "fidelity")
# Bits per element are quoted for a tensor of this many fp32 elements (4 MiB).
_LIST_NUMEL = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"gradsync {__version__} (torch {torch.__version__})"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="every compressor with its flags and bits per element")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    demo = commands.add_parser(
        "demo", help="gpt-tiny on 4 ranks: plain DDP vs gradsync, on an emulated 1 Gbit/s network"
    )
    demo.add_argument("--steps", type=int, default=None, help="training steps per run (default: the demo's)")
    demo.add_argument("--loopback", action="store_true", help="skip the emulated network")
    bench = commands.add_parser("bench", help=f"benchmarks: {', '.join(BENCHES)}")
    benches = bench.add_subparsers(dest="bench", required=True)
    # One entry per benchmark, each with its own parser for its own errors.
    bench_parsers = {name: add(benches) for name, (add, _) in BENCHES.items()}
    # Each command's module adds its parser and runs it.
    parsers = {name: module.add_parser(commands) for name, module in COMMANDS.items()}
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list(args.json)
    if args.command in COMMANDS:
        if args.command == "simulate" and args.gantt and importlib.util.find_spec("matplotlib") is None:
            parsers["simulate"].error(
                "gradsync simulate draws its timelines (--gantt) with matplotlib, which is not "
                "installed: pip install 'gradsync[bench]', or pass --gantt '' for none"
            )
        return COMMANDS[args.command].run(args, parsers[args.command])
    if args.command == "bench":
        if args.bench in _PLOTTING:
            _require_matplotlib(bench_parsers[args.bench], f"bench {args.bench}")
        _, run_bench = BENCHES[args.bench]
        return run_bench(args, bench_parsers[args.bench])
    _require_matplotlib(demo, "demo")
    from ..demo import main as demo_main

    return demo_main(steps=args.steps, use_testbed=not args.loopback, parser=demo)


def _require_matplotlib(parser: argparse.ArgumentParser, what: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        parser.error(
            f"gradsync {what} draws its plots with matplotlib, which is not installed: "
            "pip install 'gradsync[bench]' (make installs it)"
        )


def describe(name: str) -> dict[str, object]:
    """What `gradsync list` shows for one registered compressor."""
    cls = compress.lookup(name)
    codec = compress.warmed_up(compress.build(name))
    collective = default_collective(name)
    if cls.majority_vote:
        collective = "allreduce (vote)"
    elif cls.rounds > 1:
        collective = f"allreduce x{cls.rounds}"
    return {
        "name": name,
        "summable": cls.summable,
        "unbiased": cls.unbiased,
        "collective": collective,
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
    columns = f"{'name':<10} {'summable':<9} {'unbiased':<9} {'collective':<17} {'feedback':<9}"
    print(f"{columns} {'bits/elem':>10}  parameters")
    for r in rows:
        params = ", ".join(f"{k}={v!r}" for k, v in r["parameters"].items()) or "-"
        bits = f"{r['bits_per_element']:.3f}" if r["fixed_size"] else f"<={r['bits_per_element']:.1f}"
        print(
            f"{r['name']:<10} {r['summable']!s:<9} {r['unbiased']!s:<9} {r['collective']:<17} "
            f"{r['auto_feedback']:<9} {bits:>10}  {params}"
        )
    print(
        f"\nbits/elem: payload bits per element of a {_LIST_NUMEL:,}-element fp32 tensor (fp32 = 32); "
        "<= marks a size that depends on the data.\nfeedback: what error_feedback='auto' picks. "
        "vote: majority vote, sign bits summed as small integers by one allreduce; x2: two rounds."
    )
    return 0
