"""The Workload contract, checked over the whole registry with small options, and each workload's own
guarantees (parameter counts, causality, sparse embedding gradients, the tokenizers)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from gradsync import workloads
from gradsync.workloads import corpus
from gradsync.workloads.base import Workload, epoch_indices, flat_cross_entropy, heldout_sums, shard_bounds

# Small options per workload, so the whole file runs in seconds; every registered workload needs
# an entry (test_every_workload_has_small_options).
SMALL: dict[str, dict[str, Any]] = {
    "gpt-tiny": dict(
        d_model=32, n_layers=2, n_heads=4, context=16, batch_size=4, corpus_chars=60_000, eval_samples=10
    ),
    "mlp-wide": dict(
        width=64, depth=2, features=16, classes=10, batch_size=8, train_samples=100, eval_samples=50
    ),
    "embed-lm": dict(
        vocab_size=500,
        output_vocab=50,
        dim=16,
        context=4,
        hidden=32,
        batch_size=16,
        corpus_chars=100_000,
        eval_samples=40,
    ),
    "convnet": dict(channels=8, batch_size=16, eval_samples=97),
}
NAMES = workloads.names()
WORLD_SIZES = [2, 3]


def small(name: str, seed: int = 0, **overrides: Any) -> workloads.Workload:
    return workloads.build(name, seed=seed, **{**SMALL[name], **overrides})


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


class Probe(nn.Module):
    """Delegates to `inner` and records, for every forward, whether grad was enabled and whether
    the inner model was in training mode."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((torch.is_grad_enabled(), self.inner.training))
        return self.inner(x)


# --- the registry ------------------------------------------------------------------------------


def test_registry_names_the_four_workloads() -> None:
    assert NAMES == ["gpt-tiny", "mlp-wide", "embed-lm", "convnet"]


def test_every_workload_has_small_options() -> None:
    assert set(SMALL) == set(NAMES)
    for name in NAMES:
        assert set(SMALL[name]) <= set(workloads.options(name)), name


def test_options_list_constructor_defaults_without_seed() -> None:
    opts = workloads.options("gpt-tiny")
    assert "seed" not in opts
    assert opts["d_model"] == 512 and opts["n_layers"] == 6 and opts["context"] == 64


def test_unknown_name_raises_key_error_listing_the_names() -> None:
    with pytest.raises(KeyError, match="available: gpt-tiny, mlp-wide, embed-lm, convnet"):
        workloads.build("resnet-50")
    with pytest.raises(KeyError, match="gpt-tiny"):
        workloads.options("resnet-50")


def test_unknown_option_raises_type_error_listing_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"\['widht'\].*valid options: \['batch_size', 'classes'"):
        workloads.build("mlp-wide", widht=10)


