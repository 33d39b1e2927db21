"""Deep Gradient Compression: momentum correction, masking, clipping and a sparsity warm-up."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import (
    Payload,
    SeededCompressor,
    Undoable,
    check_fraction,
    check_int,
    check_real,
    shape_ctx,
)
from .scratch import scratch
from .sparse import SparsityWarmup, add_sparse_, decode_sparse, sampled_topk, sparse_payload


class DGC(SparsityWarmup, SeededCompressor):
    """Deep Gradient Compression (Lin et al., "Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training", ICLR 2018).

    Per compression point and rank, with momentum m:
        g <- g * min(1, clip_norm / ||g||)           local gradient clipping (if clip_norm)
        u <- m u + g                                 momentum correction
        v <- v + u                                   accumulation
        send the top-k of v by magnitude; v <- 0 and, with masking, u <- 0 where sent
    The top-k threshold comes from a sample of `sample_ratio` of the entries, with a correction
    pass that keeps exactly k (from a density of 1/32 up, on the CPU, an exact count instead:
    compress.sparse.sampled_topk). Density follows the warm-up schedule 25% -> 6.25% -> 1.5625% ->
    0.4%, over `sparsity_warmup_steps` compressed steps (compress.sparse.warmup_density), then
    `ratio`.

    The momentum lives here, so train with a momentum-free optimizer (SGD without momentum): with
    ratio=1 and masking=False the decoded sum is exactly the momentum SGD update direction. The
    accumulator v is DGC's own error memory (owns_memory): use error_feedback="none".

    Payload as top-k: values and int32 indices or a bitmap, whichever is smaller. Its size follows
    the schedule, equal on every rank at the same step. u and v are kept in two buffers each, so
    a step that turns out non-finite on some rank is undone (undo) and leaves no trace.
    `clip_norm` bounds the l2 norm of what this codec receives (each rank's gradient of this
    bucket, already divided by the world size); the paper scales a global bound by N^-1/2 for N
    workers.
    """

    randomness = "local"
    owns_memory = True
    sparse_rows = True

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
        self._u = Undoable("dgc momentum")
        self._v = Undoable("dgc accumulator")  # accumulated, not yet sent

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        flat = x.reshape(-1)
        k = self.entries(flat.numel())
        self.count_step()
        (u_old, u), (v_old, v) = self._u.update(flat), self._v.update(flat)
        torch.mul(u_old, self.momentum, out=u).add_(self._clipped(flat))
        torch.add(v_old, u, out=v)
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

    def undo(self) -> None:
        if self._u.undo():
            self._v.undo()
        super().undo()

    def rescale_units(self, ratio: float) -> None:
        self._u.scale(ratio)  # the momentum and the accumulator hold gradients
        self._v.scale(ratio)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "u": self._u.state(), "v": self._v.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._u.load(state["u"])
        self._v.load(state["v"])

    def _clipped(self, flat: torch.Tensor) -> torch.Tensor:
        if self.clip_norm is None:
            return flat
        norm = float(torch.linalg.vector_norm(flat))
        if norm <= self.clip_norm:
            return flat
        out = scratch("dgc-clipped", flat.numel(), flat.dtype, flat.device)
        return torch.mul(flat, self.clip_norm / norm, out=out)
