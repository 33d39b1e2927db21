"""SyncState in a world of one (LocalComm): the hook's whole path without DDP or processes."""

from __future__ import annotations

import io
import logging
import math
import pickle
import warnings
from typing import Any

import pytest
import torch

from gradsync import SyncConfig, SyncState, checkpoint, compress, feedback
from gradsync.comm import LocalComm
from gradsync.compress import Compressor

WARMUP = 2
NUMEL = 3000


def config(**fields: Any) -> SyncConfig:
    fields = {"warmup_steps": WARMUP, "min_compress_numel": 0, **fields}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # biased codec without feedback: intended here
        return SyncConfig(**fields)


def new_state(**fields: Any) -> SyncState:
    return SyncState(config(**fields), LocalComm())


def sync(state: SyncState, g: torch.Tensor, bucket: int = 0, is_last: bool = True) -> torch.Tensor:
    return state.sync(g.clone(), bucket, is_last).wait()  # sync divides its buffer in place


def gradients(steps: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) for _ in range(steps)]


def past_warmup(state: SyncState, numel: int = NUMEL) -> None:
    for g in gradients(WARMUP, numel, seed=99):
        sync(state, g)


def feedback_state(state: SyncState) -> dict[int, dict[str, Any]]:
    return {index: point.feedback.state_dict() for index, point in state.points.items()}


