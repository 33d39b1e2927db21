"""What each newer codec promises beyond the shared contract (test_compress_contract.py).

DGC's update rule, warm-up schedule and memory; PowerSGD's rank warm-up; TernGrad's levels and
second moment; natural compression's powers of two; 1-bit SGD's two means; int8's error bound;
threshold's selection; the sign codecs' votes; the sparse index formats. The oracles are written
apart from the kernels: torch.optim.SGD's momentum rule, reference loops, torch.topk, IEEE bit
arithmetic, float64 sums.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradsync import compress
from gradsync.compress.base import count_for
from gradsync.wire import decode_indices, index_format, index_nbytes, pack_bits, packed_nbytes

FLOAT32_EPS = torch.finfo(torch.float32).eps


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def round_trip(codec: compress.Compressor, x: torch.Tensor) -> torch.Tensor:
    payload, ctx = codec.compress(x)
    return codec.decompress(payload, ctx)


def sent_indices(payload: compress.Payload, numel: int) -> torch.Tensor:
    encoded, values = payload
    return decode_indices(encoded, numel, values.numel())


def dgc_state(codec: compress.Compressor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DGC's momentum u and accumulator v (zeros before the first step)."""
    state = codec.state_dict()
    u, v = state["u"], state["v"]
    return (torch.zeros(numel) if u is None else u), (torch.zeros(numel) if v is None else v)


# -- DGC: momentum correction ------------------------------------------------------------------


def test_dgc_sending_every_entry_without_masking_is_momentum_sgd() -> None:
    # ratio=1 sends the whole accumulator each step, so v is emptied and what is sent is the
    # momentum buffer, bit for bit: torch.optim.SGD's rule without dampening, b_t = m b_{t-1} + g_t
    # (written out here: constructing an optimizer first imports torch._dynamo, over a second).
    codec = compress.build("dgc", ratio=1.0, masking=False, momentum=0.9)
    buffer = torch.zeros(40, 25)
    for step in range(6):
        g = randn(40, 25, seed=step)
        buffer = buffer.mul(0.9).add(g)
        assert torch.equal(round_trip(codec, g), buffer)


def test_dgc_sending_every_entry_with_masking_is_plain_sgd() -> None:
    # Momentum factor masking clears u wherever an entry was sent: with ratio=1, everywhere.
    codec = compress.build("dgc", ratio=1.0, masking=True, momentum=0.9)
    for step in range(6):
        g = randn(1000, seed=step)
        assert torch.equal(round_trip(codec, g), g)


@pytest.mark.parametrize("masking", (False, True))
def test_dgc_accumulates_momentum_and_sends_exactly_what_leaves_the_accumulator(masking: bool) -> None:
    numel, momentum = 2000, 0.9
    codec = compress.build("dgc", ratio=0.05, masking=masking, momentum=momentum, seed=1)
    total_sent = torch.zeros(numel, dtype=torch.float64)
    total_momentum = torch.zeros(numel, dtype=torch.float64)
    u_old, v_old = dgc_state(codec, numel)
    for step in range(8):
        g = randn(numel, seed=step)
        payload, ctx = codec.compress(g)
        sent = codec.decompress(payload, ctx)
        indices = sent_indices(payload, numel)
        u_new, v_new = dgc_state(codec, numel)
        u_step = u_old * momentum + g  # momentum correction, before masking
        expected_u = u_step.index_fill(0, indices, 0) if masking else u_step
        assert torch.equal(u_new, expected_u)
        # Conservation, entry by entry and bit for bit: what was sent left v, the rest stayed.
        assert torch.equal(v_new + sent, v_old + u_step)
        assert not v_new[indices].any()
        total_sent += sent.double()
        total_momentum += u_step.double()
        u_old, v_old = u_new, v_new
    # Nothing is lost over the steps: everything accumulated was sent or is still in v. Float32
    # accumulation rounds once per step and entry (|v| < 14 here): under 1e-5 in all, below atol.
    torch.testing.assert_close(total_sent + v_old.double(), total_momentum, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("numel", "ratio"), [(5000, 0.01), (100000, 0.001)])
def test_dgc_sends_exactly_the_k_largest_accumulated_entries(numel: int, ratio: float) -> None:
    codec = compress.build("dgc", ratio=ratio, sparsity_warmup_steps=0, seed=2)  # sampled, then exact
    k = count_for(numel, ratio)
    for step in range(5):
        u_old, v_old = dgc_state(codec, numel)
        g = randn(numel, seed=step)
        accumulated = v_old + (u_old * codec.momentum + g)
        payload, _ = codec.compress(g)
        indices = sent_indices(payload, numel)
        assert indices.numel() == k
        expected = torch.topk(accumulated.abs(), k).indices.sort().values  # no ties in random data
        assert torch.equal(indices, expected)
        assert torch.equal(payload[1], accumulated[indices])  # unscaled values of v


