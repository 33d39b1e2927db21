"""Model profiles for the timeline simulator: every trainable tensor, in order, and the FLOPs behind it.

Each profile is built in code from the architecture's definition (no downloads, no torch): its
layers in forward order, each with its trainable tensors (named as the reference implementation
names its parameters) and its forward FLOPs per sample. (Over 400 lines: one builder per model
family (ResNet, VGG, BERT, GPT-2, LSTM, DeepFM), all sharing the counting rules below.)

How compute is counted and attributed, so that a simulator can turn FLOPs into time:

- A multiply-add is 2 FLOPs. Matmuls and convolutions count 2 x their MACs; normalisations count
  NORM_FLOPS_PER_ELEMENT per output element. Activations, residual adds, pooling, softmax, dropout
  and embedding lookups count 0: they are memory-bound and below 1% of the matmul FLOPs here.
- A layer's backward costs BACKWARD_FACTOR = 2 x its forward FLOPs: the gradient with respect to
  its input and the one with respect to its weights, each about one forward. (The first layer's
  input gradient is not needed; it is charged anyway, for one rule.)
- Backward runs the layers in reverse forward order, and all tensors of a layer become ready when
  that layer's backward finishes. Within a layer the tensors are also reversed, so the backprop
  order of tensors is exactly the reverse of their forward order.
- Parameter-free layers that cost FLOPs (attention scores, GPT-2's tied LM head) are kept as
  Layers with `tensors=()`: they own no gradient, but their backward delays every later one. The
  first layer must own tensors, so that every backward FLOP ends before some gradient is ready.

Example:
    >>> profile = build("resnet50")
    >>> profile.num_params, round(profile.forward_flops / 1e9, 2)
    (25557032, 8.22)
    >>> backward_schedule(profile)[:2]  # the classifier's gradients are ready first
    [('fc.bias', 1000, 8192000.0), ('fc.weight', 2048000, 8192000.0)]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

# Backward = gradient w.r.t. the input + gradient w.r.t. the weights, each costing one forward.
BACKWARD_FACTOR = 2
# BatchNorm / LayerNorm in training: mean and variance (2 FLOPs per element) and the normalise,
# scale and shift (2 more). Small next to the matmuls either way.
NORM_FLOPS_PER_ELEMENT = 4


@dataclass(frozen=True)
class Layer:
    """One layer in forward order: its trainable tensors and its forward FLOPs per sample."""

    name: str  # module path, e.g. "layer3.2.conv2", "encoder.layer.4.attention.self.query"
    tensors: tuple[tuple[str, int], ...]  # (parameter name, numel); () for parameter-free layers
    forward_flops: float  # per sample (1 multiply-add = 2 FLOPs)
    embedding_rows: int | None = None  # rows of an embedding table; None for other layers
    # Embeddings only: typical fraction of rows with a nonzero gradient in one worker's batch (Zen's
    # measurements); None where the gradient is treated as dense (unmeasured, or tied to an output).
    density: float | None = None

    def __post_init__(self) -> None:
        if self.forward_flops < 0:
            raise ValueError(f"layer {self.name!r}: forward_flops={self.forward_flops} must be >= 0")
        for tensor, numel in self.tensors:
            if numel < 1:
                raise ValueError(f"layer {self.name!r}: tensor {tensor!r} has numel={numel}; must be >= 1")
        if self.density is not None and self.embedding_rows is None:
            raise ValueError(f"layer {self.name!r}: density is for embedding tables; set embedding_rows too")
        if self.density is not None and not 0 < self.density <= 1:
            raise ValueError(f"layer {self.name!r}: density={self.density} must be in (0, 1]")
        if self.embedding_rows is not None:
            rows = self.embedding_rows
            if rows < 1 or any(numel % rows for _, numel in self.tensors):
                raise ValueError(
                    f"layer {self.name!r}: every tensor's numel must be a multiple of {rows} rows"
                )


@dataclass(frozen=True)
class ModelProfile:
    """A model as the simulator sees it: its layers' tensors and FLOPs, and a per-worker batch.

    Compute attribution is the module docstring's: backward of a layer = BACKWARD_FACTOR x its
    forward, layers run in reverse, and a layer's tensors are ready when its backward ends.
    """

    name: str  # the key in MODELS
    layers: tuple[Layer, ...]  # forward order
    batch_size: int  # samples per worker, the setting of the Espresso or Zen evaluation named per model
    sample: str  # what one sample is, e.g. "224x224 image", "128 tokens"
    known_params: int  # the published parameter count
    known_params_source: str  # where that count is published
    known_gflops: float | None  # published forward GFLOPs per sample (2 x GMACs), where well known

    def __post_init__(self) -> None:
        if not self.layers or not self.layers[0].tensors:
            raise ValueError(
                f"model {self.name!r}: the first layer must own tensors, or its backward would come "
                "after every gradient; fold a parameter-free first layer into the next one"
            )
        names = [tensor for layer in self.layers for tensor, _ in layer.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r}: tensor names must be unique")
        if self.batch_size < 1:
            raise ValueError(f"model {self.name!r}: batch_size={self.batch_size} must be >= 1 samples")

    @property
    def num_params(self) -> int:
        return sum(numel for layer in self.layers for _, numel in layer.tensors)

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs per sample, parameter-free layers included."""
        return sum(layer.forward_flops for layer in self.layers)

    def tensors_backprop_order(self) -> list[tuple[str, int, float]]:
        """[(tensor name, numel, backward FLOPs per sample spent since the previous gradient was ready)].

        A layer's backward FLOPs, and those of the parameter-free layers run just before it, go to
        its first tensor in backprop order; its other tensors, ready at the same moment, get 0.
        The attributed FLOPs sum to BACKWARD_FACTOR x forward_flops.
        """
        order, pending = [], 0.0
        for layer in reversed(self.layers):
            pending += BACKWARD_FACTOR * layer.forward_flops
            for tensor, numel in reversed(layer.tensors):
                order.append((tensor, numel, pending))
                pending = 0.0
        return order


