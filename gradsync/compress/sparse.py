"""What sparsifying codecs share: the payload layout and fast top-k selection.

A sparse payload is (encoded indices, values): the indices ascending, encoded by
`wire.encode_indices` as int32 COO or as a bitmap, whichever is smaller at this density, and the
values in the same order. The decoder learns the number of values from the payload itself, so
the same layout serves fixed-size codecs (top-k, DGC) and variable-size ones (threshold).
"""

from __future__ import annotations

from typing import Any

import torch

from ..wire import (
    check_encoded_indices,
    check_indices,
    check_marked,
    decode_indices,
    encode_indices,
    index_format,
    index_nbytes,
)
from . import native
from .base import Compressor, Payload, WarmsUp, count_for, shape_ctx
from .scratch import magnitude, scratch

# DGC's sparsity warm-up (Lin et al. 2018, section 3.4): the density falls exponentially, 25% ->
# 6.25% -> 1.5625% -> 0.4%, the stages sharing the warm-up's compressed steps equally, and the
# codec's own ratio follows (it bounds the density from below throughout). Sparsified at 1% from
# its first compressed step, mlp-wide under momentum SGD lagged DDP by 2.5x in loss at step 150
# of 400 and ended 14% above it; over a warm-up of 100 steps it ended 5% above.
WARMUP_SPARSITY = (0.75, 0.9375, 0.984375, 0.996)
SPARSITY_WARMUP_STEPS = 100


