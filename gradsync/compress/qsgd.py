"""QSGD: stochastic quantization to s levels per bucket."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..wire import pack_bits, packed_nbytes, unpack_bits
from .base import Payload, SeededCompressor, check_choice, check_int
from .scratch import padded_rows, scaled_rows, scratch


class QSGD(SeededCompressor):
    """Quantizes each bucket of `bucket_size` entries to `levels` levels of its l2 norm, rounding
    stochastically so the result is unbiased (Alistarh et al., "QSGD: Communication-Efficient
    SGD via Gradient Quantization and Encoding", NeurIPS 2017).

    Q(v_i) = ||v|| * sign(v_i) * l / s, with l = floor(s|v_i|/||v||) or that plus one, chosen
    with the probability that makes E[Q(v)] = v. The signed level l in [-s, s] is stored as
    l + s in ceil(log2(2s + 1)) bits (levels=7: 4 bits), plus one fp32 norm per bucket.
    Payloads carry per-bucket norms, so they are not summable: exchanged by allgather.

    norm="l2" is the paper's scale; norm="max" (the default) scales by the bucket's largest
    magnitude instead, as implementations do in practice: still unbiased, with far lower variance
    because the levels then span the values actually present.
    """

    unbiased = True
    randomness = "local"

    def __init__(self, levels: int = 7, bucket_size: int = 512, norm: str = "max", seed: int = 0) -> None:
        super().__init__(seed)
        self.norm = check_choice("norm", norm, ("l2", "max"))
        self.levels = check_int("levels", levels, 1, 127)
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2**31 - 1)

    @property
    def bits(self) -> int:
        return math.ceil(math.log2(2 * self.levels + 1))

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        numel = flat.numel()
        rows = padded_rows(flat, self.bucket_size, "qsgd")
        if self.norm == "l2":  # in float64: squares of values below 1e-19 vanish in float32
            norms = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).float()
        else:
            norms = torch.maximum(rows.amax(1), rows.amin(1).neg())
        # A zero bucket has a zero norm: dividing it by 1 keeps its levels at zero (and a bucket
        # of subnormal values keeps its own norm, which decoding multiplies back). Divide |v_i| by
        # the norm before multiplying by levels: levels / norm overflows for a subnormal norm.
        divisor = torch.where(norms > 0, norms, 1.0).unsqueeze(1)
        scaled = rows.abs_().div_(divisor).mul_(self.levels)  # in [0, s], up to rounding
        # Stochastic rounding: floor(a + u) rounds a up with probability frac(a) for u uniform in
        # [0, 1). The clamp: a level above s, were float rounding to push a + u past s + 1, would
        # leave the grid and its code would wrap around in uint8.
        noise = scratch("qsgd-noise", scaled.numel(), torch.float32, x.device)
        noise.uniform_(generator=self.generator(x.device))
        levels = scaled.view(-1).add_(noise).floor_().clamp_(max=self.levels)[:numel]
        # At 8 bits the codes are the packed payload itself, so they must not live in scratch.
        fresh = self.bits == 8
        codes = (
            torch.empty(numel, dtype=torch.uint8, device=x.device)
            if fresh
            else scratch("qsgd-codes", numel, torch.uint8, x.device)
        )
        codes.copy_(levels.copysign_(flat).add_(self.levels))  # l + s for the signed level l
        return (pack_bits(codes, self.bits), norms), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        packed, norms = payload
        shape, dtype = ctx
        numel = shape.numel()
        num_buckets = -(-numel // self.bucket_size)
        if norms.numel() != num_buckets:
            raise ValueError(
                f"qsgd payload has {norms.numel()} bucket norms but a tensor of {numel} elements "
                f"has {num_buckets} buckets of {self.bucket_size}"
            )
        codes = unpack_bits(packed, self.bits, numel)
        values = scaled_rows(codes, self.bucket_size, norms / self.levels, offset=self.levels)
        return values.to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        num_buckets = -(-numel // self.bucket_size)
        return packed_nbytes(numel, self.bits) + 4 * num_buckets
