"""Top-k sparsification, exact or by a sampled threshold."""

from __future__ import annotations

from typing import Any

import torch

from .base import Payload, SeededCompressor, check_choice, check_fraction, check_int
from .sparse import SPARSITY_WARMUP_STEPS, Sparsifier, SparsityWarmup, exact_topk, sampled_topk


class TopK(SparsityWarmup, Sparsifier, SeededCompressor):
    """Keeps the k entries of largest magnitude (Aji & Heafield, "Sparse Communication for
    Distributed Gradient Descent", EMNLP 2017; Stich et al., "Sparsified SGD with Memory",
    NeurIPS 2018).

    Biased and contractive: ||C(x) - x||^2 <= (1 - k/d) ||x||^2; use it with error feedback.
    Payload: k values and their indices, as int32 (64 bits per kept fp32 element) or, above a
    density of 1/32, as a bitmap of d bits; exchanged by allgather.

    mode="exact" uses torch.topk. mode="sampled" estimates the magnitude threshold from a random
    sample of `sample_ratio` of the entries, keeps the candidates above it and then takes the exact
    top-k among those few: exactly k entries, the same as "exact" up to ties, because the
    threshold is lowered until it admits at least k candidates. From a density of 1/32 up (the
    warm-up's first half) it counts the exact top-k on the CPU instead (native.c's radix select),
    as the candidates would be too many to rank cheaply.

    Over its first `sparsity_warmup_steps` compressed steps it keeps more, 25% -> 6.25% -> 1.5625%
    of the entries (DGC's warm-up, compress.sparse.warmup_density; never fewer than `ratio`):
    the first steps' gradients change fastest, and what a sparsifier holds back from them waits
    in the error memory while the weights move on. k is the same on every rank at each step.

    Example:
        >>> c = TopK(ratio=0.25)
        >>> payload, ctx = c.compress(torch.tensor([0.1, -3.0, 0.2, 2.0]))
        >>> c.decompress(payload, ctx)
        tensor([ 0., -3.,  0.,  0.])
    """

    randomness = "local"
    needs_feedback = True

    def __init__(
        self,
        ratio: float = 0.01,
        mode: str = "sampled",
        sample_ratio: float = 0.01,
        sparsity_warmup_steps: int = SPARSITY_WARMUP_STEPS,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.ratio = check_fraction("ratio", ratio)
        self.mode = check_choice("mode", mode, ("exact", "sampled"))
        self.sample_ratio = check_fraction("sample_ratio", sample_ratio)
        self.sparsity_warmup_steps = check_int(
            "sparsity_warmup_steps", sparsity_warmup_steps, 0, why="compressed steps of sparsity warm-up"
        )

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        compressed = super().compress(x)
        self.count_step()
        return compressed

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        k = self.entries(flat.numel())
        if self.mode == "sampled":
            return sampled_topk(flat, k, self.sample_ratio, self.generator(flat.device))
        return exact_topk(flat, k)
