"""Command line: `gradsync list | demo` (python -m gradsync works the same)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from . import compress

# Bits per element are quoted for a tensor of this many fp32 elements (4 MiB).
_LIST_NUMEL = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="every compressor with its flags and bits per element")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    demo = commands.add_parser("demo", help="train a small model with 2 ranks: plain DDP vs gradsync")
    demo.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list(args.json)
    if args.steps < 20:
        parser.error(f"--steps={args.steps} is too short: warm-up alone takes 10 steps; use >= 20")
    from .demo import main as demo_main  # imports torch.multiprocessing only when needed

    return demo_main(steps=args.steps)


def describe(name: str) -> dict[str, object]:
    """What `gradsync list` shows for one registered compressor."""
    cls = compress.lookup(name)
    codec = compress.build(name)
    exchange = "allreduce" if cls.summable else "allgather"
    if cls.rounds > 1:
        exchange = f"allreduce x{cls.rounds}"
    return {
        "name": name,
        "summable": cls.summable,
        "unbiased": cls.unbiased,
        "exchange": exchange,
        "bits_per_element": 8 * codec.payload_bytes(_LIST_NUMEL) / _LIST_NUMEL,
        "parameters": {k: v for k, v in compress.parameters(name).items() if k != "seed"},
        "summary": (cls.__doc__ or "").strip().splitlines()[0],
    }


def _list(as_json: bool) -> int:
    rows = [describe(name) for name in compress.names()]
    if as_json:
        print(json.dumps(rows, indent=2, default=repr))
        return 0
    print(f"{'name':<10} {'summable':<9} {'unbiased':<9} {'exchange':<13} {'bits/elem':>9}  parameters")
    for r in rows:
        params = ", ".join(f"{k}={v!r}" for k, v in r["parameters"].items()) or "-"
        print(
            f"{r['name']:<10} {r['summable']!s:<9} {r['unbiased']!s:<9} {r['exchange']:<13} "
            f"{r['bits_per_element']:>9.3f}  {params}"
        )
    print(f"\nbits/elem: payload bits per element of a {_LIST_NUMEL:,}-element fp32 tensor (fp32 = 32).")
    return 0
