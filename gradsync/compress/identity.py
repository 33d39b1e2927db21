"""No compression: the reference path."""

from __future__ import annotations

from typing import Any

import torch

from .base import Compressor, Payload, shape_ctx


class Identity(Compressor):
    """Sends the tensor as it is (fp32 allreduce); the reference every other codec is compared to."""

    summable = True
    unbiased = True

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        return (x.reshape(-1),), shape_ctx(x)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        return payload[0].to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return 4 * numel