def same_state(a: Any, b: Any) -> bool:
    """Equal nested dicts, with tensors compared bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    return a == b


ALL_CODECS = [name for name in compress.names() if name != "none"]  # "none": no compression at all
FORMS = feedback.names()


def takes_feedback(name: str) -> bool:
    """Whether `name` accepts an error-feedback form other than "none" (SyncConfig refuses the rest)."""
    codec = compress.lookup(name)
    return not (codec.owns_memory or codec.majority_vote)


# Every (compressor, feedback form) pair SyncConfig accepts, "auto" included.
VALID_PAIRS = [
    (n, f) for n in ALL_CODECS for f in [*FORMS, "auto"] if f in ("none", "auto") or takes_feedback(n)
]


def vote_payload_bytes(numel: int, world_size: int) -> int:
    """Bytes of the majority vote's count words: fields of bit_length(world_size) bits, 31 bits
    of each int32 word used."""
    fields_per_word = 31 // world_size.bit_length()
    return 4 * -(-numel // fields_per_word)


def reference_payload_bytes(cfg: SyncConfig, gs: list[torch.Tensor]) -> list[int]:
    """Bytes of each payload of a codec and feedback driven by hand, as the hook would in a world
    of one: prepare, compress, update with the local decode as the total."""
    codec, fb = cfg.build_compressor(seed=0), cfg.build_feedback()
    nbytes = []
    for g in gs:
        p = fb.prepare(g)
        payload, ctx = codec.compress(p)
        nbytes.append(sum(t.nbytes for t in payload))
        decoded = codec.decompress(payload, ctx)
        fb.update(g, p, lambda decoded=decoded: decoded, decoded)
    return nbytes


def test_warmup_steps_return_the_input_exactly_then_compression_starts() -> None:
    topk = {"ratio": 0.01, "sparsity_warmup_steps": 0}  # at its ratio from its first step
    state = new_state(compressor="topk", compressor_args=topk, warmup_steps=3)
    gs = gradients(4)
    for g in gs[:3]:
        assert torch.equal(sync(state, g), g)
    assert not state.points
    out = sync(state, gs[3])
    assert not torch.equal(out, gs[3])  # top-1% keeps 30 of 3000 entries
    assert int((out != 0).sum()) == 30
    steps = state.stats()["steps"]
    assert [s["compressed_groups"] for s in steps] == [0, 0, 0, 1]


def test_the_log_says_when_compression_starts_and_when_a_state_is_restored(caplog) -> None:
    caplog.set_level(logging.INFO, logger="gradsync")
    state = new_state(compressor="int8", warmup_steps=2)
    for g in gradients(4):
        sync(state, g)
    started = [r.getMessage() for r in caplog.records if "compressing" in r.getMessage()]
    assert started == ["gradsync: compressing from step 2 on, bucket 0 first: int8 by two-shot"]
    restored = new_state(compressor="int8", warmup_steps=2)
    restored.load_state_dict(state.state_dict())
    assert any(
        "restored on rank 0 at step 4: 1 compression point(s)" in r.getMessage() for r in caplog.records
    )


def test_top_k_in_the_hook_sends_more_over_its_first_compressed_steps() -> None:
    # Its sparsity warm-up counts the hook's compressed steps: 25 % of the entries over the
    # first quarter, 6.25 % over the second, then 1.5625 % (the ratio, 1 %, is below it).
    state = new_state(compressor="topk", compressor_args={"ratio": 0.01, "sparsity_warmup_steps": 8})
    sent = [int((sync(state, g) != 0).sum()) for g in gradients(WARMUP + 8)]
    assert sent[WARMUP:] == [750, 750, 188, 188, 47, 47, 30, 30]
    assert state.points[0].codec.steps == 8


def test_warmup_counts_training_steps_not_buckets() -> None:
    state = new_state(compressor="topk", compressor_args={"ratio": 0.01}, warmup_steps=2)
    for _ in range(3):
        for bucket, g in enumerate(gradients(2)):
            sync(state, g, bucket=bucket, is_last=bucket == 1)
    assert state.step == 3
    assert [s["compressed_groups"] for s in state.stats()["steps"]] == [0, 0, 2]
    assert [s["groups"] for s in state.stats()["steps"]] == [2, 2, 2]


def test_a_bucket_smaller_than_min_compress_numel_is_sent_uncompressed() -> None:
    topk = {"ratio": 0.01, "sparsity_warmup_steps": 0}
    state = new_state(compressor="topk", compressor_args=topk, min_compress_numel=1000)
    past_warmup(state, 999)
    small, large = torch.randn(999), torch.randn(1000)
    assert torch.equal(sync(state, small, bucket=0, is_last=False), small)
    last = state.stats()["last_step"]
    assert (last["compressed_groups"], last["payload_nbytes"]) == (0, 4 * 999)
    assert 0 not in state.points
    out = sync(state, large, bucket=1)
    assert int((out != 0).sum()) == 10
    last = state.stats()["last_step"]
    assert (last["groups"], last["compressed_groups"]) == (2, 1)
    assert last["payload_nbytes"] == 4 * 999 + state.points[1].codec.payload_bytes(1000)


@pytest.mark.parametrize("name", ALL_CODECS)
def test_stats_count_payload_bytes_steps_and_no_bytes_sent_in_a_world_of_one(name: str) -> None:
    state = new_state(compressor=name)
    compressed_steps = 3
    gs = gradients(WARMUP + compressed_steps)
    for g in gs:
        sync(state, g)
    stats = state.stats()
    codec_type = compress.lookup(name)
    if codec_type.majority_vote:  # the vote sends count words, not the codec's sign bits
        codec_bytes = [vote_payload_bytes(NUMEL, 1)] * compressed_steps
    elif codec_type.fixed_size:
        codec_bytes = [state.points[0].codec.payload_bytes(NUMEL)] * compressed_steps
    else:  # the size follows the data: what the codec itself produced, within its upper bound
        codec_bytes = reference_payload_bytes(state.config, gs[WARMUP:])
        assert all(0 < b <= state.points[0].codec.payload_bytes(NUMEL) for b in codec_bytes)
    assert stats["step"] == WARMUP + compressed_steps
    assert len(stats["steps"]) == WARMUP + compressed_steps
    assert [s["step"] for s in stats["steps"]] == list(range(WARMUP + compressed_steps))
    assert [s["payload_nbytes"] for s in stats["steps"][WARMUP:]] == codec_bytes
    last, total = stats["last_step"], stats["total"]
    assert (last["sent_nbytes"], last["fp32_nbytes"], last["compression_ratio"]) == (0, 0, None)
    assert total["payload_nbytes"] == WARMUP * 4 * NUMEL + sum(codec_bytes)
    assert (total["groups"], total["compressed_groups"]) == (WARMUP + compressed_steps, compressed_steps)
    assert total["numel"] == (WARMUP + compressed_steps) * NUMEL
    assert total["sent_nbytes"] == 0
    assert all(total[key] >= 0 for key in ("compress_s", "communicate_s", "decompress_s"))


def test_threshold_payload_bytes_follow_the_data() -> None:
    # The previous test would not notice a variable-size codec reporting its upper bound.
    state = new_state(compressor="threshold", compressor_args={"threshold": 1.0}, error_feedback="none")
    past_warmup(state)
    small, large = torch.full((NUMEL,), 0.5), torch.full((NUMEL,), 2.0)
    small[:10] = 3.0  # 10 entries pass
    sync(state, small)
    ten = state.stats()["last_step"]["payload_nbytes"]
    sync(state, large)
    every = state.stats()["last_step"]["payload_nbytes"]
    assert every == state.points[0].codec.payload_bytes(NUMEL)  # every entry passes: the bound
    assert ten < every
    assert ten == reference_payload_bytes(state.config, [small])[0]


@pytest.mark.parametrize("name", ALL_CODECS)
def test_without_feedback_the_output_is_the_codecs_round_trip(name: str) -> None:
    # The exchange in a world of one must decode exactly what the codec alone would.
    state = new_state(compressor=name, error_feedback="none")
    gs = gradients(WARMUP + 3)
    for g in gs[: WARMUP + 1]:
        sync(state, g)
    reference = state.config.build_compressor(seed=0)
    reference.load_state_dict(state.points[0].codec.state_dict())
    for g in gs[WARMUP + 1 :]:
        payload, ctx = reference.compress(g)
        assert torch.equal(sync(state, g), reference.decompress(payload, ctx))


BADS = pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])


@BADS
@pytest.mark.parametrize("form", [f for f in FORMS if f != "none"])
@pytest.mark.parametrize("name", [n for n in ALL_CODECS if takes_feedback(n)])
def test_a_non_finite_gradient_comes_out_non_finite_and_leaves_the_memory_untouched(
    name: str, form: str, bad: float
) -> None:
    state = new_state(compressor=name, error_feedback=form)
    gs = gradients(WARMUP + 4)
    for g in gs[: WARMUP + 2]:
        sync(state, g)
    before = feedback_state(state)
    poisoned = gs[WARMUP + 2].clone()
    poisoned[17] = bad
    out = sync(state, poisoned)
    assert bool(torch.isnan(out).all())
    assert same_state(feedback_state(state), before)
    assert state.stats()["step"] == WARMUP + 3
    after = sync(state, gs[WARMUP + 3])
    assert bool(torch.isfinite(after).all())
    if name != "none":  # a lossless codec leaves nothing to remember
        assert not same_state(feedback_state(state), before)  # the finite step updated the memory


def compressed_zeros(codec: Compressor, numel: int) -> None:
    """What the exchange does with a non-finite input: it compresses zeros instead; a multi-round
    codec stops after its first round, whose flag already says the step is void."""
    zeros = torch.zeros(numel)
    if codec.rounds > 1:
        codec.begin(zeros)  # type: ignore[attr-defined]
    else:
        codec.compress(zeros)


@BADS
@pytest.mark.parametrize("name", ALL_CODECS)
def test_a_non_finite_step_leaves_codec_state_unchanged_but_random_streams_in_step(
    name: str, bad: float
) -> None:
    # Codecs with state of their own (DGC's u, v and step count; Signum's momentum) undo the
    # skipped step. Random streams are not rewound: they advance as compressing zeros advances
    # them, which is what ranks whose input was finite do too, so ranks stay in step.
    state = new_state(compressor=name)
    gs = gradients(WARMUP + 3)
    for g in gs[: WARMUP + 2]:
        sync(state, g)
    codec = state.points[0].codec
    reference = state.config.build_compressor(seed=getattr(codec, "seed", 0))
    reference.load_state_dict(codec.state_dict())
    compressed_zeros(reference, NUMEL)
    before = codec.state_dict()
    poisoned = gs[WARMUP + 2].clone()
    poisoned[17] = bad
    out = sync(state, poisoned)
    if compress.lookup(name).preserves_nonfinite:  # carried through as it is, as by PyTorch's casts
        assert not bool(torch.isfinite(out[17])) and bool(torch.isfinite(out[:17]).all())
    else:  # the whole step is NaN on every rank
        assert bool(torch.isnan(out).all())
    after = codec.state_dict()
    assert same_state(
        {k: v for k, v in after.items() if k != "generator"},
        {k: v for k, v in before.items() if k != "generator"},
    )
    drawn_like_zeros = reference.state_dict().get("generator")
    assert same_state({"generator": after.get("generator")}, {"generator": drawn_like_zeros})
    if name in ("dgc", "signum"):  # the comparison has teeth: compressing zeros moves their memories
        assert not same_state(reference.state_dict(), before)


@pytest.mark.parametrize("name", ["none", "topk", "efsignsgd", "powersgd"])
def test_after_a_skipped_non_finite_step_a_deterministic_codec_continues_as_if_it_never_happened(
    name: str,
) -> None:
    gs = gradients(WARMUP + 5)
    skipped, reference = new_state(compressor=name), new_state(compressor=name)
    for g in gs[: WARMUP + 2]:
        sync(skipped, g)
        sync(reference, g)
    sync(skipped, torch.full((NUMEL,), math.nan))
    for g in gs[WARMUP + 2 :]:
        assert torch.equal(sync(skipped, g), sync(reference, g))


@pytest.mark.parametrize("form", [f for f in FORMS if f != "none"])
@pytest.mark.parametrize("name", [n for n in ALL_CODECS if takes_feedback(n)])
def test_a_finite_fp16_gradient_whose_memory_overflows_never_leaves_an_inf_in_a_memory(
    name: str, form: str
) -> None:
    # 60000 is finite in fp16 (whose largest value is 65504); a memory added to it, or EF21's and
    # EControl's estimates summed from it, may not be. Natural compression's payload would hide
    # such an inf (it saturates at 2^15), so what is compressed must be checked, not the gradient.
    state = new_state(compressor=name, error_feedback=form)
    past_warmup(state)
    for _ in range(3):
        try:
            out = sync(state, torch.full((NUMEL,), 60000.0, dtype=torch.float16))
        except RuntimeError as error:  # what a future's callback raised, wrapped
            assert form in ("ef21", "econtrol"), error  # their estimates overflow in update itself
            assert "FloatingPointError" in str(error) and "largest value, 65504;" in str(error)
            assert "float32 or bfloat16" in str(error)
            return
        assert bool(torch.isfinite(out).all()) or bool(torch.isnan(out).all())  # applied or skipped
        for memories in feedback_state(state).values():
            tensors = [t for t in memories.values() if isinstance(t, torch.Tensor)]
            assert all(bool(torch.isfinite(t).all()) for t in tensors)


def test_a_non_finite_gradient_during_warmup_comes_out_non_finite() -> None:
    state = new_state()
    g = torch.randn(NUMEL)
    g[0] = math.inf
    assert not bool(torch.isfinite(sync(state, g)).all())


def test_a_finite_gradient_whose_sum_overflows_is_still_finite() -> None:
    state = new_state(compressor="topk", compressor_args={"ratio": 1.0}, error_feedback="ef")
    past_warmup(state)
    g = torch.full((NUMEL,), 3e38)  # each entry near the float32 maximum: the sum is inf
    assert torch.equal(sync(state, g), g)
    assert state.points[0].feedback.error is not None  # the step counted as finite


def run_steps(state: SyncState, gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient split into two buckets of different sizes, as DDP would hand them over."""
    outs = []
    for g in gs:
        outs.append(sync(state, g[:2000], bucket=0, is_last=False))
        outs.append(sync(state, g[2000:], bucket=1, is_last=True))
    return outs


