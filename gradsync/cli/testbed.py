"""`gradsync testbed up|down|status`: the emulated network."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .. import testbed

    if args.action == "down":
        try:
            removed = testbed.down()
        except testbed.TestbedError as err:
            return _failed(err)
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
    except testbed.TestbedError as err:
        return _failed(err)
    print(f"up: {bed.describe()}")
    if not args.no_probe:
        from ..bench.train import describe_probe

        try:
            print(describe_probe(testbed.probe(bed), bed))
        except testbed.TestbedError as err:
            _failed(err)  # the testbed stays up: it was built, only its measurement failed
            print("the testbed is up, unmeasured; `gradsync testbed down` removes it", file=sys.stderr)
            return 1
    print("run `gradsync bench train --testbed ...` on it; `gradsync testbed down` removes it")
    return 0


def _failed(err: Exception) -> int:
    print(f"gradsync: error: {err}", file=sys.stderr)
    return 1
