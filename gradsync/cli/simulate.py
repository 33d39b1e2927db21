"""`gradsync simulate`: a step of a model on a cluster, per strategy, from the simulator."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .bench import given
from .plan import SIMULATED_CLUSTER


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..sim import cluster, models

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
        "none:scheme=auto, dgc:on=cpu, diloco:sync_every=50:compressor=int4 (DiLoCo's mean inner "
        "step) ... (default none,fp16,topk:ratio=0.01)",
    )
    sim.add_argument(
        "--groups", default="ddp", help="ddp (25 MiB buckets), layerwise, single, or a number of equal groups"
    )
    sim.add_argument("--jitter", type=float, default=0.0, help="per-worker compute variation (e.g. 0.05)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--gantt", default="runs/simulate/gantt.png", help="timeline plot ('' for none)")
    sim.add_argument("--json", action="store_true", help="print the results as JSON")
    return sim


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:

    from ..sim import cluster, compute, engine, models, outer, report

    texts = [s.strip() for item in args.strategy or ["none,fp16,topk:ratio=0.01"] for s in item.split(",")]
    try:
        if args.profile:
            from ..profile import Profile

            for flag in given(args, parser, ("model", *SIMULATED_CLUSTER)):
                print(
                    f"gradsync simulate: warning: {flag} has no effect: --profile simulates the model "
                    "and cluster it measured",
                    file=sys.stderr,
                )
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
            outer.simulate(work, where, text)
            if outer.is_outer(text)
            else engine.simulate(work, where, text, grouping, args.jitter, args.seed)
            for text in texts
            if text
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
        from ..sim import gantt

        path = gantt.draw(results, args.gantt, f"{work.name}, {where.describe()}")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _grouping(text: str, numels: list[int]) -> list[list[int]]:
    from ..sim import groups

    if text == "ddp":
        return groups.ddp(numels)
    if text == "layerwise":
        return groups.layerwise(len(numels))
    if text == "single":
        return groups.single(len(numels))
    if text.isdigit() and int(text) >= 1:
        return groups.equal(numels, int(text))
    raise ValueError(f"--groups {text!r} must be ddp, layerwise, single or a number of groups >= 1")