def backward_schedule(profile: ModelProfile) -> list[tuple[str, int, float]]:
    """[(tensor name, numel, cumulative backward FLOPs per sample when its gradient is ready)] in
    backprop order (the last layer's tensors first); the last entry is at 2 x forward FLOPs.

    Example:
        >>> backward_schedule(build("lstm"))[-1][:2]
        ('encoder.weight', 21630700)
    """
    schedule, done = [], 0.0
    for tensor, numel, flops in profile.tensors_backprop_order():
        done += flops
        schedule.append((tensor, numel, done))
    return schedule


# --- layer helpers: numels and FLOPs per sample from a layer's shape -------------------------------


def _conv(name: str, c_in: int, c_out: int, k: int, hw_out: int, bias: bool = False) -> Layer:
    """A k x k convolution producing an hw_out x hw_out map."""
    weight = k * k * c_in * c_out
    tensors = ((f"{name}.weight", weight),) + (((f"{name}.bias", c_out),) if bias else ())
    return Layer(name, tensors, 2.0 * weight * hw_out * hw_out)


def _batchnorm(name: str, channels: int, hw: int) -> Layer:
    return Layer(
        name,
        ((f"{name}.weight", channels), (f"{name}.bias", channels)),
        float(NORM_FLOPS_PER_ELEMENT * channels * hw * hw),
    )


def _linear(name: str, d_in: int, d_out: int, tokens: int = 1, bias: bool = True) -> Layer:
    """A dense layer applied to `tokens` positions of one sample."""
    tensors = ((f"{name}.weight", d_in * d_out),) + (((f"{name}.bias", d_out),) if bias else ())
    return Layer(name, tensors, 2.0 * d_in * d_out * tokens)


def _layernorm(name: str, d: int, tokens: int) -> Layer:
    return Layer(
        name, ((f"{name}.weight", d), (f"{name}.bias", d)), float(NORM_FLOPS_PER_ELEMENT * d * tokens)
    )


def _embedding(name: str, rows: int, dim: int, density: float | None = None) -> Layer:
    """A lookup table: no FLOPs forward (a gather), so none backward by the 2x rule either."""
    return Layer(name, ((f"{name}.weight", rows * dim),), 0.0, embedding_rows=rows, density=density)


def _attention(name: str, d: int, tokens: int) -> Layer:
    """Scores Q K^T and their weighted sum of V: two tokens x tokens x d matmuls, no parameters.

    Causal models compute the full square and mask it, so the count is the same for GPT-2.
    """
    return Layer(name, (), 2.0 * 2 * tokens * tokens * d)