@pytest.mark.filterwarnings("ignore:compressor .* is biased:UserWarning")  # load re-validates
@pytest.mark.parametrize(("name", "form"), VALID_PAIRS, ids=[f"{n}-{f}" for n, f in VALID_PAIRS])
def test_a_restored_state_continues_with_bit_identical_outputs(name: str, form: str) -> None:
    gs = gradients(WARMUP + 6)
    state = new_state(compressor=name, error_feedback=form)
    run_steps(state, gs[: WARMUP + 3])
    checkpoint = io.BytesIO()
    torch.save(state.state_dict(), checkpoint)  # as a training script would
    expected = run_steps(state, gs[WARMUP + 3 :])
    checkpoint.seek(0)
    restored = new_state(compressor=name, error_feedback=form)
    restored.load_state_dict(torch.load(checkpoint))
    assert restored.step == WARMUP + 3
    outs = run_steps(restored, gs[WARMUP + 3 :])
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))


def test_a_state_saved_on_a_gpu_resumes_on_this_ranks_own_device() -> None:
    # Rank k's error memories were saved on the GPU it had then (here tagged "cuda:5" as torch.save
    # would tag them on GPU 5); they load onto this process's own device, the CPU here, where
    # torch.load alone refuses a GPU tensor (and on a GPU machine would put it on GPU 5, another
    # rank's or none), and training goes on as it would have.
    saving = False

    def on_gpu_5(storage: Any) -> str | None:
        return "cuda:5" if saving else None

    torch.serialization.register_package(0, on_gpu_5, lambda storage, location: None)
    gs = gradients(WARMUP + 6)
    state = new_state(error_feedback="ef")  # int4: error memories, a two-shot shard error
    run_steps(state, gs[: WARMUP + 3])
    saving = True
    try:
        saved = state.state_dict()
    finally:
        saving = False
    if torch.cuda.device_count() <= 5:  # where GPU 5 exists, torch.load would put them there
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(checkpoint.entry_body(saved["rank 0"])), weights_only=True)
    expected = run_steps(state, gs[WARMUP + 3 :])
    restored = new_state(error_feedback="ef")
    restored.load_state_dict(saved)
    outs = run_steps(restored, gs[WARMUP + 3 :])
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))


