"""PowerSGD: rank-r approximation by one step of power iteration, warm-started."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .base import Payload, SeededCompressor, check_int


class Matrix(NamedTuple):
    """One tensor of a group as PowerSGD approximates it: `rows` x `cols` from element `start` of
    the flat input, at rank `rank`."""

    start: int
    rows: int
    cols: int
    rank: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


class Layout(NamedTuple):
    """How a flat input of `numel` elements is approximated: its matrices, and the runs
    [start, end) sent exactly (summed with the first round's factors). `padded` is the size of
    the buffer the matrices are read from: numel, or more where a near-square view pads it."""

    numel: int
    matrices: tuple[Matrix, ...]
    exact: tuple[tuple[int, int], ...]
    padded: int


class PowerSGD(SeededCompressor):
    """Rank-r low-rank compression by power iteration (Vogels et al., "PowerSGD: Practical
    Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019).

    Each weight is approximated as its own matrix, (shape[0], numel / shape[0]), as the paper and
    PyTorch's hook do, where the hook knows a group's tensors (`uses_shapes`): a layer's gradient
    is a sum of a few outer products, so a few ranks hold most of it. Tensors a rank-r pair would
    not shrink at least twofold (biases, norms' weights, thin matrices) are sent exactly.
    Without shapes the flat input is viewed as one near-square matrix (rows = ceil(sqrt(d)),
    zero-padded), as PyTorch's batched hook does: it mixes layers, so at the same rank it keeps
    less of the gradient.

    Round 1: P = M Q per matrix, allreduce the P's (and the exact runs). Round 2: P^ = orthonormal
    columns of P, Q = M^T P^, allreduce the Q's. The result is P^ Q^T; Q is kept to warm-start
    the next step. Q's initial value comes from a generator seeded identically on every rank.
    Wire: r (rows + cols) fp32 values per matrix, plus the exact runs, over two allreduces.

    It is the one multi-round codec (rounds = 2): the exchange layer drives begin / next_round /
    finish. compress / decompress run both rounds for a world of one, so the payload is the two
    rounds' frames. Biased; meant for error feedback.
    """

    randomness = "shared"
    needs_feedback = True
    rounds = 2
    uses_shapes = True

    def __init__(self, rank: int = 1, warm_start: bool = True, seed: int = 0) -> None:
        super().__init__(seed)
        self.rank = check_int("rank", rank, 1, 2**16)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start={warm_start!r} must be True or False")
        self.warm_start = warm_start
        self._shapes: tuple[torch.Size, ...] | None = None
        self._layout: Layout | None = None
        self._q: torch.Tensor | None = None  # every matrix's Q, end to end
        # Reused from step to step (a fresh one costs page faults each time): the input's float32
        # copy where it cannot be read in place, then the products that decode it.
        self._buffer: torch.Tensor | None = None

    def use_shapes(self, shapes: Sequence[Sequence[int]]) -> None:
        """The shapes of the tensors the flat input holds, in order: each is approximated as its
        own matrix."""
        self._shapes = tuple(torch.Size(s) for s in shapes)
        self._layout = None

    # -- multi-round protocol, driven by gradsync.exchange -------------------------------------

    def begin(self, x: torch.Tensor) -> tuple[Payload, Any]:
        layout = self.layout(x.numel())
        source = self._source(x, layout)
        qs = self._views(self._start_q(layout, x.device), layout, "cols")
        p = torch.empty(_factor_numel(layout, "rows") + _exact_numel(layout), device=x.device)
        ps = self._views(p, layout, "rows")
        for matrix, q, out in zip(layout.matrices, qs, ps, strict=True):
            torch.matmul(_view(source, matrix), q, out=out)
        _gather_exact(p, source, layout)
        return (p,), (source, p, x.shape, x.dtype)

    def next_round(self, summed: Payload, ctx: Any) -> tuple[Payload, Any]:
        source, p_local, shape, dtype = ctx
        layout = self.layout(shape.numel())
        p_hats = [orthonormalize(p) for p in self._views(summed[0], layout, "rows")]
        q = torch.empty(_factor_numel(layout, "cols"), device=source.device)
        for matrix, p_hat, out in zip(layout.matrices, p_hats, self._views(q, layout, "cols"), strict=True):
            torch.matmul(_view(source, matrix).t(), p_hat, out=out)
        exact = (summed[0], p_local)  # the exact runs summed, and this rank's own
        return (q,), (p_hats, q, exact, shape, dtype)

    def finish(
        self, summed: Payload, ctx: Any, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """The decoded sum (written into `out` where given), a function giving this rank's own
        decoded part, and one subtracting it from a tensor in place (error feedback's residual,
        without a full-size temporary)."""
        p_hats, q_local, (p_sum, p_local), shape, dtype = ctx
        layout = self.layout(shape.numel())
        q_sum = summed[0]
        self._q = q_sum.clone()
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=q_sum.device)
        total = self._decode(p_hats, q_sum, p_sum, layout, out)

        def local() -> torch.Tensor:
            mine = torch.empty(shape, dtype=dtype, device=q_sum.device)
            return self._decode(p_hats, q_local, p_local, layout, mine)

        def subtract(t: torch.Tensor) -> torch.Tensor:
            flat = t.view(-1)
            qs = self._views(q_local, layout, "cols")
            for matrix, p_hat, q in zip(layout.matrices, p_hats, qs, strict=True):
                product = self._product(p_hat, q, matrix)
                end = min(matrix.start + matrix.numel, layout.numel)
                flat[matrix.start : end].sub_(product[: end - matrix.start])
            for (start, end), offset in _exact_runs(layout):
                flat[start:end].sub_(p_local[offset : offset + end - start])
            return t

        return total, local, subtract

    # -- world of one ----------------------------------------------------------------------------

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        (p,), ctx = self.begin(x)
        (q,), ctx = self.next_round((p,), ctx)
        self._q = q.clone()
        return (p, q), (x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        p, q = payload
        shape, dtype = ctx
        layout = self.layout(shape.numel())
        p_hats = [orthonormalize(part) for part in self._views(p, layout, "rows")]
        return self._decode(p_hats, q, p, layout, torch.empty(shape, dtype=dtype, device=p.device))

    def payload_bytes(self, numel: int) -> int:
        layout = self.layout(numel)
        return 4 * (_factor_numel(layout, "rows") + _factor_numel(layout, "cols") + _exact_numel(layout))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "q": None if self._q is None else self._q.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._q = state.get("q")

    # -- the layout --------------------------------------------------------------------------------

    def layout(self, numel: int) -> Layout:
        """How an input of `numel` elements is approximated: by the shapes given, where they add
        up to numel, else as one near-square matrix."""
        layout = self._layout
        if layout is None or layout.numel != numel:
            layout = self._layout = self._plan(numel)
        return layout

    def _plan(self, numel: int) -> Layout:
        shapes = self._shapes
        if shapes is None or sum(s.numel() for s in shapes) != numel:
            rows = max(1, math.isqrt(max(0, numel - 1)) + 1)  # ceil(sqrt(numel))
            cols = max(1, -(-numel // rows))
            return Layout(numel, (Matrix(0, rows, cols, min(self.rank, rows, cols)),), (), rows * cols)
        matrices, exact, start = [], [], 0
        for shape in shapes:
            size = shape.numel()
            rows = shape[0] if len(shape) >= 2 else 1
            cols = size // rows if rows else 0
            rank = min(self.rank, rows, cols)
            if len(shape) >= 2 and rank > 0 and 2 * rank * (rows + cols) <= size:
                matrices.append(Matrix(start, rows, cols, rank))
            elif exact and exact[-1][1] == start:
                exact[-1] = (exact[-1][0], start + size)
            elif size:
                exact.append((start, start + size))
            start += size
        return Layout(numel, tuple(matrices), tuple(exact), numel)

    def _views(self, flat: torch.Tensor, layout: Layout, side: str) -> list[torch.Tensor]:
        """Each matrix's factor in `flat` (P's, `side` "rows", or Q's, "cols"), end to end."""
        views, offset = [], 0
        for matrix in layout.matrices:
            length = getattr(matrix, side)
            views.append(flat[offset : offset + length * matrix.rank].view(length, matrix.rank))
            offset += length * matrix.rank
        return views

    def _source(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        """x, flat and float32, with the padding the layout reads: x itself where it can be."""
        flat = x.reshape(-1)
        if layout.padded == layout.numel and flat.dtype == torch.float32 and flat.data_ptr() == x.data_ptr():
            return flat
        buffer = self._padded(layout.padded, x.device)
        buffer[: layout.numel].copy_(flat)
        buffer[layout.numel :].zero_()
        return buffer

    def _decode(
        self, p_hats: list[torch.Tensor], q: torch.Tensor, p: torch.Tensor, layout: Layout, out: torch.Tensor
    ) -> torch.Tensor:
        """out <- every matrix's P^ Q^T and the exact runs from the first round's frame `p`."""
        flat = out.view(-1)
        direct = layout.padded == layout.numel and flat.dtype == torch.float32
        qs = self._views(q, layout, "cols")
        for matrix, p_hat, q_part in zip(layout.matrices, p_hats, qs, strict=True):
            if direct:
                torch.matmul(p_hat, q_part.t(), out=_view(flat, matrix))
            else:
                end = min(matrix.start + matrix.numel, layout.numel)
                flat[matrix.start : end].copy_(self._product(p_hat, q_part, matrix)[: end - matrix.start])
        for (start, end), offset in _exact_runs(layout):
            flat[start:end].copy_(p[offset : offset + end - start])
        return out

    def _product(self, p_hat: torch.Tensor, q: torch.Tensor, matrix: Matrix) -> torch.Tensor:
        """p_hat q^T, flat, in the reused buffer: valid until the next product or compression."""
        buffer = self._padded(matrix.numel, p_hat.device)
        return torch.matmul(p_hat, q.t(), out=_view(buffer, matrix._replace(start=0))).view(-1)

    def _padded(self, numel: int, device: torch.device) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = self._buffer = torch.empty(numel, device=device)
        return buffer[:numel]

    def _start_q(self, layout: Layout, device: torch.device) -> torch.Tensor:
        numel = _factor_numel(layout, "cols")
        if self.warm_start and self._q is not None:
            if self._q.numel() != numel:
                raise ValueError(
                    f"powersgd warm-start Q has {self._q.numel()} elements but this group's matrices "
                    f"need {numel}: the state belongs to a group of another size or layout (a "
                    "checkpoint from another model, bucket_cap_mb or gradsync version); register "
                    "gradsync afresh"
                )
            return self._q.reshape(-1).to(device)  # flat; checkpoints before 2026-11 kept (cols, r)
        q = torch.empty(numel, device=device)
        for part in self._views(q, layout, "cols"):  # one draw per matrix, in order
            part.copy_(torch.randn(part.shape, generator=self.generator(device), device=device))
        return q


def _view(flat: torch.Tensor, matrix: Matrix) -> torch.Tensor:
    return flat[matrix.start : matrix.start + matrix.numel].view(matrix.rows, matrix.cols)


def _factor_numel(layout: Layout, side: str) -> int:
    return sum(getattr(m, side) * m.rank for m in layout.matrices)


def _exact_numel(layout: Layout) -> int:
    return sum(end - start for start, end in layout.exact)


def _exact_runs(layout: Layout) -> list[tuple[tuple[int, int], int]]:
    """Each exact run with its offset in the first round's frame, after the P's."""
    runs, offset = [], _factor_numel(layout, "rows")
    for start, end in layout.exact:
        runs.append(((start, end), offset))
        offset += end - start
    return runs


def _gather_exact(p: torch.Tensor, source: torch.Tensor, layout: Layout) -> None:
    for (start, end), offset in _exact_runs(layout):
        p[offset : offset + end - start].copy_(source[start:end])


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
