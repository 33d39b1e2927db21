"""The training benchmark's pure parts: strategies, options, statistics, reports, supervision."""

from __future__ import annotations

import io
import json
import statistics
import sys
from pathlib import Path

import pytest

import gradsync
from gradsync.bench import report, strategies, train
from gradsync.bench.progress import ProgressBar

# -- strategies --------------------------------------------------------------------------------------


def test_baselines_parse_to_their_kinds():
    assert strategies.parse("ddp").kind == "ddp"
    assert strategies.parse("torch-fp16").kind == "torch-fp16"
    powersgd = strategies.parse("torch-powersgd:rank=4")
    warmup = gradsync.SyncConfig().warmup_steps  # torch's PowerSGD starts where gradsync compresses
    assert powersgd.kind == "torch-powersgd"
    assert powersgd.options == {"rank": 4, "min_rate": 2.0, "warmup": warmup}
    assert powersgd.warmup_steps == warmup and strategies.parse("topk").warmup_steps == warmup
    assert strategies.parse("torch-powersgd:warmup=10").warmup_steps == 10
    assert "rank 4" in powersgd.label


def test_a_named_compressor_runs_with_its_own_defaults_as_a_user_gets_them():
    topk = strategies.parse("topk")
    assert topk.kind == "gradsync"
    assert dict(topk.config.compressor_args) == {}  # no setting a user would not find
    assert topk.config.feedback_name == "ef"
    assert "ef" in topk.label
    assert strategies.parse("auto").config.compressor == gradsync.SyncConfig().compressor


def test_diloco_takes_its_options_and_the_outer_gradients_codec():
    s = strategies.parse("diloco:sync_every=20:fragments=2:delay=1:compressor=int4:block_size=64")
    assert s.kind == "diloco" and not s.wraps_in_ddp and s.warmup_steps == 0
    assert s.options == {
        "sync_every": 20,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "fragments": 2,
        "delay": 1,
        "alpha": 0.0,
    }
    assert s.config.compressor == "int4" and dict(s.config.compressor_args) == {"block_size": 64}
    assert s.label == "gradsync DiLoCo H=20, 2 fragments, delay 1 (int4 block_size=64)"
    assert strategies.parse("diloco:outer_lr=1:outer_momentum=0").label == "gradsync Local SGD H=100 (fp32)"


def test_fsdp_is_fsdps_own_reduce_scatter_or_gradsyncs_with_a_codec():
    plain = strategies.parse("fsdp")
    assert plain.kind == "fsdp" and not plain.wraps_in_ddp and plain.config is None
    assert plain.is_reference and plain.label == "FSDP2 fp32 (no hook)"
    s = strategies.parse("fsdp:compressor=int4:warmup=3")
    assert not s.is_reference and s.config.compressor == "int4" and s.warmup_steps == 3
    assert s.label == "gradsync FSDP2 int4 + ef"
    assert strategies.parse("ddp").is_reference and not strategies.parse("int4").is_reference


def test_gradsync_options_reach_the_config():
    s = strategies.parse("qsgd:levels=4:ef=ef:warmup=5")
    assert s.config.compressor_args["levels"] == 4
    assert s.config.error_feedback == "ef" and s.config.warmup_steps == 5


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("nope", ["unknown strategy 'nope'", "ddp", "topk"]),
        ("ddp:x=1", ["takes no options"]),
        ("torch-powersgd:rank=0", ["rank=0", ">= 1"]),
        ("torch-powersgd:foo=1", ["unknown option", "rank"]),
        ("torch-powersgd:warmup=1", ["warmup=1", ">= 2"]),
        ("topk:ratio", ["not key=value"]),
        ("topk:ratio=2", ["ratio"]),
        ("diloco:sync_every=4:delay=4", ["delay=4", "[0, 3]"]),
        ("diloco:compressor=nope", ["nope"]),
        ("fsdp:compressor=topk", ["fsdp:compressor=topk", "fp16, bf16, int8 or int4"]),
    ],
)
def test_bad_strategies_are_refused_with_the_reason(text, words):
    with pytest.raises(ValueError) as err:
        strategies.parse(text)
    for word in words:
        assert word in str(err.value)


def test_strategy_lists_refuse_duplicates_and_emptiness():
    assert [s.kind for s in strategies.parse_list("ddp, topk")] == ["ddp", "gradsync"]
    with pytest.raises(ValueError, match="twice"):
        strategies.parse_list("ddp,ddp")
    with pytest.raises(ValueError, match="no strategy"):
        strategies.parse_list(" , ")