def test_a_restore_that_fails_in_a_codec_leaves_the_state_as_it_was() -> None:
    state = new_state(compressor="dgc")
    run_steps(state, gradients(WARMUP + 2))
    own = torch.load(io.BytesIO(checkpoint.entry_body(state.state_dict()["rank 0"])), weights_only=True)
    del own["points"][1]["codec"]["v"]  # the second group's codec cannot take its state
    damaged = checkpoint.pack(own, 0)
    before = (state.step, dict(state.points), state.state_dict())
    with pytest.raises(ValueError, match=r"(?s)nothing was loaded.*cannot be rebuilt \(KeyError: 'v'\)"):
        state.load_state_dict(damaged)
    assert (state.step, state.points) == before[:2]
    assert state.state_dict() == before[2]


def test_a_flipped_bit_in_a_saved_error_memory_is_refused_and_format_3_still_loads() -> None:
    # A bit flipped inside a tensor's bytes unpickles as well as the saved one: only the entry's
    # digest tells them apart, and a load must not silently change the trajectory.
    gs = gradients(WARMUP + 6)
    state = new_state(compressor="topk", error_feedback="ef")
    run_steps(state, gs[: WARMUP + 3])
    saved = state.state_dict()
    entry = bytearray(saved["rank 0"])
    entry[len(entry) // 2] ^= 0x40  # in the middle of the error memories
    restored = new_state(compressor="topk", error_feedback="ef")
    fresh = restored.state_dict()
    with pytest.raises(ValueError, match=r"(?s)nothing was loaded.*SHA-256 digest does not match"):
        restored.load_state_dict({**saved, "rank 0": bytes(entry)})
    assert restored.state_dict() == fresh
    expected = run_steps(state, gs[WARMUP + 3 :])
    # The entry a format-3 state_dict held: the same bytes without the digest, loaded unchecked.
    older = {"format": 3, "rank 0": bytes(checkpoint.entry_body(saved["rank 0"]))}
    restored.load_state_dict(older)
    outs = run_steps(restored, gs[WARMUP + 3 :])
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))


