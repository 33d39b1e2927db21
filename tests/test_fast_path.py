"""The allocation-free hot path gives the bits the straightforward path gave.

Error feedback's residual is taken in place (Compressor.sub_decoded_, Exchanged.remove_local_),
p = g + e is written into a spare buffer, the allgather decodes the sum into the bucket itself,
and sparse selection scans its flags word by word. Each is checked bit for bit (signed zeros
included) against the formula it replaces: p - decompress(payload), g + e, zeros + decodes,
(size >= t).nonzero().
"""

from __future__ import annotations

import math
import pickle
import warnings
from typing import Any

import pytest
import torch

from gradsync import SyncConfig, SyncState, compress, exchange, feedback
from gradsync.comm import LocalComm
from gradsync.compress.sparse import at_least, sampled_topk
from gradsync.exchange import Route
from gradsync.sync import _derive_seed

Case = tuple[str, dict[str, Any]]

# Every codec, plus sparse settings that send zeros (top-k at 90 % of an input that is 40 % zeros,
# DGC sending everything) and that switch the index format (bitmap above a density of 1/32).
CASES: list[Case] = [(name, {}) for name in compress.names()] + [
    ("topk", {"ratio": 0.9}),
    ("topk", {"ratio": 0.5, "mode": "sampled"}),
    ("topk", {"ratio": 0.05, "mode": "sampled"}),
    ("threshold", {"threshold": 0.5}),
    ("dgc", {"ratio": 1.0, "masking": False}),
    ("randk", {"ratio": 0.5}),
    ("powersgd", {"rank": 2}),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def case_id(case: Case) -> str:
    name, args = case
    return "-".join([name, *(f"{k}={v}" for k, v in args.items())])


def make(case: Case, seed: int = 3) -> compress.Compressor:
    name, args = case
    if "seed" in compress.parameters(name):
        args = {**args, "seed": seed}
    return compress.build(name, **args)


def with_signed_zeros(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal entries, a fifth of them +0.0 and a fifth -0.0."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = x.view(-1)
    flat[::5] = 0.0
    flat[1::5] = -0.0
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits: unlike torch.equal, +0.0 and -0.0 differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype]))


def test_same_bits_tells_signed_zeros_apart() -> None:
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert same_bits(torch.tensor([-0.0]), torch.tensor([-0.0]))


# -- the codec's in-place subtraction --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sub_decoded_is_bit_identical_to_subtracting_the_decoded_tensor(
    case: Case, dtype: torch.dtype
) -> None:
    codec = make(case)
    x = with_signed_zeros(33, 17, dtype=dtype)
    if type(codec).rounds > 1:
        pytest.skip("multi-round codecs are decoded by finish(); remove_local_ covers them below")
    payload, ctx = codec.compress(x)
    decoded = codec.decompress(payload, ctx)
    # Of the compressed tensor itself (error feedback's case), and of an unrelated one.
    for out in (x, with_signed_zeros(33, 17, seed=1, dtype=dtype)):
        expected = out - decoded
        got = out.clone()
        codec.sub_decoded_(got, payload, ctx)
        assert same_bits(got, expected)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_remove_local_is_bit_identical_to_subtracting_local(case: Case) -> None:
    x = with_signed_zeros(1000)
    result = exchange.start(make(case), x.clone(), Route(LocalComm())).wait()
    expected = x - result.local()
    got = x.clone()
    assert result.remove_local_(got) is got
    assert same_bits(got, expected)


def test_a_sparse_residual_is_exactly_zero_where_entries_were_sent() -> None:
    codec = compress.build("topk", ratio=0.9)
    p = with_signed_zeros(1000)
    payload, ctx = codec.compress(p)
    sent = codec.decompress(payload, ctx) != 0
    codec.sub_decoded_(p, payload, ctx)
    assert same_bits(p[sent], torch.zeros(int(sent.sum())))


# -- error feedback ---------------------------------------------------------------------------------

