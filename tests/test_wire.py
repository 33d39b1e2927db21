"""Wire formats: bit packing (with its word-parallel fast paths), vote fields and sparse index codecs.

Round trips, exact sizes, reference layouts written independently of the fast paths, bad input.
"""

from __future__ import annotations

import pytest
import torch

from gradsync.wire import (
    check_indices,
    decode_indices,
    encode_indices,
    field_bits,
    fields_per_word,
    frame_into,
    framed,
    index_format,
    index_nbytes,
    pack_bits,
    pack_fields,
    packed_nbytes,
    unpack_bits,
    unpack_fields,
)

BITS = range(1, 9)
LENGTHS = (0, 1, 3, 7, 9, 1001)


def random_codes(numel: int, bits: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + numel * 10 + bits)
    return torch.randint(0, 2**bits, (numel,), generator=generator, dtype=torch.uint8)


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """Little-endian bit stream: code i's bit j is stream bit i * bits + j; byte b holds stream
    bits 8b .. 8b + 7, the lowest first."""
    stream = [(code >> j) & 1 for code in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(bit << j for j, bit in enumerate(stream[i : i + 8])) for i in range(0, len(stream), 8)]


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("bits", BITS)
def test_unpack_inverts_pack_for_every_width_and_length(bits: int, numel: int) -> None:
    codes = random_codes(numel, bits)
    packed = pack_bits(codes, bits)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("bits", BITS)