# -- options -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"world_size": 0}, ["world_size=0", ">= 1"]),
        ({"steps": 4}, ["steps=4", "warm-up"]),  # steady from step 3: after the warm-up of 2
        ({"tolerance": 1.5}, ["tolerance=1.5"]),
        ({"strategies": ("ddp", "ddp")}, ["twice"]),
        ({"strategies": ("ddp", "bogus")}, ["bogus"]),
        ({"workload": "resnet-9000"}, ["resnet-9000", "gpt-tiny"]),
    ],
)
def test_bad_options_are_refused(kwargs, words):
    with pytest.raises(ValueError) as err:
        train.BenchOptions(**kwargs)
    for word in words:
        assert word in str(err.value)


# -- statistics --------------------------------------------------------------------------------------


# A strategy whose warm-up is pinned at 10 steps: its first 11 steps are not counted.
TOPK = "topk:warmup=10"


def _raw(strategy: str, step_s: float, losses: list[float], compression: float | None = None) -> dict:
    steps = 20
    evals = [{"step": 5 * i, "wall_s": 5 * i * step_s, "loss": loss} for i, loss in enumerate(losses)]
    return {
        "strategy": strategy,
        "label": strategies.parse(strategy).label,
        "params": 1000,
        "samples_per_step": 64,
        "step_s": [10.0] * 11 + [step_s] * (steps - 11),  # slow warm-up steps must not count
        "sent_nbytes": [4000] * 11 + [400] * (steps - 11),
        "compression_s": [compression] * steps,
        "wire_bytes_per_step": None,
        "compute_s": [0.1, 0.1, 0.1],
        "evals": evals,
    }


def test_summary_counts_steady_steps_and_finds_time_to_target():
    options = train.BenchOptions(strategies=("ddp", TOPK), steps=20, tolerance=0.02)
    raw = [_raw("ddp", 1.0, [3.0, 2.0, 1.5, 1.2, 1.0]), _raw(TOPK, 0.25, [3.0, 2.1, 1.6, 1.02, 1.01], 0.05)]
    doc = train.summarize(raw, {"workload": "mlp-wide"}, options)
    ddp, topk = doc["runs"]
    assert doc["meta"]["target_loss"] == pytest.approx(1.0 * 1.02)
    assert ddp["step_median_s"] == 1.0 and topk["step_median_s"] == 0.25
    assert topk["step_speedup"] == pytest.approx(4.0)
    assert topk["samples_per_s"] == pytest.approx(64 / 0.25)
    assert topk["bytes_per_step"] == 400
    # DDP first reaches 1.02 at its last evaluation (step 20); top-k at step 15 (loss 1.02).
    assert ddp["time_to_target_s"] == pytest.approx(20.0) and ddp["steps_to_target"] == 20
    assert topk["time_to_target_s"] == pytest.approx(15 * 0.25) and topk["steps_to_target"] == 15
    assert topk["time_to_target_speedup"] == pytest.approx(20.0 / 3.75)
    # compute + compression + communication add up to the median step.
    parts = topk["breakdown_s"]
    assert parts["compute"] + parts["compression"] + parts["communication"] == pytest.approx(0.25)
    assert ddp["breakdown_s"]["compression"] is None


def test_the_reference_curve_reports_its_noise_and_its_fall_over_the_last_quarter():
    options = train.BenchOptions(strategies=("ddp",), steps=20)
    raw = _raw("ddp", 1.0, [3.0, 2.0, 1.5, 1.25, 1.0])
    raw["evals"][-1]["loss_se"] = 0.01
    curve = train.summarize([raw], {}, options)["meta"]["reference_curve"]
    # Step 15 (at 75% of 20) had 1.25; the final 1.0: a fall of 25%.
    assert curve == {"final_loss": 1.0, "final_se": 0.01, "last_quarter_fall": pytest.approx(0.25)}


def test_paired_difference_is_the_mean_and_standard_error_of_per_prediction_differences():
    reference = [1.0, 2.0, 3.0, 2.0]
    losses = [1.5, 2.0, 3.5, 2.2]  # differences 0.5, 0, 0.5, 0.2: mean 0.3 over a mean loss of 2
    difference, se = train.paired_difference(losses, reference)
    assert difference == pytest.approx(0.3 / 2.0)
    assert se == pytest.approx(statistics.stdev([0.5, 0.0, 0.5, 0.2]) / 2 / 2.0)
    # Pairing: a model worse by the same amount on every prediction is known exactly, however
    # much the predictions themselves differ.
    assert train.paired_difference([x + 0.1 for x in reference], reference) == pytest.approx((0.05, 0.0))
    assert train.paired_difference(losses, reference[:3]) is None  # not the same predictions
    assert train.paired_difference(None, reference) is None
    assert train.paired_difference([1.0, float("nan"), 3.0, 2.0], reference) is None  # a diverged run
    assert train.paired_difference(losses, [0.0] * 4) is None  # no loss to be relative to


