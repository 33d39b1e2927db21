"""No compression: the payload is the tensor itself."""

from __future__ import annotations

from typing import Any

import torch

from .base import Compressor, Payload, shape_ctx


class NoCompression(Compressor):
    """Sends the tensor as it is (fp32 allreduce): registered as "none", the one spelling of no
    compression, and the reference every other codec is compared to."""

    summable = True
    preserves_nonfinite = True
    reveals_nonfinite = True
    unbiased = True

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        return (x.reshape(-1),), shape_ctx(x)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        return payload[0].to(dtype).reshape(shape)

    def decompress_into(self, out: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        out.view(-1).copy_(payload[0])
        return out

    def payload_bytes(self, numel: int) -> int:
        return 4 * numel
