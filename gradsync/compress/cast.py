"""Half-precision casts: fp16 and bf16."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .base import Compressor, Payload, shape_ctx


class Cast(Compressor):
    """Sends the tensor cast to a 16-bit float type; the sum is taken in that type by allreduce.

    As in PyTorch's fp16_compress_hook, the caller divides by the world size before casting, so
    the sum of n casts cannot overflow where the average would not.
    """

    summable = True
    wire_dtype: ClassVar[torch.dtype]

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        return (x.reshape(-1).to(self.wire_dtype),), shape_ctx(x)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        return payload[0].to(dtype).reshape(shape)

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