def warmup_density(ratio: float, step: int, warmup_steps: int) -> float:
    """The fraction of entries a sparsifier of `ratio` sends at its compressed step `step`
    (0-based) with a warm-up of `warmup_steps`."""
    if step < warmup_steps:
        return max(ratio, 1 - WARMUP_SPARSITY[step * len(WARMUP_SPARSITY) // warmup_steps])
    return ratio


class SparsityWarmup(WarmsUp):
    """A sparsifier's warm-up (top-k's, DGC's): at its compressed step `step` it sends
    `density(step)` of the entries, and `ratio` once its `sparsity_warmup_steps` are over."""

    ratio: float
    sparsity_warmup_steps: int

    def density(self, step: int) -> float:
        """Fraction of entries sent at compressed step `step` (0-based)."""
        return warmup_density(self.ratio, step, self.sparsity_warmup_steps)

    def entries(self, numel: int) -> int:
        """Entries the next payload sends of a tensor of `numel`."""
        return count_for(numel, self.density(self.steps))

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the next payload (the warm-up's density at the current step)."""
        k = self.entries(numel)
        return index_nbytes(numel, k) + 4 * k


# From this density on, the sampled threshold's ~1.5k candidates are too many to rank cheaply
# (25% of 22.3M entries: 0.8 s on one thread), and native.c counts the exact top k in four passes
# instead (0.2 s); below it, sampling is the faster (at 1%: 0.03 s against the count's 0.07 s).
COUNT_FROM_DENSITY = 1 / 32
# How many more candidates than k the sampled threshold aims for: a margin makes a second,
# lower threshold rarely necessary, while the exact top-k among ~1.5k candidates stays cheap.
OVERSELECT = 1.5
_MIN_SAMPLE = 256


class Sparsifier(Compressor):
    """Base of codecs that send some entries and their positions; subclasses choose which."""

    sparse_rows = True

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        indices = self.select(flat)
        return sparse_payload(flat, indices), shape_ctx(x)

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Ascending, distinct int64 indices of the entries to send."""
        raise NotImplementedError(f"{type(self).__name__} must implement select")

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return decode_sparse(payload, ctx)

    def add_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        add_sparse_(out, payload)

    def sub_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        sub_sparse_(out, payload)


def sparse_payload(flat: torch.Tensor, indices: torch.Tensor) -> Payload:
    """The wire form of `flat` restricted to ascending `indices`."""
    # index_select, not flat[indices]: the same values, at a third of the cost on the CPU.
    values = flat.index_select(0, indices)
    numel = flat.numel()
    if (
        index_format(numel, indices.numel()) == "bitmap"
        and indices.dtype == torch.int64
        and native.usable(indices)
    ):
        check_indices(indices, numel)  # the kernel writes where they point
        return native.bitmap_of(indices, numel), values  # the same bytes as encode_indices
    return encode_indices(indices, numel), values


def decode_sparse(payload: Payload, ctx: tuple[torch.Size, torch.dtype]) -> torch.Tensor:
    """The dense tensor a sparse payload stands for."""
    shape, dtype = ctx
    out = torch.zeros(shape.numel(), dtype=dtype, device=payload[1].device)
    add_sparse_(out, payload)
    return out.reshape(shape)


def add_sparse_(out: torch.Tensor, payload: Payload) -> None:
    """out += the dense tensor a sparse payload stands for, without making that tensor."""
    if _bitmap_added(out, payload, negate=False):
        return
    encoded, values = payload
    indices = decode_indices(encoded, out.numel(), values.numel())
    # Indices are distinct within one payload, so this adds in a fixed order even on CUDA.
    out.view(-1).index_add_(0, indices, values.to(out.dtype))


def sub_sparse_(out: torch.Tensor, payload: Payload) -> None:
    """out -= the dense tensor a sparse payload stands for, bit for bit, without making it.

    Error feedback's residual p - decoded costs a pass over the k sent entries instead of two
    full-size tensors. Where nothing was sent, out - 0 == out. Where v was sent, the dense tensor
    holds 0 + v, which is v except that -0.0 becomes +0.0; so 0 + v is what is subtracted, and
    out - (0 + v) is out + -1 * (0 + v) exactly (index_add_ with alpha=-1). At the entries of p
    itself, that leaves exactly +0.0.
    """
    if _bitmap_added(out, payload, negate=True):
        return
    encoded, values = payload
    indices = decode_indices(encoded, out.numel(), values.numel())
    as_decoded = values.to(out.dtype) + 0  # a copy: the payload itself stays as sent
    out.view(-1).index_add_(0, indices, as_decoded, alpha=-1)


def _bitmap_added(out: torch.Tensor, payload: Payload, negate: bool) -> bool:
    """out += (negate: -=) a bitmap-coded float32 payload in native.c's one pass over the bitmap,
    the same bits as index_add_ of its decoded indices; False where the kernel does not run. The
    torch path unpacks the bitmap into a byte per entry and finds its marks: 0.15 s at 25% of
    22.3M entries, against the kernel's 9 ms."""
    encoded, values = payload
    flat, count = out.view(-1), values.numel()
    wire_types = flat.dtype == values.dtype == torch.float32 and encoded.dtype == torch.uint8
    if not (
        wire_types and index_format(flat.numel(), count) == "bitmap" and native.usable(flat, encoded, values)
    ):
        return False
    check_encoded_indices(encoded, flat.numel(), count)
    check_marked(native.bitmap_count(encoded, flat.numel()), count)  # before a single write
    native.bitmap_add(flat, encoded, values, negate)
    return True


def exact_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k largest magnitudes, by torch.topk."""
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=flat.device)
    return magnitude(flat).topk(k, sorted=False).indices.sort().values


def sampled_topk(flat: torch.Tensor, k: int, sample_ratio: float, generator: torch.Generator) -> torch.Tensor:
    """Ascending indices of exactly k largest magnitudes, found through a sampled threshold.

    A random sample of `sample_ratio` of the entries estimates the magnitude above which about
    1.5k entries lie; the exact top-k is then taken among those candidates only. When the sample
    underestimates the tail and fewer than k pass, the threshold is lowered and tried again, so
    the result is always the top k (the same set as exact_topk up to ties).

    From a density of COUNT_FROM_DENSITY on (a sparsifier's warm-up), float32 CPU tensors take
    native.c's exact count instead, drawing no sample: the same set up to ties, which it breaks
    toward the lower index, and NaN, which it ranks first (as torch.topk) where the sampled
    threshold never passes it.
    """
    numel = flat.numel()
    if k >= numel:
        return torch.arange(numel, device=flat.device)
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=flat.device)
    if k >= numel * COUNT_FROM_DENSITY and flat.dtype == torch.float32 and native.usable(flat):
        return native.top_magnitudes(flat, k)
    num_samples = min(numel, max(_MIN_SAMPLE, int(numel * sample_ratio)))
    sample_at = torch.randint(numel, (num_samples,), generator=generator, device=flat.device)
    sample = flat.index_select(0, sample_at).abs_()
    # Rank of the threshold within the sample, aiming for about 1.5k candidates overall.
    wanted = min(num_samples, max(1, int(num_samples * k / numel * OVERSELECT) + 1))
    while wanted < num_samples:
        threshold = _largest(sample, wanted)
        candidates = magnitude_at_least(flat, float(threshold), expected=int(k * OVERSELECT * 1.25))
        if candidates.numel() >= k:
            return _best_of(candidates, flat.index_select(0, candidates).abs_(), k)
        wanted *= 4  # the sample underestimated the tail: lower the threshold and retry
    return exact_topk(flat, k)


def _largest(sample: torch.Tensor, wanted: int) -> torch.Tensor:
    """The `wanted`-th largest entry of 1-D `sample` (0-d), NaN ranked above every number as
    kthvalue ranks it. On a GPU the last of its top `wanted`, sorted: CUDA's kthvalue ranks a single
    slice in one thread block (3 ms for 671,088 samples on an H200, 16x topk's). On the CPU
    kthvalue is as fast or faster (7 ms against 10 ms for as many on one core)."""
    if sample.device.type == "cuda":
        return sample.topk(wanted).values[-1]
    return sample.kthvalue(sample.numel() - wanted + 1).values


def magnitude_at_least(flat: torch.Tensor, threshold: float, expected: int) -> torch.Tensor:
    """Ascending int64 indices of the entries of 1-D `flat` with |flat| >= threshold (compared in
    flat's dtype); `expected`, about how many, sizes the native kernel's first try. One pass of
    native.c's kernel where it runs, else magnitudes and at_least."""
    if flat.dtype == torch.float32 and native.usable(flat):
        return native.at_least(flat, threshold, expected)
    size = magnitude(flat)
    return at_least(size, torch.tensor(threshold, dtype=size.dtype))


def at_least(size: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Ascending int64 indices of the entries of 1-D `size` that are >= `threshold`.

    On the CPU, nonzero() costs about a nanosecond per element, set or not. So the flags (in a
    scratch buffer: no fresh full-size mask) are scanned as int64 words of 8 first, and only the
    words with a flag set are looked at byte by byte: at the ~1.5% density of top-k candidates
    that is ~11% of the words, and both scans together cost half of one nonzero() over the
    flags. Where most words have a flag set, plain nonzero() is cheaper and is used.
    """
    if size.device.type != "cpu":
        return (size >= threshold).nonzero().squeeze(1)
    numel = size.numel()
    num_words = -(-numel // 8)
    flags = scratch("at-least-flags", 8 * num_words, torch.bool, size.device)
    # A Python scalar takes ATen's scalar fast path: 20% quicker than a 0-d tensor operand.
    torch.ge(size, float(threshold), out=flags[:numel])
    flags[numel:] = False  # the last word's padding
    words = flags.view(torch.int64)  # a scratch tensor starts its storage, so words align
    hit_words = words.nonzero().squeeze(1)
    if 2 * hit_words.numel() > num_words:
        return flags[:numel].nonzero().squeeze(1)
    # The hit words' bytes, in order, are the flags 8 w .. 8 w + 7 of each hit word w.
    hits = words.index_select(0, hit_words).view(torch.bool).nonzero().squeeze(1)
    return hit_words.index_select(0, hits >> 3).mul_(8).add_(hits & 7)


def _best_of(candidates: torch.Tensor, sizes: torch.Tensor, k: int) -> torch.Tensor:
    """The k candidates of largest size, still ascending: a mask keeps their order without a sort."""
    if candidates.numel() == k:
        return candidates
    keep = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    keep[sizes.topk(k, sorted=False).indices] = True
    return candidates[keep]