def test_summary_compares_each_final_loss_with_the_references_over_the_same_predictions():
    options = train.BenchOptions(strategies=("ddp", "topk"), steps=20)
    ddp, topk = _raw("ddp", 1.0, [3.0, 2.0, 1.0]), _raw("topk", 0.25, [3.0, 2.0, 1.1])
    ddp["final_prediction_losses"], topk["final_prediction_losses"] = [0.5, 1.5, 1.0], [0.6, 1.6, 1.1]
    runs = train.summarize([ddp, topk], {}, options)["runs"]
    assert runs[1]["final_vs_reference"] == pytest.approx(0.1)
    assert runs[1]["final_vs_reference_se"] == pytest.approx(0.0, abs=1e-12)
    assert runs[0]["final_vs_reference"] is None  # the reference itself
    # The per-prediction losses are used, not published.
    assert all("final_prediction_losses" not in run for run in runs)
    text = report.table({"meta": _document()["meta"], "runs": runs})
    assert "| final vs DDP |" in text and "+10.0% ± 0.00" in text
    # A standard error of 0 (every prediction 0.1 worse) gives no tolerance "in errors" to print.
    assert "Final vs DDP" not in text


def test_the_caption_states_the_tolerance_in_the_largest_paired_standard_error():
    document = _document()
    document["runs"][1]["final_vs_reference"], document["runs"][1]["final_vs_reference_se"] = 0.01, 0.004
    caption = report.conditions(document)
    assert "the largest here is 0.40%, so the tolerance is at least 5.0 of them" in caption
    document["runs"][1]["final_vs_reference_se"] = float("nan")  # a diverged run says nothing
    assert "Final vs DDP" not in report.conditions(document)


def test_documents_measured_before_the_paired_comparison_render_as_they_were():
    text = report.table(_document())  # no run has final_vs_reference
    header = text.splitlines()[0]
    assert "final vs" not in header and header.count("|") == 12


def test_a_schedule_longer_than_the_runs_is_stated():
    document = _document()
    assert "schedule spans" not in report.conditions(document)
    document["meta"]["schedule_steps"] = 60  # until_flat stopped the runs at 20
    assert "20 steps (its learning-rate schedule spans 60)" in report.conditions(document)


def test_the_caption_names_the_allocator_settings_the_runs_inherited():
    document = _document()
    assert "Every run had" not in report.conditions(document)  # glibc's defaults, or an old document
    document["meta"]["allocator_env"] = {"MALLOC_MMAP_THRESHOLD_": "1000000000"}
    assert report.conditions(document).endswith(" Every run had MALLOC_MMAP_THRESHOLD_=1000000000.")


def test_a_run_that_never_reaches_the_target_has_no_time_to_target():
    options = train.BenchOptions(strategies=("ddp", "signsgd"), steps=20)
    raw = [_raw("ddp", 1.0, [3.0, 2.0, 1.0]), _raw("signsgd", 0.5, [3.0, 2.5, 2.0])]
    signsgd = train.summarize(raw, {}, options)["runs"][1]
    assert signsgd["time_to_target_s"] is None and signsgd["time_to_target_speedup"] is None


def test_without_ddp_there_is_no_target():
    options = train.BenchOptions(strategies=("topk",), steps=20)
    doc = train.summarize([_raw("topk", 0.5, [3.0, 2.0])], {}, options)
    assert doc["meta"]["target_loss"] is None and "step_speedup" not in doc["runs"][0]


def test_p90_is_the_ninetieth_percentile_of_steady_steps():
    options = train.BenchOptions(strategies=("ddp", TOPK), steps=31)
    raw = _raw("ddp", 1.0, [2.0, 1.0])
    raw["step_s"] = [9.0] * 11 + [float(i) for i in range(1, 21)]
    raw["sent_nbytes"] = [1] * 31
    raw["compression_s"] = [None] * 31
    run = train.summarize([raw], {}, options)["runs"][0]
    assert run["step_median_s"] == statistics.median(range(1, 21))
    assert run["step_p90_s"] == 19.0


# -- reports -----------------------------------------------------------------------------------------


