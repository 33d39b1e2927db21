"""Model profiles: published parameter counts and FLOPs as oracles, torch modules on "meta" for the
models defined here, and the invariants of the backward schedule."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from gradsync.sim import models
from gradsync.sim.models import Layer, ModelProfile, backward_schedule

PROFILES = {name: models.build(name) for name in models.names()}


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An nn.Embedding on "meta", trainable; from a tensor, because normal_ on meta costs seconds once."""
    return nn.Embedding.from_pretrained(torch.empty(rows, dim, device="meta"), freeze=False)


@pytest.mark.parametrize("name", models.names())
def test_parameter_count_is_the_published_one(name):
    profile = PROFILES[name]
    assert profile.num_params == profile.known_params, profile.known_params_source


def lstm_module() -> nn.Module:
    """PyTorch examples' word_language_model, medium: the modules the profile describes."""
    return nn.ModuleDict(
        {
            "encoder": embedding(33_278, 650),
            "rnn": nn.LSTM(650, 650, num_layers=2, device="meta"),
            "decoder": nn.Linear(650, 33_278, device="meta"),
        }
    )


class DeepFM(nn.Module):
    """The DeepFM the profile describes: two shared tables, an MLP over the 39 field embeddings, a bias."""

    def __init__(self) -> None:
        super().__init__()
        rows = models.DEEPFM_HASHED_ROWS + models.DEEPFM_DENSE_FIELDS
        fields = models.DEEPFM_DENSE_FIELDS + models.DEEPFM_CATEGORICAL_FIELDS
        self.feature_bias = embedding(rows, 1)
        self.feature_embeddings = embedding(rows, models.DEEPFM_EMBEDDING_DIM)
        widths = (fields * models.DEEPFM_EMBEDDING_DIM, *models.DEEPFM_HIDDEN)
        blocks = [
            m for a, b in itertools.pairwise(widths) for m in (nn.Linear(a, b, device="meta"), nn.ReLU())
        ]
        self.mlp = nn.Sequential(*blocks, nn.Linear(widths[-1], 1, device="meta"))
        self.bias = nn.Parameter(torch.zeros(1, device="meta"))


@pytest.mark.parametrize(("name", "module"), [("lstm", lstm_module), ("deepfm", DeepFM)])
def test_tensors_match_the_torch_modules_built_on_meta(name, module):
    profile = PROFILES[name]
    expected = {n: p.numel() for n, p in module().named_parameters()}
    actual = {n: numel for layer in profile.layers for n, numel in layer.tensors}
    assert actual == expected
    assert profile.num_params == sum(expected.values())


@pytest.mark.parametrize("name", [n for n, p in PROFILES.items() if p.known_gflops is not None])
def test_forward_flops_are_within_10_percent_of_the_published_figure(name):
    profile = PROFILES[name]
    assert profile.forward_flops / 1e9 == pytest.approx(profile.known_gflops, rel=0.10)


# Sequence models: forward FLOPs ~ 2 x (non-embedding parameters + a tied head's) x tokens, plus
# the attention scores and context, 2 matmuls of tokens^2 x hidden per layer: 2 * 2 * L * T^2 * d
# per sample (Kaplan et al. 2020). The formula counts biases and BERT's pooler at every token and
# leaves out the norms, so it matches to a few percent, not exactly.
SEQUENCE_MODELS = {
    # name: (tokens per sample, attention layers, hidden, tied head parameters)
    "bert-base": (384, 12, 768, 0),
    "gpt2": (1024, 12, 768, 50257 * 768),
    "lstm": (35, 0, 650, 0),
    "deepfm": (1, 0, 10, 0),
}


@pytest.mark.parametrize("name", list(SEQUENCE_MODELS))
def test_forward_flops_follow_2_n_t_plus_attention(name):
    profile = PROFILES[name]
    tokens, depth, hidden, head = SEQUENCE_MODELS[name]
    embedded = sum(n for layer in profile.layers if layer.embedding_rows for _, n in layer.tensors)
    expected = 2 * (profile.num_params - embedded + head) * tokens + 2 * 2 * depth * tokens**2 * hidden
    assert profile.forward_flops == pytest.approx(expected, rel=0.03)


