"""The Compressor contract, checked over the whole registry, and each codec's own guarantees.

Cases are generated from compress.names(), so a newly registered codec is covered at once; a few
non-default argument sets exercise the other code paths (sampled top-k and both index formats, the
dense rand-k support, odd QSGD widths and buckets that do not divide numel, PowerSGD of rank > 1,
DGC's momentum, masking, clipping and warm-up, int8 blocks, threshold counts, Signum's beta).
Method-specific behaviour (DGC's schedule, TernGrad's levels, ...) is in test_codec_methods.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradsync import compress
from gradsync.compress.base import count_for
from gradsync.wire import decode_indices, index_format, index_nbytes, unpack_bits

Case = tuple[str, dict[str, Any]]

DEFAULT_CASES: list[Case] = [(name, {}) for name in compress.names()]
EXTRA_CASES: list[Case] = [
    ("topk", {"ratio": 0.1, "mode": "sampled"}),
    ("topk", {"ratio": 0.3}),
    ("randk", {"ratio": 0.1}),
    ("randk", {"ratio": 0.75}),  # above half the entries: the permutation path
    ("qsgd", {"levels": 1}),
    ("qsgd", {"levels": 3, "bucket_size": 100}),
    ("qsgd", {"levels": 127}),
    ("qsgd", {"norm": "l2", "bucket_size": 333}),
    ("powersgd", {"rank": 2}),
    ("powersgd", {"rank": 4, "warm_start": False}),
    # Indices as int32 COO up to a density of 1/32, as a bitmap above it.
    ("topk", {"ratio": 0.05}),
    ("topk", {"ratio": 0.1}),
    ("topk", {"ratio": 0.5}),
    ("topk", {"ratio": 0.1, "sparsity_warmup_steps": 4}),  # one step per stage: 25 %, then 10 %
    ("dgc", {"ratio": 0.1}),
    ("dgc", {"ratio": 1.0, "masking": False}),  # every entry sent: momentum SGD
    ("dgc", {"sparsity_warmup_steps": 8}),
    ("dgc", {"clip_norm": 0.5}),
    ("threshold", {"threshold": 0.5}),  # about 60 % of N(0, 1) entries kept: a bitmap
    ("threshold", {"threshold": 2.5}),  # about 1 %: COO, and none at all for tiny tensors
    ("int8", {"block_size": 1}),
    ("int8", {"block_size": 100}),  # does not divide most numels
    ("int8", {"block_size": 4096}),  # one block, mostly padding, for small tensors
    ("signum", {"beta": 0.5}),
    # terngrad, natural and onebit take no option but a seed: their default cases cover them.
]
CASES = DEFAULT_CASES + EXTRA_CASES


def case_id(case: Case) -> str:
    name, args = case
    return "-".join([name, *(f"{k}={v}" for k, v in args.items())])


def make(case: Case, seed: int = 0) -> compress.Compressor:
    """The codec of `case`; `seed` goes to codecs that take one."""
    name, args = case
    if "seed" in compress.parameters(name):
        args = {**args, "seed": seed}
    return compress.build(name, **args)


def cls(case: Case) -> type[compress.Compressor]:
    return compress.lookup(case[0])


def rank_seed(case: Case, rank: int) -> int:
    """The seed a rank's codec gets: one for all ranks on a shared stream, its own otherwise."""
    return 7 if cls(case).randomness == "shared" else 7 + rank


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def round_trip(codec: compress.Compressor, x: torch.Tensor) -> torch.Tensor:
    payload, ctx = codec.compress(x)
    return codec.decompress(payload, ctx)


def snapshot(payload: compress.Payload) -> compress.Payload:
    """A copy of a payload: a later compress must not be able to change what is compared."""
    return tuple(t.clone() for t in payload)


def keeps_memory(case: Case) -> bool:
    """Whether the codec carries state beyond its generator and its count of steps from one
    compress to the next (DGC's accumulators, Signum's momentum, PowerSGD's warm start)."""
    codec = make(case)
    codec.compress(torch.ones(4))
    return bool(set(codec.state_dict()) - {"generator", "steps"})


def payloads_equal(a: compress.Payload, b: compress.Payload) -> bool:
    return len(a) == len(b) and all(
        s.dtype == t.dtype and torch.equal(s, t) for s, t in zip(a, b, strict=True)
    )


CASE_PARAMS = pytest.mark.parametrize("case", CASES, ids=case_id)
SUMMABLE = [c for c in CASES if cls(c).summable]
UNBIASED = [c for c in CASES if cls(c).unbiased]
BIASED = [c for c in CASES if not cls(c).unbiased]
FIXED_SIZE = [c for c in CASES if cls(c).fixed_size]
VARIABLE_SIZE = [c for c in CASES if not cls(c).fixed_size]
MAJORITY_VOTE = [c for c in CASES if cls(c).majority_vote]
# Payload = (encoded ascending indices, values), decoded by wire.decode_indices.
SPARSE = [c for c in CASES if c[0] in ("topk", "threshold", "dgc")]
MEMORY = [c for c in CASES if keeps_memory(c)]
# Codecs whose payloads depend on state: drawn random numbers, momentum, an accumulator, a warm
# start, or the position in a warm-up short enough to move within a test's few steps. Top-k's
# draws do not count: exact top-k draws nothing, and sampled top-k draws a sample only to find
# its threshold faster; it keeps the exact top-k whatever the generator's state.
STATEFUL = [
    c
    for c in CASES
    if (cls(c).randomness != "none" and c[0] != "topk")
    or c in MEMORY
    or 0 < c[1].get("sparsity_warmup_steps", 0) <= 4
]


# -- the registry ------------------------------------------------------------------------------