def test_the_state_dict_has_one_shape_from_creation_on() -> None:
    # torch.distributed.checkpoint loads into the keys of a fresh state's state_dict(): the
    # keys must not grow as training adds error memories.
    state = new_state(compressor="topk", error_feedback="ef")
    fresh = state.state_dict()
    run_steps(state, gradients(WARMUP + 3))
    trained = state.state_dict()
    assert trained.keys() == fresh.keys() == {"format", "rank 0"}
    assert trained["rank 0"] != fresh["rank 0"]


def test_a_fresh_state_past_warmup_does_not_continue_identically() -> None:
    # The previous test depends on what the state carries: without it, outputs differ.
    gs = gradients(WARMUP + 4)
    state, fresh = new_state(compressor="randk"), new_state(compressor="randk")
    run_steps(state, gs[: WARMUP + 3])
    run_steps(fresh, gs[:WARMUP])
    assert not torch.equal(run_steps(state, gs[-1:])[0], run_steps(fresh, gs[-1:])[0])


@pytest.mark.parametrize(
    "change",
    [
        {"compressor": "randk"},
        {"error_feedback": "ef21"},
        {"seed": 1},
        {"warmup_steps": 3},
        {"compressor_args": {"ratio": 0.02}},
    ],
    ids=lambda change: next(iter(change)),
)
def test_loading_a_state_made_with_another_config_raises_value_error(change: dict) -> None:
    state = new_state(compressor="topk", compressor_args={"ratio": 0.01})
    run_steps(state, gradients(WARMUP + 1))
    other = new_state(**{"compressor": "topk", "compressor_args": {"ratio": 0.01}, **change})
    field = next(iter(change))
    named = rf"another SyncConfig \({field} .* there, .* here\): resume with the same"
    with pytest.raises(ValueError, match=named):
        other.load_state_dict(state.state_dict())


