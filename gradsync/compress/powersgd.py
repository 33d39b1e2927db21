"""PowerSGD: rank-r approximation by one step of power iteration, warm-started."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .base import Payload, SeededCompressor, check_int


class PowerSGD(SeededCompressor):
    """Rank-r low-rank compression by power iteration (Vogels et al., "PowerSGD: Practical
    Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).

    The flat input is viewed as a near-square matrix M (rows = ceil(sqrt(d)), zero-padded), as
    in PyTorch's batched PowerSGD hook. Round 1: P = M Q, allreduce P. Round 2: P^ = orthonormal
    columns of P, Q = M^T P^, allreduce Q. The result is P^ Q^T; Q is kept to warm-start the next
    step. Q's initial value comes from a generator seeded identically on every rank. Wire: r
    (rows + cols) fp32 values over two allreduces.

    It is the one multi-round codec (rounds = 2): the exchange layer drives begin / next_round /
    finish. compress / decompress run both rounds for a world of one, so the payload is (P, Q).
    Biased; meant for error feedback.
    """

    randomness = "shared"
    needs_feedback = True
    rounds = 2

    def __init__(self, rank: int = 1, warm_start: bool = True, seed: int = 0) -> None:
        super().__init__(seed)
        self.rank = check_int("rank", rank, 1, 2**16)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start={warm_start!r} must be True or False")
        self.warm_start = warm_start
        self._q: torch.Tensor | None = None
        # The padded matrix, reused from step to step (a fresh one costs page faults each time):
        # the input's copy until the second round, then the products that decode it.
        self._buffer: torch.Tensor | None = None

    # -- multi-round protocol, driven by gradsync.exchange -------------------------------------

    def begin(self, x: torch.Tensor) -> tuple[Payload, Any]:
        m = self._matrix(x)
        p = m @ self._start_q(m)
        return (p,), (m, x.shape, x.dtype)

    def next_round(self, summed: Payload, ctx: Any) -> tuple[Payload, Any]:
        m, shape, dtype = ctx
        p_hat = orthonormalize(summed[0])
        q = m.t() @ p_hat
        return (q,), (p_hat, q, shape, dtype)

    def finish(
        self, summed: Payload, ctx: Any, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """The decoded sum (written into `out` where given), a function giving this rank's own
        decoded part, and one subtracting it from a tensor in place (error feedback's residual,
        without a full-size temporary)."""
        p_hat, q_local, shape, dtype = ctx
        q_sum = summed[0]
        self._q = q_sum.clone()
        numel = shape.numel()
        product = self._product(p_hat, q_sum)
        if out is not None:
            total = out.view(-1).copy_(product[:numel]).view(out.shape)
        else:
            total = product[:numel].to(dtype, copy=True).reshape(shape)

        def local() -> torch.Tensor:
            return self._product(p_hat, q_local)[:numel].to(dtype, copy=True).reshape(shape)

        def subtract(t: torch.Tensor) -> torch.Tensor:
            t.view(-1).sub_(self._product(p_hat, q_local)[:numel])
            return t

        return total, local, subtract

    # -- world of one ----------------------------------------------------------------------------

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        (p,), ctx = self.begin(x)
        (q,), _ = self.next_round((p,), ctx)
        self._q = q.clone()
        return (p, q), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        p, q = payload
        shape, dtype = ctx
        return _unmatrix(orthonormalize(p) @ q.t(), shape, dtype)

    def payload_bytes(self, numel: int) -> int:
        rows, cols, rank = self._dims(numel)
        return 4 * rank * (rows + cols)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "q": None if self._q is None else self._q.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._q = state.get("q")

    # -- helpers ---------------------------------------------------------------------------------

    def _dims(self, numel: int) -> tuple[int, int, int]:
        rows = max(1, math.isqrt(max(0, numel - 1)) + 1)  # ceil(sqrt(numel))
        cols = max(1, -(-numel // rows))
        return rows, cols, min(self.rank, rows, cols)

    def _matrix(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols, _ = self._dims(x.numel())
        padded = self._padded(rows * cols, x.device)
        padded[: x.numel()].copy_(x.reshape(-1))
        padded[x.numel() :].zero_()
        return padded.view(rows, cols)

    def _padded(self, numel: int, device: torch.device) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() != numel or buffer.device != device:
            buffer = self._buffer = torch.empty(numel, device=device)
        return buffer

    def _product(self, p_hat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """p_hat q^T, flat, in the reused buffer: valid until the next product or compression."""
        rows, cols = p_hat.shape[0], q.shape[0]
        out = self._padded(rows * cols, p_hat.device).view(rows, cols)
        return torch.matmul(p_hat, q.t(), out=out).view(-1)

    def _start_q(self, m: torch.Tensor) -> torch.Tensor:
        _, cols = m.shape
        rank = min(self.rank, *m.shape)
        if self.warm_start and self._q is not None:
            if self._q.shape != (cols, rank):
                raise ValueError(
                    f"powersgd warm-start Q has shape {tuple(self._q.shape)} but this tensor needs "
                    f"{(cols, rank)}: the state belongs to a tensor of another size"
                )
            return self._q.to(m.device)
        generator = self.generator(m.device)
        return torch.randn(cols, rank, generator=generator, device=m.device)


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning those of p, by modified Gram-Schmidt (deterministic, so every
    rank gets the same bits from the same input). A zero column stays zero."""
    p = p.clone()
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i]
        col.div_(col.norm().clamp_min(tiny))
        rest = p[:, i + 1 :]
        if rest.numel():
            rest.sub_(col.unsqueeze(1) * (col @ rest))
    return p


def _unmatrix(m: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return m.reshape(-1)[: shape.numel()].to(dtype).reshape(shape)
