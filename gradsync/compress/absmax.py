"""Blockwise absmax quantization to signed integers: int8, and int4 packed two to a byte."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ..wire import pack_bits, packed_nbytes, unpack_bits
from . import native
from .base import Compressor, Payload, check_corrected, check_int
from .scratch import padded_rows, scaled_rows, scaled_rows_into, scratch


class Int8(Compressor):
    """Rounds each block of `block_size` entries to int8 codes of its largest magnitude / 127
    (blockwise absmax quantization, as in Dettmers et al., "8-bit Optimizers via Block-wise
    Quantization", ICLR 2022).

    Decodes to code * absmax / 127: the error per entry is at most half a step, absmax / 254.
    Round to nearest, so slightly biased; the error is small enough that training needs no error
    feedback. Wire: 8 bits per element plus one fp32 scale per block (block_size=256: 8.125 bits).
    Scales are per rank, so payloads are not summed: ranks exchange them by two-shot (each
    shard's owner decodes, sums and encodes the sum again) or allgather.

    Example:
        >>> c = Int8(block_size=4)
        >>> payload, ctx = c.compress(torch.tensor([0.5, -1.27, 0.01, 1.0]))
        >>> c.decompress(payload, ctx)
        tensor([ 0.5000, -1.2700,  0.0100,  1.0000])
    """

    bits: ClassVar[int] = 8
    reveals_nonfinite = True  # a block's scale is NaN or inf where the block holds one
    fuses_feedback = True

    def __init__(self, block_size: int = 256) -> None:
        self.block_size = check_int("block_size", block_size, 1, 2**31 - 1, why="entries per scale")

    @classmethod
    def levels(cls) -> int:
        """The largest code's magnitude: codes run from -levels to +levels."""
        return 2 ** (cls.bits - 1) - 1

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        if flat.dtype == torch.float32 and self._native(flat):  # the same bits in one pass (native.c)
            packed, scales = self._empty_payload(flat.numel())
            native.absmax_encode(flat, self.block_size, self.bits, packed, scales)
            return (packed, scales), (x.shape, x.dtype)
        rows = padded_rows(flat, self.block_size, f"int{self.bits}")
        # abs_: an all-zero block's maximum(0.0, -0.0) may be -0.0; its scale is +0.0, as native.c's.
        absmax = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).abs_()
        scales = absmax / self.levels()
        # Divide by the scale rather than multiply by levels / absmax, which overflows to inf for
        # blocks below about 4e-37; all-zero blocks divide by 1, not 0.
        divisor = torch.where(absmax > 0, scales, torch.ones_like(scales))
        # Clamped: a block whose scale is subnormal divides to beyond the levels (as native.c's).
        # NaN (a zero in a block whose scale underflowed to 0, or a non-finite block) becomes
        # +levels, as there: a NaN's conversion to an integer is undefined.
        levels = self.levels()
        codes = rows.div_(divisor.unsqueeze(1)).round_()
        codes = codes.nan_to_num_(nan=levels, posinf=levels, neginf=-levels).clamp_(-levels, levels)
        codes = codes.view(-1)[: flat.numel()]
        return (self._pack(codes), scales), (x.shape, x.dtype)

    def compress_corrected(
        self, g: torch.Tensor, base: torch.Tensor, alpha: float, out: torch.Tensor
    ) -> tuple[Payload, Any]:
        check_corrected(g, base, out)
        tensors = (g, base, out)
        if all(t.dtype == torch.float32 for t in tensors) and self._native(*tensors):
            packed, scales = self._empty_payload(g.numel())
            flat_g, flat_base, flat_out = (t.view(-1) for t in tensors)
            native.absmax_encode_corrected(
                flat_g, flat_base, alpha, self.block_size, self.bits, packed, scales, flat_out
            )
            return (packed, scales), (out.shape, out.dtype)
        # The same bits in three passes: torch.add with alpha rounds once, as native.c's fmaf.
        payload, ctx = self.compress(torch.add(base, g, alpha=alpha, out=out))
        self.sub_decoded_(out, payload, ctx)
        return payload, ctx

    def _empty_payload(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales for a float32 tensor of `numel` entries, as the torch path makes them."""
        code_dtype = torch.int8 if self.bits == 8 else torch.uint8  # as _pack makes them
        packed = torch.empty(packed_nbytes(numel, self.bits), dtype=code_dtype)
        return packed, torch.empty(-(-numel // self.block_size), dtype=torch.float32)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.int8)

    def _unpack(self, packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, int]:
        """The codes, and the offset to subtract from them."""
        return packed, 0

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        if ctx[1] == torch.float32 and self._native(*payload):
            return self.decompress_into(torch.empty(ctx[0], dtype=torch.float32), payload, ctx)
        codes, offset = self._codes(payload, ctx)
        return scaled_rows(codes, self.block_size, payload[1], offset).to(ctx[1]).reshape(ctx[0])

    # Decoded straight into the caller's float32 tensor or a scratch one: a fresh full-size tensor
    # costs as much in page faults as a copy. Other dtypes take the plain path, bit for bit as
    # decompress (which computes in float32 and casts).

    def decompress_into(self, out: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        if out.dtype != torch.float32:
            return super().decompress_into(out, payload, ctx)
        if self._native(out, *payload):
            self._decode_native(out, payload, ctx, mode=0)
            return out
        codes, offset = self._codes(payload, ctx)
        scaled_rows_into(out.view(-1), codes, self.block_size, payload[1], offset)
        return out

    def add_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        if out.dtype != torch.float32:
            return super().add_decoded_(out, payload, ctx)
        if self._native(out, *payload):
            return self._decode_native(out, payload, ctx, mode=1)
        out += self.decompress_into(_scratch_like(out), payload, ctx)

    def sum_decoded_(self, out: torch.Tensor, payloads: Sequence[Payload], ctx: Any) -> None:
        if out.dtype != torch.float32 or not self._native(out, *(t for p in payloads for t in p)):
            return super().sum_decoded_(out, payloads, ctx)
        for payload in payloads:
            self._check_into(out, payload, ctx)
        packed, scales = [p[0] for p in payloads], [p[1] for p in payloads]
        native.absmax_sum_decoded(out.view(-1), packed, scales, self.block_size, self.bits)

    def sub_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        if out.dtype != torch.float32:
            return super().sub_decoded_(out, payload, ctx)
        if self._native(out, *payload):
            return self._decode_native(out, payload, ctx, mode=2)
        out -= self.decompress_into(_scratch_like(out), payload, ctx)

    def _native(self, *tensors: torch.Tensor) -> bool:
        """Whether native.c's kernels run on `tensors` (float32 ones, as the callers check): on the
        CPU, and (int4) with blocks that never share a byte, as an odd block_size would."""
        wire_types = all(t.dtype in (torch.float32, torch.uint8, torch.int8) for t in tensors)
        widths = self.bits == 8 or (self.bits == 4 and self.block_size % 2 == 0)  # native.c's
        return wire_types and widths and native.usable(*tensors)

    def _decode_native(self, out: torch.Tensor, payload: Payload, ctx: Any, mode: int) -> None:
        self._check_into(out, payload, ctx)
        native.absmax_decode(out.view(-1), payload[0], payload[1], self.block_size, self.bits, mode)

    def _check_into(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        """The payload checked against `ctx`, and `out` against both: the kernels write
        out.numel() entries."""
        self._check(payload, ctx)
        if out.numel() != ctx[0].numel():
            raise ValueError(
                f"int{self.bits}: decoding a payload of {ctx[0].numel()} entries into a tensor of "
                f"{out.numel()}; pass a tensor shaped like the one compressed"
            )

    def _codes(self, payload: Payload, ctx: Any) -> tuple[torch.Tensor, int]:
        """The payload's codes, checked against the tensor it claims to be, and their offset."""
        self._check(payload, ctx)
        return self._unpack(payload[0], ctx[0].numel())

    def _check(self, payload: Payload, ctx: Any) -> None:
        """Refuse a payload that does not fit the tensor `ctx` describes."""
        packed, scales = payload
        shape, _ = ctx
        numel = shape.numel()
        num_blocks = -(-numel // self.block_size)
        if packed.numel() != packed_nbytes(numel, self.bits) or scales.numel() != num_blocks:
            raise ValueError(
                f"int{self.bits} payload has {packed.numel()} code bytes and {scales.numel()} scales; a "
                f"tensor of {numel} elements needs {packed_nbytes(numel, self.bits)} and {num_blocks}: "
                "it belongs to another tensor"
            )

    def payload_bytes(self, numel: int) -> int:
        return packed_nbytes(numel, self.bits) + 4 * -(-numel // self.block_size)


class Int4(Int8):
    """Int8's blockwise absmax quantization with 4-bit codes, -7 .. 7, packed two to a byte.

    A step is absmax / 7, so the rounding error (up to absmax / 14 per entry) is large enough to
    matter: use error feedback (error_feedback="auto" turns it on). Wire: 4 bits per element plus
    one fp32 scale per block (block_size=128: 4.25 bits), half of int8's. ZeRO++ sends gradients
    at this width the same way, in two shots.

    Example:
        >>> c = Int4(block_size=4)
        >>> payload, ctx = c.compress(torch.tensor([0.6, -1.4, 0.0, 1.0]))
        >>> c.decompress(payload, ctx)
        tensor([ 0.6000, -1.4000,  0.0000,  1.0000])
    """

    bits = 4
    needs_feedback = True

    def __init__(self, block_size: int = 128) -> None:
        super().__init__(block_size)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return pack_bits(codes.add_(self.levels()), self.bits)  # 0 .. 14: one nibble each

    def _unpack(self, packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, int]:
        return unpack_bits(packed, self.bits, numel), self.levels()


def _scratch_like(out: torch.Tensor) -> torch.Tensor:
    return scratch("absmax-decoded", out.numel(), out.dtype, out.device).view(out.shape)
