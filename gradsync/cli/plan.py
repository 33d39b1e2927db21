"""`gradsync plan`: a plan for a simulated cluster, a measured profile, or measured on real ranks."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from .. import tuner
from ..config import SyncConfig
from .bench import add_network_options, given


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..sim import cluster, models

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
    planning = tuner.warmup_steps(SyncConfig(plan="auto"))
    measured.add_argument(
        "--steps",
        type=int,
        default=planning + 8,
        help=f"steps to train: planning takes at most the first {planning}",
    )
    measured.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    add_network_options(measured, measured)
    return plan


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`gradsync plan`: one function per mode; each returns the plan and what to say about it."""
    from ..registry import parse_spec

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
# The options of a simulated cluster, which a profile or a measured run replaces.
SIMULATED_CLUSTER = ("nodes", "gpus_per_node", "device", "inter", "intra", "precision", "batch")
_MEASURED_RUN = ("world", "steps", "threads", "testbed", "bandwidth", "latency", "no_probe")


def _unused_plan_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """A note for each option given a value that the chosen way of planning does not read."""
    notes = []
    if args.workload:
        ignored, why = (*SIMULATED_CLUSTER, "max_groups"), "--workload plans on the real ranks it trains"
        if not args.testbed:
            shaping = given(args, parser, ("bandwidth", "latency", "no_probe"))
            notes = [f"{flag} has no effect without --testbed: the ranks run on loopback" for flag in shaping]
    elif args.profile:
        ignored, why = SIMULATED_CLUSTER + _MEASURED_RUN, "--profile plans for the cluster it measured"
    else:
        ignored, why = _MEASURED_RUN, "these options are for --workload, which trains on real ranks"
    return [f"{flag} has no effect: {why}" for flag in given(args, parser, ignored)] + notes


def _plan_simulated(args: argparse.Namespace, name: str, codec_args: dict[str, Any]) -> tuple[Any, list[str]]:
    from .. import autoplan
    from ..sim import cluster, compute, models

    if args.profile:
        from ..profile import Profile

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
    from ..bench import train
    from ..plan import Plan
    from ..testbed import TestbedError

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