def test_packed_size_is_ceil_of_numel_times_bits_over_eight(bits: int, numel: int) -> None:
    packed = pack_bits(random_codes(numel, bits), bits)
    expected = -(-numel * bits // 8)
    assert packed.dtype == torch.uint8
    assert packed.shape == (expected,)
    assert packed_nbytes(numel, bits) == expected


@pytest.mark.parametrize("numel", (1, 3, 7, 9, 33))
@pytest.mark.parametrize("bits", BITS)
def test_pack_matches_a_reference_little_endian_bit_stream(bits: int, numel: int) -> None:
    codes = random_codes(numel, bits, seed=1)
    packed = pack_bits(codes, bits)
    assert packed.tolist() == reference_pack(codes.tolist(), bits)


@pytest.mark.parametrize("bits", BITS)
def test_unpack_returns_uint8_codes_of_the_requested_length(bits: int) -> None:
    codes = random_codes(1001, bits)
    unpacked = unpack_bits(pack_bits(codes, bits), bits, 1001)
    assert unpacked.dtype == torch.uint8
    assert unpacked.shape == (1001,)


@pytest.mark.parametrize("dtype", (torch.bool, torch.int64, torch.int32, torch.float32))
def test_pack_accepts_codes_of_any_integer_valued_dtype(dtype: torch.dtype) -> None:
    bits = 1 if dtype == torch.bool else 3
    codes = random_codes(37, bits)
    assert torch.equal(pack_bits(codes.to(dtype), bits), pack_bits(codes, bits))


def test_pack_flattens_multidimensional_codes() -> None:
    codes = random_codes(35, 5)
    assert torch.equal(pack_bits(codes.view(5, 7), 5), pack_bits(codes, 5))


@pytest.mark.parametrize("bits", BITS)
def test_empty_codes_pack_to_zero_bytes_and_unpack_to_nothing(bits: int) -> None:
    packed = pack_bits(torch.empty(0, dtype=torch.uint8), bits)
    assert packed.shape == (0,)
    assert packed.dtype == torch.uint8
    assert unpack_bits(packed, bits, 0).shape == (0,)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("delta", (-1, 1))
def test_unpack_refuses_a_payload_of_the_wrong_size(bits: int, delta: int) -> None:
    numel = 9
    packed = pack_bits(random_codes(numel, bits), bits)
    wrong = torch.zeros(packed.numel() + delta, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{wrong.numel()} bytes"):
        unpack_bits(wrong, bits, numel)


def test_unpack_refuses_a_payload_for_zero_codes_that_has_bytes() -> None:
    with pytest.raises(ValueError, match="1 bytes"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 4, 0)


@pytest.mark.parametrize(
    "packed",
    [
        torch.zeros(2, dtype=torch.int8),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(1, 2, dtype=torch.uint8),
    ],
    ids=["int8", "int32", "2-D"],
)
def test_unpack_refuses_anything_but_a_flat_uint8_tensor(packed: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack_bits(packed, 8, 2)


@pytest.mark.parametrize("bits", (0, 9, -1))
def test_widths_outside_one_to_eight_are_refused(bits: int) -> None:
    with pytest.raises(ValueError, match=f"bits={bits}"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match=f"bits={bits}"):
        unpack_bits(torch.zeros(4, dtype=torch.uint8), bits, 4)


def test_check_indices_accepts_every_index_in_range_and_empty_indices() -> None:
    assert check_indices(torch.arange(10, dtype=torch.int32), 10) is None  # 0 and 9 included
    assert check_indices(torch.empty(0, dtype=torch.int32), 0) is None


@pytest.mark.parametrize("bad", (-1, 10, 1000))
def test_check_indices_refuses_negative_and_too_large_indices(bad: int) -> None:
    indices = torch.tensor([0, 3, bad, 9], dtype=torch.int32)
    with pytest.raises(IndexError, match=f"index {bad} is out of range"):
        check_indices(indices, 10)


# -- word-parallel fast paths (1, 2, 4 bits) and their tails ----------------------------------

# Around the word of each fast path (8 codes of 1 bit, 4 of 2, 2 of 4) and its multiples, so both
# the whole-word part and the code-by-code tail are exercised, alone and together.
WORD_LENGTHS = (0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 1001, 1003)


@pytest.mark.parametrize("numel", WORD_LENGTHS)
@pytest.mark.parametrize("bits", BITS)
def test_unpack_inverts_pack_at_lengths_around_word_boundaries(bits: int, numel: int) -> None:
    codes = random_codes(numel, bits, seed=2)
    packed = pack_bits(codes, bits)
    assert packed.shape == (packed_nbytes(numel, bits),)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


@pytest.mark.parametrize("numel", WORD_LENGTHS)
@pytest.mark.parametrize("bits", BITS)
def test_pack_matches_the_reference_bit_stream_around_word_boundaries(bits: int, numel: int) -> None:
    codes = random_codes(numel, bits, seed=3)
    assert pack_bits(codes, bits).tolist() == reference_pack(codes.tolist(), bits)


@pytest.mark.parametrize("numel", WORD_LENGTHS)
def test_bool_codes_pack_like_zero_one_bytes_and_unpack_to_them(numel: int) -> None:
    mask = random_codes(numel, 1, seed=4).bool()
    packed = pack_bits(mask, 1)
    assert packed.tolist() == reference_pack(mask.long().tolist(), 1)
    assert torch.equal(unpack_bits(packed, 1, numel), mask.to(torch.uint8))


@pytest.mark.parametrize("bits", BITS)
def test_codes_of_all_ones_and_all_zeros_pack_to_full_and_empty_bytes(bits: int) -> None:
    # Every bit set: a carry between neighbouring codes in a word would show as a wrong byte.
    numel = 67
    full = pack_bits(torch.full((numel,), 2**bits - 1, dtype=torch.uint8), bits)
    assert full.tolist() == reference_pack([2**bits - 1] * numel, bits)
    assert not pack_bits(torch.zeros(numel, dtype=torch.uint8), bits).any()


@pytest.mark.parametrize("offset", (1, 3))
@pytest.mark.parametrize("bits", BITS)
def test_pack_accepts_a_slice_that_starts_inside_a_word(bits: int, offset: int) -> None:
    # The word-parallel paths view bytes as wider integers, which needs an aligned start; a
    # valid slice of a larger uint8 or bool tensor must still pack (as a copy would).
    codes = random_codes(70, bits, seed=5)
    part = codes[offset:]
    assert pack_bits(part, bits).tolist() == reference_pack(part.tolist(), bits)
    if bits == 1:
        assert pack_bits(codes.bool()[offset:], 1).tolist() == reference_pack(part.tolist(), 1)


# -- vote fields: counts summed by one int32 allreduce -----------------------------------------


def reference_pack_fields(counts: list[int], bits: int) -> list[int]:
    """Element e in field e // num_words of word e % num_words, field f at bits f * bits."""
    per_word = 31 // bits
    num_words = -(-len(counts) // per_word)
    words = [0] * num_words
    for e, count in enumerate(counts):
        words[e % num_words] |= count << (bits * (e // num_words))
    return words


def random_counts(numel: int, bits: int, seed: int, high: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + numel * 10 + bits)
    return torch.randint(0, high or 2**bits, (numel,), generator=generator, dtype=torch.int32)


FIELD_LENGTHS = (0, 1, 2, 7, 30, 31, 32, 61, 1001, 1003)


@pytest.mark.parametrize("numel", FIELD_LENGTHS)
@pytest.mark.parametrize("bits", BITS)
def test_unpack_fields_inverts_pack_fields_and_matches_the_reference_layout(bits: int, numel: int) -> None:
    counts = random_counts(numel, bits, seed=1)
    words = pack_fields(counts, bits)
    assert words.dtype == torch.int32
    assert words.shape == (-(-numel // fields_per_word(bits)),)
    assert bool((words >= 0).all())  # the sign bit stays clear
    assert words.tolist() == reference_pack_fields(counts.tolist(), bits)
    unpacked = unpack_fields(words, bits, numel)
    assert unpacked.dtype == torch.int32
    assert torch.equal(unpacked, counts)


@pytest.mark.parametrize("bits", BITS)
def test_fields_per_word_fill_thirty_one_bits(bits: int) -> None:
    assert fields_per_word(bits) == 31 // bits
    assert fields_per_word(bits) * bits <= 31 < (fields_per_word(bits) + 1) * bits


@pytest.mark.parametrize("numel", (1, 31, 1003))
@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 7, 8, 15))
def test_summed_packed_votes_of_all_ranks_equal_the_packed_summed_votes(world_size: int, numel: int) -> None:
    # The majority-vote exchange: each rank packs its 0/1 votes into fields wide enough for
    # world_size, one int32 allreduce sums the words, and every field then holds its count.
    bits = field_bits(world_size)
    votes = [random_counts(numel, 1, seed=rank) for rank in range(world_size)]
    summed_words = sum((pack_fields(v, bits) for v in votes), torch.zeros(1, dtype=torch.int32))
    summed_votes = sum(votes, torch.zeros(numel, dtype=torch.int32))
    assert torch.equal(summed_words, pack_fields(summed_votes, bits))
    assert torch.equal(unpack_fields(summed_words, bits, numel), summed_votes)


def test_summed_fields_stay_exact_when_every_field_reaches_its_maximum() -> None:
    bits, numel = 3, 100
    parts = [torch.full((numel,), 3, dtype=torch.int32), torch.full((numel,), 4, dtype=torch.int32)]
    summed = pack_fields(parts[0], bits) + pack_fields(parts[1], bits)  # every field holds 7
    assert torch.equal(unpack_fields(summed, bits, numel), torch.full((numel,), 7, dtype=torch.int32))
    assert bool((summed >= 0).all())


@pytest.mark.parametrize(
    ("max_count", "bits"), [(1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4), (127, 7), (128, 8)]
)
def test_field_bits_is_the_fewest_bits_that_hold_max_count(max_count: int, bits: int) -> None:
    assert field_bits(max_count) == bits
    assert 2**bits - 1 >= max_count > 2 ** (bits - 1) - 1


@pytest.mark.parametrize("max_count", (0, -1, 2**31))
def test_field_bits_refuses_a_count_out_of_range(max_count: int) -> None:
    with pytest.raises(ValueError, match=f"max_count={max_count}"):
        field_bits(max_count)


@pytest.mark.parametrize("delta", (-1, 1))
def test_unpack_fields_refuses_the_wrong_number_of_words(delta: int) -> None:
    words = pack_fields(random_counts(100, 4, seed=2), 4)  # 14 words of 7 fields
    wrong = torch.zeros(words.numel() + delta, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32 values for 100 counts"):
        unpack_fields(wrong, 4, 100)


def test_unpack_fields_refuses_words_that_are_not_int32() -> None:
    words = pack_fields(random_counts(100, 4, seed=3), 4)
    with pytest.raises(ValueError, match="int32"):
        unpack_fields(words.to(torch.int64), 4, 100)


# -- sparse index codecs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "count", "fmt"),
    [
        (800, 0, "coo"),
        (800, 1, "coo"),
        (800, 25, "coo"),  # 100 bytes either way: the tie goes to COO
        (800, 26, "bitmap"),  # 104 bytes of COO against a 100-byte bitmap
        (800, 800, "bitmap"),
        (801, 25, "coo"),  # 100 bytes against a 101-byte bitmap
        (801, 26, "bitmap"),
        (0, 0, "coo"),
    ],
)
def test_index_format_is_the_smaller_encoding_with_ties_going_to_coo(
    numel: int, count: int, fmt: str
) -> None:
    assert index_format(numel, count) == fmt
    assert index_nbytes(numel, count) == min(packed_nbytes(numel, 1), 4 * count)


def test_index_nbytes_is_the_smaller_of_bitmap_and_coo_everywhere() -> None:
    for numel in (1, 7, 8, 9, 31, 32, 33, 255, 256, 257):
        for count in range(numel + 1):
            assert index_nbytes(numel, count) == min(packed_nbytes(numel, 1), 4 * count)
            assert (index_format(numel, count) == "bitmap") == (packed_nbytes(numel, 1) < 4 * count)


def random_indices(numel: int, count: int, seed: int) -> torch.Tensor:
    """`count` sorted distinct indices in [0, numel), with 0 and numel - 1 whenever count >= 2."""
    if count == 0:
        return torch.empty(0, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    ends = [0, numel - 1][:count] if numel > 1 else [0]
    middle = torch.randperm(max(0, numel - 2), generator=generator)[: count - len(ends)] + 1
    return torch.cat([torch.tensor(ends), middle]).sort().values


INDEX_CASES = [
    (numel, count)
    for numel in (1, 7, 8, 9, 800, 1001)
    for count in sorted({0, 1, 2, numel // 32, numel // 32 + 1, numel // 4, numel - 1, numel})
    if 0 <= count <= numel
]


@pytest.mark.parametrize(("numel", "count"), INDEX_CASES)
def test_decode_indices_inverts_encode_indices_in_either_format(numel: int, count: int) -> None:
    indices = random_indices(numel, count, seed=numel + count)
    assert indices.numel() == count
    encoded = encode_indices(indices, numel)
    assert encoded.dtype == torch.uint8
    assert encoded.shape == (index_nbytes(numel, count),)
    decoded = decode_indices(encoded, numel, count)
    assert decoded.dtype == torch.int64
    assert torch.equal(decoded, indices)


def test_coo_indices_are_little_endian_int32_and_the_bitmap_is_a_packed_mask() -> None:
    numel = 800
    coo = torch.tensor([0, 5, 799])
    assert encode_indices(coo, numel).tolist() == [0, 0, 0, 0, 5, 0, 0, 0, 31, 3, 0, 0]
    dense = torch.arange(0, numel, 2)  # 400 indices: a bitmap
    mask = torch.zeros(numel, dtype=torch.uint8)
    mask[dense] = 1
    assert encode_indices(dense, numel).tolist() == reference_pack(mask.tolist(), 1)


@pytest.mark.parametrize("offset", (1, 2, 3))
def test_coo_indices_decode_from_a_slice_that_is_not_int32_aligned(offset: int) -> None:
    # Received frames hold several payload tensors back to back, so an index block may start at
    # any byte.
    indices = random_indices(1000, 10, seed=1)
    encoded = encode_indices(indices, 1000)
    frame = torch.cat([torch.zeros(offset, dtype=torch.uint8), encoded, torch.zeros(3, dtype=torch.uint8)])
    assert torch.equal(decode_indices(frame[offset : offset + encoded.numel()], 1000, 10), indices)


@pytest.mark.parametrize(
    ("numel", "count", "delta"),
    [(1000, 10, -1), (1000, 10, 1), (1000, 10, 4), (800, 26, -1), (800, 26, 1), (800, 0, 1), (800, 0, 4)],
)
def test_decode_indices_refuses_the_wrong_number_of_bytes(numel: int, count: int, delta: int) -> None:
    encoded = encode_indices(random_indices(numel, count, seed=2), numel)
    wrong = torch.zeros(encoded.numel() + delta, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{wrong.numel()} bytes"):
        decode_indices(wrong, numel, count)


@pytest.mark.parametrize("marked", (29, 31))
def test_decode_indices_refuses_a_bitmap_marking_another_number_of_elements(marked: int) -> None:
    encoded = encode_indices(random_indices(800, marked, seed=3), 800)
    assert index_format(800, 30) == index_format(800, marked) == "bitmap"
    with pytest.raises(ValueError, match=f"marks {marked} elements but the payload carries 30"):
        decode_indices(encoded, 800, 30)


@pytest.mark.parametrize("bad", (-1, -5, 1000, 2**31 - 1))
def test_decode_indices_refuses_an_out_of_range_coo_index(bad: int) -> None:
    encoded = torch.tensor([0, 7, bad], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(IndexError, match=f"index {bad} is out of range"):
        decode_indices(encoded, 1000, 3)


def test_decode_indices_refuses_anything_but_flat_uint8() -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        decode_indices(torch.tensor([0, 7], dtype=torch.int32), 1000, 2)


def test_a_frame_is_the_parts_end_to_end_then_the_flag_and_frame_into_writes_the_same() -> None:
    parts = [torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8) + 100]
    for finite, flag in ((True, 0), (False, 1)):
        expected = torch.cat([*parts, torch.tensor([flag], dtype=torch.uint8)])
        assert torch.equal(framed(parts, finite), expected)
        buffer = torch.full((20,), 7, dtype=torch.uint8)
        assert torch.equal(frame_into(buffer[4:13], parts, finite), expected)
        assert torch.equal(buffer[:4], torch.full((4,), 7, dtype=torch.uint8))  # nothing outside it
        assert torch.equal(buffer[13:], torch.full((7,), 7, dtype=torch.uint8))


def test_frame_into_refuses_a_frame_of_another_size() -> None:
    frame = torch.full((10,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="a frame of 10 elements for parts of 8 and a flag"):
        frame_into(frame, [torch.zeros(8, dtype=torch.uint8)], True)
    assert torch.equal(frame, torch.full((10,), 7, dtype=torch.uint8))  # refused before any write
