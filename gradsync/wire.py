"""Wire formats: bit packing and index checks (pure tensor functions, no communication).

Codes of `bits` bits (1 <= bits <= 8) are packed little-endian into uint8 bytes, so that
n codes take exactly ceil(n * bits / 8) bytes on the wire.
"""

from __future__ import annotations

import torch

_POWERS_OF_TWO = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that `numel` codes of `bits` bits take once packed."""
    return (numel * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) into a flat uint8 tensor of packed_nbytes(numel, bits)."""
    _check_bits(bits)
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes
    if bits in _POWERS_OF_TWO:
        # Several whole codes per byte: shift each into its slot and add the slots up.
        per_byte = 8 // bits
        padded = _pad_to_multiple(codes, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (padded.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)
    # Odd widths straddle byte boundaries: spread codes into bits, then pack the bit stream.
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    bit_stream = (codes.unsqueeze(1) >> shifts) & 1
    return pack_bits(bit_stream, 1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` codes as uint8."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed codes must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    expected = packed_nbytes(numel, bits)
    if packed.numel() != expected:
        raise ValueError(
            f"packed payload has {packed.numel()} bytes but {numel} codes of {bits} bits need "
            f"{expected}; the payload belongs to a tensor of another size"
        )
    if bits == 8:
        return packed
    if bits in _POWERS_OF_TWO:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        mask = (1 << bits) - 1
        return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:numel]
    bit_stream = unpack_bits(packed, 1, numel * bits).view(numel, bits)
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.uint8, device=packed.device)
    return (bit_stream * weights).sum(dim=1, dtype=torch.uint8)


def check_indices(indices: torch.Tensor, numel: int) -> None:
    """Raise IndexError unless every index lies in [0, numel); nothing may be written out of bounds.

    Negative indices must be refused explicitly: torch indexing would silently wrap them around.
    """
    if indices.numel() == 0:
        return
    lo, hi = torch.aminmax(indices)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= numel:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"payload index {bad} is out of range [0, {numel}): the payload was not made for a "
            f"tensor of {numel} elements (are the ranks configured differently?)"
        )


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits={bits} is out of range [1, 8]; codes wider than a byte are not packed")


def _pad_to_multiple(codes: torch.Tensor, multiple: int) -> torch.Tensor:
    remainder = codes.numel() % multiple
    if remainder == 0:
        return codes
    return torch.cat([codes, codes.new_zeros(multiple - remainder)])