def test_dgc_clips_the_gradient_norm_before_accumulating() -> None:
    clip_norm = 0.5
    codec = compress.build("dgc", ratio=1.0, momentum=0.0, clip_norm=clip_norm)
    large = randn(1000, seed=1)  # norm about 31.6
    y = round_trip(codec, large)
    assert math.isclose(float(y.norm()), clip_norm, rel_tol=1e-6)
    torch.testing.assert_close(y, large * (clip_norm / float(large.norm())), rtol=1e-6, atol=0)
    small = large * (0.4 / float(large.norm()))  # already within the bound: left as it is
    assert torch.equal(round_trip(codec, small), small)


# -- top-k and DGC: sparsity warm-up -------------------------------------------------------------

WARMUP_STEPS = (0, 99, 100, 199, 200, 300, 399, 400, 10**6)
WARMUP_SPARSITY = (0.75, 0.75, 0.9375, 0.9375, 0.984375, 0.996, 0.996, 0.999, 0.999)
SPARSIFIERS = pytest.mark.parametrize("name", ("topk", "dgc"))


@SPARSIFIERS
def test_warmup_sparsity_follows_dgcs_exponential_stages(name: str) -> None:
    codec = compress.build(name, ratio=0.001, sparsity_warmup_steps=400)
    assert [1 - codec.density(step) for step in WARMUP_STEPS] == list(WARMUP_SPARSITY)


def test_top_k_warms_up_over_100_compressed_steps_by_default() -> None:
    codec = compress.build("topk", ratio=0.01)
    stages = [codec.density(step) for step in (0, 24, 25, 49, 50, 74, 75, 99, 100)]
    assert stages == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01, 0.01]


@SPARSIFIERS
def test_sparsifiers_send_the_scheduled_count_at_each_step_and_payload_bytes_predicts_it(name: str) -> None:
    numel = 4000
    codec = compress.build(name, ratio=0.001, sparsity_warmup_steps=400)
    sent_counts = []
    for step in range(402):
        expected_nbytes = codec.payload_bytes(numel)  # the next payload
        payload, _ = codec.compress(randn(numel, seed=step % 7))
        count = payload[1].numel()
        assert count == count_for(numel, codec.density(step))
        assert expected_nbytes == sum(t.nbytes for t in payload) == index_nbytes(numel, count) + 4 * count
        sent_counts.append(count)
    # 25 %, 6.25 %, 1.5625 %, 0.4 % of 4000 for 100 steps each, then the ratio.
    assert sent_counts == [1000] * 100 + [250] * 100 + [63] * 100 + [16] * 100 + [4] * 2


@SPARSIFIERS
def test_warmup_never_sends_fewer_than_the_configured_ratio(name: str) -> None:
    codec = compress.build(name, ratio=0.1, sparsity_warmup_steps=400)
    assert codec.density(0) == 0.25
    assert all(codec.density(step) == 0.1 for step in range(100, 500))  # 0.1 > 6.25 %, 1.6 %, 0.4 %
    no_warmup = compress.build(name, ratio=0.02, sparsity_warmup_steps=0)
    assert no_warmup.density(0) == no_warmup.density(10**6) == 0.02


@SPARSIFIERS
def test_restored_mid_warmup_continues_the_same_payload_sequence(name: str) -> None:
    numel = 3000
    original = compress.build(name, ratio=0.01, sparsity_warmup_steps=8, seed=3)
    for step in range(3):
        original.compress(randn(numel, seed=step))
    state = original.state_dict()
    restored = compress.build(name, ratio=0.01, sparsity_warmup_steps=8, seed=99)  # the state decides
    restored.load_state_dict(state)
    for step in range(3, 12):  # across the last warm-up stages and past them
        x = randn(numel, seed=step)
        assert restored.payload_bytes(numel) == original.payload_bytes(numel)
        expected = [t.clone() for t in original.compress(x)[0]]
        got = restored.compress(x)[0]
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    fresh = compress.build(name, ratio=0.01, sparsity_warmup_steps=8, seed=3)
    assert fresh.payload_bytes(numel) != restored.payload_bytes(numel)  # the step count is restored


