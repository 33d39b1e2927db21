"""Half-precision casts: fp16 and bf16."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from . import native
from .base import Compressor, Payload, shape_ctx


class Cast(Compressor):
    """Sends the tensor cast to a 16-bit float type; the sum is taken in that type by allreduce.

    As in PyTorch's fp16_compress_hook, the caller divides by the world size before casting, so
    the sum of n casts cannot overflow where the average would not.
    """

    summable = True
    preserves_nonfinite = True
    reveals_nonfinite = True
    wire_dtype: ClassVar[torch.dtype]

    def __init__(self) -> None:
        # The payload's buffer, reused from step to step: a fresh one costs page faults each time.
        self._wire: torch.Tensor | None = None

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        wire = self._wire_for(x)
        wire.copy_(x.reshape(-1))
        return (wire,), shape_ctx(x)

    def compress_mean(self, x: torch.Tensor, world_size: int) -> tuple[Payload, Any]:
        # One pass, x / n rounded once to the wire's type, where the torch ops make two: a
        # division of the float32 gradient in place, then the cast. The same bits either way.
        if x.dtype != torch.float32 or not native.usable(x):
            return super().compress_mean(x, world_size)
        wire = self._wire_for(x)
        native.cast_mean(x.reshape(-1), world_size, wire)
        return (wire,), shape_ctx(x)

    def _wire_for(self, x: torch.Tensor) -> torch.Tensor:
        wire = self._wire
        if wire is None or wire.numel() != x.numel() or wire.device != x.device:
            wire = self._wire = torch.empty(x.numel(), dtype=self.wire_dtype, device=x.device)
        return wire

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        return payload[0].to(dtype).reshape(shape)

    def decompress_into(self, out: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        out.view(-1).copy_(payload[0])
        return out

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel


class FP16(Cast):
    """IEEE half precision (Micikevicius et al., "Mixed Precision Training", ICLR 2018).

    5 exponent bits: values above 65504 overflow to inf, below 6e-8 flush to zero.
    """

    wire_dtype = torch.float16


class BF16(Cast):
    """bfloat16 (Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", 2019).

    fp32's exponent range with an 8-bit mantissa: never overflows where fp32 does not, coarser.
    """

    wire_dtype = torch.bfloat16