# --- convolutional networks (torchvision) --------------------------------------------------------


def _bottleneck(prefix: str, c_in: int, width: int, hw_in: int, stride: int) -> list[Layer]:
    """torchvision's Bottleneck, v1.5: the stride is on the 3x3 convolution.

    The shortcut runs after the main branch in forward, so its backward comes first.
    """
    hw_out, c_out = hw_in // stride, 4 * width
    layers = [
        _conv(f"{prefix}.conv1", c_in, width, 1, hw_in),
        _batchnorm(f"{prefix}.bn1", width, hw_in),
        _conv(f"{prefix}.conv2", width, width, 3, hw_out),
        _batchnorm(f"{prefix}.bn2", width, hw_out),
        _conv(f"{prefix}.conv3", width, c_out, 1, hw_out),
        _batchnorm(f"{prefix}.bn3", c_out, hw_out),
    ]
    if stride != 1 or c_in != c_out:
        layers += [
            _conv(f"{prefix}.downsample.0", c_in, c_out, 1, hw_out),
            _batchnorm(f"{prefix}.downsample.1", c_out, hw_out),
        ]
    return layers


def _resnet(
    name: str, blocks: tuple[int, int, int, int], known_params: int, known_gmacs: float
) -> ModelProfile:
    layers = [_conv("conv1", 3, 64, 7, 112), _batchnorm("bn1", 64, 112)]
    c_in, hw = 64, 56  # after the 3x3 stride-2 max pool
    for stage, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True), start=1):
        for block in range(count):
            stride = 2 if stage > 1 and block == 0 else 1
            layers += _bottleneck(f"layer{stage}.{block}", c_in, width, hw, stride)
            c_in, hw = 4 * width, hw // stride
    layers.append(_linear("fc", c_in, 1000))  # after global average pooling
    return ModelProfile(
        name,
        tuple(layers),
        batch_size=32,  # Espresso's ResNet-101 runs: --batch-size 32 per GPU (ImageNet); ResNet-50 alike
        sample="224x224 image",
        known_params=known_params,
        known_params_source=f"torchvision {name}: {known_params:,}",
        # torchvision's model table lists "GFLOPS" that are GMACs: 4.09 (resnet50), 7.80 (resnet101).
        known_gflops=2 * known_gmacs,
    )


def resnet50() -> ModelProfile:
    return _resnet("resnet50", (3, 4, 6, 3), 25_557_032, 4.09)


def resnet101() -> ModelProfile:
    return _resnet("resnet101", (3, 4, 23, 3), 44_549_160, 7.80)


def vgg16() -> ModelProfile:
    """torchvision VGG-16 without BatchNorm; module indices count its ReLU and pooling modules."""
    plan = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
    layers, index, c_in, hw = [], 0, 3, 224
    for item in plan:
        if item == "M":
            hw, index = hw // 2, index + 1
        else:
            layers.append(_conv(f"features.{index}", c_in, item, 3, hw, bias=True))
            c_in, index = item, index + 2  # the conv and its ReLU
    flat = c_in * 7 * 7  # the adaptive pool is the identity on 224x224 inputs
    layers += [
        _linear("classifier.0", flat, 4096),
        _linear("classifier.3", 4096, 4096),
        _linear("classifier.6", 4096, 1000),
    ]
    return ModelProfile(
        "vgg16",
        tuple(layers),
        batch_size=32,  # Espresso's VGG16 runs: --batch-size 32 per GPU (ImageNet)
        sample="224x224 image",
        known_params=138_357_544,
        known_params_source="torchvision vgg16: 138,357,544",
        known_gflops=2 * 15.47,  # torchvision's model table: 15.47 "GFLOPS" (GMACs)
    )


# --- transformers (HuggingFace parameter names) ---------------------------------------------------


def _bert_layer(prefix: str, d: int, ffn: int, tokens: int) -> list[Layer]:
    """A post-LayerNorm encoder layer of BertModel."""
    return [
        _linear(f"{prefix}.attention.self.query", d, d, tokens),
        _linear(f"{prefix}.attention.self.key", d, d, tokens),
        _linear(f"{prefix}.attention.self.value", d, d, tokens),
        _attention(f"{prefix}.attention.self.scores", d, tokens),
        _linear(f"{prefix}.attention.output.dense", d, d, tokens),
        _layernorm(f"{prefix}.attention.output.LayerNorm", d, tokens),
        _linear(f"{prefix}.intermediate.dense", d, ffn, tokens),
        _linear(f"{prefix}.output.dense", ffn, d, tokens),
        _layernorm(f"{prefix}.output.LayerNorm", d, tokens),
    ]