@SPARSIFIERS
def test_an_undone_step_leaves_the_warmup_where_it_was(name: str) -> None:
    # A step found non-finite on some rank is undone: the next compress sends the count the
    # undone one did, as on a codec that never saw it.
    numel = 3000
    codec = compress.build(name, ratio=0.01, sparsity_warmup_steps=8, seed=3)
    codec.compress(randn(numel, seed=0))
    before = codec.payload_bytes(numel)
    codec.compress(randn(numel, seed=1))
    assert codec.payload_bytes(numel) != before  # the second step ended the first stage
    codec.undo()
    assert codec.payload_bytes(numel) == before
    assert codec.compress(randn(numel, seed=1))[0][1].numel() == count_for(numel, codec.density(1))


WARMING_UP = {  # every codec that warms up (Compressor.warms_up), with a short warm-up
    "topk": {"ratio": 0.01, "sparsity_warmup_steps": 8},
    "dgc": {"ratio": 0.01, "sparsity_warmup_steps": 8},
    "powersgd": {"rank": 1, "rank_warmup_steps": 8},
}


def test_every_codec_that_warms_up_is_listed_here() -> None:
    assert sorted(WARMING_UP) == sorted(n for n in compress.names() if compress.lookup(n).warms_up)


@pytest.mark.parametrize("name", sorted(WARMING_UP))
def test_undo_takes_back_one_compressed_step_once_and_none_after_a_restore(name: str) -> None:
    # The hook undoes a step found non-finite on some rank; a second undo, or one after a restore,
    # has no step of its own to take back.
    codec = compress.build(name, seed=3, **WARMING_UP[name])
    for step in range(3):
        codec.compress(randn(3000, seed=step))
    codec.undo()
    codec.undo()
    assert codec.steps == 2
    state = codec.state_dict()
    restored = compress.build(name, seed=3, **WARMING_UP[name])
    restored.load_state_dict(state)
    restored.undo()
    assert restored.steps == 2


def test_topk_checkpoint_from_before_the_warmup_continues_at_its_ratio() -> None:
    # Such a checkpoint holds only the generator: its run was sparsified at `ratio` throughout.
    codec = compress.build("topk", ratio=0.01, seed=3)
    codec.load_state_dict({"generator": None})
    assert codec.payload_bytes(3000) == index_nbytes(3000, 30) + 4 * 30


# -- PowerSGD: rank warm-up ----------------------------------------------------------------------

# One weight of 256 x 192: every warm-up rank of a rank-2 codec (up to 32) still shrinks it.
MATRIX = torch.Size((256, 192))


def warming_powersgd(rank_warmup_steps: int, seed: int = 3) -> compress.Compressor:
    codec = compress.build("powersgd", rank=2, rank_warmup_steps=rank_warmup_steps, seed=seed)
    codec.use_shapes([MATRIX])
    return codec


def test_powersgd_warms_up_at_16_8_4_and_2_times_its_rank_over_100_compressed_steps_by_default() -> None:
    codec = compress.build("powersgd", rank=4)
    stages = [codec.rank_at(step) for step in (0, 24, 25, 49, 50, 74, 75, 99, 100, 10**6)]
    assert stages == [64, 64, 32, 32, 16, 16, 8, 8, 4, 4]
    no_warmup = compress.build("powersgd", rank=4, rank_warmup_steps=0)
    assert no_warmup.rank_at(0) == 4