def _document() -> dict:
    options = train.BenchOptions(workload="mlp-wide", strategies=("ddp", "topk"), steps=20)
    raw = [_raw("ddp", 1.0, [3.0, 2.0, 1.0]), _raw("topk", 0.25, [3.0, 2.0, 1.01], 0.05)]
    meta = {
        "workload": "mlp-wide",
        "workload_description": "mlp-wide: 1,000 parameters",
        "options": {"world_size": 2, "steps": 20, "threads": 1},
        "network": {"kind": "loopback", "description": "loopback"},
        "machine": {"cores": 2},
    }
    return train.summarize(raw, meta, options)


def test_table_has_a_row_per_strategy_with_its_numbers():
    text = report.table(_document())
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 3  # header + 2 strategies
    assert "DDP fp32" in rows[1] and "1.000" in rows[1] and "1.00x" in rows[1]
    assert "gradsync topk" in rows[2] and "0.250" in rows[2] and "4.00x" in rows[2]
    assert "Target: DDP's final eval loss" in text


def test_write_produces_json_markdown_and_two_pngs(tmp_path: Path):
    pytest.importorskip("matplotlib")
    paths = report.write(_document(), tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == ["metric-vs-time.png", "results.json", "results.md", "step-breakdown.png"]
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["strategy"] for r in document["runs"]] == ["ddp", "topk"]
    for png in ("metric-vs-time.png", "step-breakdown.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_logs_a_line_per_tenth_off_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(100, "ddp", stream=stream)
    for done in range(1, 101):
        bar.update(done, f"step {done}")
    lines = stream.getvalue().splitlines()
    # The first update, then one per tenth done.
    assert [line.split("] ")[1].split("/")[0] for line in lines] == [
        "1",
        *(str(10 * i) for i in range(1, 11)),
    ]
    assert lines[-1].startswith("ddp") and lines[-1].endswith("step 100")


# -- supervision of the rank processes ---------------------------------------------------------------


def _script_ranks(tmp_path: Path, scripts: list[str]):
    logs = [tmp_path / f"rank{r}.log" for r in range(len(scripts))]
    argv_for = {r: [sys.executable, "-c", code] for r, code in enumerate(scripts)}

    class ScriptNetwork(train.Network):
        def command(self, rank, argv):
            return argv_for[rank]

    return ScriptNetwork("loopback", "test"), logs


def test_a_failing_rank_raises_with_its_log_and_no_process_survives(tmp_path: Path):
    network, logs = _script_ranks(
        tmp_path,
        [
            "import time; time.sleep(60)",
            "import sys; print('boom: bad things', file=sys.stderr); sys.exit(3)",
        ],
    )
    with pytest.raises(train.BenchError) as err, train.launch_ranks(network, [], 2, 12345, logs) as procs:
        train.follow_ranks(procs, logs, timeout_s=30, bar=None, name="test")
    assert "rank(s) [1]" in str(err.value) and "boom: bad things" in str(err.value)
    assert all(p.poll() is not None for p in procs)  # the sleeping rank was killed too


def test_a_run_past_its_timeout_is_stopped(tmp_path: Path):
    network, logs = _script_ranks(tmp_path, ["import time; time.sleep(60)"])
    with (
        pytest.raises(train.BenchError, match="timeout"),
        train.launch_ranks(network, [], 1, 12345, logs) as procs,
    ):
        train.follow_ranks(procs, logs, timeout_s=1, bar=None, name="test")
    assert procs[0].poll() is not None


# -- command line ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--strategies", "ddp,nope"], ["unknown strategy 'nope'"]),
        (["--world", "0"], ["world_size=0"]),
        (["--option", "width"], ["not KEY=VALUE"]),
        (["--option", "wdith=3"], ["wdith"]),
        (["--workload", "resnet"], ["resnet", "mlp-wide"]),
    ],
)
def test_bench_train_refuses_bad_arguments_before_starting_anything(argv, words, capsys):
    from gradsync.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "train", "--workload", "mlp-wide", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_a_failed_run_ends_with_its_message_and_exit_code_1(monkeypatch, capsys):
    from gradsync.bench import report

    def fail(options, network, progress=True):
        raise train.BenchError("strategy 'ddp': rank(s) [1] exited with code(s) [3]\nboom")

    monkeypatch.setattr(train, "run", fail)
    options = train.BenchOptions(workload="mlp-wide", strategies=("ddp",), steps=20)
    start = lambda network: train.run(options, network)  # noqa: E731
    code = train.run_and_report(
        start, 2, False, "1gbit", "0.2ms", False, report.table, report.write, "unused"
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "gradsync: error: strategy 'ddp'" in err and "boom" in err


def test_a_bench_asked_for_a_testbed_that_cannot_be_built_fails_and_the_demo_falls_back(monkeypatch, capsys):
    # `make bench-runtime` writes --testbed results into docs/bench-runtime/1gbit: loopback numbers
    # must never land there because the machine could not build the emulated network.
    monkeypatch.setattr(train.testbed, "available", lambda: "the testbed needs root (euid is 1000)")
    ran: list[str] = []

    def start(network):
        ran.append(network.description)
        return {}

    code = train.run_and_report(start, 4, True, "1gbit", "0.2ms", False, str, lambda d, o: [], "unused")
    err = capsys.readouterr().err
    assert code == 1 and ran == []
    assert "needs root (euid is 1000)" in err and "leave out --testbed" in err
    code = train.run_and_report(start, 4, True, "1gbit", "0.2ms", False, str, lambda d, o: [], "unused", True)
    assert code == 0 and len(ran) == 1 and "loopback" in ran[0]
    assert "running on loopback instead" in capsys.readouterr().err


def test_the_headline_says_how_much_sooner_each_run_reached_ddps_loss_or_that_it_did_not():
    options = train.BenchOptions(strategies=("ddp", "topk", "signsgd"), steps=20)
    raw = [
        _raw("ddp", 1.0, [3.0, 2.0, 1.0]),
        _raw("topk", 0.25, [3.0, 2.0, 1.01], 0.05),
        _raw("signsgd", 0.5, [3.0, 2.5, 2.0]),
    ]
    document = train.summarize(raw, {}, options)
    assert document["meta"]["reference"] == "ddp"
    topk, signsgd = report.headline(document).splitlines()
    # DDP reaches its own final loss at step 10 (10 s); top-k at step 10 too, at 0.25 s a step.
    assert "after 2.5 s" in topk and "DDP's 10.0 s" in topk and "4.00x sooner" in topk
    assert "did not reach" in signsgd and "2.0000" in signsgd
    assert report.headline(train.summarize(raw[1:], {}, options)) == "No DDP run, so no time to DDP's loss."


def test_a_run_that_starts_within_the_tolerance_of_ddps_end_reaches_it_only_after_training():
    # DDP barely learned (its end is within 2% of the shared start): the step-0 evaluation does
    # not count as reaching it, and the headline still reads.
    options = train.BenchOptions(strategies=("ddp", "topk"), steps=20)
    raw = [_raw("ddp", 1.0, [1.0, 1.01, 0.995]), _raw("topk", 0.25, [1.0, 0.99, 0.99], 0.05)]
    document = train.summarize(raw, {}, options)
    ddp, topk = document["runs"]
    assert ddp["steps_to_target"] == 5 and topk["steps_to_target"] == 5
    assert topk["time_to_target_speedup"] == pytest.approx(5.0 / 1.25)
    assert "4.00x sooner" in report.headline(document)


@pytest.mark.parametrize("argv", [["bench", "train"], ["bench", "sparse"], ["demo", "--loopback"]])
def test_without_matplotlib_a_plotting_command_stops_before_measuring(argv, monkeypatch, capsys):
    import importlib.util

    from gradsync.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    monkeypatch.setattr(train, "run", lambda *a, **k: pytest.fail("trained without a way to plot"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "matplotlib, which is not installed" in capsys.readouterr().err


def test_version_names_gradsync_and_torch(capsys):
    from gradsync.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"gradsync {gradsync.__version__} ") and "torch" in out


def test_the_last_quarters_fall_needs_four_evaluations_after_the_first():
    evals = [{"step": 10 * i, "loss": loss} for i, loss in enumerate([4.0, 3.0, 2.0, 1.1, 1.0])]
    assert train.last_quarter_fall(evals) == pytest.approx(0.1)  # step 30: 1.1, step 40: 1.0
    assert train.last_quarter_fall(evals[:4]) is None


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"until_flat": 0.0}, ["until_flat=0.0", "(0, 1)"]),
        ({"until_flat": 0.02, "strategies": ("topk",)}, ["add ddp"]),
    ],
)
def test_until_flat_is_checked(kwargs, words):
    with pytest.raises(ValueError) as err:
        train.BenchOptions(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_the_caption_names_the_machine_the_runs_measured_as_its_document_recorded_it():
    document = _document()
    document["meta"]["machine"] = {"cores": 2, "cpu": "x86_64"}  # an old document: no model, no speeds
    assert "on 2 cores (x86_64). " in report.conditions(document)
    document["meta"]["machine"].update(
        cpu_model="Intel(R) Xeon(R) Processor", matmul_gflops_1_thread=107.6, copy_gbytes_per_s_1_thread=8.9
    )
    assert (
        "on 2 cores (Intel(R) Xeon(R) Processor, one thread 107.6 GFLOP/s matmul and 8.9 GB/s copy). "
        in report.conditions(document)
    )