def bert_base() -> ModelProfile:
    """BertModel (bert-base-uncased): embeddings, 12 encoder layers and the pooler."""
    vocab, positions, types, d, ffn, depth, tokens = 30522, 512, 2, 768, 3072, 12, 384
    layers = [
        _embedding("embeddings.word_embeddings", vocab, d),
        _embedding("embeddings.position_embeddings", positions, d),
        _embedding("embeddings.token_type_embeddings", types, d),
        _layernorm("embeddings.LayerNorm", d, tokens),
    ]
    for i in range(depth):
        layers += _bert_layer(f"encoder.layer.{i}", d, ffn, tokens)
    layers.append(_linear("pooler.dense", d, d))  # on the first token only
    return ModelProfile(
        "bert-base",
        tuple(layers),
        # Espresso fine-tunes BERT-base on SQuAD: --train_batch_size=8 per GPU, --max_seq_length=384.
        batch_size=8,
        sample=f"{tokens} tokens",
        known_params=109_482_240,
        known_params_source="HuggingFace BertModel bert-base-uncased: 109,482,240",
        known_gflops=None,  # no standard published figure; tests use 2 N T + attention
    )


def _gpt2_block(prefix: str, d: int, tokens: int) -> list[Layer]:
    """A pre-LayerNorm decoder block of GPT-2 (its Conv1D weights are d_in x d_out matrices)."""
    return [
        _layernorm(f"{prefix}.ln_1", d, tokens),
        _linear(f"{prefix}.attn.c_attn", d, 3 * d, tokens),  # query, key and value in one matmul
        _attention(f"{prefix}.attn.scores", d, tokens),
        _linear(f"{prefix}.attn.c_proj", d, d, tokens),
        _layernorm(f"{prefix}.ln_2", d, tokens),
        _linear(f"{prefix}.mlp.c_fc", d, 4 * d, tokens),
        _linear(f"{prefix}.mlp.c_proj", 4 * d, d, tokens),
    ]


def gpt2() -> ModelProfile:
    """GPT-2 small (GPT2LMHeadModel, 124M): the LM head is tied to the token embedding."""
    vocab, positions, d, depth, tokens = 50257, 1024, 768, 12, 1024
    # The tied embedding's gradient accumulates in the head (first in backprop) and in the lookup
    # (last), so it is ready only at the very end: it belongs to the first layer.
    layers = [_embedding("transformer.wte", vocab, d), _embedding("transformer.wpe", positions, d)]
    for i in range(depth):
        layers += _gpt2_block(f"transformer.h.{i}", d, tokens)
    layers += [
        _layernorm("transformer.ln_f", d, tokens),
        Layer("lm_head", (), 2.0 * d * vocab * tokens),  # the tied weight: FLOPs, no tensor
    ]
    return ModelProfile(
        "gpt2",
        tuple(layers),
        batch_size=4,  # Espresso's GPT-2 runs: --per_gpu_train_batch_size 4 (WikiText-2)
        sample=f"{tokens} tokens",
        known_params=124_439_808,
        known_params_source="HuggingFace GPT2LMHeadModel gpt2 (tied head): 124,439,808",
        known_gflops=None,  # no standard published figure; tests use 2 N T + attention + head
    )


# --- sparse-embedding models ------------------------------------------------------------------------


