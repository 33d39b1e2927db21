"""`gradsync simulate` and `gradsync bench sim`: what they print and write, and their errors."""

from __future__ import annotations

import json

import pytest

from gradsync.bench import simulator
from gradsync.cli import main


def test_simulate_prints_each_strategy_and_writes_the_gantt(tmp_path, capsys):
    png = tmp_path / "gantt.png"
    code = main(
        [
            "simulate",
            "--model",
            "bert-base",
            "--nodes",
            "8",
            "--gpus-per-node",
            "8",
            "--inter",
            "25gbit",
            "--strategy",
            "none,fp16",
            "--strategy",
            "topk:ratio=0.01",
            "--gantt",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "109,482,240 parameters" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "strategy" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["none", "fp16", "topk:ratio=0.01"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_json_matches_the_table(capsys):
    assert (
        main(
            ["simulate", "--model", "resnet50", "--nodes", "2", "--strategy", "none", "--gantt", "", "--json"]
        )
        == 0
    )
    (result,) = json.loads(capsys.readouterr().out)
    assert result["world_size"] == 16
    assert result["step_s"] >= result["compute_s"]
    assert result["scaling"] == pytest.approx(result["compute_s"] / result["step_s"])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--model", "alexnet"], "unknown model 'alexnet'"),
        (["--strategy", "qsgd:collective=allreduce"], "cannot be summed"),
        (["--inter", "fast"], "not a rate"),
        (["--device", "tpu"], "unknown device"),
        (["--groups", "some"], "--groups 'some'"),
        (["--nodes", "0"], "nodes=0"),
        (["--profile", "/nonexistent/profile.json"], "profile.json"),
    ],
)
def test_simulate_refuses_bad_input_with_exit_code_2(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--gantt", "", *argv])
    assert exit_.value.code == 2
    assert match in capsys.readouterr().err


def test_options_a_profile_replaces_are_named_as_having_no_effect(capsys):
    with pytest.raises(SystemExit):  # the profile does not exist: only the warnings matter here
        main(["simulate", "--gantt", "", "--profile", "/nonexistent/profile.json", "--inter", "100gbit"])
    err = capsys.readouterr().err
    assert "--inter has no effect: --profile simulates the model and cluster it measured" in err
    assert "--nodes has no effect" not in err  # left at its default


def test_without_matplotlib_simulate_fails_before_simulating_and_names_the_fix(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--strategy", "none"])
    assert exit_.value.code == 2
    err = capsys.readouterr()
    assert "pip install 'gradsync[bench]', or pass --gantt ''" in err.err
    assert err.out == ""  # nothing simulated first


def test_bench_sim_tables_scale_and_predictions(tmp_path):
    options = simulator.SimBenchOptions(
        models=("resnet50", "bert-base"), scale_workers=(64,), strategies=("none", "fp16"), repeats=1
    )
    document = simulator.run(options)
    assert [(r["model"], r["grouping"]) for r in document["scale"]] == [
        ("resnet50", "ddp"),
        ("resnet50", "layerwise"),
        ("bert-base", "ddp"),
        ("bert-base", "layerwise"),
    ]
    assert [r["groups"] for r in document["scale"]][1::2] == [161, 199]  # one per tensor
    assert len(document["predictions"]) == 2 * 2 * 2 * 2  # models, precisions, networks, strategies
    text = simulator.table(document)
    assert "| bert-base | fp32 | 25gbit |" in text
    paths = simulator.write(document, tmp_path)
    assert {p.name for p in paths} == {"results.json", "results.md", "gantt-bert-base.png"}
