"""Blockwise int8 quantization with an absmax scale per block."""

from __future__ import annotations

from typing import Any

import torch

from .base import Compressor, Payload, check_int
from .scratch import padded_rows, scaled_rows


class Int8(Compressor):
    """Rounds each block of `block_size` entries to int8 codes of its largest magnitude / 127
    (blockwise absmax quantization, as in Dettmers et al., "8-bit Optimizers via Block-wise
    Quantization", ICLR 2022).

    Decodes to code * absmax / 127: the error per entry is at most half a step, absmax / 254.
    Round to nearest, so slightly biased; the error is small enough that training needs no error
    feedback. Wire: 8 bits per element plus one fp32 scale per block (block_size=256: 8.125 bits).
    Scales are per rank, so payloads are exchanged by allgather.

    Example:
        >>> c = Int8(block_size=4)
        >>> payload, ctx = c.compress(torch.tensor([0.5, -1.27, 0.01, 1.0]))
        >>> c.decompress(payload, ctx)
        tensor([ 0.5000, -1.2700,  0.0100,  1.0000])
    """

    def __init__(self, block_size: int = 256) -> None:
        self.block_size = check_int("block_size", block_size, 1, 2**31 - 1, why="entries per scale")

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        rows = padded_rows(flat, self.block_size, "int8")
        absmax = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
        scales = absmax / 127
        # Divide by the scale rather than multiply by 127 / absmax, which overflows to inf for
        # blocks below about 4e-37; all-zero blocks divide by 1, not 0.
        divisor = torch.where(absmax > 0, scales, torch.ones_like(scales))
        codes = rows.div_(divisor.unsqueeze(1)).round_().view(-1)[: flat.numel()].to(torch.int8)
        return (codes, scales), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        codes, scales = payload
        shape, dtype = ctx
        numel = shape.numel()
        num_blocks = -(-numel // self.block_size)
        if codes.numel() != numel or scales.numel() != num_blocks:
            raise ValueError(
                f"int8 payload has {codes.numel()} codes and {scales.numel()} scales; a tensor of "
                f"{numel} elements needs {numel} and {num_blocks}: it belongs to another tensor"
            )
        return scaled_rows(codes, self.block_size, scales).to(dtype).reshape(shape)

    def payload_bytes(self, numel: int) -> int:
        return numel + 4 * -(-numel // self.block_size)