FEEDBACK_CASES = [c for c in CASES if not (make(c).owns_memory or make(c).majority_vote)]


def gradients(steps: int, numel: int = 1000) -> list[torch.Tensor]:
    return [with_signed_zeros(numel, seed=seed) for seed in range(steps)]


def ef_step(fb: feedback.Feedback, codec: compress.Compressor, g: torch.Tensor) -> exchange.Exchanged:
    p = fb.prepare(g)
    result = exchange.start(codec, p, Route(LocalComm())).wait()
    fb.update(g, p, result.local, result.total, result.remove_local_)
    return result


@pytest.mark.parametrize("case", FEEDBACK_CASES, ids=case_id)
def test_ef_memory_is_bit_identical_to_p_minus_the_decoded_payload(case: Case) -> None:
    fb, codec, reference_codec = feedback.build("ef"), make(case), make(case)
    error = torch.zeros(1000)
    for g in gradients(5):
        result = ef_step(fb, codec, g)
        p = g + error
        payload, ctx = reference_codec.compress(p)
        error = p - reference_codec.decompress(payload, ctx)
        assert same_bits(fb.error, error)
        assert same_bits(result.total, reference_codec.decompress(payload, ctx))


def test_ef_alternates_between_two_buffers_and_allocates_none_per_step() -> None:
    fb, codec = feedback.build("ef"), compress.build("topk", ratio=0.1)
    addresses = []
    for g in gradients(6):
        p = fb.prepare(g)
        addresses.append(p.data_ptr())
        result = exchange.start(codec, p, Route(LocalComm())).wait()
        fb.update(g, p, result.local, result.total, result.remove_local_)
        assert fb.error is p  # the residual was taken in p itself
    assert len(set(addresses[1:])) == 2
    assert addresses[1::2] == [addresses[1]] * 3 and addresses[2::2] == [addresses[2]] * 2


def test_ef_prepare_without_update_leaves_no_trace() -> None:
    # A step found non-finite on another rank calls prepare but never update.
    gs = gradients(4)
    fb, codec = feedback.build("ef"), compress.build("topk", ratio=0.1)
    reference, reference_codec = feedback.build("ef"), compress.build("topk", ratio=0.1)
    ef_step(fb, codec, gs[0])
    ef_step(reference, reference_codec, gs[0])
    before = fb.state_dict()
    codec.compress(fb.prepare(gs[1]))  # skipped: top-k is stateless, so no undo is needed
    assert same_bits(fb.state_dict()["error"], before["error"])
    for g in gs[2:]:
        ef_step(fb, codec, g)
        ef_step(reference, reference_codec, g)
        assert same_bits(fb.error, reference.error)


@pytest.mark.parametrize("form", feedback.names())
def test_only_residual_feedback_defers_p_and_then_to_prepares_formula(form: str) -> None:
    # A form whose p is not e + g / n (momentum correction adds a velocity) must compute it itself.
    fb, g = feedback.build(form), with_signed_zeros(100)
    deferred = fb.defer(g, 4)
    if form != "ef":
        assert deferred is None
        return
    p, corrected = deferred
    assert corrected.g is g and corrected.alpha == 0.25
    assert same_bits(torch.add(corrected.base, g, alpha=corrected.alpha), fb.prepare(g.clone(), 4))
    assert p.data_ptr() == fb._spares["error"].data_ptr()  # p's buffer is the spare prepare writes into


def test_ef_state_dict_has_only_the_memory_and_round_trips() -> None:
    fb = feedback.build("ef")
    for g in gradients(3):
        ef_step(fb, compress.build("topk", ratio=0.1), g)
    state = fb.state_dict()
    assert list(state) == ["error"]
    assert state["error"] is not fb.error
    restored = feedback.build("ef")
    restored.load_state_dict(state)
    assert same_bits(restored.error, fb.error)
    with pytest.raises(ValueError, match="another error_feedback setting"):
        restored.load_state_dict({**state, "_spare": None})


