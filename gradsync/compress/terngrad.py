"""TernGrad: stochastic ternary quantization to {-s, 0, s}."""

from __future__ import annotations

from typing import Any

import torch

from ..wire import pack_bits, packed_nbytes, unpack_bits
from .base import Payload, SeededCompressor, flat_float32
from .scratch import scratch


class TernGrad(SeededCompressor):
    """Ternary gradients (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning", NeurIPS 2017).

    With s = max |x_i| (per tensor), x_i becomes s * sign(x_i) with probability |x_i| / s and 0
    otherwise: unbiased, E||C(x)||^2 = s ||x||_1. Wire: 2 bits per element (codes 0, 1, 2 for
    -s, 0, +s) and s in fp32. s is per rank, so payloads are exchanged by allgather.
    """

    unbiased = True
    randomness = "local"

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = flat_float32(x)
        scale = torch.maximum(flat.amax(), flat.amin().neg()) if flat.numel() else flat.new_zeros(())
        # Keep x_i with probability |x_i| / s: compare |x_i| with a uniform draw times s, for
        # each sign separately, so no |x| temporary is needed.
        bound = scratch("terngrad-bound", flat.numel(), torch.float32, flat.device)
        bound.uniform_(generator=self.generator(flat.device)).mul_(scale)
        numel = flat.numel()
        above = scratch("terngrad-above", numel, torch.bool, flat.device)
        codes = scratch("terngrad-codes", numel, torch.uint8, flat.device)
        torch.add(torch.gt(flat, bound, out=above).view(torch.uint8), 1, out=codes)
        codes -= torch.lt(flat, bound.neg_(), out=above).view(torch.uint8)
        return (pack_bits(codes, 2), scale.reshape(1)), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        packed, scale = payload
        shape, dtype = ctx
        codes = unpack_bits(packed, 2, shape.numel())
        out = codes.to(torch.float32).sub_(1).mul_(scale)
        return out.to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return packed_nbytes(numel, 2) + 4