def lstm() -> ModelProfile:
    """PyTorch examples' word_language_model, medium setting (--emsize 650 --nhid 650), WikiText-2.

    nn.Embedding(33278, 650) -> nn.LSTM(650, 650, num_layers=2) -> nn.Linear(650, 33278), untied.
    """
    vocab, d, num_layers, steps = 33_278, 650, 2, 35
    rnn: list[tuple[str, int]] = []
    for i in range(num_layers):
        # torch.nn.LSTM: four gates stacked, and two bias vectors (input-side and hidden-side).
        rnn += [(f"rnn.weight_ih_l{i}", 4 * d * d), (f"rnn.weight_hh_l{i}", 4 * d * d)]
        rnn += [(f"rnn.bias_ih_l{i}", 4 * d), (f"rnn.bias_hh_l{i}", 4 * d)]
    gate_flops = 2.0 * num_layers * 4 * d * (d + d) * steps
    layers = (
        _embedding("encoder", vocab, d, density=0.0113),  # Zen: LSTM embedding density 1.13%
        # One layer: cuDNN runs the whole nn.LSTM as one autograd node, so both layers' gradients
        # become ready together when it finishes.
        Layer("rnn", tuple(rnn), gate_flops),
        _linear("decoder", d, vocab, steps),
    )
    return ModelProfile(
        "lstm",
        layers,
        batch_size=20,  # the example's default --batch_size; Espresso's LSTM scripts pass none
        sample=f"{steps} tokens (one BPTT sequence)",
        known_params=50_065_078,
        known_params_source="PyTorch examples word_language_model, LSTM 650x2 on WikiText-2: 50,065,078",
        known_gflops=None,
    )


# DeepFM on Criteo's layout. In DeepFM's usual form every field (dense or categorical) indexes one
# row of two shared tables: a 10-wide embedding (FM and deep part) and a 1-wide first-order weight.
# A categorical value hashes into a row of a 1,000,000-row space shared by the 26 fields; each of the
# 13 dense fields owns one row, scaled by the field's value (so a dense field's projection is a
# learned 10-vector times its value). The size keeps Zen's 2.80% at 1024 samples reachable: 39 x 1024
# lookups touch at most 4.0% of these 1,000,013 rows (of a 26M-row table, at most 0.15%).
DEEPFM_DENSE_FIELDS = 13
DEEPFM_CATEGORICAL_FIELDS = 26
DEEPFM_HASHED_ROWS = 1_000_000
DEEPFM_EMBEDDING_DIM = 10
DEEPFM_HIDDEN = (400, 400, 400)


def deepfm() -> ModelProfile:
    """DeepFM (Guo et al., IJCAI 2017) on Criteo: FM over 39 field embeddings + an MLP 400-400-400-1.

    Tensors as a module would hold them: feature_bias (rows x 1), feature_embeddings (rows x 10),
    mlp = Sequential(Linear(390, 400), ReLU, Linear(400, 400), ReLU, Linear(400, 400), ReLU,
    Linear(400, 1)) and a global bias; logit = bias + first order + FM pairs + MLP.
    """
    fields = DEEPFM_DENSE_FIELDS + DEEPFM_CATEGORICAL_FIELDS
    rows, dim = DEEPFM_HASHED_ROWS + DEEPFM_DENSE_FIELDS, DEEPFM_EMBEDDING_DIM
    density = 0.0280  # Zen: DeepFM embedding density 2.80%
    layers = [
        _embedding("feature_bias", rows, 1, density=density),
        _embedding("feature_embeddings", rows, dim, density=density),
        # Pairwise FM term by the sum-square trick: sum, square, sum of squares, difference.
        Layer("fm", (), 4.0 * fields * dim),
    ]
    widths = (fields * dim, *DEEPFM_HIDDEN, 1)
    for i, (d_in, d_out) in enumerate(itertools.pairwise(widths)):
        layers.append(_linear(f"mlp.{2 * i}", d_in, d_out))  # ReLUs sit at the odd indices
    layers.append(Layer("output", (("bias", 1),), 3.0))  # the global bias and the three-way sum
    return ModelProfile(
        "deepfm",
        tuple(layers),
        batch_size=1024,  # Zen's DeepFM runs on Criteo: batch 1024
        sample=f"a Criteo row: {DEEPFM_DENSE_FIELDS} dense + {DEEPFM_CATEGORICAL_FIELDS} categorical fields",
        known_params=11_477_745,
        known_params_source="this definition, no published count (the test counts torch modules): 11,477,745",
        known_gflops=None,
    )


# --- the registry -----------------------------------------------------------------------------------

MODELS: dict[str, Callable[[], ModelProfile]] = {
    "resnet50": resnet50,
    "resnet101": resnet101,
    "vgg16": vgg16,
    "bert-base": bert_base,
    "gpt2": gpt2,
    "lstm": lstm,
    "deepfm": deepfm,
}


def names() -> list[str]:
    return list(MODELS)


def build(name: str) -> ModelProfile:
    """The profile registered as `name`.

    Example:
        >>> build("gpt2").num_params
        124439808
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name]()