@pytest.mark.parametrize(
    ("name", "bad", "pattern"),
    [
        ("gpt-tiny", {"n_heads": 3}, "d_model=32 is not divisible by n_heads=3"),
        ("gpt-tiny", {"corpus_chars": 100}, "corpus_chars=100 is out of range"),
        ("mlp-wide", {"classes": 1}, "classes=1 is out of range"),
        ("mlp-wide", {"batch_size": 0}, "batch_size=0 is out of range"),
        ("embed-lm", {"output_vocab": 501}, "output_vocab=501 is out of range"),
        ("embed-lm", {"sparse": "yes"}, "sparse='yes' must be True or False"),
        ("convnet", {"channels": 12}, "channels=12 is not a multiple of 8"),
        ("convnet", {"eval_samples": 1797}, "eval_samples=1797 is out of range"),
        ("convnet", {"batch_size": 2.5}, r"batch_size=2.5 must be an integer"),
    ],
)
def test_bad_values_raise_value_error_naming_them(name: str, bad: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        small(name, **bad)


def test_negative_seed_is_rejected() -> None:
    with pytest.raises(ValueError, match="seed=-1 is out of range"):
        small("convnet", seed=-1)


@pytest.mark.parametrize("name", NAMES)
def test_batch_rejects_a_rank_outside_the_world(name: str) -> None:
    w = small(name)
    with pytest.raises(ValueError, match="rank=2 is out of range"):
        w.batch(0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size=0 is out of range"):
        evaluate(w, w.model(), rank=0, world_size=0)


def evaluate(w: Workload, model: torch.nn.Module, rank: int, world_size: int) -> dict[str, float]:
    """The held-out totals of rank's shard, as the benchmark's worker sums them."""
    return heldout_sums(*w.heldout_losses(model, rank, world_size), counts_correct=w.counts_correct)


# --- the contract, over the whole registry -------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_builds_and_describes_itself(name: str) -> None:
    w = small(name)
    model = w.model()
    assert w.name == name and w.metric == "loss"
    assert w.batch_size == SMALL[name]["batch_size"]
    assert w.num_params() == sum(p.numel() for p in model.parameters())
    assert name in w.describe() and f"{w.num_params():,} parameters" in w.describe()
    inputs, targets = w.batch(0, 0, 1)
    assert inputs.shape[0] == targets.shape[0] == w.batch_size
    assert torch.isfinite(w.loss(model, inputs, targets))


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_gives_the_same_weights_and_another_seed_other_weights(name: str) -> None:
    assert_same_weights(small(name).model(), small(name).model())
    a, b = small(name, seed=0).model(), small(name, seed=1).model()
    assert not torch.equal(next(a.parameters()), next(b.parameters()))


@pytest.mark.parametrize("name", NAMES)
def test_leaves_the_global_rng_alone(name: str) -> None:
    w = small(name)
    before = torch.get_rng_state()
    model = w.model()
    w.batch(3, 1, 2)
    evaluate(w, model, 0, 1)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("name", NAMES)
def test_batches_depend_on_seed_and_step(name: str) -> None:
    a, b, other = small(name), small(name), small(name, seed=1)
    for step in (0, 7):
        xa, ya = a.batch(step, 0, 1)
        xb, yb = b.batch(step, 0, 1)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, other.batch(step, 0, 1)[0])
    assert not torch.equal(a.batch(0, 0, 1)[0], a.batch(1, 0, 1)[0])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_rank_shards_tile_the_global_batch(name: str, world_size: int) -> None:
    w = small(name)
    whole = small(name, batch_size=w.batch_size * world_size)
    for step in (0, 5):
        shards = [w.batch(step, rank, world_size) for rank in range(world_size)]
        global_inputs, global_targets = whole.batch(step, 0, 1)
        # Rank r holds rows [r * batch_size, (r + 1) * batch_size) of the global batch: disjoint
        # slices whose union, in rank order, is the global batch.
        assert torch.equal(torch.cat([x for x, _ in shards]), global_inputs)
        assert torch.equal(torch.cat([y for _, y in shards]), global_targets)
        assert all(x.shape[0] == w.batch_size for x, _ in shards)


@pytest.mark.parametrize("name", NAMES)
def test_evaluation_shards_partition_the_heldout_set(name: str) -> None:
    w = small(name)
    model = w.model()
    whole = evaluate(w, model, 0, 1)
    # gpt-tiny predicts every position of a window, the others one target per sample.
    predictions_per_sample = SMALL[name]["context"] if name == "gpt-tiny" else 1
    assert whole["count"] == w.heldout_size * predictions_per_sample
    assert math.isfinite(whole["loss_sum"]) and whole["loss_sum"] > 0
    assert ("correct" in whole) == w.counts_correct
    for world_size in (2, 3, 7):
        shards = [evaluate(w, model, rank, world_size) for rank in range(world_size)]
        for key, total in whole.items():
            assert sum(s[key] for s in shards) == pytest.approx(total, rel=1e-5), key


@pytest.mark.parametrize("name", NAMES)
def test_heldout_losses_of_the_shards_in_rank_order_are_the_whole_sets(name: str) -> None:
    # Runs compared prediction by prediction (the benchmark's paired difference) need the same
    # predictions in the same order, however many ranks evaluated them.
    w = small(name)
    model = w.model()
    whole, correct = w.heldout_losses(model, 0, 1)
    assert whole.dtype == torch.float64 and whole.numel() == evaluate(w, model, 0, 1)["count"]
    for world_size in (2, 3):
        shards = [w.heldout_losses(model, rank, world_size) for rank in range(world_size)]
        assert torch.allclose(torch.cat([losses for losses, _ in shards]), whole, rtol=1e-5)
        assert sum(c for _, c in shards) == correct


def test_mlp_wide_decays_its_learning_rate_to_zero_by_a_cosine_over_the_run() -> None:
    w = small("mlp-wide")
    optimizer = w.recommended_optimizer(w.model().parameters())
    schedule = w.recommended_schedule(optimizer, steps=8)
    rates = []
    for _ in range(8):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    expected = [w.recommended_lr * (1 + math.cos(math.pi * k / 8)) / 2 for k in range(8)]
    assert rates == pytest.approx(expected)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # after the last step
    with pytest.raises(ValueError, match="steps=0 is out of range"):
        w.recommended_schedule(optimizer, steps=0)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "mlp-wide"])