def test_a_pickled_ef_leaves_its_spare_behind_and_continues_identically() -> None:
    gs = gradients(5)
    fb = feedback.build("ef")
    for g in gs[:3]:
        ef_step(fb, compress.build("topk", ratio=0.1), g)
    copy = pickle.loads(pickle.dumps(fb))
    assert copy._spares is None
    for g in gs[3:]:
        ef_step(fb, compress.build("topk", ratio=0.1), g)
        ef_step(copy, compress.build("topk", ratio=0.1), g)
        assert same_bits(copy.error, fb.error)


def test_an_ef_pickled_by_an_earlier_version_with_one_spare_still_steps() -> None:
    gs = gradients(3)
    fb, reference = feedback.build("ef"), feedback.build("ef")
    ef_step(fb, compress.build("topk", ratio=0.1), gs[0])
    ef_step(reference, compress.build("topk", ratio=0.1), gs[0])
    fb.__dict__["_spare"] = None  # the attribute earlier versions pickled
    copy = pickle.loads(pickle.dumps(fb))
    for g in gs[1:]:
        ef_step(copy, compress.build("topk", ratio=0.1), g)
        ef_step(reference, compress.build("topk", ratio=0.1), g)
        assert same_bits(copy.error, reference.error)


# -- the hook: outputs as before, and the sum decoded into the bucket where nothing needs it -------


def past_warmup(config: SyncConfig) -> SyncState:
    state = SyncState(config, LocalComm())
    for g in gradients(config.warmup_steps, 600):
        state.sync(g.clone(), 0, True).wait()
    return state