def test_powersgd_sends_the_scheduled_rank_at_each_step_and_payload_bytes_predicts_it() -> None:
    codec = warming_powersgd(rank_warmup_steps=8)
    sent_ranks = []
    for step in range(10):
        expected_nbytes = codec.payload_bytes(MATRIX.numel())  # the next payload
        (p, q), _ = codec.compress(randn(MATRIX.numel(), seed=step))
        assert p.numel() % MATRIX[0] == 0 and q.numel() == p.numel() // MATRIX[0] * MATRIX[1]
        assert expected_nbytes == p.nbytes + q.nbytes
        sent_ranks.append(p.numel() // MATRIX[0])
    assert sent_ranks == [32, 32, 16, 16, 8, 8, 4, 4, 2, 2]


def test_powersgd_warm_start_keeps_the_leading_columns_of_q_as_the_rank_falls() -> None:
    codec = warming_powersgd(rank_warmup_steps=8)
    codec.compress(randn(MATRIX.numel(), seed=0))
    (_, q), _ = codec.compress(randn(MATRIX.numel(), seed=1))  # the last step at rank 32
    x = randn(MATRIX.numel(), seed=2)
    (p, _), _ = codec.compress(x)  # rank 16: P = M Q, Q warm-started from the last one's
    expected = x.view(MATRIX) @ q.view(MATRIX[1], 32)[:, :16]
    torch.testing.assert_close(p.view(MATRIX[0], 16), expected, rtol=1e-5, atol=1e-5)
    cold = compress.build("powersgd", rank=16, rank_warmup_steps=0, seed=3)
    cold.use_shapes([MATRIX])
    (p_cold, _), _ = cold.compress(x)
    assert not torch.allclose(p_cold, p)  # a fresh draw would differ: the check has teeth


def test_powersgd_set_back_into_its_warmup_widens_q_keeping_its_columns() -> None:
    # plan="auto" times a candidate past its warm-up, then the adopted codec takes the warm-up up
    # where training stands (sync's _set_warmup): the rank rises from 2 to 32.
    codec = warming_powersgd(rank_warmup_steps=8)
    codec.steps = compress.PAST_WARMUP
    (_, q), _ = codec.compress(randn(MATRIX.numel(), seed=0))
    codec.steps = 0
    x = (randn(256, 20, seed=1) @ randn(20, 192, seed=2)).reshape(-1)  # rank 20, under 32
    (p, q_new), ctx = codec.compress(x)
    torch.testing.assert_close(p.view(256, 32)[:, :2], x.view(MATRIX) @ q.view(192, 2), rtol=1e-5, atol=1e-5)
    y = codec.decompress((p, q_new), ctx)
    torch.testing.assert_close(y, x, rtol=0, atol=1e-4 * float(x.abs().max()))


def test_powersgd_restored_mid_warmup_continues_the_same_payload_sequence() -> None:
    original = warming_powersgd(rank_warmup_steps=8)
    for step in range(3):
        original.compress(randn(MATRIX.numel(), seed=step))
    restored = warming_powersgd(rank_warmup_steps=8, seed=99)  # the state decides
    restored.load_state_dict(original.state_dict())
    for step in range(3, 10):  # across the last stages and past the warm-up
        x = randn(MATRIX.numel(), seed=step)
        assert restored.payload_bytes(MATRIX.numel()) == original.payload_bytes(MATRIX.numel())
        expected = [t.clone() for t in original.compress(x)[0]]
        assert all(torch.equal(a, b) for a, b in zip(restored.compress(x)[0], expected, strict=True))


def test_powersgd_undone_step_leaves_the_warmup_where_it_was() -> None:
    codec = warming_powersgd(rank_warmup_steps=8)
    codec.compress(randn(MATRIX.numel(), seed=0))
    before = codec.payload_bytes(MATRIX.numel())
    codec.compress(randn(MATRIX.numel(), seed=1))
    assert codec.payload_bytes(MATRIX.numel()) != before  # the second step ended the first stage
    codec.undo()
    assert codec.payload_bytes(MATRIX.numel()) == before


def test_powersgd_undone_step_puts_back_the_q_it_warm_starts_from() -> None:
    # A world of one's compress keeps the step's Q at once: undo must take it back, so that the
    # next step is the one that would have followed the step before.
    codec, twin = warming_powersgd(rank_warmup_steps=0), warming_powersgd(rank_warmup_steps=0)
    for c in (codec, twin):
        c.compress(randn(MATRIX.numel(), seed=0))
    codec.compress(randn(MATRIX.numel(), seed=1))
    codec.undo()
    x = randn(MATRIX.numel(), seed=2)
    assert all(torch.equal(a, b) for a, b in zip(codec.compress(x)[0], twin.compress(x)[0], strict=True))


def test_powersgd_checkpoint_from_before_the_warmup_continues_at_its_rank() -> None:
    # Such a checkpoint holds the generator and Q at `rank`: its run had no warm-up.
    old = warming_powersgd(rank_warmup_steps=0)
    old.compress(randn(MATRIX.numel(), seed=0))
    state = {key: value for key, value in old.state_dict().items() if key not in ("steps", "q_rank")}
    restored = warming_powersgd(rank_warmup_steps=100)
    restored.load_state_dict(state)
    x = randn(MATRIX.numel(), seed=1)
    assert restored.payload_bytes(MATRIX.numel()) == old.payload_bytes(MATRIX.numel())
    assert all(torch.equal(a, b) for a, b in zip(restored.compress(x)[0], old.compress(x)[0], strict=True))


# -- sparse index formats ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ("topk", "dgc"))
@pytest.mark.parametrize(
    ("ratio", "fmt"), [(0.01, "coo"), (1 / 32, "coo"), (0.0315, "bitmap"), (0.1, "bitmap")]
)
def test_sparse_codecs_use_coo_up_to_density_one_32nd_and_a_bitmap_above(
    name: str, ratio: float, fmt: str
) -> None:
    # At 3200 elements the bitmap is 400 bytes: COO for k <= 100 (a tie at 100), a bitmap above.
    numel = 3200
    x = randn(numel, seed=5)
    k = count_for(numel, ratio)
    assert index_format(numel, k) == fmt
    payload, ctx = compress.build(name, ratio=ratio, sparsity_warmup_steps=0).compress(x)
    encoded = payload[0]
    reference = torch.topk(x.abs(), k).indices.sort().values  # DGC's first step: v = g
    if fmt == "coo":
        assert torch.equal(encoded.view(torch.int32).long(), reference)
    else:
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[reference] = True
        assert torch.equal(encoded, pack_bits(mask, 1))
    expected = torch.zeros(numel).index_put_((reference,), x[reference])
    assert torch.equal(compress.build(name).decompress(payload, ctx), expected)


# -- TernGrad ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_terngrad_decodes_to_minus_s_zero_or_s_with_the_inputs_sign(seed: int) -> None:
    x = randn(33, 31, seed=seed)
    x.view(-1)[::10] = 0
    codec = compress.build("terngrad", seed=seed)
    (packed, scale), ctx = codec.compress(x)
    s = float(x.abs().max())
    assert float(scale) == s
    y = codec.decompress((packed, scale), ctx)
    assert bool(((y == s) | (y == 0) | (y == -s)).all())
    assert bool((y * x >= 0).all())  # never the opposite sign
    assert not y[x == 0].any()
    largest = x.abs().argmax()  # kept with probability |x| / s = 1
    assert float(y.view(-1)[largest]) == math.copysign(s, float(x.view(-1)[largest]))


def test_terngrad_of_zeros_is_zeros() -> None:
    y = round_trip(compress.build("terngrad"), torch.zeros(100))
    assert torch.equal(y, torch.zeros(100))


def test_terngrad_second_moment_is_s_times_the_l1_norm() -> None:
    # ||C(x)||^2 = s^2 N with N the number of entries kept, a sum of Bernoulli(|x_i| / s): its
    # mean over the draws must lie within 5 standard errors of s ||x||_1 (about 2.5 % here).
    x = randn(1000, seed=8).double()
    s = float(x.abs().max())
    p = x.abs() / s
    draws = 200
    codec = compress.build("terngrad", seed=1)
    moments = [float(round_trip(codec, x.float()).double().square().sum()) for _ in range(draws)]
    standard_error = s**2 * math.sqrt(float((p * (1 - p)).sum()) / draws)
    expected = s * float(x.abs().sum())
    assert abs(sum(moments) / draws - expected) < 5 * standard_error
    assert 5 * standard_error < 0.03 * expected  # the check is tight enough to mean something


# -- natural compression -------------------------------------------------------------------------


def float_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def wide_range_input(numel: int, seed: int) -> torch.Tensor:
    """Random signs and mantissas with exponents from the subnormals to 2^126."""
    generator = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(numel, generator=generator) + 1
    exponent = torch.randint(-149, 127, (numel,), generator=generator).float()
    sign = torch.randint(0, 2, (numel,), generator=generator).float() * 2 - 1
    return (sign * mantissa * torch.exp2(exponent)).float()


def test_natural_outputs_are_zero_or_signed_powers_of_two_bracketing_the_input() -> None:
    x = wide_range_input(20000, seed=1)
    x[:10] = 0
    y = round_trip(compress.build("natural", seed=2), x)
    assert not (float_bits(y) & 0x7FFFFF).any()  # no mantissa bits: 0 or +-2^e
    # The power of two at or below |x| keeps x's sign and exponent bits; the one above is twice
    # it, or 2^-126 for subnormals, whose "power below" is zero.
    below = (float_bits(x) & ~0x7FFFFF).view(torch.float32)
    subnormal = (x != 0) & (x.abs() < 2.0**-126)
    above = torch.where(subnormal, torch.copysign(torch.tensor(2.0**-126), x), below * 2)
    assert bool(((y == below) | (y == above)).all())
    assert bool((torch.signbit(y) == torch.signbit(x)).all())
    assert bool(subnormal.any()) and bool((y[subnormal] != 0).any())  # both kinds drawn


def test_natural_leaves_signed_powers_of_two_and_zeros_unchanged() -> None:
    powers = torch.exp2(torch.arange(-126, 128).float())  # 2^-126, the smallest normal, to 2^127
    x = torch.cat([powers, -powers, torch.tensor([0.0, -0.0])])
    for seed in range(3):
        y = round_trip(compress.build("natural", seed=seed), x)
        assert torch.equal(float_bits(y), float_bits(x))  # -0.0 keeps its sign bit too


@pytest.mark.parametrize(
    ("value", "up", "probability"),
    [
        (1.25, 2.0, 0.25),
        (1.75, 2.0, 0.75),
        (-3.0, -4.0, 0.5),
        (5e-39, 2.0**-126, 5e-39 / 2.0**-126),  # a subnormal: 0 or 2^-126
        (1.0 + 2.0**-23, 2.0, 2.0**-23),
    ],
)
def test_natural_rounds_up_with_probability_equal_to_the_mantissa_fraction(
    value: float, up: float, probability: float
) -> None:
    numel = 200_000
    y = round_trip(compress.build("natural", seed=4), torch.full((numel,), value))
    frequency = float((y == up).float().mean())
    assert bool(((y == up) | (y == torch.tensor(up) / 2) | (y == 0)).all())
    # 5 standard errors of a binomial frequency, and at least 3 draws' worth for tiny p.
    tolerance = max(5 * math.sqrt(probability * (1 - probability) / numel), 3 / numel)
    assert abs(frequency - probability) < tolerance


def test_natural_saturates_the_largest_finite_inputs_at_two_to_the_127() -> None:
    largest = torch.finfo(torch.float32).max
    x = torch.tensor([3e38, -3e38, largest, -largest, 1.9 * 2.0**127]).repeat(1000)
    y = round_trip(compress.build("natural", seed=5), x)
    assert torch.equal(y, torch.copysign(torch.tensor(2.0**127), x))


def test_natural_never_rounds_a_finite_half_precision_input_to_inf() -> None:
    # fp16's largest finite value is 65504 < 2^16; 60000 = 2^15 * 1.83 rounds up to 2^16 with
    # probability 0.83, which must saturate at 2^15 like 2^128 saturates at 2^127 in fp32.
    x = torch.full((1000,), 60000.0, dtype=torch.float16)
    y = round_trip(compress.build("natural", seed=6), x)
    assert y.dtype == torch.float16
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("numel", (0, 1, 7, 8, 9, 1001))
def test_natural_payload_is_nine_bits_per_element(numel: int) -> None:
    codec = compress.build("natural")
    (exponents, signs), _ = codec.compress(randn(numel))
    assert exponents.dtype == signs.dtype == torch.uint8
    assert exponents.numel() == numel
    assert signs.numel() == -(-numel // 8)
    assert codec.payload_bytes(numel) == numel + packed_nbytes(numel, 1)


# -- 1-bit SGD -----------------------------------------------------------------------------------


def onebit_reference(x: torch.Tensor) -> tuple[float, float]:
    """Means of the entries >= 0 and of the negative ones, in float64 (0 for an empty side)."""
    x = x.double()
    nonnegative, negative = x[x >= 0], x[x < 0]
    return (
        float(nonnegative.mean()) if nonnegative.numel() else 0.0,
        float(negative.mean()) if negative.numel() else 0.0,
    )


def few_tiny_negatives() -> torch.Tensor:
    x = randn(1000, seed=6).abs() + 1
    x[:3] = -1e-3
    return x


@pytest.mark.parametrize(
    "x",
    [
        randn(1000, seed=1),
        randn(33, 17, seed=2) + 1.5,  # mostly positive
        few_tiny_negatives(),
        randn(1000, seed=3).abs(),  # all positive
        torch.cat([torch.zeros(10), randn(90, seed=4).abs()]),  # zeros count as positive
        -randn(1000, seed=5).abs() - 1e-3,  # all negative
    ],
    ids=["mixed", "mostly-positive", "few-tiny-negatives", "all-positive", "with-zeros", "all-negative"],
)
def test_onebit_decodes_each_side_to_its_mean_and_conserves_the_sum(x: torch.Tensor) -> None:
    y = round_trip(compress.build("onebit"), x)
    positive, negative = onebit_reference(x)
    # Each mean is a float32 sum of same-signed entries over a count: within 16 ulps of itself.
    # Decoding computes bit * (positive - negative) + negative, which adds up to 2 ulps of
    # |positive| + |negative| on the positive side and nothing on the negative side.
    ulp = FLOAT32_EPS
    assert bool(((y[x < 0] - negative).abs() <= 16 * ulp * abs(negative)).all())
    positive_tolerance = 16 * ulp * abs(positive) + 2 * ulp * (abs(positive) + abs(negative))
    assert bool(((y[x >= 0] - positive).abs() <= positive_tolerance).all())
    total = float(x.double().sum())
    assert math.isclose(float(y.double().sum()), total, rel_tol=0, abs_tol=1e-5 * float(x.abs().sum()))


# -- int8 ----------------------------------------------------------------------------------------


def blocks_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each entry's block maximum magnitude, in float64."""
    flat = x.reshape(-1).double()
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % block_size)])
    absmax = padded.view(-1, block_size).abs().amax(dim=1)
    return absmax.repeat_interleave(block_size)[: flat.numel()]


