"""Bit packing and index checks: round trips, exact sizes, a reference bit order, bad input."""

from __future__ import annotations

import pytest
import torch

from gradsync.wire import check_indices, pack_bits, packed_nbytes, unpack_bits

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