def reference_outputs(config: SyncConfig, gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A compression point driven with the formulas the hook used before: fresh tensors only."""
    codec = config.build_compressor(_derive_seed(config.seed, 0, 0))
    form = config.feedback_name
    eta = float(config.error_feedback_args.get("eta", 0.01))
    beta = float(config.error_feedback_args.get("momentum", 0.9))
    e = h_local = h_mean = u = applied = torch.zeros(gs[0].numel())
    outs = []
    for g in gs:
        u = torch.add(g, u, alpha=beta) if form == "momentum" else u  # g + beta u, as one op
        p = {
            "none": g,
            "ef": g + e,
            "ef21": g - h_local,
            "econtrol": (g - h_local).add_(e, alpha=eta),
            "momentum": e + u,
        }[form]
        result = exchange.start(codec, p, Route(LocalComm())).wait()
        out = result.total
        if form in ("ef", "momentum"):
            e = p - result.local()
        if form == "momentum":  # DGC's update direction, less what the optimizer's momentum adds
            out, applied = torch.sub(result.total, applied, alpha=beta), result.total
        elif form in ("ef21", "econtrol"):
            delta = result.local()
            if form == "econtrol":
                e = e + (g - h_local) - delta
            h_local, h_mean = h_local + delta, h_mean + result.total
            out = h_mean.clone()
        outs.append(out)
    return outs


def takes_feedback(name: str) -> bool:
    codec = compress.lookup(name)
    return name != "none" and not (codec.owns_memory or codec.majority_vote)


# Every (codec, form) pair SyncConfig accepts, and the benchmark's setting: sampled top-k with ef.
PAIRS: list[tuple[str, dict[str, Any], str]] = [
    (n, {}, f)
    for n in compress.names()
    if n != "none"  # compressor="none" is no compression: the plain allreduce
    for f in feedback.names()
    if f == "none" or takes_feedback(n)
] + [("topk", {"ratio": 0.05, "mode": "sampled"}, "ef"), ("threshold", {"threshold": 0.5}, "ef")]


@pytest.mark.parametrize(
    ("name", "args", "form"), PAIRS, ids=[case_id((n, a)) + f"-{f}" for n, a, f in PAIRS]
)
def test_sync_outputs_are_bit_identical_to_the_reference_path(name: str, args: dict, form: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # biased codecs without feedback: intended
        config = SyncConfig(
            compressor=name, compressor_args=args, error_feedback=form, warmup_steps=2, min_compress_numel=0
        )
    state = past_warmup(config)
    gs = gradients(5, 600)
    outs = [state.sync(g.clone(), 0, True).wait() for g in gs]
    for out, expected in zip(outs, reference_outputs(config, gs), strict=True):
        assert same_bits(out, expected)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_sync_with_ef_leaves_the_add_and_the_residual_to_a_codec_that_fuses_them(name, monkeypatch) -> None:
    # The outputs are checked against the formulas above; here, that the fused pass is what ran.
    config = SyncConfig(compressor=name, error_feedback="ef", warmup_steps=2, min_compress_numel=0)
    state = past_warmup(config)
    codec = type(compress.build(name))

    def unfused(self, x):
        raise AssertionError("compressed by the three-pass path")

    monkeypatch.setattr(codec, "compress", unfused)
    for g in gradients(2, 600):
        state.sync(g.clone(), 0, True).wait()
    assert state.stats()["total"]["compressed_groups"] == 2


@pytest.mark.parametrize("form", ["ef", "none"])
def test_sync_decodes_the_allgathered_sum_into_the_bucket_where_nothing_reads_it_after(form: str) -> None:
    # With ef the bucket is not what was compressed (p is); without feedback nothing decodes this
    # rank's payload again; EF21 reads only the bucket's shape.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        config = SyncConfig(compressor="topk", error_feedback=form, warmup_steps=2, min_compress_numel=0)
    state = past_warmup(config)
    for g in gradients(3, 600):
        buffer = g.clone()
        assert state.sync(buffer, 0, True).wait() is buffer
    assert state.stats()["total"]["compressed_groups"] == 3


@pytest.mark.parametrize("form", ["econtrol"])
def test_sync_leaves_the_bucket_alone_where_something_still_reads_it(form: str) -> None:
    # EControl's update reads the gradient.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        config = SyncConfig(compressor="topk", error_feedback=form, warmup_steps=2, min_compress_numel=0)
    state = past_warmup(config)
    for g in gradients(3, 600):
        buffer = g.clone()
        out = state.sync(buffer, 0, True).wait()
        assert out is not buffer
        assert same_bits(buffer, g)  # divided by a world size of one
    assert state.stats()["total"]["compressed_groups"] == 3


def test_exchange_refuses_an_out_unlike_x() -> None:
    x = torch.randn(10)
    with pytest.raises(ValueError, match="must match x"):
        exchange.start(compress.build("topk"), x, Route(LocalComm()), out=torch.empty(11))


@pytest.mark.parametrize(("name", "collective"), [("int4", "allgather"), ("qsgd", "two-shot")])
def test_exchange_refuses_a_corrected_input_where_the_codec_does_not_compute_it(name, collective) -> None:
    x = torch.empty(10)
    corrected = feedback.Corrected(torch.randn(10), torch.zeros(10), 1.0)
    with pytest.raises(ValueError, match="fuses_feedback"):
        exchange.start(compress.build(name), x, Route(LocalComm()), collective, corrected=corrected)


def test_exchange_refuses_a_corrected_input_it_would_misread() -> None:
    codec, x, g = compress.build("int4"), torch.empty(10), torch.randn(10)
    for bad in (
        {"corrected": feedback.Corrected(torch.randn(11), torch.zeros(11), 1.0)},  # another shape
        {"corrected": feedback.Corrected(g, torch.zeros(10), 1.0), "divisor": 2},  # divided twice
        {"corrected": feedback.Corrected(g, torch.zeros(10), 1.0), "out": x},  # the residual's buffer
    ):
        with pytest.raises(ValueError, match="corrected"):
            exchange.start(codec, x, Route(LocalComm()), "two-shot", **bad)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_compress_corrected_refuses_tensors_one_pass_cannot_read_and_write(name) -> None:
    codec, g, base = compress.build(name), torch.randn(256), torch.randn(256)
    with pytest.raises(ValueError, match="differ in shape"):
        codec.compress_corrected(g, base, 1.0, torch.empty(255))
    with pytest.raises(ValueError, match="out overlaps base"):
        codec.compress_corrected(g, base, 1.0, base)
    with pytest.raises(ValueError, match="out overlaps base, or part of g"):
        buffer = torch.randn(257)
        codec.compress_corrected(buffer[:256], base, 1.0, buffer[1:])


# -- sparse selection -------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1000, 4097, 100_003])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 2.5, 10.0])
def test_at_least_is_nonzero_of_the_comparison(numel: int, threshold: float) -> None:
    size = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).abs()
    expected = (size >= threshold).nonzero().squeeze(1)
    assert torch.equal(at_least(size, torch.tensor(threshold)), expected)


def test_at_least_ignores_flags_left_by_a_larger_call() -> None:
    at_least(torch.ones(1000), torch.tensor(0.0))  # the scratch flags are all set
    assert at_least(torch.zeros(13), torch.tensor(1.0)).numel() == 0


def reference_sampled_topk(
    flat: torch.Tensor, k: int, sample_ratio: float, generator: torch.Generator
) -> torch.Tensor:
    """sampled_topk as written before: boolean indexing and one nonzero() over all entries."""
    numel = flat.numel()
    size = flat.abs()
    num_samples = min(numel, max(256, int(numel * sample_ratio)))
    sample = size[torch.randint(numel, (num_samples,), generator=generator)]
    wanted = min(num_samples, max(1, int(num_samples * k / numel * 1.5) + 1))
    while wanted < num_samples:
        threshold = sample.kthvalue(num_samples - wanted + 1).values
        candidates = (size >= threshold).nonzero().squeeze(1)
        if candidates.numel() >= k:
            if candidates.numel() == k:
                return candidates
            keep = torch.zeros(candidates.numel(), dtype=torch.bool)
            keep[size[candidates].topk(k, sorted=False).indices] = True
            return candidates[keep]
        wanted *= 4
    return size.topk(k, sorted=False).indices.sort().values


@pytest.mark.parametrize(("numel", "ratio"), [(100_000, 0.01), (100_000, 0.1), (5000, 0.3), (300, 0.01)])
def test_sampled_topk_selects_what_it_selected_before(numel: int, ratio: float) -> None:
    flat = with_signed_zeros(numel, seed=numel)
    k = max(1, int(numel * ratio + 0.5))
    for seed in range(3):
        got = sampled_topk(flat, k, 0.01, torch.Generator().manual_seed(seed))
        expected = reference_sampled_topk(flat, k, 0.01, torch.Generator().manual_seed(seed))
        assert torch.equal(got, expected)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_sampled_threshold_is_the_samples_wanted_th_largest_on_every_device(device: str) -> None:
    from gradsync.compress.sparse import _largest

    sample = torch.randn(10_007, generator=torch.Generator().manual_seed(3)).abs_()
    sample[[5, 900, 7000]] = float("nan")  # ranked above every number, as kthvalue ranks it
    for wanted in (1, 3, 4, 151, 10_006):
        reference = sample.kthvalue(sample.numel() - wanted + 1).values  # on the CPU
        got, expected = float(_largest(sample.to(device), wanted)), float(reference)
        assert got == expected or (wanted <= 3 and math.isnan(got) and math.isnan(expected)), wanted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("numel", "ratio"), [(1 << 20, 0.01), (100_000, 0.1), (300, 0.01)])
def test_sampled_topk_on_a_gpu_keeps_the_exact_top_k(numel: int, ratio: float) -> None:
    from gradsync.compress.sparse import exact_topk

    flat = torch.randn(numel, generator=torch.Generator().manual_seed(numel))  # no ties
    k = max(1, int(numel * ratio))
    got = sampled_topk(flat.cuda(), k, 0.01, torch.Generator(device="cuda").manual_seed(0))
    assert torch.equal(got.cpu(), exact_topk(flat, k))