@pytest.mark.parametrize("block_size", (1, 7, 100, 256, 5000))
@pytest.mark.parametrize("numel", (1000, 1003))
def test_int8_error_is_at_most_half_a_step_of_the_block_scale(block_size: int, numel: int) -> None:
    x = randn(numel, seed=block_size) * torch.logspace(-3, 3, numel)  # blocks of unlike scales
    codec = compress.build("int8", block_size=block_size)
    (codes, scales), ctx = codec.compress(x)
    assert scales.numel() == -(-numel // block_size)
    assert codec.payload_bytes(numel) == codes.nbytes + scales.nbytes
    y = codec.decompress((codes, scales), ctx)
    # Half a step is absmax / 254; float32 rounding of the scale and of x * 127 / absmax adds
    # under 1e-4 of it.
    bound = blocks_absmax(x, block_size) / 254 * (1 + 1e-4)
    assert bool(((y.double() - x.double()).abs() <= bound).all())


def test_int8_decodes_each_blocks_largest_magnitude_almost_exactly_and_zero_blocks_exactly() -> None:
    block_size, numel = 100, 1050
    x = randn(numel, seed=3) * torch.logspace(-2, 2, numel)
    x[300:400] = 0  # a whole block
    y = round_trip(compress.build("int8", block_size=block_size), x)
    assert torch.equal(y[300:400], torch.zeros(100))
    for start in range(0, numel, block_size):  # the last block has 50 entries
        block = slice(start, start + block_size)
        at = x[block].abs().argmax()
        largest = float(x[block][at])
        assert abs(float(y[block][at]) - largest) <= 2 * FLOAT32_EPS * abs(largest)


def test_int8_error_bound_holds_for_blocks_of_tiny_magnitude() -> None:
    # 127 / absmax overflows float32 once absmax < 127 / 3.4e38 = 3.7e-37: then every entry of
    # the block must still be within half a step (here: every code rounds to its own value).
    x = torch.tensor([1e-37, -3e-37, 0.0, 2e-37, 1.0, 0.5, -0.25, 0.0])
    y = round_trip(compress.build("int8", block_size=4), x)
    bound = blocks_absmax(x, 4) / 254 * (1 + 1e-4)
    assert bool(((y.double() - x.double()).abs() <= bound).all())
    assert bool(torch.isfinite(y).all())


# -- threshold -----------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", (0.5, 1.0, 2.5))
def test_threshold_keeps_exactly_the_entries_at_or_above_it_unchanged(threshold: float) -> None:
    x = randn(5000, seed=7) * 2
    t = torch.tensor(threshold)
    below = torch.nextafter(t, torch.tensor(0.0))
    x[:4] = torch.stack([t, -t, below, -below])  # at the threshold: kept; just below: dropped
    codec = compress.build("threshold", threshold=threshold)
    payload, ctx = codec.compress(x)
    keep = x.abs() >= threshold
    assert torch.equal(sent_indices(payload, x.numel()), keep.nonzero().squeeze(1))
    assert torch.equal(payload[1], x[keep])
    assert torch.equal(codec.decompress(payload, ctx), torch.where(keep, x, torch.zeros_like(x)))


def test_threshold_above_every_entry_sends_an_empty_payload() -> None:
    codec = compress.build("threshold", threshold=10.0)
    payload, ctx = codec.compress(randn(1000, seed=1))
    assert sum(t.nbytes for t in payload) == 0
    assert torch.equal(codec.decompress(payload, ctx), torch.zeros(1000))


@pytest.mark.parametrize("numel", (1, 9, 1000))
def test_threshold_below_every_entry_sends_a_full_bitmap_the_largest_payload(numel: int) -> None:
    x = randn(numel, seed=2).sign() * (1 + randn(numel, seed=3).abs())
    codec = compress.build("threshold", threshold=1.0)
    (encoded, values), ctx = codec.compress(x)
    assert torch.equal(values, x)
    assert encoded.numel() == packed_nbytes(numel, 1)  # a bitmap, every bit set
    assert torch.equal(encoded, pack_bits(torch.ones(numel, dtype=torch.bool), 1))
    assert encoded.nbytes + values.nbytes == codec.payload_bytes(numel)
    assert torch.equal(codec.decompress((encoded, values), ctx), x)


# -- signSGD and Signum --------------------------------------------------------------------------


def signs(x: torch.Tensor) -> torch.Tensor:
    """+1 where x >= 0 (zero included), -1 elsewhere."""
    return torch.where(x >= 0, 1.0, -1.0)


def test_signsgd_decodes_to_the_sign_with_zero_counted_as_plus() -> None:
    x = randn(33, 17, seed=1)
    x.view(-1)[::5] = 0
    x.view(-1)[1::5] = -0.0
    assert torch.equal(round_trip(compress.build("signsgd"), x), signs(x))


@pytest.mark.parametrize("beta", (0.5, 0.9))
def test_signum_sends_the_sign_of_its_momentum(beta: float) -> None:
    codec = compress.build("signum", beta=beta)
    momentum = torch.zeros(2000)
    differs_from_gradient = False
    for step in range(6):
        g = randn(2000, seed=step)
        momentum = momentum.mul(beta).add(g, alpha=1 - beta)
        y = round_trip(codec, g)
        assert torch.equal(y, signs(momentum))
        assert torch.equal(codec.state_dict()["momentum"], momentum)
        differs_from_gradient |= not torch.equal(y, signs(g))
    assert differs_from_gradient  # the oracle distinguishes momentum from the gradient


def test_signum_without_momentum_is_signsgd() -> None:
    signum, signsgd = compress.build("signum", beta=0.0), compress.build("signsgd")
    for step in range(4):
        g = randn(1001, seed=step)
        g[::7] = 0
        (a,), _ = signum.compress(g)
        (b,), _ = signsgd.compress(g)
        assert torch.equal(a, b)


def _payload_bits(codec: compress.Compressor, x: torch.Tensor) -> list[bytes]:
    payload, _ = codec.compress(x)
    return [t.cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in payload]


def test_a_random_stream_saved_by_another_kind_of_generator_restarts_from_the_seed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A GPU's generator state (Philox: 16 bytes) restored where the codec runs on the CPU (5056).
    x = randn(4000, seed=2)
    codec = compress.build("qsgd", seed=7)
    codec.load_state_dict({"generator": torch.zeros(16, dtype=torch.uint8)})
    with caplog.at_level("WARNING", logger="gradsync"):
        restored = _payload_bits(codec, x)
    assert restored == _payload_bits(compress.build("qsgd", seed=7), x)  # as a new run draws
    assert "saved random stream (16 bytes) is not one a cpu generator keeps" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's random stream")
def test_a_gpu_codecs_random_stream_resumes_from_a_checkpoint_loaded_onto_the_gpu() -> None:
    import io

    from gradsync import checkpoint

    device = torch.device("cuda", torch.cuda.current_device())
    x = randn(4000, seed=3).to(device)
    codec = compress.build("qsgd", seed=7)
    codec.compress(x)
    buffer = io.BytesIO()
    torch.save(codec.state_dict(), buffer)
    buffer.seek(0)
    # Loaded as a checkpoint's tensors are: onto the model's device.
    saved = torch.load(buffer, map_location=checkpoint.onto(device), weights_only=True)
    resumed = compress.build("qsgd", seed=7)
    resumed.load_state_dict(saved)
    assert _payload_bits(resumed, x) == _payload_bits(codec, x)


@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e-39])  # normal, small, subnormal
def test_qsgd_sends_a_bucket_of_equal_values_at_any_magnitude(magnitude: float) -> None:
    # Every value is the bucket's max norm: its level is the top one, with no rounding to draw
    # (decoding multiplies by norm / levels: within a rounding of the norm, also subnormal).
    x = torch.full((1000,), magnitude).neg_()
    x[::3] = magnitude
    torch.testing.assert_close(round_trip(compress.build("qsgd", seed=0), x), x, rtol=1e-5, atol=0)


@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e-39])
def test_qsgd_l2_norm_of_tiny_values_does_not_vanish(magnitude: float) -> None:
    # Unbiased: the mean of many decodes of one value is the value, also where its square is
    # below float32's range (the norm would be 0 and every decode 0).
    x = torch.full((64,), magnitude)
    codec = compress.build("qsgd", norm="l2", seed=0)
    mean = torch.stack([round_trip(codec, x) for _ in range(200)]).double().mean()
    assert abs(float(mean) / magnitude - 1) < 0.1