def test_registry_is_not_empty_and_covers_the_extra_cases() -> None:
    assert compress.names()
    assert compress.names() == list(compress.REGISTRY)
    assert {name for name, _ in EXTRA_CASES} <= set(compress.names())
    # Each capability is declared by some codec, so the checks that branch on it test something.
    assert SUMMABLE and UNBIASED and BIASED and VARIABLE_SIZE and MAJORITY_VOTE and SPARSE
    assert any(cls(c).owns_memory for c in CASES)
    assert {"dgc", "signum", "powersgd"} <= {name for name, _ in MEMORY}


@pytest.mark.parametrize("name", compress.names())
def test_every_registered_codec_builds_with_its_defaults_and_declares_valid_flags(name: str) -> None:
    codec = compress.build(name)
    kind = type(codec)
    assert isinstance(codec, compress.Compressor)
    assert kind is compress.lookup(name)
    assert isinstance(kind.summable, bool)
    assert isinstance(kind.unbiased, bool)
    assert isinstance(kind.fixed_size, bool)
    assert kind.randomness in ("none", "shared", "local")
    assert isinstance(kind.rounds, int)
    assert kind.rounds >= 1
    assert isinstance(kind.needs_feedback, bool)
    assert isinstance(kind.owns_memory, bool)
    assert isinstance(kind.majority_vote, bool)
    # A codec that draws random numbers must take the seed the hook derives per bucket and rank.
    assert ("seed" in compress.parameters(name)) == (kind.randomness != "none")
    if kind.rounds > 1:  # the exchange layer drives multi-round codecs through these
        assert all(callable(getattr(codec, m, None)) for m in ("begin", "next_round", "finish"))


@pytest.mark.parametrize("name", compress.names())
def test_declared_capabilities_do_not_contradict_each_other(name: str) -> None:
    kind = compress.lookup(name)
    if kind.majority_vote:
        # Ranks combine by sign(sum of signs), not by a sum, and the result is a unit step, not
        # an estimate of the gradient: there is nothing for error feedback to correct.
        assert not kind.summable
        assert not kind.needs_feedback
        assert not kind.unbiased
        assert kind.rounds == 1
    if kind.owns_memory:
        # What it did not send stays in its own state; the hook's feedback would count it twice.
        assert not kind.needs_feedback
    if kind.unbiased:
        assert not kind.needs_feedback  # unbiased codecs lose nothing in expectation
    if kind.fuses_feedback:
        # The fused pass computes what is compressed as it encodes, so only the payload can tell
        # of a non-finite one: neither the hook nor a two-shot owner looks again before the
        # error memory keeps it.
        assert kind.reveals_nonfinite


def test_a_codec_that_fuses_feedback_without_revealing_a_non_finite_input_is_refused_as_written() -> None:
    # Codecs added to compress.REGISTRY are held to it too, where their class is made.
    with pytest.raises(TypeError, match=r"Hiding declares fuses_feedback but not reveals_nonfinite"):

        class Hiding(compress.Compressor):
            fuses_feedback = True

    class Revealing(compress.Compressor):
        fuses_feedback = True
        reveals_nonfinite = True

    assert Revealing.fuses_feedback


REVEALING = [c for c in CASES if cls(c).reveals_nonfinite]


@pytest.mark.parametrize("case", REVEALING, ids=case_id)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_codec_that_reveals_a_non_finite_input_puts_one_in_its_payload_and_keeps_no_state(
    case: Case, bad: float
) -> None:
    # The hook skips its own finiteness pass for these codecs: the exchange's check of the
    # payloads must find the bad entry, wherever it is, and no codec state may have taken it in.
    assert REVEALING and {"fp16", "int4"} <= {name for name, _ in REVEALING}
    codec = make(case)
    assert codec.state_dict() == make(case).state_dict() and case not in MEMORY
    for where in (0, 500, 4096):
        x = randn(4097)
        x[where] = bad
        payload, _ = codec.compress(x)
        floats = [t for t in payload if t.is_floating_point()]
        assert floats and not all(bool(torch.isfinite(t).all()) for t in floats), where


# -- round trip, payload size, decoding --------------------------------------------------------

FP32_SHAPES = [(1,), (7,), (1000,), (4097,), (33, 17), (2, 3, 5), (), (0,)]
ROUND_TRIPS = [(shape, torch.float32) for shape in FP32_SHAPES] + [
    (shape, dtype) for shape in [(7,), (33, 17)] for dtype in (torch.float16, torch.bfloat16, torch.float64)
]


