"""The demo (`make demo`): gpt-tiny on 4 ranks, plain DDP against gradsync's best configuration.

It is the training benchmark (bench/train.py) with the demo's settings: on an emulated 1 Gbit/s
network when this machine can build one (root, `ip` and `tc`), else on loopback with a warning.
Both runs use the same seeds, data order and optimizer; only the gradient exchange differs.
"""

from __future__ import annotations

import argparse
import sys

from .bench import report
from .bench.train import BenchOptions, run, run_and_report

# Plain DDP, and gradsync as a user writes it first (SyncConfig(): int4 with error feedback, by
# two-shot), the configuration we recommend: DDP's model quality at an eighth of its bytes.
STRATEGIES = ("ddp", "int4")
STEPS = 60
OUT = "runs/demo"


def options(steps: int = STEPS) -> BenchOptions:
    return BenchOptions(
        workload="gpt-tiny", world_size=4, strategies=STRATEGIES, steps=steps, eval_every=max(1, steps // 6)
    )


def main(
    steps: int | None = None, use_testbed: bool = True, parser: argparse.ArgumentParser | None = None
) -> int:
    try:
        demo = options(STEPS if steps is None else steps)
    except ValueError as err:
        if parser is None:
            raise
        parser.error(f"--steps: {err}")
    print(
        f"gradsync demo: {demo.workload}, {demo.world_size} ranks, {demo.steps} steps per run; "
        f"{' vs '.join(STRATEGIES)} with the same seeds and data order",
        file=sys.stderr,
    )
    return run_and_report(
        lambda network: run(demo, network),
        demo.world_size,
        use_testbed,
        "1gbit",
        "0.2ms",
        True,
        lambda document: report.table(document) + "\n" + report.headline(document),
        report.write,
        OUT,
        fallback=True,  # the demo runs anywhere: on loopback, with a warning, where no testbed can be built
    )
