"""Wire formats: bit packing, vote fields and sparse index codecs (pure tensor functions).

Codes of `bits` bits (1 <= bits <= 8) are packed little-endian into uint8 bytes, so that n codes
take exactly ceil(n * bits / 8) bytes on the wire: code i's bit j is bit i * bits + j of the
stream, and byte b holds stream bits 8b .. 8b + 7, the lowest first.

The common widths (1, 2, 4) are packed word-parallel: a few integer operations on 64-, 32- or
16-bit words move every code of a word into place at once, so packing costs a fraction of one
pass over the data instead of a pass per bit.
"""

from __future__ import annotations

import torch

# Multiplying a word of 0/1 bytes by this gathers byte i's bit into bit 56 + i: the partial
# products land on distinct bits, so no carry disturbs the top byte.
_GATHER_1_IN_8 = 0x0102040810204080
# The same for four 2-bit codes in the bytes of a 32-bit word, gathered into its top byte.
_GATHER_2_IN_4 = (1 << 24) | (1 << 18) | (1 << 12) | (1 << 6)
_LOW_BIT_OF_EACH_BYTE = 0x0101010101010101
_LOW_2_BITS_OF_EACH_BYTE = 0x03030303
_LOW_4_BITS_OF_EACH_BYTE = 0x0F0F


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that `numel` codes of `bits` bits take once packed."""
    return (numel * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer (or bool) codes in [0, 2**bits) into a flat uint8 tensor of packed_nbytes bytes.

    At 8 bits, uint8 codes are returned as they are (a view, no copy).
    """
    _check_bits(bits)
    codes = codes.reshape(-1)
    codes = codes.view(torch.uint8) if codes.dtype == torch.bool else codes.to(torch.uint8)
    if bits == 8:
        return codes
    if bits in (1, 2, 4):
        # Whole words go the fast way; the few codes after the last whole word, the slow way.
        per_word = {1: 8, 2: 4, 4: 2}[bits]
        whole = codes.numel() - codes.numel() % per_word
        head = _pack_words(codes[:whole].contiguous(), bits)
        if whole == codes.numel():
            return head
        return torch.cat([head, _pack_stream(codes[whole:], bits)])
    return _pack_stream(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `numel` codes as uint8."""
    _check_bits(bits)
    _check_wire_bytes(packed, packed_nbytes(numel, bits), "packed codes", f"{numel} codes of {bits} bits")
    if bits == 8:
        return packed
    if bits == 1:
        # Copy each byte to 8 positions 7 bits apart: byte i of the word then holds bit i in its
        # lowest bit. Shifted ORs, not a multiply: overlapping copies must not carry.
        words = packed.to(torch.int64)
        words |= words << 7
        words |= words << 14
        words |= words << 28
        return (words & _LOW_BIT_OF_EACH_BYTE).view(torch.uint8)[:numel]
    if bits == 2:
        words = packed.to(torch.int32)
        words |= words << 6
        words |= words << 12
        return (words & _LOW_2_BITS_OF_EACH_BYTE).view(torch.uint8)[:numel]
    if bits == 4:
        words = packed.to(torch.int16)
        words |= words << 4
        return (words & _LOW_4_BITS_OF_EACH_BYTE).view(torch.uint8)[:numel]
    bit_stream = unpack_bits(packed, 1, numel * bits).view(numel, bits)
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.uint8, device=packed.device)
    return (bit_stream * weights).sum(dim=1, dtype=torch.uint8)


# -- vote fields: small counts summed by an integer allreduce ----------------------------------


def field_bits(max_count: int) -> int:
    """Bits a field needs to hold every count in [0, max_count] without overflowing."""
    if not 1 <= max_count < 2**31:
        raise ValueError(f"max_count={max_count} is out of range [1, 2**31): a count of ranks")
    return max_count.bit_length()


def fields_per_word(bits: int) -> int:
    # 31, not 32: the sign bit stays clear, so a sum never relies on signed overflow.
    return 31 // bits


def pack_fields(counts: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack small non-negative counts into int32 words of 31 // bits fields each.

    Summing such words elementwise (an int32 allreduce) sums every field at once, as long as no
    field's sum exceeds 2**bits - 1: choose bits = field_bits(world_size) for 0/1 votes.
    Element e sits in field e // num_words of word e % num_words, so each field is a contiguous
    slice of the input.
    """
    per_word = fields_per_word(bits)
    numel = counts.numel()
    num_words = -(-numel // per_word)
    counts = counts.reshape(-1)
    words = torch.zeros(num_words, dtype=torch.int32, device=counts.device)
    for field in range(per_word):
        part = counts[field * num_words : (field + 1) * num_words]
        if part.numel():
            words[: part.numel()] |= part.to(torch.int32) << (bits * field)
    return words


def unpack_fields(words: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack_fields: the first `numel` counts as int32."""
    per_word = fields_per_word(bits)
    num_words = -(-numel // per_word)
    if words.dtype != torch.int32 or words.shape != (num_words,):
        raise ValueError(
            f"vote words must be {num_words} int32 values for {numel} counts of {bits} bits, got "
            f"{words.dtype} {tuple(words.shape)}"
        )
    out = torch.empty(per_word * num_words, dtype=torch.int32, device=words.device)
    mask = (1 << bits) - 1
    for field in range(per_word):
        torch.bitwise_and(words >> (bits * field), mask, out=out[field * num_words : (field + 1) * num_words])
    return out[:numel]


# -- sparse index codecs -----------------------------------------------------------------------


def index_format(numel: int, count: int) -> str:
    """ "bitmap" (one bit per element) where it is smaller than "coo" (an int32 per index).

    The choice depends only on the tensor's size and the number of indices, which every decoder
    knows from the payload, so no format tag crosses the wire. The bitmap wins above a density
    of 1/32.
    """
    return "bitmap" if packed_nbytes(numel, 1) < 4 * count else "coo"


def index_nbytes(numel: int, count: int) -> int:
    """Bytes of `count` indices into a tensor of `numel` elements, encoded by encode_indices."""
    return packed_nbytes(numel, 1) if index_format(numel, count) == "bitmap" else 4 * count


def encode_indices(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Encode sorted, distinct indices into [0, numel) as uint8 bytes, in the smaller format.

    The values that go with them must be in the same (ascending) order: a bitmap cannot keep
    any other.
    """
    if index_format(numel, indices.numel()) == "coo":
        return indices.to(torch.int32).view(torch.uint8)
    mask = torch.zeros(numel, dtype=torch.bool, device=indices.device)
    mask[indices] = True
    return pack_bits(mask, 1)


def check_encoded_indices(encoded: torch.Tensor, numel: int, count: int) -> None:
    """Raise ValueError unless `encoded` is as long as encode_indices makes `count` indices into
    `numel` elements."""
    expected = index_nbytes(numel, count)
    _check_wire_bytes(encoded, expected, "encoded indices", f"{count} indices into {numel} elements")


def check_marked(marked: int, count: int) -> None:
    """Raise ValueError unless an index bitmap marks as many elements as its payload has values."""
    if marked != count:
        raise ValueError(f"index bitmap marks {marked} elements but the payload carries {count} values")


def decode_indices(encoded: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """Inverse of encode_indices: `count` int64 indices, each checked to lie in [0, numel)."""
    check_encoded_indices(encoded, numel, count)
    if index_format(numel, count) == "coo":
        if encoded.storage_offset() % 4 or encoded.data_ptr() % 4:
            encoded = encoded.clone()  # a misaligned slice cannot be viewed as int32
        indices = encoded.view(torch.int32).long()
        check_indices(indices, numel)
        return indices
    indices = unpack_bits(encoded, 1, numel).nonzero().squeeze(1)
    check_marked(indices.numel(), count)
    return indices


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


# -- helpers -----------------------------------------------------------------------------------


# -- frames: a payload's tensors as one 1-D tensor of one dtype, as collectives move them -----------


def framed(parts: list[torch.Tensor], finite: bool) -> torch.Tensor:
    """The parts concatenated (one dtype), then the flag: 0 if this rank's input was finite, else 1."""
    frame = parts[0].new_empty(sum(part.numel() for part in parts) + 1)
    return frame_into(frame, parts, finite)


def frame_into(frame: torch.Tensor, parts: list[torch.Tensor], finite: bool) -> torch.Tensor:
    """framed(parts, finite) written into `frame` (1-D, one element longer than the parts): a
    slice of a larger send buffer, so that a collective sends the frames without another copy."""
    offset = sum(part.numel() for part in parts)
    if frame.numel() != offset + 1:
        raise ValueError(f"a frame of {frame.numel()} elements for parts of {offset} and a flag")
    offset = 0
    for part in parts:
        frame[offset : offset + part.numel()].copy_(part)
        offset += part.numel()
    frame[offset] = 0 if finite else 1
    return frame


def split_frame(frame: torch.Tensor, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Cut a concatenated frame back into tensors shaped like `like`."""
    parts = frame.split([t.numel() for t in like])
    return tuple(part.view(t.shape) for part, t in zip(parts, like, strict=True))


def layout_nbytes(layout: list) -> list[int]:
    return [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in layout]


def from_bytes(frame: torch.Tensor, layout: list) -> tuple[torch.Tensor, ...]:
    tensors = []
    offset = 0
    for (dtype, shape), nbytes in zip(layout, layout_nbytes(layout), strict=True):
        chunk = frame[offset : offset + nbytes]
        if chunk.storage_offset() % dtype.itemsize:  # the frame itself may be a slice of a buffer
            chunk = chunk.clone()  # a misaligned slice cannot be viewed as a wider type
        tensors.append(chunk.view(dtype).view(shape))
        offset += nbytes
    return tuple(tensors)


def _check_wire_bytes(data: torch.Tensor, expected: int, what: str, holding: str) -> None:
    """Refuse anything but `expected` bytes in a 1-D uint8 tensor, naming `what` it should hold."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"{what} must be a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    if data.numel() != expected:
        raise ValueError(
            f"{what}: {data.numel()} bytes, but {holding} take {expected}; the payload was made "
            "for a tensor of another size"
        )


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits={bits} is out of range [1, 8]; codes wider than a byte are not packed")


def _pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a whole number of words of codes (8, 4 or 2 codes per output byte)."""
    word_nbytes = 8 // bits  # int64, int32 or int16 words
    if codes.storage_offset() % word_nbytes:
        codes = codes.clone()  # a slice starting inside a word cannot be viewed as words
    if bits == 1:
        gathered = codes.view(torch.int64) * _GATHER_1_IN_8
        return gathered.view(torch.uint8)[7::8].clone()  # the top byte of each word
    if bits == 2:
        gathered = codes.view(torch.int32) * _GATHER_2_IN_4
        return gathered.view(torch.uint8)[3::4].clone()
    words = codes.view(torch.int16)
    return (words | (words >> 4)).to(torch.uint8)  # low byte: code 0 | code 1 << 4


def _pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Any width, element by bit: spread each code into its bits, then gather 8 bits per byte."""
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=codes.device)
    return (stream.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