@CASE_PARAMS
@pytest.mark.parametrize(("shape", "dtype"), ROUND_TRIPS, ids=[f"{s}-{str(d)[6:]}" for s, d in ROUND_TRIPS])
def test_round_trip_keeps_shape_dtype_and_finiteness(
    case: Case, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x = randn(*shape, dtype=dtype)
    y = round_trip(make(case), x)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    assert y.device == x.device
    assert bool(torch.isfinite(y).all())


@CASE_PARAMS
def test_compress_leaves_its_input_unchanged(case: Case) -> None:
    x = randn(33, 17)
    original = x.clone()
    codec = make(case)
    payload, ctx = codec.compress(x)
    codec.decompress(payload, ctx)
    assert torch.equal(x, original)


@CASE_PARAMS
@pytest.mark.parametrize("shape", [(3001,), (40, 25)])
def test_a_payload_and_its_decoding_stay_valid_after_other_tensors_are_compressed(
    case: Case, shape: tuple[int, ...]
) -> None:
    # Kernels take full-size temporaries from a per-thread scratch pool that the next call of
    # any codec on a tensor of the same size overwrites. The exchange decodes a payload (and error
    # feedback decodes this rank's own) after the hook has compressed the next bucket with other
    # codecs, so nothing in a payload, a ctx or a decoding may live in that pool. (A payload may
    # live in a buffer of its own codec's, until that codec's next compress.)
    a, b = randn(*shape, seed=1), randn(*shape, seed=2) * 3
    codec = make(case)
    payload, ctx = codec.compress(a)
    sent = snapshot(payload)
    decoded = codec.decompress(payload, ctx)
    expected = decoded.clone()
    others = [make(case, seed=9)] + [compress.build(name) for name in compress.names()]
    for other in others:
        other_payload, other_ctx = other.compress(b)
        other.decompress(other_payload, other_ctx)
    assert payloads_equal(payload, sent)
    assert torch.equal(decoded, expected)
    assert torch.equal(codec.decompress(payload, ctx), expected)


@CASE_PARAMS
@pytest.mark.parametrize("numel", (0, 1, 7, 8, 9, 511, 513, 100003))
def test_payload_bytes_equals_the_bytes_of_the_payload(case: Case, numel: int) -> None:
    codec = make(case)
    declared = codec.payload_bytes(numel)  # asked first: DGC's is the size of the next payload
    payload, _ = codec.compress(randn(numel))
    assert all(isinstance(t, torch.Tensor) for t in payload)
    nbytes = sum(t.nbytes for t in payload)
    if cls(case).fixed_size:
        assert nbytes == declared
    else:
        # The largest payload bounds every one; the actual size follows from the count sent.
        assert nbytes <= declared
        _, values = payload
        assert nbytes == index_nbytes(numel, values.numel()) + values.nbytes


@pytest.mark.parametrize("case", SPARSE, ids=case_id)
@pytest.mark.parametrize("numel", (0, 1, 9, 800, 3001))
def test_sparse_payloads_carry_ascending_distinct_indices_and_the_values_decoded_there(
    case: Case, numel: int
) -> None:
    x = randn(numel, seed=4)
    codec = make(case)
    (encoded, values), ctx = codec.compress(x)
    assert encoded.dtype == torch.uint8
    assert encoded.numel() == index_nbytes(numel, values.numel())
    indices = decode_indices(encoded, numel, values.numel())
    assert bool((indices[1:] > indices[:-1]).all())
    y = codec.decompress((encoded, values), ctx).reshape(-1)
    assert torch.equal(y[indices], values)
    outside = torch.ones(numel, dtype=torch.bool)
    outside[indices] = False
    assert not y[outside].any()


@pytest.mark.parametrize("case", FIXED_SIZE, ids=case_id)
def test_fixed_size_payload_layout_depends_only_on_numel(case: Case) -> None:
    a = randn(1200, seed=1)
    b = randn(30, 40, seed=2) * 100
    b[:7] = 0
    layout_a = [(t.dtype, t.shape) for t in make(case).compress(a)[0]]
    layout_b = [(t.dtype, t.shape) for t in make(case, seed=3).compress(b)[0]]
    assert layout_a == layout_b


@CASE_PARAMS
def test_add_decoded_adds_exactly_the_decoded_payload(case: Case) -> None:
    codec = make(case)
    payload, ctx = codec.compress(randn(40, 25, seed=1))
    out = randn(40, 25, seed=2)
    expected = out + codec.decompress(payload, ctx)
    codec.add_decoded_(out, payload, ctx)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@CASE_PARAMS
def test_sum_decoded_is_a_zero_plus_each_decoded_payload_in_order(case: Case) -> None:
    # The decoded sum an allgather or a two-shot owner takes: ranks' payloads added in rank order,
    # so it has the same bits on every rank; nothing the output held before is read.
    codec = make(case)
    compressed = [codec.compress(randn(40, 25, seed=seed)) for seed in (1, 2, 3)]
    ctx = compressed[0][1]
    expected = torch.zeros(40, 25)
    for payload, _ in compressed:
        expected += codec.decompress(payload, ctx)
    out = torch.full((40, 25), float("nan"))
    codec.sum_decoded_(out, [payload for payload, _ in compressed], ctx)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("case", MAJORITY_VOTE, ids=case_id)
@pytest.mark.parametrize("shape", [(1,), (9,), (1001,), (33, 17)])
def test_majority_vote_payloads_decode_to_plus_or_minus_one(case: Case, shape: tuple[int, ...]) -> None:
    # One rank's vote: a unit sign per element; the exchange sums votes, not decodings.
    codec = make(case)
    for seed in range(3):  # stateful codecs (Signum) too, after some steps
        x = randn(*shape, seed=seed)
        x.view(-1)[::4] = 0
        y = round_trip(codec, x)
        assert bool(((y == 1) | (y == -1)).all())


@CASE_PARAMS
def test_a_payload_decodes_identically_with_another_ranks_ctx(case: Case) -> None:
    # ctx holds only what every rank knows, so rank 1 can decode rank 0's payload with its own.
    rank0, rank1 = make(case, rank_seed(case, 0)), make(case, rank_seed(case, 1))
    payload0, ctx0 = rank0.compress(randn(2000, seed=1))
    _, ctx1 = rank1.compress(randn(2000, seed=2))
    assert torch.equal(rank0.decompress(payload0, ctx1), rank0.decompress(payload0, ctx0))
    assert torch.equal(rank1.decompress(payload0, ctx1), rank0.decompress(payload0, ctx0))


# -- summable and unbiased codecs -------------------------------------------------------------


@pytest.mark.parametrize("case", SUMMABLE, ids=case_id)
def test_summable_codecs_decode_summed_payloads_to_the_sum_of_decodings(case: Case) -> None:
    world_size = 3
    codecs = [make(case, rank_seed(case, r)) for r in range(world_size)]
    compressed = [c.compress(randn(3001, seed=r)) for r, c in enumerate(codecs)]
    payloads = [p for p, _ in compressed]
    summed = tuple(
        sum(parts[1:], parts[0]) for parts in zip(*payloads, strict=True)
    )  # elementwise, like allreduce
    ctx = compressed[0][1]
    decoded_sum = codecs[0].decompress(summed, ctx)
    decodings = [c.decompress(p, ctx) for c, (p, _) in zip(codecs, compressed, strict=True)]
    sum_of_decodings = decodings[0] + decodings[1] + decodings[2]
    wire_dtypes = {t.dtype for t in payloads[0]}
    if wire_dtypes == {torch.float32}:
        assert torch.equal(decoded_sum, sum_of_decodings)
    else:
        # Each of the two additions in the wire type rounds by at most eps / 2 of a partial sum.
        (wire_dtype,) = wire_dtypes
        bound = torch.finfo(wire_dtype).eps * sum(d.abs() for d in decodings)
        assert bool(((decoded_sum - sum_of_decodings).abs() <= bound).all())


def test_identity_decodes_summed_payloads_to_the_exact_sum_of_inputs() -> None:
    codec = compress.build("none")
    xs = [randn(4097, seed=r) for r in range(3)]
    compressed = [codec.compress(x) for x in xs]
    summed = (compressed[0][0][0] + compressed[1][0][0] + compressed[2][0][0],)
    assert torch.equal(codec.decompress(summed, compressed[0][1]), xs[0] + xs[1] + xs[2])


def bias_statistic(
    codec: compress.Compressor | Callable[[int], torch.Tensor], x: torch.Tensor, draws: int
) -> float:
    """||mean of draws - x||^2 divided by its expectation for an unbiased codec, sum(var) / draws.

    Close to 1 for an unbiased codec (the sum over ~1000 coordinates concentrates); a bias b adds
    draws * ||b||^2 / sum(var), which grows with the number of draws. `codec` is a codec whose
    round trips of x are the draws, or a function giving draw i.
    """
    draw = codec if callable(codec) else lambda _: round_trip(codec, x)
    samples = torch.stack([draw(i).double() for i in range(draws)])
    squared_error = float(((samples.mean(0) - x.double()) ** 2).sum())
    variance_of_mean = float(samples.var(0).sum()) / draws
    if variance_of_mean == 0:  # a deterministic codec is unbiased only if it is exact
        return 0.0 if squared_error == 0 else math.inf
    return squared_error / variance_of_mean


DRAWS = 400
UNBIASED_BOUND = 1.5  # observed 0.9-1.1 over seeds; a 2 % scale bias gives about 4


@pytest.mark.parametrize("case", UNBIASED, ids=case_id)
def test_unbiased_codecs_monte_carlo_mean_converges_to_the_input(case: Case) -> None:
    x = randn(1000, seed=11)
    assert bias_statistic(make(case, seed=5), x, DRAWS) < UNBIASED_BOUND


def test_the_unbiasedness_check_detects_a_two_percent_bias() -> None:
    qsgd = compress.lookup("qsgd")

    class ScaledQSGD(qsgd):  # type: ignore[misc, valid-type]
        def decompress(self, payload: compress.Payload, ctx: Any) -> torch.Tensor:
            return super().decompress(payload, ctx) * 1.02

    x = randn(1000, seed=11)
    assert bias_statistic(qsgd(seed=5), x, DRAWS) < UNBIASED_BOUND
    assert bias_statistic(ScaledQSGD(seed=5), x, DRAWS) > UNBIASED_BOUND


@pytest.mark.parametrize("case", BIASED, ids=case_id)
def test_codecs_declared_biased_fail_the_unbiasedness_check(case: Case) -> None:
    # Guards the flag in the other direction: a codec that is in fact unbiased should say so.
    # Magnitudes spread over four decades, so that fixed thresholds (threshold's default 1e-3)
    # drop some entries; at randn's scale that codec would be exact.
    x = randn(1000, seed=11) * torch.logspace(-4, 0, 1000)
    if case in MEMORY:
        # Repeated round trips on one codec would mix the steps of its memory (DGC would send,
        # over time, all it accumulated). Each draw is instead the second step of a fresh codec
        # on x: the first step of DGC with ratio 1 is exact, the second shows its momentum.
        def draw(i: int) -> torch.Tensor:
            codec = make(case, seed=i)
            codec.compress(x)
            return round_trip(codec, x)

        assert bias_statistic(draw, x, 100) > UNBIASED_BOUND
    else:
        assert bias_statistic(make(case, seed=5), x, 100) > UNBIASED_BOUND


def test_qsgd_error_of_the_mean_shrinks_like_one_over_sqrt_of_draws() -> None:
    x = randn(1000, seed=12)

    def error_of_mean(draws: int) -> float:
        codec = compress.build("qsgd", seed=draws)
        mean = torch.stack([round_trip(codec, x) for _ in range(draws)]).mean(0)
        return float((mean - x).norm())

    ratio = error_of_mean(64) / error_of_mean(1024)  # sqrt(1024 / 64) = 4; observed 3.8-4.1
    assert 3 < ratio < 5.3


# -- top-k -------------------------------------------------------------------------------------


def sparse_indices(payload: compress.Payload, numel: int) -> torch.Tensor:
    encoded, values = payload
    return decode_indices(encoded, numel, values.numel())


@pytest.mark.parametrize("mode", ("exact", "sampled"))
@pytest.mark.parametrize("numel", (1, 7, 1000, 100003))
@pytest.mark.parametrize("ratio", (0.001, 0.01, 0.3, 1.0))
def test_topk_error_is_bounded_by_one_minus_k_over_d(mode: str, numel: int, ratio: float) -> None:
    codec = compress.build("topk", ratio=ratio, mode=mode, sparsity_warmup_steps=0)
    for x in (randn(numel, seed=numel), torch.ones(numel)):  # ones: the bound is met with equality
        y = round_trip(codec, x)
        k = count_for(numel, ratio)
        error = float(((y.double() - x.double()) ** 2).sum())
        bound = (1 - k / numel) * float((x.double() ** 2).sum())
        assert error <= bound * (1 + 1e-12)


@pytest.mark.parametrize("mode", ("exact", "sampled"))
def test_topk_keeps_the_largest_magnitudes_unscaled(mode: str) -> None:
    x = randn(5000, seed=3)
    codec = compress.build("topk", ratio=0.02, mode=mode, sparsity_warmup_steps=0)
    payload, _ = codec.compress(x)
    indices = sparse_indices(payload, 5000)
    assert indices.numel() == 100
    kept = torch.zeros(5000, dtype=torch.bool)
    kept[indices] = True
    assert torch.equal(payload[1], x[indices])
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


@pytest.mark.parametrize(
    ("numel", "ratio", "sample_ratio"),
    [(100003, 0.01, 0.01), (100000, 0.001, 0.01), (5000, 0.1, 0.01), (300, 0.3, 0.5), (50000, 0.05, 0.2)],
)
def test_topk_sampled_keeps_exactly_k_with_the_magnitudes_of_exact(
    numel: int, ratio: float, sample_ratio: float
) -> None:
    x = randn(numel, seed=numel)
    exact = compress.build("topk", ratio=ratio, mode="exact", sparsity_warmup_steps=0)
    sampled = compress.build(
        "topk", ratio=ratio, mode="sampled", sample_ratio=sample_ratio, sparsity_warmup_steps=0, seed=1
    )
    (_, exact_values), _ = exact.compress(x)
    sampled_payload, _ = sampled.compress(x)
    sampled_indices, sampled_values = sparse_indices(sampled_payload, numel), sampled_payload[1]
    k = count_for(numel, ratio)
    assert sampled_indices.numel() == k
    assert sampled_indices.unique().numel() == k
    assert torch.equal(sampled_values.abs().sort().values, exact_values.abs().sort().values)


def test_topk_sampled_lowers_its_threshold_when_the_sample_finds_too_few(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gradsync.compress.sparse as sparse_module

    # Aim for far fewer candidates than k, so the first thresholds admit too few and must drop.
    monkeypatch.setattr(sparse_module, "OVERSELECT", 0.05)
    x = randn(100000, seed=4)
    exact = compress.build("topk", ratio=0.01, mode="exact", sparsity_warmup_steps=0)
    sampled = compress.build("topk", ratio=0.01, mode="sampled", sparsity_warmup_steps=0, seed=2)
    (_, exact_values), _ = exact.compress(x)
    sampled_payload, _ = sampled.compress(x)
    sampled_indices, sampled_values = sparse_indices(sampled_payload, 100000), sampled_payload[1]
    assert sampled_indices.unique().numel() == 1000
    assert torch.equal(sampled_values.abs().sort().values, exact_values.abs().sort().values)


# -- sign, QSGD, PowerSGD, rand-k --------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (7,), (1001,), (33, 17)])
def test_efsignsgd_decodes_to_mean_magnitude_times_sign(shape: tuple[int, ...]) -> None:
    x = randn(*shape, seed=5)
    x.view(-1)[::3] = 0  # sign(0) decodes to +1
    y = round_trip(compress.build("efsignsgd"), x)
    scale = x.abs().sum() / x.numel()
    expected = torch.where(x >= 0, scale, -scale)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("levels", (1, 3, 7, 127))
@pytest.mark.parametrize("norm", ("max", "l2"))
@pytest.mark.parametrize("bucket_size", (1, 100, 512))
def test_qsgd_codes_are_in_range_and_values_lie_on_the_level_grid(
    levels: int, norm: str, bucket_size: int
) -> None:
    numel = 1000
    x = randn(numel, seed=levels)
    x[200:300] = 0  # whole zero buckets (for bucket_size 100) decode to zero, not NaN
    codec = compress.build("qsgd", levels=levels, norm=norm, bucket_size=bucket_size, seed=1)
    (packed, norms), ctx = codec.compress(x)
    assert codec.bits == math.ceil(math.log2(2 * levels + 1))
    codes = unpack_bits(packed, codec.bits, numel)
    assert int(codes.max()) <= 2 * levels
    y = codec.decompress((packed, norms), ctx)
    assert bool(torch.isfinite(y).all())
    scale = (norms / levels).repeat_interleave(bucket_size)[:numel]
    level = torch.where(scale > 0, y / scale, torch.zeros_like(y))
    assert bool((level - level.round()).abs().max() < 1e-3)
    level = level.round()
    assert bool((level.abs() <= levels).all())
    assert bool((level == codes.float() - levels).all())
    assert bool((level * x >= 0).all())  # never the opposite sign
    # Stochastic rounding picks one of the two levels around s |x| / norm.
    exact_level = torch.where(scale > 0, x.abs() / scale, torch.zeros_like(x))
    assert bool(((level.abs() - exact_level).abs() < 1 + 1e-4).all())
    assert bool((y[200:300] == 0).all())


def test_qsgd_never_rounds_the_bucket_maximum_past_the_top_level() -> None:
    # |v| * (s / |v|) rounds to just above s for some v; rounding up from there once gave
    # level s + 1, whose negative code wrapped around in uint8 to a large positive level.
    levels = 127
    candidates = torch.rand(100000, generator=torch.Generator().manual_seed(6)) + 0.5
    overshoot = candidates * (levels / candidates) - levels
    v = float(candidates[overshoot.argmax()])
    assert float(overshoot.max()) > 0  # such a v exists
    x = torch.full((1_000_000,), -v)
    codec = compress.build("qsgd", levels=levels, bucket_size=1, seed=1)
    (packed, norms), ctx = codec.compress(x)
    codes = unpack_bits(packed, codec.bits, x.numel())
    assert int(codes.max()) <= 2 * levels
    assert bool((codec.decompress((packed, norms), ctx) < 0).all())


def powersgd_dims(numel: int) -> tuple[int, int]:
    rows = math.ceil(math.sqrt(numel))
    return rows, -(-numel // rows)


@pytest.mark.parametrize("numel", (1, 7, 16, 20, 101))
def test_powersgd_of_full_rank_reconstructs_its_input(numel: int) -> None:
    rows, cols = powersgd_dims(numel)
    codec = compress.build("powersgd", rank=min(rows, cols), seed=1)
    x = randn(numel, seed=numel)
    for _ in range(2):  # the warm-started second step too
        torch.testing.assert_close(round_trip(codec, x), x, rtol=0, atol=1e-4 * float(x.abs().max()))


def test_powersgd_reconstructs_a_square_matrix_of_rank_at_most_its_rank() -> None:
    u, v = randn(12, 2, seed=1), randn(12, 2, seed=2)
    x = u @ v.t()  # 144 elements: viewed as exactly this 12 x 12 matrix
    y = round_trip(compress.build("powersgd", rank=2, rank_warmup_steps=0, seed=3), x)
    torch.testing.assert_close(y, x, rtol=0, atol=1e-4 * float(x.abs().max()))
    rank1 = round_trip(compress.build("powersgd", rank=1, rank_warmup_steps=0, seed=3), x)
    assert float((rank1 - x).norm()) > 1e-2 * float(x.norm())  # rank 1 cannot: the check has teeth


@pytest.mark.parametrize("rank", (3, 8, 12))
def test_powersgd_above_the_matrix_rank_still_reconstructs_it(rank: int) -> None:
    # A gradient of fewer samples than the rank (and the warm-up's ranks) leaves P with dependent
    # columns. Normalized, their rounding became directions far from orthogonal to the others,
    # and the decode was off by up to 300 times the input's largest entry at rank 12.
    x = randn(12, 2, seed=1) @ randn(2, 12, seed=2)
    y = round_trip(compress.build("powersgd", rank=rank, rank_warmup_steps=0, seed=3), x)
    torch.testing.assert_close(y, x, rtol=0, atol=1e-4 * float(x.abs().max()))


def test_powersgd_keeps_a_direction_a_thousand_times_weaker_than_the_first() -> None:
    u, v = randn(40, 2, seed=1), randn(30, 2, seed=2)
    x = u[:, :1] @ v[:, :1].t() + 1e-3 * u[:, 1:] @ v[:, 1:].t()  # rank 2, a spread spectrum
    codec = compress.build("powersgd", rank=2, rank_warmup_steps=0, seed=3)
    codec.use_shapes([torch.Size((40, 30))])
    y = round_trip(codec, x.reshape(-1))
    weak = 1e-3 * float((u[:, 1:] @ v[:, 1:].t()).norm())
    assert float((y.view(40, 30) - x).norm()) < 1e-2 * weak  # the weak part is there, not dropped


def test_powersgd_after_a_zero_gradient_approximates_again() -> None:
    # A zero step leaves a warm-start Q of zeros, so the next step's P = M Q is zero too.
    codec = compress.build("powersgd", rank=2, rank_warmup_steps=0, seed=3)
    codec.compress(torch.zeros(144))
    x = (randn(12, 2, seed=1) @ randn(2, 12, seed=2)).reshape(-1)
    round_trip(codec, x)
    torch.testing.assert_close(round_trip(codec, x), x, rtol=0, atol=1e-4 * float(x.abs().max()))


# A group as the hook hands it over: two weights of rank 2, a bias between them, and a matrix too
# thin for a rank-2 pair to shrink (3 x 2: 2 * 2 * (3 + 2) > 6): PowerSGD sends those two exactly.
SHAPES = [torch.Size((40, 24)), torch.Size((12,)), torch.Size((3, 2)), torch.Size((24, 4, 10))]


def shaped_group(seed: int) -> torch.Tensor:
    """Weights of exactly rank 2 as their matrices (the last one's (24, 40) view), the rest at random."""
    parts = []
    for i, shape in enumerate(SHAPES):
        if shape.numel() > 6:
            rows = shape[0]
            cols = shape.numel() // rows
            parts.append(randn(rows, 2, seed=seed + 10 * i) @ randn(2, cols, seed=seed + 10 * i + 1))
        else:
            parts.append(randn(shape.numel(), seed=seed + 10 * i))
    return torch.cat([part.reshape(-1) for part in parts])


def shaped_powersgd(rank: int, seed: int = 3, rank_warmup_steps: int = 0) -> compress.Compressor:
    codec = compress.build("powersgd", rank=rank, rank_warmup_steps=rank_warmup_steps, seed=seed)
    codec.use_shapes(SHAPES)
    return codec


def test_powersgd_given_shapes_approximates_each_weight_as_its_own_matrix() -> None:
    x = shaped_group(seed=1)
    y = round_trip(shaped_powersgd(rank=2), x)
    torch.testing.assert_close(y, x, rtol=0, atol=1e-4 * float(x.abs().max()))
    # The bias and the thin matrix are sent as they are.
    assert torch.equal(y[960:978], x[960:978])
    # The same group as one near-square matrix mixes the weights: rank 2 cannot hold it.
    flat = round_trip(compress.build("powersgd", rank=2, seed=3), x)
    assert float((flat - x).norm()) > 0.1 * float(x.norm())
    # Nor can rank 1 per weight: the first check has teeth.
    rank1 = round_trip(shaped_powersgd(rank=1), x)
    assert float((rank1 - x).norm()) > 1e-2 * float(x.norm())


def test_powersgd_given_shapes_sends_factors_of_each_weight_and_the_rest_exactly() -> None:
    codec = shaped_powersgd(rank=2)
    x = shaped_group(seed=2)
    (p, q), _ = codec.compress(x)
    factors = 2 * ((40 + 24) + (24 + 40))  # rank 2 (rows + cols) per weight
    assert p.numel() + q.numel() == factors + 12 + 6
    assert codec.payload_bytes(x.numel()) == 4 * (factors + 12 + 6)
    # Shapes that do not add up to the input: viewed as one near-square matrix, as without shapes.
    rows, cols = powersgd_dims(x.numel() + 1)
    assert codec.payload_bytes(x.numel() + 1) == 4 * 2 * (rows + cols)


@pytest.mark.parametrize("shaped", (False, True, "warming up"), ids=("near-square", "shaped", "warming-up"))
def test_powersgd_rounds_over_simulated_ranks_decode_to_the_sum_of_inputs(shaped: bool | str) -> None:
    world_size = 3
    if shaped == "warming up":  # ranks 96 (sent exactly), 48, 24, 12, then 6: Q cut at each
        codecs = [compress.build("powersgd", rank=6, rank_warmup_steps=4, seed=9) for _ in range(world_size)]
        for codec in codecs:
            codec.use_shapes([torch.Size((256, 192))])
        numel = 256 * 192
    elif shaped:  # the sum of three ranks' rank-2 weights has rank 6
        codecs = [shaped_powersgd(rank=6, seed=9) for _ in range(world_size)]
        numel = shaped_group(seed=0).numel()
    else:
        numel = 50
        rows, cols = powersgd_dims(numel)
        codecs = [compress.build("powersgd", rank=min(rows, cols), seed=9) for _ in range(world_size)]
    # Enough steps to warm-start, and to cross every stage of a 4-step rank warm-up.
    for step in range(6 if shaped == "warming up" else 2):
        seeds = [10 * step + r for r in range(world_size)]
        if shaped == "warming up":
            xs = [(randn(256, 2, seed=s) @ randn(2, 192, seed=s + 5)).reshape(-1) for s in seeds]
        else:
            xs = [shaped_group(seed=s) if shaped else randn(numel, seed=s) for s in seeds]
        check_powersgd_rounds(codecs, xs, numel)


def check_powersgd_rounds(codecs: list[compress.Compressor], xs: list[torch.Tensor], numel: int) -> None:
    next_nbytes = codecs[0].payload_bytes(numel)
    begun = [c.begin(x) for c, x in zip(codecs, xs, strict=True)]
    p_sum = (sum(p for (p,), _ in begun),)
    second = [c.next_round(p_sum, ctx) for c, (_, ctx) in zip(codecs, begun, strict=True)]
    q_sum = (sum(q for (q,), _ in second),)
    finished = [c.finish(q_sum, ctx) for c, (_, ctx) in zip(codecs, second, strict=True)]
    totals = [total for total, _, _ in finished]
    expected = xs[0] + xs[1] + xs[2]
    assert all(torch.equal(t, totals[0]) for t in totals)  # the same bits on every rank
    torch.testing.assert_close(totals[0], expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    locals_sum = sum(local() for _, local, _ in finished)
    torch.testing.assert_close(locals_sum, totals[0], rtol=0, atol=1e-4 * float(expected.abs().max()))
    # Subtracting this rank's part in place is exactly subtracting local().
    for r, (_, local, subtract) in enumerate(finished):
        assert torch.equal(subtract(xs[r].clone()), xs[r] - local())
    assert 4 * sum(p.numel() for p in p_sum + q_sum) == next_nbytes


def randk_support(codec: compress.Compressor, numel: int) -> torch.Tensor:
    _, (_, _, support) = codec.compress(torch.zeros(numel))
    return support


@pytest.mark.parametrize("ratio", (0.01, 0.1, 0.75, 1.0))
def test_randk_support_is_k_distinct_sorted_indices_and_values_are_copied(ratio: float) -> None:
    numel = 2003
    codec = compress.build("randk", ratio=ratio, seed=3)
    x = randn(numel, seed=1)
    for _ in range(5):
        (values,), (_, _, support) = codec.compress(x)
        k = count_for(numel, ratio)
        assert support.numel() == k
        assert support.unique().numel() == k
        assert torch.equal(support, support.sort().values)
        assert int(support.min()) >= 0
        assert int(support.max()) < numel
        assert torch.equal(values, x[support])


@pytest.mark.parametrize("ratio", (0.01, 0.75))
def test_randk_with_the_same_seed_draws_the_same_supports_and_new_ones_each_call(ratio: float) -> None:
    a, b = compress.build("randk", ratio=ratio, seed=11), compress.build("randk", ratio=ratio, seed=11)
    other = compress.build("randk", ratio=ratio, seed=12)
    supports_a = [randk_support(a, 5000) for _ in range(4)]
    supports_b = [randk_support(b, 5000) for _ in range(4)]
    assert all(torch.equal(s, t) for s, t in zip(supports_a, supports_b, strict=True))
    assert not any(torch.equal(s, t) for s, t in itertools.pairwise(supports_a))
    assert not torch.equal(randk_support(other, 5000), supports_a[0])


@pytest.mark.parametrize("ratio", (0.1, 0.6))
def test_randk_includes_every_index_equally_often(ratio: float) -> None:
    numel, draws = 50, 4000
    codec = compress.build("randk", ratio=ratio, seed=13)
    counts = torch.zeros(numel)
    for _ in range(draws):
        counts[randk_support(codec, numel)] += 1
    k = count_for(numel, ratio)
    expected = draws * k / numel
    # Pearson statistic of the inclusion counts; drawn without replacement, it has about
    # (1 - k/numel) times the mean and standard deviation of a chi-square with numel - 1 degrees.
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = numel - 1
    assert statistic < (1 - k / numel) * (dof + 6 * math.sqrt(2 * dof))


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_codec_name_raises_key_error_listing_the_names() -> None:
    with pytest.raises(KeyError) as excinfo:
        compress.build("nope")
    message = excinfo.value.args[0]
    assert "'nope'" in message
    assert all(name in message for name in compress.names())


@pytest.mark.parametrize("name", compress.names())
def test_unknown_parameter_raises_type_error_listing_the_valid_ones(name: str) -> None:
    with pytest.raises(TypeError) as excinfo:
        compress.build(name, ratoi=0.1)
    message = str(excinfo.value)
    assert "ratoi" in message
    assert all(param in message for param in compress.parameters(name))
    if not compress.parameters(name):
        assert "none" in message


BAD_VALUES = [
    ("topk", "ratio", 0),
    ("topk", "ratio", 1.5),
    ("topk", "ratio", -1),
    ("topk", "ratio", True),
    ("topk", "ratio", "0.1"),
    ("topk", "sample_ratio", 0),
    ("topk", "mode", "fast"),
    ("topk", "seed", -1),
    ("randk", "ratio", 0),
    ("randk", "ratio", 1.5),
    ("randk", "seed", True),
    ("qsgd", "levels", 0),
    ("qsgd", "levels", 200),
    ("qsgd", "levels", True),
    ("qsgd", "levels", 7.0),
    ("qsgd", "bucket_size", 0),
    ("qsgd", "bucket_size", False),
    ("qsgd", "norm", "l1"),
    ("powersgd", "rank", 0),
    ("powersgd", "rank", True),
    ("powersgd", "warm_start", 1),
]


@pytest.mark.parametrize(
    ("name", "param", "value"), BAD_VALUES, ids=[f"{n}-{p}={v!r}" for n, p, v in BAD_VALUES]
)
def test_out_of_range_parameter_raises_value_error_naming_the_value(
    name: str, param: str, value: Any
) -> None:
    with pytest.raises(ValueError) as excinfo:
        compress.build(name, **{param: value})
    message = str(excinfo.value)
    assert f"{param}={value!r}" in message or f"{param}={value}" in message


def coo_payload(index: int, numel: int) -> compress.Payload:
    """Three int32 COO indices (few enough for COO at this size) and their values."""
    assert index_format(numel, 3) == "coo"
    indices = torch.tensor([0, numel // 2, index], dtype=torch.int32)
    return indices.view(torch.uint8), torch.tensor([1.0, 2.0, 3.0])


@pytest.mark.parametrize("name", ("topk", "threshold", "dgc"))
@pytest.mark.parametrize("bad", (-1, -100, 1000, 1001))
def test_sparse_payload_with_an_out_of_range_index_raises_and_writes_nothing(name: str, bad: int) -> None:
    codec = compress.build(name)
    _, ctx = codec.compress(torch.zeros(1000))
    with pytest.raises(IndexError, match=str(bad)):
        codec.decompress(coo_payload(bad, 1000), ctx)
    out = randn(1000, seed=1)
    before = out.clone()
    with pytest.raises(IndexError, match=str(bad)):
        codec.add_decoded_(out, coo_payload(bad, 1000), ctx)
    assert torch.equal(out, before)


@pytest.mark.parametrize("name", ("randk", "qsgd", "efsignsgd"))
def test_decoding_a_payload_made_for_another_size_raises_value_error(name: str) -> None:
    codec = compress.build(name)
    payload, _ = codec.compress(randn(1000))
    _, ctx = codec.compress(randn(3000))
    with pytest.raises(ValueError, match=r"another size|bucket norms"):
        codec.decompress(payload, ctx)


def test_powersgd_warm_start_refuses_a_tensor_of_another_size() -> None:
    codec = compress.build("powersgd")
    codec.compress(randn(100))  # a 10 x 10 matrix
    with pytest.raises(ValueError, match="another size"):
        codec.compress(randn(200))  # 15 x 14


# -- state -------------------------------------------------------------------------------------


@CASE_PARAMS
def test_a_codec_restored_from_a_state_dict_continues_the_same_payloads(case: Case) -> None:
    xs = [randn(3000, seed=s) for s in range(6)]
    original = make(case, seed=21)
    for x in xs[:3]:
        original.compress(x)
    state = original.state_dict()
    expected = [snapshot(original.compress(x)[0]) for x in xs[3:]]  # taken after the snapshot
    restored = make(case, seed=21)
    restored.load_state_dict(state)
    for x, payload in zip(xs[3:], expected, strict=True):
        assert payloads_equal(restored.compress(x)[0], payload)


@CASE_PARAMS
def test_one_state_dict_restores_several_codecs_that_continue_identically(case: Case) -> None:
    # A state dict is a snapshot: restoring it must copy it, as Feedback.load_state_dict does,
    # or the restored codec's next steps would rewrite it in place, and a second restore (a
    # retry, another rank from the same checkpoint) would continue from a later state.
    xs = [randn(3000, seed=s) for s in range(6)]
    original = make(case, seed=21)
    for x in xs[:3]:
        original.compress(x)
    state = original.state_dict()
    first, second = make(case, seed=21), make(case, seed=21)
    first.load_state_dict(state)
    expected = [snapshot(first.compress(x)[0]) for x in xs[3:]]
    second.load_state_dict(state)
    for x, payload in zip(xs[3:], expected, strict=True):
        assert payloads_equal(second.compress(x)[0], payload)


@pytest.mark.parametrize("case", STATEFUL, ids=case_id)
def test_without_its_state_a_fresh_codec_does_not_continue_the_payloads(case: Case) -> None:
    # Shows that the previous test depends on the state: a fresh instance of a codec that draws
    # random numbers or keeps a warm start would not produce the continued payloads.
    xs = [randn(3000, seed=s) for s in range(4)]
    original, fresh = make(case, seed=21), make(case, seed=21)
    for x in xs[:3]:
        original.compress(x)
    assert not payloads_equal(snapshot(original.compress(xs[3])[0]), fresh.compress(xs[3])[0])


@pytest.mark.parametrize("name", [n for n in compress.names() if not compress.build(n).state_dict()])
def test_stateless_codecs_refuse_a_non_empty_state(name: str) -> None:
    codec = compress.build(name)
    codec.load_state_dict({})
    with pytest.raises(ValueError, match="keeps no state"):
        codec.load_state_dict({"generator": None})
