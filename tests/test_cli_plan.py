"""`gradsync plan`: for a simulated cluster (fast), and measured on real ranks (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync import cli, tuner
from gradsync.config import SyncConfig
from gradsync.plan import Plan
from gradsync.sim import cluster, compute, engine, groups, models


def test_a_simulated_plan_is_written_covers_every_gradient_and_predicts_what_the_engine_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "resnet50", "--nodes", "2", "--gpus-per-node", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    plan = Plan.load(out)
    assert plan.describe() in printed.out and plan.model == "sim:resnet50" and plan.world_size == 4
    where = cluster.cluster(2, 2, "v100", "25gbit")
    work = compute.from_model(models.build("resnet50"), where.device)
    grouping = [list(g.params) for g in plan.groups]  # gradient indices, for a simulated model
    assert sorted(i for g in grouping for i in g) == list(range(len(work.gradients)))
    buckets = {(b[0], b[-1]) for b in groups.ddp(work.numels)}
    copied = [(g[0], g[-1]) not in buckets for g in grouping]
    predicted = engine.simulate(work, where, plan.strategies, grouping, copied=copied).step_s
    assert plan.predicted_step_s == pytest.approx(predicted, rel=1e-12)
    assert all(g.reason for g in plan.groups)
    assert "searched" in printed.err and f"wrote {out}" in printed.err


def test_no_compressor_plans_only_fp32_and_the_casts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "lstm", "--nodes", "2", "--compressor", "none", "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert {s.codec for s in plan.strategies} <= {"none", "fp16", "bf16"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "alexnet"], "alexnet"),
        (["--model", "resnet50", "--compressor", "zip"], "zip"),
        (["--model", "resnet50", "--nodes", "0"], "nodes=0"),
        (["--model", "resnet50", "--max-groups", "0"], "--max-groups 0"),
        (["--model", "resnet50", "--workload", "gpt-tiny"], "not allowed with argument"),
    ],
)
def test_bad_input_is_refused_with_the_value_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *argv])
    assert exit_info.value.code != 0
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_measured_plan_reports_its_predicted_and_measured_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    steps = tuner.warmup_steps(SyncConfig(plan="auto")) + 3  # planning, then the least a run takes
    argv = ["plan", "--workload", "mlp-wide", "--world", "2", "--steps", str(steps), "--out", str(out)]
    assert cli.main(argv) == 0
    plan = Plan.load(out)
    assert plan.world_size == 2 and plan.predicted_step_s and plan.measured_step_s
    err = capsys.readouterr().err
    assert "predicted step" in err and "measured" in err


def test_shaping_options_given_to_a_measured_plan_without_a_testbed_are_named_as_having_no_effect() -> None:
    # Without --testbed the ranks run on loopback: --bandwidth 100mbit would silently shape nothing.
    import argparse

    from gradsync.cli import plan as plan_cli

    parser = plan_cli.add_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(["--workload", "gpt-tiny", "--bandwidth", "100mbit", "--latency", "5ms"])
    notes = plan_cli._unused_plan_options(args, parser)
    assert "--bandwidth has no effect without --testbed: the ranks run on loopback" in notes
    assert "--latency has no effect without --testbed: the ranks run on loopback" in notes
    args = parser.parse_args(["--workload", "gpt-tiny", "--testbed", "--bandwidth", "100mbit"])
    assert plan_cli._unused_plan_options(args, parser) == []
