"""A short real run of the training benchmark: every strategy trains with 2 gloo ranks on loopback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gradsync.bench import report, train

# A small mlp-wide (one bucket of 32k parameters, enough to be compressed), so the run takes seconds.
_SMALL = {"width": 160, "depth": 2, "features": 32, "classes": 10, "batch_size": 16, "eval_samples": 4096}


# The scheme is pinned: "auto" decides from timed rounds, and on a loaded machine it may send this
# small model's payload dense (one round instead of two), which the byte checks below would not expect.
# The warm-ups are pinned at 10 steps, so that the evaluations at steps 4 and 8 see fp32 training.
TOPK = "topk:ratio=0.1:sparse=agsparse:warmup=10"
POWERSGD = "torch-powersgd:warmup=10"
DILOCO = "diloco:sync_every=4"


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict:
    options = train.BenchOptions(
        workload="mlp-wide",
        workload_options=_SMALL,
        world_size=2,
        strategies=("ddp", "torch-fp16", POWERSGD, TOPK, DILOCO),
        steps=16,
        eval_every=4,
        probe_steps=2,
        timeout_s=240,
    )
    doc = train.run(options, train.loopback(), progress=False)
    doc["paths"] = [str(p) for p in report.write(doc, tmp_path_factory.mktemp("bench"))]
    return doc


def test_every_strategy_reports_its_measurements(document: dict):
    runs = {r["strategy"]: r for r in document["runs"]}
    assert list(runs) == ["ddp", "torch-fp16", POWERSGD, TOPK, DILOCO]
    for run in runs.values():
        assert len(run["step_s"]) == 16 and all(s > 0 for s in run["step_s"])
        assert [e["step"] for e in run["evals"]] == [0, 4, 8, 12, 16]
        walls = [e["wall_s"] for e in run["evals"]]
        assert walls == sorted(walls) and walls[-1] == pytest.approx(sum(run["step_s"]))
        assert run["step_p90_s"] >= run["step_median_s"] > 0
        assert run["final_loss"] == run["evals"][-1]["loss"]
        assert "final_prediction_losses" not in run  # every prediction's loss is compared, not published
        # mlp-wide's cosine schedule ran to its end: the last step's rate is the cosine at 15 / 16.
        assert run["lr_last"] == pytest.approx(0.01 * (1 + math.cos(math.pi * 15 / 16)) / 2)
    assert runs["ddp"]["step_speedup"] == 1.0
    # The paired comparison is over the 4,096 predictions of both final models: its mean
    # difference is the difference of the two final losses (up to float32 per prediction).
    ddp_final = runs["ddp"]["final_loss"]
    for strategy in ("torch-fp16", POWERSGD, TOPK, DILOCO):
        run = runs[strategy]
        assert run["final_vs_reference"] == pytest.approx(run["final_loss"] / ddp_final - 1, abs=1e-5)
        assert run["final_vs_reference_se"] > 0
    # Paired over the same predictions in the same order, fp16's small difference from DDP is
    # known far better than two independent held-out estimates would know it (misaligned
    # predictions would give about their combined error).
    fp16, ddp = runs["torch-fp16"], runs["ddp"]
    unpaired = math.hypot(fp16["evals"][-1]["loss_se"], ddp["evals"][-1]["loss_se"]) / ddp_final
    assert fp16["final_vs_reference_se"] < 0.5 * unpaired
    assert runs["ddp"]["final_vs_reference"] is None


def test_same_seeds_and_data_give_the_same_trajectory_until_compression_starts(document: dict):
    runs = {r["strategy"]: r for r in document["runs"]}
    start = runs["ddp"]["evals"][0]["loss"]
    assert all(r["evals"][0]["loss"] == start for r in runs.values())
    # gradsync and PowerSGD allreduce fp32 for their first 10 steps: the same training as DDP's
    # (up to the order of division and summation), visible at the evaluations of steps 4 and 8.
    for strategy in (POWERSGD, TOPK):
        for ddp_eval, other in zip(runs["ddp"]["evals"][1:3], runs[strategy]["evals"][1:3], strict=True):
            assert other["loss"] == pytest.approx(ddp_eval["loss"], rel=1e-5)
    # fp16 rounding shows from the first step on, but stays close.
    assert runs["torch-fp16"]["evals"][1]["loss"] == pytest.approx(runs["ddp"]["evals"][1]["loss"], rel=1e-2)


def test_bytes_per_step_follow_each_exchange(document: dict):
    runs = {r["strategy"]: r for r in document["runs"]}
    ddp = runs["ddp"]["bytes_per_step"]
    params = document["meta"]["params"]
    assert ddp == 2 * (2 - 1) * 4 * params // 2  # ring allreduce of fp32 with 2 ranks
    assert runs["torch-fp16"]["bytes_per_step"] == ddp // 2
    assert runs[POWERSGD]["bytes_per_step"] < ddp / 2
    assert runs[TOPK]["bytes_per_step"] < ddp / 2
    # DiLoCo sends DDP's fp32 allreduce once every 4 inner steps: after steps 4, 8, 12 and 16.
    steady = range(document["meta"]["steady_from"], 16)
    syncs = sum(1 for i in steady if (i + 1) % 4 == 0)
    assert runs[DILOCO]["bytes_per_step"] == pytest.approx(ddp * syncs / len(steady))
    # gradsync's own timing of its codec is part of the breakdown; torch's hooks have none.
    assert runs[TOPK]["breakdown_s"]["compression"] > 0
    assert runs["ddp"]["breakdown_s"]["compression"] is None


def test_results_are_written_as_json_markdown_and_plots(document: dict):
    names = sorted(Path(p).name for p in document["paths"])
    assert names == ["metric-vs-time.png", "results.json", "results.md", "step-breakdown.png"]
    written = json.loads(Path(next(p for p in document["paths"] if p.endswith(".json"))).read_text())
    assert written["meta"]["network"]["kind"] == "loopback"
    assert written["meta"]["target_loss"] == pytest.approx(runs_final(written, "ddp") * 1.02)


def runs_final(document: dict, strategy: str) -> float:
    return next(r["final_loss"] for r in document["runs"] if r["strategy"] == strategy)


@pytest.mark.slow  # a second benchmark run (~9 s): `make test-all`
def test_until_flat_stops_ddp_when_its_loss_is_flat_and_trains_every_strategy_as_long(tmp_path: Path):
    # A loose flatness (a fall under 90%) stops DDP at its first chance: 5 evaluations, and past
    # the warm-up; DDP trains first though named last, and the document keeps the order given.
    options = train.BenchOptions(
        workload="mlp-wide",
        workload_options=_SMALL,
        world_size=2,
        strategies=("fp16", "ddp"),
        steps=60,
        eval_every=4,
        probe_steps=1,
        timeout_s=240,
        until_flat=0.9,
    )
    document = train.run(options, train.loopback(), progress=False)
    fp16, ddp = document["runs"]
    assert (fp16["strategy"], ddp["strategy"]) == ("fp16", "ddp")
    assert len(ddp["step_s"]) == len(fp16["step_s"]) == document["meta"]["options"]["steps"] == 16
    assert document["meta"]["options"]["until_flat"] == 0.9
    # Both ran the schedule of the 60 steps asked for, stopped at step 16 of it.
    assert document["meta"]["schedule_steps"] == 60
    for run in (fp16, ddp):
        assert run["lr_last"] == pytest.approx(0.01 * (1 + math.cos(math.pi * 15 / 60)) / 2)


@pytest.mark.slow  # a third benchmark run (~10 s): `make test-all`
def test_fsdp_runs_are_measured_against_fsdps_own(tmp_path: Path):
    # No DDP run: FSDP2's own reduce-scatter is the reference. gradsync's runs its warm-up
    # uncompressed (FSDP's result exactly), then halves the bytes with bf16.
    options = train.BenchOptions(
        workload="mlp-wide",
        workload_options=_SMALL,
        world_size=2,
        strategies=("fsdp:compressor=bf16:warmup=4", "fsdp"),
        steps=16,
        eval_every=4,
        probe_steps=1,
        timeout_s=240,
    )
    document = train.run(options, train.loopback(), progress=False)
    bf16, fsdp = document["runs"]
    assert document["meta"]["reference"] == "fsdp" and fsdp["step_speedup"] == 1.0
    assert document["meta"]["target_loss"] == pytest.approx(fsdp["final_loss"] * 1.02)
    assert [e["loss"] for e in bf16["evals"][:2]] == [e["loss"] for e in fsdp["evals"][:2]]
    assert bf16["evals"][2]["loss"] != fsdp["evals"][2]["loss"]  # compressed from step 4 on
    params = document["meta"]["params"]
    assert fsdp["bytes_per_step"] == 4 * params // 2  # 2 ranks: half of the fp32 gradient each
    assert bf16["sent_nbytes"][4:] == [bf16["sent_nbytes"][4]] * 12
    # Only the 160 x 160 layer is over min_compress_numel here; it sends half its bytes.
    assert bf16["sent_nbytes"][4] < 0.7 * fsdp["sent_nbytes"][4]
    assert "FSDP2's held-out loss" in report.headline(document)


def test_gradsyncs_diloco_trains_as_torchfts_does(tmp_path: Path):
    # torchft's DiLoCo (its lighthouse, Managers and gloo process group) and gradsync's, fp32 outer
    # gradients, from the same weights on the same data: the same held-out losses at every
    # evaluation, for DiLoCo's outer Nesterov step and for Local SGD's plain average.
    pytest.importorskip("torchft", reason="the torchft extra: pip install -e '.[torchft]'")
    pairs = [("diloco:sync_every=5", "torchft-diloco:sync_every=5")]
    local = ":outer_lr=1:outer_momentum=0"
    pairs.append((pairs[0][0] + local, pairs[0][1] + local))
    options = train.BenchOptions(
        workload="mlp-wide",
        workload_options=_SMALL,
        world_size=2,
        strategies=tuple(s for pair in pairs for s in pair),
        steps=20,
        eval_every=5,
        probe_steps=1,
        timeout_s=240,
    )
    runs = {r["strategy"]: r for r in train.run(options, train.loopback(), progress=False)["runs"]}
    for ours, theirs in pairs:
        losses = [e["loss"] for e in runs[ours]["evals"]]
        assert losses == pytest.approx([e["loss"] for e in runs[theirs]["evals"]], rel=1e-6), (ours, theirs)
        assert losses[-1] < losses[0]
        # torchft's bytes are counted from its committed syncs: all 4 of them, as gradsync's.
        assert runs[ours]["sent_nbytes"] == runs[theirs]["sent_nbytes"]
    assert runs[pairs[0][0]]["evals"][-1]["loss"] != runs[pairs[1][0]]["evals"][-1]["loss"]
