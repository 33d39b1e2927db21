"""Natural compression: stochastic rounding to a signed power of two."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..wire import pack_bits, packed_nbytes, unpack_bits
from .base import Payload, SeededCompressor, flat_float32
from .scratch import scratch

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_EXPONENT_BIAS = 127


def _largest_exponent(dtype: torch.dtype) -> int:
    """The biased fp32 exponent of the largest power of two finite in `dtype` (and in fp32: 255
    means inf or NaN), so that decoding and casting back never overflows: 254 for fp32 and
    bf16, 142 (2^15) for fp16."""
    return min(254, _EXPONENT_BIAS + math.floor(math.log2(torch.finfo(dtype).max)))


class Natural(SeededCompressor):
    """Natural compression (Horvath et al., "Natural Compression for Distributed Deep Learning",
    MSML 2022).

    |t| = 2^e (1 + m) becomes 2^(e+1) with probability m and 2^e otherwise: unbiased, with
    omega = 1/8. In IEEE terms the mantissa is dropped and the exponent bumped with probability
    mantissa / 2^23, which a 23-bit uniform integer decides exactly. Wire: 9 bits per element,
    the 8-bit exponent and the sign bit. Zero stays zero; subnormals become 0 or 2^-126, still
    unbiased; exponents saturate at the largest power of two of the input's dtype (2^127 for
    fp32, 2^15 for fp16) rather than overflow to inf. Inputs are rounded in fp32. Payloads differ
    per rank and are not additive: exchanged by allgather.
    """

    unbiased = True
    randomness = "local"

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = flat_float32(x)
        bits = flat.view(torch.int32)
        numel = flat.numel()
        draw = scratch("natural-draw", numel, torch.int32, flat.device)
        draw.random_(generator=self.generator(flat.device)).bitwise_and_(_MANTISSA_MASK)
        field = scratch("natural-field", numel, torch.int32, flat.device)
        # draw - mantissa is negative exactly when draw < mantissa (both lie in [0, 2^23)), so its
        # sign, shifted down, is -1 where the exponent rounds up and 0 elsewhere: integer
        # arithmetic in place, where adding a bool mask would convert it.
        mantissa = torch.bitwise_and(bits, _MANTISSA_MASK, out=field)
        minus_round_up = draw.sub_(mantissa).bitwise_right_shift_(31)
        exponent = torch.bitwise_right_shift(bits, _MANTISSA_BITS, out=field).bitwise_and_(0xFF)
        exponent.sub_(minus_round_up).clamp_(max=_largest_exponent(x.dtype))
        negative = torch.lt(bits, 0, out=scratch("negative", numel, torch.bool, flat.device))
        return (exponent.to(torch.uint8), pack_bits(negative, 1)), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        exponents, signs = payload
        shape, dtype = ctx
        numel = shape.numel()
        if exponents.numel() != numel:
            raise ValueError(
                f"natural payload has {exponents.numel()} exponents for a tensor of {numel} "
                "elements: it belongs to another tensor"
            )
        out = exponents.to(torch.int32).bitwise_left_shift_(_MANTISSA_BITS)
        sign = scratch("natural-sign", numel, torch.int32, exponents.device)
        out.bitwise_or_(sign.copy_(unpack_bits(signs, 1, numel)).bitwise_left_shift_(31))
        return out.view(torch.float32).to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return numel + packed_nbytes(numel, 1)
