"""Top-k sparsification, exact or by a sampled threshold."""

from __future__ import annotations

from typing import Any

import torch

from ..wire import check_indices
from .base import Payload, SeededCompressor, check_choice, check_fraction, count_for, shape_ctx

# How many more candidates than k the sampled threshold aims for: a margin makes a second,
# lower threshold rarely necessary, while the exact top-k among ~1.5k candidates stays cheap.
_OVERSELECT = 1.5
_MIN_SAMPLE = 256


class TopK(SeededCompressor):
    """Keeps the k entries of largest magnitude (Aji & Heafield, "Sparse Communication for
    Distributed Gradient Descent", EMNLP 2017; Stich et al., "Sparsified SGD with Memory",
    NeurIPS 2018).

    Biased and contractive: ||C(x) - x||^2 <= (1 - k/d) ||x||^2; use it with error feedback.
    Payload: k int32 indices and k values (64 bits per kept fp32 element), exchanged by allgather.

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
        self, ratio: float = 0.01, mode: str = "exact", sample_ratio: float = 0.01, seed: int = 0
    ) -> None:
        super().__init__(seed)
        self.ratio = check_fraction("ratio", ratio)
        self.mode = check_choice("mode", mode, ("exact", "sampled"))
        self.sample_ratio = check_fraction("sample_ratio", sample_ratio)

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        k = count_for(flat.numel(), self.ratio)
        if self.mode == "sampled":
            indices = self._sampled_topk(flat, k)
        else:
            indices = flat.abs().topk(k, sorted=False).indices
        return (indices.to(torch.int32), flat[indices]), shape_ctx(x)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        out = torch.zeros(shape.numel(), dtype=dtype, device=payload[1].device)
        self.add_decoded_(out, payload, ctx)
        return out.reshape(shape)

    def add_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        indices, values = payload
        check_indices(indices, out.numel())
        # Indices are unique within one payload, so this adds in a fixed order even on CUDA.
        out.view(-1).index_add_(0, indices, values.to(out.dtype))

    def payload_bytes(self, numel: int) -> int:
        return 8 * count_for(numel, self.ratio)

    def _sampled_topk(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        numel = flat.numel()
        if k == 0:  # an empty tensor: randint below cannot sample from nothing
            return torch.empty(0, dtype=torch.long, device=flat.device)
        magnitude = flat.abs()
        num_samples = min(numel, max(_MIN_SAMPLE, int(numel * self.sample_ratio)))
        generator = self.generator(flat.device)
        sample_at = torch.randint(numel, (num_samples,), generator=generator, device=flat.device)
        sample = magnitude[sample_at]
        # Rank of the threshold within the sample, aiming for about 1.5k candidates overall.
        wanted = min(num_samples, max(1, int(num_samples * k / numel * _OVERSELECT) + 1))
        while wanted < num_samples:
            threshold = sample.kthvalue(num_samples - wanted + 1).values
            candidates = (magnitude >= threshold).nonzero().squeeze(1)
            if candidates.numel() >= k:
                best = magnitude[candidates].topk(k, sorted=False).indices
                return candidates[best]
            wanted *= 4  # the sample underestimated the tail: lower the threshold and retry
        return magnitude.topk(k, sorted=False).indices
