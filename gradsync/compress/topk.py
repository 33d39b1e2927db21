"""Top-k sparsification, exact or by a sampled threshold."""

from __future__ import annotations

import torch

from ..wire import index_nbytes
from .base import SeededCompressor, check_choice, check_fraction, count_for
from .sparse import Sparsifier, exact_topk, sampled_topk


class TopK(Sparsifier, SeededCompressor):
    """Keeps the k entries of largest magnitude (Aji & Heafield, "Sparse Communication for
    Distributed Gradient Descent", EMNLP 2017; Stich et al., "Sparsified SGD with Memory",
    NeurIPS 2018).

    Biased and contractive: ||C(x) - x||^2 <= (1 - k/d) ||x||^2; use it with error feedback.
    Payload: k values and their indices, as int32 (64 bits per kept fp32 element) or, above a
    density of 1/32, as a bitmap of d bits; exchanged by allgather.

    mode="exact" uses torch.topk. mode="sampled" estimates the magnitude threshold from a random
    sample of `sample_ratio` of the entries, keeps the candidates above it and then takes the exact
    top-k among those few: exactly k entries, the same as "exact" up to ties, because the
    threshold is lowered until it admits at least k candidates.

    Example:
        >>> c = TopK(ratio=0.25)
        >>> payload, ctx = c.compress(torch.tensor([0.1, -3.0, 0.2, 2.0]))
        >>> c.decompress(payload, ctx)
        tensor([ 0., -3.,  0.,  0.])
    """

    randomness = "local"
    needs_feedback = True

    def __init__(
        self, ratio: float = 0.01, mode: str = "sampled", sample_ratio: float = 0.01, seed: int = 0
    ) -> None:
        super().__init__(seed)
        self.ratio = check_fraction("ratio", ratio)
        self.mode = check_choice("mode", mode, ("exact", "sampled"))
        self.sample_ratio = check_fraction("sample_ratio", sample_ratio)

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        k = count_for(flat.numel(), self.ratio)
        if self.mode == "sampled":
            return sampled_topk(flat, k, self.sample_ratio, self.generator(flat.device))
        return exact_topk(flat, k)

    def payload_bytes(self, numel: int) -> int:
        k = count_for(numel, self.ratio)
        return index_nbytes(numel, k) + 4 * k
