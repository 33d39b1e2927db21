"""embed-lm: a word-level language model whose large input embedding gets sparse gradients."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from ..compress.base import check_int
from . import corpus
from .base import Workload, generator_for

# The last 5% of the word stream is held out.
HELDOUT_FRACTION = 0.05


class WordMLP(nn.Module):
    """Embeds `context` previous words, mixes their concatenation through one ReLU layer and
    predicts the next word among `output_vocab` classes (Bengio et al., "A Neural Probabilistic
    Language Model", JMLR 2003). Maps (batch, context) word ids to (batch, output_vocab) logits.

    The input embedding is untied from the output layer: only the rows of the words in a batch
    get a gradient, which is the sparsity gradient exchange can exploit.
    """

    def __init__(self, vocab_size: int, output_vocab: int, dim: int, context: int, hidden: int, sparse: bool):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, sparse=sparse)
        self.mixer = nn.Linear(context * dim, hidden)
        self.head = nn.Linear(hidden, output_vocab)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mixer(self.embedding(words).flatten(1))))


def init_word_mlp(model: WordMLP, generator: torch.Generator) -> None:
    """N(0, 1) embeddings (PyTorch's default), He-initialized mixer, N(0, 1/fan_in) output layer so
    the first logits are O(1), zero biases."""
    nn.init.normal_(model.embedding.weight, 0.0, 1.0, generator=generator)
    for layer, gain in ((model.mixer, 2.0), (model.head, 1.0)):
        nn.init.normal_(layer.weight, 0.0, math.sqrt(gain / layer.in_features), generator=generator)
        nn.init.zeros_(layer.bias)


class EmbedLm(Workload):
    """Next-word prediction on the standard library's source, split into identifiers, numbers
    and single punctuation characters.

    Input ids: the vocab_size - 1 most frequent words, then <unk> (vocab_size - 1) for the rest.
    Output classes: the output_vocab - 1 most frequent words, then <other>, so the softmax stays
    small while the embedding is large. A sample is one position of the word stream with the
    `context` words before it. Training positions lie in the first 95% of the stream, drawn with
    replacement per step; the held-out set is `eval_samples` positions evenly spaced over the
    last 5%.

    With sparse=True the embedding's gradient is a sparse COO tensor (use SGD, not Adam); with
    the default sparse=False it is dense but zero outside the rows of touched_rows(inputs).
    """

    name = "embed-lm"
    eval_chunk = 1024
    recommended_lr = 0.1
    # The parameter whose gradient is zero outside the rows of the batch's words.
    embedding_parameter: ClassVar[str] = "embedding.weight"

    def __init__(
        self,
        seed: int = 0,
        vocab_size: int = 32768,
        output_vocab: int = 2048,
        dim: int = 128,
        context: int = 8,
        hidden: int = 512,
        batch_size: int = 64,
        corpus_chars: int = 8_000_000,
        eval_samples: int = 2048,
        sparse: bool = False,
    ) -> None:
        super().__init__(seed, batch_size)
        self.vocab_size = check_int("vocab_size", vocab_size, 2, why="input words, <unk> included")
        self.output_vocab = check_int(
            "output_vocab",
            output_vocab,
            2,
            vocab_size,
            why="output classes, <other> included; at most vocab_size, since only input words are told apart",
        )
        self.dim = check_int("dim", dim, 1, why="embedding dimensions")
        self.context = check_int("context", context, 1, why="previous words per prediction")
        self.hidden = check_int("hidden", hidden, 1, why="units of the mixing layer")
        self.eval_samples = check_int("eval_samples", eval_samples, 1, why="held-out positions")
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse={sparse!r} must be True or False")
        self.sparse = sparse
        self.corpus_chars = check_int("corpus_chars", corpus_chars, 1, why="characters of stdlib source")
        ids, self.words = corpus.word_tokens(self.corpus_chars, vocab_size)
        if len(self.words) < vocab_size - 1:
            warnings.warn(
                f"vocab_size={vocab_size:,} but corpus_chars={corpus_chars:,} has only {len(self.words):,} "
                f"distinct words: {vocab_size - 1 - len(self.words):,} embedding rows are never used; "
                "lower vocab_size or raise corpus_chars",
                stacklevel=2,
            )
        split = round(len(ids) * (1 - HELDOUT_FRACTION))
        if min(split, len(ids) - split) <= context:
            raise ValueError(
                f"corpus_chars={corpus_chars:,} gives {len(ids):,} words, too few for context={context} in "
                f"both the training and the held-out 5%; raise corpus_chars or lower context"
            )
        self.train_ids, self.heldout_ids = ids[:split], ids[split:]
        # Fixed, not seeded: every seed is scored on the same positions.
        last = len(self.heldout_ids) - 1
        self.heldout_positions = torch.linspace(context, last, eval_samples).round().long()
        self.offsets = torch.arange(-context, 0)

    def architecture(self) -> nn.Module:
        return WordMLP(self.vocab_size, self.output_vocab, self.dim, self.context, self.hidden, self.sparse)

    def initialize(self, model: nn.Module, generator: torch.Generator) -> None:
        init_word_mlp(model, generator)

    def sample_indices(self, step: int, global_batch: int) -> torch.Tensor:
        # Positions with `context` words before them.
        generator = generator_for(self.seed, "batch", step)
        return torch.randint(self.context, len(self.train_ids), (global_batch,), generator=generator)

    def _samples(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = ids[positions[:, None] + self.offsets].long()
        # Frequency ranks below output_vocab - 1 are their own class; the rest, <unk> included,
        # are <other>.
        targets = ids[positions].long().clamp_(max=self.output_vocab - 1)
        return inputs, targets

    def training_samples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._samples(self.train_ids, indices)

    @property
    def heldout_size(self) -> int:
        return self.eval_samples

    def heldout_samples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._samples(self.heldout_ids, self.heldout_positions[indices])

    def touched_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        """Sorted embedding rows a batch's gradient can be non-zero in: the distinct input words."""
        return torch.unique(inputs)

    def touched_fraction(self, inputs: torch.Tensor) -> float:
        """Fraction of the embedding's rows a batch touches; for a step over all ranks, pass the
        inputs of every rank concatenated."""
        return self.touched_rows(inputs).numel() / self.vocab_size

    def recommended_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """SGD with momentum 0.9 at recommended_lr (0.1); it also takes sparse gradients."""
        return torch.optim.SGD(params, lr=self.recommended_lr, momentum=0.9)

    def data_summary(self) -> str:
        return (
            f"{len(self.train_ids):,} stdlib words (vocabulary {self.vocab_size:,}, {self.output_vocab:,} "
            f"output classes, context {self.context}), {self.eval_samples:,} held-out positions"
        )