def test_every_model_has_a_profile_without_published_flops_only_where_none_is_standard():
    assert set(SEQUENCE_MODELS) | {n for n, p in PROFILES.items() if p.known_gflops} == set(models.names())


@pytest.mark.parametrize("name", models.names())
def test_backward_schedule_reverses_forward_order_and_ends_at_twice_the_forward(name):
    profile = PROFILES[name]
    schedule = backward_schedule(profile)
    forward_names = [tensor for layer in profile.layers for tensor, _ in layer.tensors]
    assert [tensor for tensor, _, _ in schedule] == forward_names[::-1]
    assert len(set(forward_names)) == len(forward_names)
    assert sum(numel for _, numel, _ in schedule) == profile.num_params
    ready = [flops for _, _, flops in schedule]
    assert all(a <= b for a, b in itertools.pairwise(ready))
    assert ready[-1] == pytest.approx(2 * profile.forward_flops, rel=1e-12)


@pytest.mark.parametrize("name", models.names())
def test_a_tensor_is_ready_after_the_backward_of_its_layer_and_every_layer_after_it(name):
    profile = PROFILES[name]
    ready = {tensor: flops for tensor, _, flops in backward_schedule(profile)}
    for i, layer in enumerate(profile.layers):
        expected = 2 * sum(later.forward_flops for later in profile.layers[i:])
        for tensor, _ in layer.tensors:
            assert ready[tensor] == pytest.approx(expected, rel=1e-9), tensor


def test_attributed_flops_go_to_the_first_tensor_of_each_layer_in_backprop_order():
    order = PROFILES["resnet50"].tensors_backprop_order()
    assert order[:2] == [("fc.bias", 1000, 2 * 2.0 * 2048 * 1000), ("fc.weight", 2048 * 1000, 0.0)]
    assert sum(flops for _, _, flops in order) == pytest.approx(2 * PROFILES["resnet50"].forward_flops)


def test_parameter_free_layers_delay_the_next_gradient():
    # GPT-2's tied LM head owns no tensor; its backward comes before the final LayerNorm's.
    profile = PROFILES["gpt2"]
    head = profile.layers[-1]
    assert head.name == "lm_head" and head.tensors == ()
    first = backward_schedule(profile)[0]
    assert first[0] == "transformer.ln_f.bias"
    assert first[2] == pytest.approx(2 * (head.forward_flops + profile.layers[-2].forward_flops))


def test_sparse_embeddings_carry_zens_densities():
    def densities(name):
        return {layer.name: layer.density for layer in PROFILES[name].layers if layer.density is not None}

    assert densities("lstm") == {"encoder": 0.0113}
    assert densities("deepfm") == {"feature_bias": 0.028, "feature_embeddings": 0.028}
    assert all(not densities(name) for name in ["resnet50", "resnet101", "vgg16", "bert-base", "gpt2"])


def test_build_names_the_choices_for_an_unknown_model():
    with pytest.raises(KeyError, match="unknown model 'resnet18'; choose one of: resnet50, resnet101, vgg16"):
        models.build("resnet18")
    assert models.names() == list(models.MODELS)


def test_invalid_layers_and_profiles_are_refused():
    with pytest.raises(ValueError, match="density"):
        Layer("emb", (("emb.weight", 10),), 0.0, density=0.5)
    with pytest.raises(ValueError, match="multiple of 3 rows"):
        Layer("emb", (("emb.weight", 10),), 0.0, embedding_rows=3)
    with pytest.raises(ValueError, match="numel"):
        Layer("fc", (("fc.weight", 0),), 1.0)
    free, owned = Layer("scores", (), 5.0), Layer("fc", (("fc.weight", 4),), 8.0)
    with pytest.raises(ValueError, match="first layer must own tensors"):
        ModelProfile("m", (free, owned), 1, "x", 4, "", None)
    with pytest.raises(ValueError, match="unique"):
        ModelProfile("m", (owned, owned), 1, "x", 8, "", None)
