"""Deep Gradient Compression: momentum correction, masking, clipping and a sparsity warm-up."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..wire import index_nbytes
from .base import Payload, SeededCompressor, check_fraction, check_int, check_real, count_for, shape_ctx
from .scratch import scratch
from .sparse import add_sparse_, decode_sparse, sampled_topk, sparse_payload

# Sparsity during the warm-up, one stage after the other (the paper's exponential schedule); the
# stages share the warm-up steps equally and the configured ratio follows.
WARMUP_SPARSITY = (0.75, 0.9375, 0.984375, 0.996)


class DGC(SeededCompressor):
    """Deep Gradient Compression (Lin et al., "Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training", ICLR 2018).

    Per compression point and rank, with momentum m:
        g <- g * min(1, clip_norm / ||g||)           local gradient clipping (if clip_norm)
        u <- m u + g                                 momentum correction
        v <- v + u                                   accumulation
        send the top-k of v by magnitude; v <- 0 and, with masking, u <- 0 where sent
    The top-k threshold comes from a sample of `sample_ratio` of the entries, with a correction
    pass that keeps exactly k. Density follows the warm-up schedule 25% -> 6.25% -> 1.5625% ->
    0.4%, over `sparsity_warmup_steps` compressed steps, then `ratio`.

    The momentum lives here, so train with a momentum-free optimizer (SGD without momentum): with
    ratio=1 and masking=False the decoded sum is exactly the momentum SGD update direction. The
    accumulator v is DGC's own error memory (owns_memory): use error_feedback="none".

    Payload as top-k: values and int32 indices or a bitmap, whichever is smaller. Its size follows
    the schedule, equal on every rank at the same step. A non-finite step compresses zeros, so the
    state advances as if the gradient had been zero. `clip_norm` bounds the l2 norm of what this
    codec receives (each rank's gradient of this bucket, already divided by the world size); the
    paper scales a global bound by N^-1/2 for N workers.
    """

    randomness = "local"
    owns_memory = True

    def __init__(
        self,
        ratio: float = 0.001,
        momentum: float = 0.9,
        masking: bool = True,
        clip_norm: float | None = None,
        sample_ratio: float = 0.01,
        sparsity_warmup_steps: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.ratio = check_fraction("ratio", ratio)
        self.momentum = check_real("momentum", momentum, 0, 1, "[)", "the paper uses 0.9")
        if not isinstance(masking, bool):
            raise ValueError(f"masking={masking!r} must be True or False")
        self.masking = masking
        self.clip_norm = None
        if clip_norm is not None:
            self.clip_norm = check_real("clip_norm", clip_norm, 0, math.inf, "()", "or None: no clipping")
        self.sample_ratio = check_fraction("sample_ratio", sample_ratio)
        self.sparsity_warmup_steps = check_int(
            "sparsity_warmup_steps", sparsity_warmup_steps, 0, why="compressed steps of sparsity warm-up"
        )
        self.steps = 0  # compressed steps so far: the position in the schedule
        self._u: torch.Tensor | None = None  # momentum
        self._v: torch.Tensor | None = None  # accumulated, not yet sent

    def density(self, step: int) -> float:
        """Fraction of entries sent at compressed step `step` (0-based)."""
        if step < self.sparsity_warmup_steps:
            stage = step * len(WARMUP_SPARSITY) // self.sparsity_warmup_steps
            return max(self.ratio, 1 - WARMUP_SPARSITY[stage])
        return self.ratio

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        k = count_for(flat.numel(), self.density(self.steps))
        self.steps += 1
        u, v = self._memory("_u", flat), self._memory("_v", flat)
        u.mul_(self.momentum).add_(self._clipped(flat))
        v.add_(u)
        indices = sampled_topk(v, k, self.sample_ratio, self.generator(flat.device))
        payload = sparse_payload(v, indices)
        v.index_fill_(0, indices, 0)
        if self.masking:
            u.index_fill_(0, indices, 0)
        return payload, shape_ctx(x)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return decode_sparse(payload, ctx)

    def add_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        add_sparse_(out, payload)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the next payload (the schedule's density at the current step)."""
        k = count_for(numel, self.density(self.steps))
        return index_nbytes(numel, k) + 4 * k

    def state_dict(self) -> dict[str, Any]:
        memory = {name: None if t is None else t.clone() for name, t in (("u", self._u), ("v", self._v))}
        return {**super().state_dict(), "steps": self.steps, **memory}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps = state["steps"]
        # Copies: the memories change in place, and the state dict may be loaded again.
        self._u, self._v = (None if t is None else t.clone() for t in (state["u"], state["v"]))

    def _clipped(self, flat: torch.Tensor) -> torch.Tensor:
        if self.clip_norm is None:
            return flat
        norm = float(torch.linalg.vector_norm(flat))
        if norm <= self.clip_norm:
            return flat
        out = scratch("dgc-clipped", flat.numel(), flat.dtype, flat.device)
        return torch.mul(flat, self.clip_norm / norm, out=out)

    def _memory(self, name: str, like: torch.Tensor) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            value = torch.zeros_like(like)
        elif value.shape != like.shape:
            raise ValueError(
                f"dgc memory has {value.numel()} elements but the tensor has {like.numel()}: the "
                "state belongs to a tensor of another size"
            )
        elif value.device != like.device or value.dtype != like.dtype:
            value = value.to(like.device, like.dtype)
        setattr(self, name, value)
        return value