def test_the_state_pickles_and_an_unpickled_state_refuses_to_sync() -> None:
    gs = gradients(WARMUP + 3)
    state = new_state(compressor="qsgd")
    run_steps(state, gs[: WARMUP + 1])
    unpickled = pickle.loads(pickle.dumps(state))
    assert unpickled.comm is None
    assert unpickled.stats() == state.stats()
    with pytest.raises(RuntimeError, match=r"unpickled.*load_state_dict"):
        sync(unpickled, gs[0])
    # Pickling took nothing from the original, and the unpickled state still checkpoints.
    assert state.comm is not None
    resumed = new_state(compressor="qsgd")
    resumed.load_state_dict(unpickled.state_dict())
    expected = run_steps(state, gs[WARMUP + 1 :])
    assert all(torch.equal(a, b) for a, b in zip(run_steps(resumed, gs[WARMUP + 1 :]), expected, strict=True))


def test_a_state_made_before_the_process_group_says_to_create_it_first() -> None:
    # No comm: the state binds the default group at its first exchange (a framework's comm hook
    # state is made before the framework creates the group); there is none in this process.
    state = SyncState(SyncConfig(warmup_steps=0))
    assert state.comm is None and state.rank is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        sync(state, gradients(1)[0])
    with pytest.raises(RuntimeError, match="init_process_group"):
        state.state_dict()
    with pytest.raises(TypeError, match=r"gradsync\.SyncConfig, got dict"):
        SyncState({"compressor": "int4"})  # type: ignore[arg-type]
    # Unpickled, a state not yet bound still waits for the default group; a bound one refuses.
    assert pickle.loads(pickle.dumps(state))._binds_default_group
    bound = SyncState(SyncConfig(warmup_steps=0))
    bound._bind(LocalComm())
    with pytest.raises(RuntimeError, match="unpickled"):
        sync(pickle.loads(pickle.dumps(bound)), gradients(1)[0])


def test_a_bucket_whose_size_changed_raises_value_error() -> None:
    state = new_state()
    past_warmup(state)
    sync(state, torch.randn(NUMEL))
    with pytest.raises(ValueError, match=rf"{NUMEL + 1} elements .* made for {NUMEL}"):
        sync(state, torch.randn(NUMEL + 1))


def test_the_output_has_the_shape_and_dtype_of_the_bucket() -> None:
    state = new_state(compressor="qsgd")
    past_warmup(state)
    for dtype in (torch.float32, torch.float16):
        g = torch.randn(NUMEL).to(dtype)
        out = sync(state, g)
        assert (out.shape, out.dtype) == (g.shape, g.dtype)


def one_sample_gradients(model: torch.nn.Module, seed: int) -> torch.Tensor:
    """The model's gradients on one sample, flat in parameter order: each Linear weight's is an
    outer product, a matrix of rank 1."""
    model.zero_grad()
    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_powersgd_in_the_hook_approximates_each_weight_as_its_own_matrix() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))
    params = tuple(range(len(list(model.parameters()))))
    fields = {"compressor": "powersgd", "compressor_args": {"rank": 1}, "error_feedback": "ef"}
    shaped, flat = SyncState(config(**fields), LocalComm(), model=model), new_state(**fields)
    g = one_sample_gradients(model, seed=1)
    past_warmup(shaped, g.numel())
    past_warmup(flat, g.numel())
    # Rank 1 per weight holds a one-sample gradient whole (biases go exactly); one near-square
    # view of the whole group does not.
    torch.testing.assert_close(shaped.sync(g.clone(), 0, True, params=params).wait(), g)
    assert float((sync(flat, g) - g).norm()) > 0.1 * float(g.norm())
    # A state restored from a checkpoint approximates by the same matrices, warm-started alike.
    restored = SyncState(config(**fields), LocalComm(), model=model)
    restored.load_state_dict(shaped.state_dict())
    g = one_sample_gradients(model, seed=2)
    a = shaped.sync(g.clone(), 0, True, params=params).wait()
    assert torch.equal(restored.sync(g.clone(), 0, True, params=params).wait(), a)


