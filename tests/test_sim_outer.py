"""The simulator's DiLoCo: a mean inner step and bytes, checked against the event engine's step
with one group and against the formula: H x compute + each fragment's exposed exchange, per H."""

from __future__ import annotations

import pytest

from gradsync.sim import cluster, compute, engine, groups, models, outer

WORK = compute.from_model(models.build("bert-base"), cluster.device("v100"))
WHERE = cluster.cluster(4, 8, "v100", "1gbit")


def test_syncing_every_step_uncompressed_is_the_engines_step_with_one_group() -> None:
    # One group is ready when the backward pass ends, so the engine's step is compute + its
    # exchange: DiLoCo with H = 1 exchanges the same bytes after the optimizer step instead.
    once = outer.simulate(WORK, WHERE, "diloco:sync_every=1")
    single = engine.simulate(WORK, WHERE, "none", groups.single(len(WORK.numels)))
    assert once.step_s == pytest.approx(single.step_s)
    assert once.groups[0].payload_bytes == single.groups[0].payload_bytes


def test_h_steps_share_one_exchange_and_its_bytes() -> None:
    once = outer.simulate(WORK, WHERE, "diloco:sync_every=1")
    rare = outer.simulate(WORK, WHERE, "diloco:sync_every=50")
    assert rare.step_s - WORK.step_s == pytest.approx((once.step_s - WORK.step_s) / 50)
    assert rare.meta["sent_nbytes_per_step"] == pytest.approx(once.meta["sent_nbytes_per_step"] / 50)
    assert rare.scaling > 10 * once.scaling  # at 1 Gbit/s BERT-base is network-bound either way


def test_a_compressed_outer_gradient_sends_its_codecs_bytes() -> None:
    fp32 = outer.simulate(WORK, WHERE, "diloco:sync_every=50")
    int4 = outer.simulate(WORK, WHERE, "diloco:sync_every=50:compressor=int4")
    assert int4.groups[0].strategy.startswith("int4")
    ratio = fp32.meta["sent_nbytes_per_step"] / int4.meta["sent_nbytes_per_step"]
    assert 32 / 4.25 * 0.5 < ratio < 32 / 4.25 * 1.5  # two-shot's shares against the ring's
    assert int4.step_s < fp32.step_s


def test_a_delay_hides_the_exchange_behind_inner_steps_and_fragments_cut_the_peak() -> None:
    fast = cluster.cluster(4, 8, "v100", "100gbit")
    plain = outer.simulate(WORK, fast, "diloco:sync_every=50")
    needed = plain.meta["exchange_s"][0] / WORK.step_s  # inner steps the exchange lasts
    assert 1 < needed < 49
    hidden = outer.simulate(WORK, fast, f"diloco:sync_every=50:delay={int(needed) + 1}")
    assert hidden.step_s == pytest.approx(WORK.step_s) and hidden.meta["exposed_s"] == [0.0]
    streaming = outer.simulate(WORK, fast, "diloco:sync_every=50:fragments=4")
    assert len(streaming.groups) == 4
    assert streaming.meta["peak_nbytes"] < plain.meta["peak_nbytes"] / 2.5  # about a quarter
    assert streaming.meta["sent_nbytes_per_step"] == pytest.approx(
        plain.meta["sent_nbytes_per_step"], rel=1e-3
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("diloco:sync_every=0", ["sync_every=0"]),
        ("diloco:sync_every=4:delay=4", ["delay=4", "[0, 3]"]),
        ("diloco:compressor=nope", ["nope"]),
        ("topk", ["not a diloco strategy"]),
    ],
)
def test_bad_outer_strategies_are_refused_naming_the_value(text: str, words: list[str]) -> None:
    with pytest.raises((ValueError, KeyError)) as excinfo:
        outer.simulate(WORK, WHERE, text)
    for word in words:
        assert word in str(excinfo.value)
