"""Reusable temporaries for codec kernels on the CPU.

A fresh tensor of tens of MiB comes from mmap and is paid for in page faults on first touch:
for 2^24 fp32 elements that is most of the cost of a clone. Kernels that need a full-size
temporary take it from here instead, so it is faulted in once per thread, not once per call.
CUDA's caching allocator already reuses freed blocks, so elsewhere this hands out fresh tensors.

A scratch tensor never leaves the kernel that asked for it (never in a payload, a ctx or an
output), and is valid until the same thread asks for the same slot again. Pools are per thread
because the exchange decodes in the communication library's callback thread while the hook
compresses the next bucket.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def scratch(slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-D tensor of `numel` elements, reused across calls naming `slot`."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    pool: dict[tuple[str, torch.dtype], torch.Tensor] = _local.__dict__.setdefault("pool", {})
    buffer = pool.get((slot, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = pool[slot, dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def release() -> None:
    """Free this thread's scratch tensors (tests, or after the largest tensors are gone)."""
    _local.__dict__.pop("pool", None)


def padded_rows(flat: torch.Tensor, row_size: int, slot: str) -> torch.Tensor:
    """`flat` as float32 in a scratch (num_rows, row_size) tensor, the last row padded with zeros.

    One in-place pass over warm memory; padding the input itself with torch.cat would allocate
    (and fault in) a fresh copy.
    """
    numel = flat.numel()
    num_rows = -(-numel // row_size)
    rows = scratch(slot, num_rows * row_size, torch.float32, flat.device)
    rows[:numel].copy_(flat)
    rows[numel:].zero_()
    return rows.view(num_rows, row_size)


def magnitude(flat: torch.Tensor) -> torch.Tensor:
    """|flat| in a scratch tensor: valid until the next call on this thread."""
    return torch.abs(flat, out=scratch("magnitude", flat.numel(), flat.dtype, flat.device))


def scaled_rows_into(
    out: torch.Tensor, codes: torch.Tensor, row_size: int, scales: torch.Tensor, offset: float = 0
) -> torch.Tensor:
    """scaled_rows written into `out` (1-D, codes.numel() elements, any float dtype): no fresh
    tensor. Full rows broadcast their scale; the short last row, if any, is done on its own."""
    numel = codes.numel()
    full = numel // row_size * row_size
    if full:
        rows = out[:full].view(-1, row_size)
        rows.copy_(codes[:full].view(-1, row_size)).sub_(offset).mul_(scales[: full // row_size].unsqueeze(1))
    if full < numel:
        out[full:].copy_(codes[full:]).sub_(offset).mul_(scales[-1])
    return out


def scaled_rows(codes: torch.Tensor, row_size: int, scales: torch.Tensor, offset: float = 0) -> torch.Tensor:
    """(codes - offset) * scale of their row, as a fresh float32 tensor of codes.numel() elements.

    The inverse of quantizing `padded_rows`: the rows are padded in the output buffer, so the
    per-row scale broadcasts over whole rows without a copy of the codes.
    """
    numel = codes.numel()
    num_rows = -(-numel // row_size)
    out = torch.empty(num_rows * row_size, dtype=torch.float32, device=codes.device)
    out[:numel].copy_(codes).sub_(offset)
    out[numel:].zero_()
    out.view(num_rows, row_size).mul_(scales.unsqueeze(1))
    return out[:numel]