@pytest.mark.parametrize(
    ("call", "where", "outcome"),
    [
        (
            lambda s: s.sync(torch.ones(NUMEL), 0, True),
            "the check that every rank has the same SyncConfig",
            "Nothing was exchanged",
        ),
        (lambda s: s.full_state_dict(), "full_state_dict", "Nothing was saved"),
        (lambda s: s.load_state_dict(s.state_dict()), "load_state_dict", "Nothing was loaded"),
    ],
    ids=["config check", "full_state_dict", "load_state_dict"],
)
def test_a_peer_lost_outside_a_step_is_named_with_the_call_and_what_it_left_undone(
    monkeypatch: pytest.MonkeyPatch, call: Any, where: str, outcome: str
) -> None:
    from gradsync import sync as sync_module
    from gradsync.comm import CollectiveError

    def lost(*args: Any, **kwargs: Any) -> Any:
        raise CollectiveError("allgather of 9 uint8 elements failed: Connection closed by peer")

    state = new_state()
    monkeypatch.setattr(sync_module, "allgather_object", lost)
    with pytest.raises(CollectiveError) as raised:
        call(state)
    message = str(raised.value)
    assert message.startswith(f"gradsync: {where}: allgather of 9 uint8 elements failed")
    assert f"{outcome}: stop every rank and resume from the last checkpoint" in message
    assert "gradients were not averaged" not in message


def test_ranks_found_configured_differently_are_checked_again_on_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A caller that catches the refusal and tries again must not exchange anything unchecked.
    from gradsync import sync as sync_module

    state, other, calls = new_state(), new_state(warmup_steps=WARMUP + 1), []

    def gathered(comm: Any, seen: dict[int, str], device: Any) -> list[dict[int, str]]:
        calls.append(seen)
        return [seen, {1: other.config.fingerprint()}]

    monkeypatch.setattr(sync_module, "allgather_object", gathered)
    for _ in range(2):
        with pytest.raises(ValueError, match="different SyncConfigs"):
            state.sync(torch.ones(NUMEL), 0, True)
    assert len(calls) == 2
    assert state.step == 0  # no step was counted, nothing exchanged


def test_close_ends_the_lane_thread_and_a_later_exchange_still_runs() -> None:
    # PowerSGD waits for its P before it issues Q, so it runs on the lane's thread.
    state = new_state(compressor="powersgd", compressor_args={"rank": 1}, error_feedback="ef", warmup_steps=0)
    g = torch.randn(64 * 48, generator=torch.Generator().manual_seed(0))
    sync(state, g)
    thread = state.lane._thread
    assert thread is not None and thread.is_alive()  # it idles a minute after its last program
    state.close()
    assert not thread.is_alive()
    assert torch.isfinite(sync(state, g)).all()  # a closed state still exchanges, on a new thread


def test_a_model_too_small_to_compress_is_said_once_after_warm_up(caplog: pytest.LogCaptureFixture) -> None:
    # The one line on a small model compresses nothing: a user must hear why, not find it in stats.
    state = new_state(compressor="int4", min_compress_numel=2500)
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        run_steps(state, gradients(WARMUP + 3))  # buckets of 2000 and 1000 elements
    said = [r.getMessage() for r in caplog.records if "nothing is compressed" in r.getMessage()]
    assert said == [
        "gradsync: nothing is compressed: the largest bucket, 2000 elements, is below "
        "min_compress_numel=2500 (where compressing costs more than it saves); lower "
        "SyncConfig(min_compress_numel=...) to compress smaller ones"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        run_steps(new_state(compressor="int4", min_compress_numel=1500), gradients(WARMUP + 3))
    assert not [r for r in caplog.records if "nothing is compressed" in r.getMessage()]


def test_a_step_met_again_after_a_restore_is_not_taken_for_the_skipped_one() -> None:
    # Step s was skipped (not finite); a checkpoint from before s is loaded in the same process
    # and training meets step s again, finite: it keeps what it sends, as a fresh process would.
    gs = gradients(3)
    state = new_state(compressor="topk", compressor_args={"ratio": 0.01})
    past_warmup(state)
    saved = state.state_dict()
    assert not math.isfinite(float(sync(state, torch.full((NUMEL,), math.inf)).sum()))
    state.load_state_dict(saved)
    fresh = new_state(compressor="topk", compressor_args={"ratio": 0.01})
    fresh.load_state_dict(saved)
    for g in gs:
        assert torch.equal(sync(state, g), sync(fresh, g))
    assert same_state(feedback_state(state), feedback_state(fresh))
    assert any(bool(t.any()) for t in feedback_state(state)[0].values())
