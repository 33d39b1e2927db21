"""Random-k sparsification with a support shared by all ranks."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Payload, SeededCompressor, check_fraction, count_for

# Above this density a full permutation is cheaper than rejection of duplicate draws.
_DENSE_SUPPORT = 0.5


class RandK(SeededCompressor):
    """Keeps k entries chosen uniformly at random without replacement (Stich et al.,
    "Sparsified SGD with Memory", NeurIPS 2018; Wangni et al., "Gradient Sparsification for
    Communication-Efficient Distributed Optimization", NeurIPS 2018).

    The support comes from a generator seeded identically on every rank, so all ranks keep the
    same coordinates: only the k values are sent (32 bits per kept fp32 element, no indices) and
    payloads are summable by allreduce. Values are not rescaled by d/k: the codec is biased and
    contractive in expectation (delta = k/d), the form meant for error feedback.
    """

    summable = True
    randomness = "shared"
    needs_feedback = True

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__(seed)
        self.ratio = check_fraction("ratio", ratio)

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        support = self._support(flat.numel(), flat.device)
        return (flat[support],), (x.shape, x.dtype, support)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype, _ = ctx
        out = torch.zeros(shape.numel(), dtype=dtype, device=payload[0].device)
        self.add_decoded_(out, payload, ctx)
        return out.reshape(shape)

    def add_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        support = ctx[2]
        (values,) = payload
        if values.numel() != support.numel():
            raise ValueError(
                f"randk payload has {values.numel()} values for a support of {support.numel()}; "
                "the payload was made for a tensor of another size"
            )
        out.view(-1).index_add_(0, support, values.to(out.dtype))

    def payload_bytes(self, numel: int) -> int:
        return 4 * count_for(numel, self.ratio)

    def _support(self, numel: int, device: torch.device) -> torch.Tensor:
        """k distinct indices, sorted for memory locality, uniform over all k-subsets."""
        k = count_for(numel, self.ratio)
        if k == 0:  # an empty tensor: nothing to draw, and k / numel below would divide by zero
            return torch.empty(0, dtype=torch.long, device=device)
        generator = self.generator(device)
        if k > _DENSE_SUPPORT * numel:
            return torch.randperm(numel, generator=generator, device=device)[:k].sort().values
        # The distinct values of iid uniform draws form, given their count, a uniform random
        # subset; a uniform k-subset of it is then a uniform k-subset of [0, numel). Drawing
        # -numel * ln(1 - k/numel) values yields k distinct ones in expectation; add a margin.
        draws = int(-numel * math.log1p(-k / numel) * 1.05) + 16
        while True:
            distinct = torch.randint(numel, (draws,), generator=generator, device=device).unique()
            if distinct.numel() >= k:
                keep = torch.randperm(distinct.numel(), generator=generator, device=device)[:k]
                return distinct[keep].sort().values
            draws *= 2
