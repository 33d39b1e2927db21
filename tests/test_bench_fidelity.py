"""bench fidelity: which simulator strategy models each trained one, what the profile must measure,
the report, option errors, and one real (loopback) profile-measure-predict round."""

from __future__ import annotations

import json

import pytest

from gradsync.bench import fidelity, train
from gradsync.profile import Profile


def test_each_trained_strategy_maps_to_the_exchange_it_runs():
    assert fidelity.sim_text("ddp") == "none"
    assert fidelity.sim_text("fp16:warmup=2") == "fp16"
    assert fidelity.sim_text("qsgd:warmup=2:ef=none") == "qsgd"
    assert fidelity.sim_text("int8") == "int8"
    for text, match in [
        ("topk", "not simulated"),
        ("torch-fp16", "no simulator model"),
        ("qsgd:sparse=balanced", "no simulator model"),
    ]:
        with pytest.raises(ValueError, match=match):
            fidelity.sim_text(text)


def test_the_profile_measures_what_the_strategies_need():
    options = fidelity.FidelityOptions(strategies=("ddp", "fp16:warmup=2", "qsgd:warmup=2", "bf16:warmup=3"))
    assert fidelity.hooked(options) == {
        "fp16": "fp16:warmup=2",
        "qsgd": "qsgd:warmup=2",
        "bf16": "bf16:warmup=3",
    }
    # fp16 and bf16 are summed in their own dtype, which gloo adds at its own speed.
    assert fidelity.collectives(options) == [
        "allreduce",
        "allgather",
        "allreduce:float16",
        "allreduce:bfloat16",
    ]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"worlds": (1,)}, "world size 1"),
        ({"bandwidths": ("fast",)}, "not a rate"),
        ({"strategies": ("topk",)}, "not simulated"),
        ({"workload": "nope"}, "unknown workload"),
        ({"steps": 2}, "steps=2"),
    ],
)
def test_bad_options_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        fidelity.FidelityOptions(**changes)


def test_the_table_reports_each_configuration_and_the_median_error():
    rows = [
        {"world": 2, "bandwidth": "1gbit", "strategy": s, "simulated_as": s, "predicted_s": p,
         "measured_s": m, "error": (p - m) / m}
        for s, p, m in [("ddp", 0.9, 1.0), ("fp16", 0.55, 0.5), ("qsgd", 0.4, 0.5)]
    ]  # fmt: skip
    document = {"rows": rows, "median_abs_error": 0.1, "max_abs_error": 0.2}
    text = fidelity.table(document)
    assert "| 2 | 1gbit | fp16 | fp16 | 0.550 | 0.500 | +10.0% |" in text
    assert "| 2 | 1gbit | qsgd | qsgd | 0.400 | 0.500 | -20.0% |" in text
    assert "Median absolute error 10.0% over 3 configurations (max 20.0%)" in text


def test_a_loopback_round_profiles_measures_and_predicts():
    options = fidelity.FidelityOptions(
        workload="convnet",
        worlds=(2,),
        strategies=("ddp", "fp16:warmup=2"),
        steps=3,
        warmup=3,
        profile_steps=2,
        collective_sizes=(4, 1 << 16, 1 << 20),
        codec_sizes=(1 << 14, 1 << 16),
        timeout_s=120,
    )
    raw = fidelity._run_ranks(options, train.loopback(), 2)
    found = Profile.from_json(json.dumps(raw["profile"]))
    assert found.world_size == 2 and sorted(found.hook) == ["fp16"]
    assert sorted(found.collectives) == ["allgather", "allreduce", "allreduce:float16"]
    assert sorted(found.contention) == sorted(found.collectives)
    for text in options.strategies:
        measured = raw["measured"][text]
        assert len(measured["step_s"]) == options.steps and measured["median_s"] > 0
        predicted = fidelity.predict(found, fidelity.sim_text(text))
        assert predicted.step_s >= found.compute_s
