"""Scaled sign compression (EF-SignSGD)."""

from __future__ import annotations

from typing import Any

import torch

from ..wire import pack_bits, packed_nbytes, unpack_bits
from .base import Compressor, Payload


class EFSignSGD(Compressor):
    """Sends one sign bit per element and one scale, ||x||_1 / d (Karimireddy et al., "Error
    Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019).

    Decodes to scale * sign(x) with sign(0) = +1. Biased and contractive with
    delta = ||x||_1^2 / (d ||x||_2^2); meant for error feedback. The scale is per rank, so
    payloads are not summable: exchanged by allgather.
    """

    needs_feedback = True

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        scale = flat.abs().sum(dtype=torch.float32).div_(max(1, flat.numel())).reshape(1)
        return (pack_bits(flat >= 0, 1), scale), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        packed, scale = payload
        shape, dtype = ctx
        bits = unpack_bits(packed, 1, shape.numel())
        # bit 1 -> +scale, bit 0 -> -scale
        signs = bits.to(torch.float32).mul_(2).sub_(1)
        return signs.mul_(scale).to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return packed_nbytes(numel, 1) + 4