def test_the_other_workloads_keep_a_constant_rate(name: str) -> None:
    w = small(name)
    assert w.recommended_schedule(w.recommended_optimizer(w.model().parameters()), steps=10) is None


def test_shard_bounds_are_disjoint_and_cover_everything() -> None:
    for total in (0, 1, 10, 97):
        for world_size in (1, 2, 3, 7):
            covered = [i for r in range(world_size) for i in range(*shard_bounds(total, r, world_size))]
            assert covered == list(range(total))


@pytest.mark.parametrize("name", NAMES)
def test_heldout_losses_run_without_grad_in_eval_mode_and_restore_the_mode(name: str) -> None:
    w = small(name)
    probe = Probe(w.model())
    probe.train()
    evaluate(w, probe, 0, 1)
    assert probe.calls and set(probe.calls) == {(False, False)}
    assert all(m.training for m in probe.modules())
    probe.eval()
    evaluate(w, probe, 0, 1)
    assert not any(m.training for m in probe.modules())


@pytest.mark.parametrize("name", NAMES)
def test_heldout_sums_add_the_squared_losses_for_the_standard_error(name: str) -> None:
    w = small(name)
    model = w.model()
    sums = evaluate(w, model, 0, 1)
    inputs, targets = w.heldout_samples(torch.arange(w.heldout_size))
    with torch.no_grad():
        losses = flat_cross_entropy(model(inputs), targets, reduction="none").double()
    assert sums["count"] == losses.numel()
    assert sums["loss_sum"] == pytest.approx(float(losses.sum()), rel=1e-9)
    assert sums["loss_sq_sum"] == pytest.approx(float(losses.square().sum()), rel=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_a_few_sgd_steps_reduce_the_loss_on_a_fixed_batch(name: str) -> None:
    w = small(name)
    model = w.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs, targets = w.batch(0, 0, 1)
    first = w.loss(model, inputs, targets).item()
    for _ in range(10):
        optimizer.zero_grad()
        w.loss(model, inputs, targets).backward()
        optimizer.step()
    assert w.loss(model, inputs, targets).item() < 0.8 * first


@pytest.mark.parametrize("name", NAMES)
def test_recommended_optimizer_updates_every_parameter(name: str) -> None:
    w = small(name)
    model = w.model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = w.recommended_optimizer(model.parameters())
    assert isinstance(optimizer, torch.optim.Optimizer)
    # Two steps: the convnet's residual branches start at zero scale, so their weights get no
    # gradient before the first step has moved that scale.
    for step in range(2):
        optimizer.zero_grad()
        w.loss(model, *w.batch(step, 0, 1)).backward()
        optimizer.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
    assert all(changed), [n for (n, _), c in zip(model.named_parameters(), changed, strict=True) if not c]


def test_epoch_indices_visit_every_sample_once_per_epoch() -> None:
    population, global_batch = 10, 4
    visited = torch.cat([epoch_indices(0, step, global_batch, population) for step in range(10)])
    for epoch in range(4):
        assert sorted(visited[epoch * population : (epoch + 1) * population].tolist()) == list(range(10))
    assert not torch.equal(visited[:population], visited[population : 2 * population])


# --- gpt-tiny ------------------------------------------------------------------------------------


def test_gpt_tiny_default_model_has_about_19m_parameters() -> None:
    # Default architecture; a tiny corpus, which does not change the model.
    w = workloads.build("gpt-tiny", corpus_chars=5_000)
    d, layers, vocab, context = 512, 6, corpus.CHAR_VOCAB, 64
    per_block = 12 * d * d + 13 * d  # qkv, proj, fc, out with biases; two LayerNorms
    expected = vocab * d + context * d + layers * per_block + 2 * d + d * vocab
    assert w.num_params() == expected
    assert 18_000_000 <= expected <= 22_000_000


def test_gpt_tiny_targets_are_the_inputs_shifted_by_one() -> None:
    inputs, targets = small("gpt-tiny").batch(2, 0, 1)
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < corpus.CHAR_VOCAB


def test_gpt_tiny_is_causal() -> None:
    w = small("gpt-tiny")
    model = w.model()
    inputs, _ = w.batch(0, 0, 1)
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % corpus.CHAR_VOCAB
    with torch.no_grad():
        a, b = model(inputs), model(changed)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_encode_chars_gives_one_token_per_character() -> None:
    texts = ["def f(x):\n", "    return 'é€' + \"😀\"  # \ufffd\n"]
    expected = [ord(c) if ord(c) < 128 else corpus.NON_ASCII_TOKEN for c in "".join(texts)]
    assert corpus.encode_chars(texts).tolist() == expected


def test_stdlib_corpus_has_the_requested_length() -> None:
    assert len(corpus.char_tokens(12_345)) == 12_345
    assert sum(len(t) for t in corpus.stdlib_texts(12_345)) == 12_345


# --- mlp-wide ------------------------------------------------------------------------------------


def test_mlp_wide_default_has_at_least_20m_parameters() -> None:
    assert workloads.build("mlp-wide").num_params() >= 20_000_000


def test_mlp_wide_samples_are_a_function_of_their_index() -> None:
    w = small("mlp-wide")
    indices = torch.tensor([3, 17, 3])
    x, y = w.training_samples(indices)
    assert torch.equal(x[0], x[2]) and y[0] == y[2]
    assert not torch.equal(x[0], x[1])
    # The held-out samples follow the training samples: none of them is trained on.
    assert not torch.equal(w.heldout_samples(torch.tensor([0]))[0], w.training_samples(torch.tensor([0]))[0])
    assert torch.equal(w.heldout_samples(torch.tensor([0]))[0], w.training_samples(torch.tensor([100]))[0])


# --- embed-lm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse", [False, True])
def test_embed_lm_gradient_touches_only_the_batch_words(sparse: bool) -> None:
    w = small("embed-lm", sparse=sparse)
    model = w.model()
    inputs, targets = w.batch(0, 0, 1)
    w.loss(model, inputs, targets).backward()
    grad = dict(model.named_parameters())[w.embedding_parameter].grad
    if sparse:
        assert grad.is_sparse
        rows = torch.unique(grad.coalesce().indices())
    else:
        rows = torch.nonzero(grad.abs().sum(1)).flatten()
    assert torch.equal(rows, w.touched_rows(inputs))
    assert w.touched_fraction(inputs) == len(torch.unique(inputs)) / 500 < 0.2


def test_embed_lm_targets_fold_rare_words_into_other() -> None:
    w = small("embed-lm")
    position = torch.arange(10, 2000)
    inputs, targets = w.training_samples(position)
    ids = w.train_ids[position].long()
    assert torch.equal(inputs[:, -1], w.train_ids[position - 1].long())
    assert torch.equal(targets, torch.where(ids < 49, ids, torch.tensor(49)))
    assert (targets == 49).any() and (targets < 49).any()


def test_encode_words_ranks_by_frequency_and_maps_rare_words_to_unk() -> None:
    ids, words = corpus.encode_words(["b = a.b(a, b)\n", "c"], vocab_size=4)
    # counts: b 3, a 2, then '(' ')' ',' '.' '=' 'c' once each: alphabetical among the ties
    assert words == ("b", "a", "(")
    assert ids.tolist() == [0, 3, 1, 3, 0, 2, 1, 3, 0, 3, 3]


def test_embed_lm_warns_when_the_vocabulary_outgrows_the_corpus() -> None:
    with pytest.warns(UserWarning, match="embedding rows are never used"):
        small("embed-lm", corpus_chars=2_000)


# --- convnet -------------------------------------------------------------------------------------


def test_convnet_has_no_buffers_for_ddp_to_broadcast() -> None:
    assert list(small("convnet").model().buffers()) == []


def test_convnet_heldout_split_is_fixed_and_disjoint_from_training() -> None:
    a, b = small("convnet", seed=0), small("convnet", seed=5)
    assert torch.equal(a.heldout_images, b.heldout_images)
    assert len(a.train_labels) + a.heldout_size == 1797
    train_rows = {tuple(row.tolist()) for row in a.train_images.flatten(1)}
    # Duplicated images aside, held-out images are not training images.
    overlap = sum(tuple(row.tolist()) in train_rows for row in a.heldout_images.flatten(1))
    assert overlap < 5
