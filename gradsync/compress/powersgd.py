"""PowerSGD: rank-r approximation by one step of power iteration, warm-started."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .base import Payload, SeededCompressor, WarmsUp, check_int

# The rank's warm-up, DGC's sparsity warm-up in PowerSGD's terms: over its first
# `rank_warmup_steps` compressed steps the codec approximates at 16, 8, 4 and then 2 times its
# rank, a quarter of the warm-up each. The first steps' gradients change fastest, and what a
# low rank holds back from them waits in the error memory while the weights move on. Under Adam
# on gpt-tiny (200 steps, 4 ranks) rank 4 from its first compressed step ended 3.9% above DDP's
# held-out loss; measured with this warm-up and beside the others tried in docs/compressors.md
# ("Rank warm-up").
RANK_WARMUP = (16, 8, 4, 2)
RANK_WARMUP_STEPS = 100


def warmup_rank(rank: int, step: int, warmup_steps: int) -> int:
    """The rank PowerSGD of `rank` approximates at its compressed step `step` (0-based), with
    a warm-up of `warmup_steps`."""
    if step < warmup_steps:
        return rank * RANK_WARMUP[step * len(RANK_WARMUP) // warmup_steps]
    return rank


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
    """How a flat input of `numel` elements is approximated at rank `rank` (no matrix's rank
    above it): its matrices, and the runs [start, end) sent exactly (summed with the first
    round's factors). `padded` is the size of the buffer the matrices are read from: numel, or
    more where a near-square view pads it."""

    numel: int
    rank: int
    matrices: tuple[Matrix, ...]
    exact: tuple[tuple[int, int], ...]
    padded: int


class PowerSGD(WarmsUp, SeededCompressor):
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

    Over its first `rank_warmup_steps` compressed steps (100 by default) the rank is 16, 8, 4,
    then 2 times `rank`, a quarter each (RANK_WARMUP); a matrix's warm-start Q keeps its leading
    columns as the rank falls. `steps` counts compressed steps, as the sparsifiers' does.

    It is the one multi-round codec (rounds = 2): the exchange layer drives begin / next_round /
    finish. compress / decompress run both rounds for a world of one, so the payload is the two
    rounds' frames. Biased; meant for error feedback.
    """

    randomness = "shared"
    needs_feedback = True
    rounds = 2
    uses_shapes = True

    def __init__(
        self,
        rank: int = 1,
        warm_start: bool = True,
        rank_warmup_steps: int = RANK_WARMUP_STEPS,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.rank = check_int("rank", rank, 1, 2**16)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start={warm_start!r} must be True or False")
        self.warm_start = warm_start
        self.rank_warmup_steps = check_int(
            "rank_warmup_steps", rank_warmup_steps, 0, why="compressed steps of rank warm-up"
        )
        self._shapes: tuple[torch.Size, ...] | None = None
        self._layout: Layout | None = None
        self._q: torch.Tensor | None = None  # every matrix's Q, end to end
        self._q_rank = self.rank  # the rank _q was made at: the warm-up changes it
        self._q_before: tuple[torch.Tensor | None, int] | None = None  # what this step's Q replaced
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
        self.count_step()  # this step's rank is in its layout, carried to the later rounds
        self._q_before = None  # nothing of this step kept yet
        source = self._source(x, layout)
        qs = self._views(self._start_q(layout, x.device), layout, "cols")
        p = torch.empty(_factor_numel(layout, "rows") + _exact_numel(layout), device=x.device)
        ps = self._views(p, layout, "rows")
        for matrix, q, out in zip(layout.matrices, qs, ps, strict=True):
            torch.matmul(_view(source, matrix), q, out=out)
        _gather_exact(p, source, layout)
        return (p,), (source, p, layout, x.shape, x.dtype)

    def next_round(self, summed: Payload, ctx: Any) -> tuple[Payload, Any]:
        source, p_local, layout, shape, dtype = ctx
        p_hats = [orthonormalize(p) for p in self._views(summed[0], layout, "rows")]
        q = torch.empty(_factor_numel(layout, "cols"), device=source.device)
        for matrix, p_hat, out in zip(layout.matrices, p_hats, self._views(q, layout, "cols"), strict=True):
            torch.matmul(_view(source, matrix).t(), p_hat, out=out)
        exact = (summed[0], p_local)  # the exact runs summed, and this rank's own
        return (q,), (p_hats, q, exact, layout, shape, dtype)

    def finish(
        self, summed: Payload, ctx: Any, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """The decoded sum (written into `out` where given), a function giving this rank's own
        decoded part, and one subtracting it from a tensor in place (error feedback's residual,
        without a full-size temporary)."""
        p_hats, q_local, (p_sum, p_local), layout, shape, dtype = ctx
        q_sum = summed[0]
        self._keep_q(q_sum, layout)
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
        layout = ctx[2]
        (q,), ctx = self.next_round((p,), ctx)
        self._keep_q(q, layout)
        return (p, q), (layout, x.shape, x.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        p, q = payload
        layout, shape, dtype = ctx
        p_hats = [orthonormalize(part) for part in self._views(p, layout, "rows")]
        return self._decode(p_hats, q, p, layout, torch.empty(shape, dtype=dtype, device=p.device))

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the next payload (at the warm-up's rank for the current step)."""
        layout = self.layout(numel)
        return 4 * (_factor_numel(layout, "rows") + _factor_numel(layout, "cols") + _exact_numel(layout))

    def state_dict(self) -> dict[str, Any]:
        q = None if self._q is None else self._q.clone()
        return {**super().state_dict(), "q": q, "q_rank": self._q_rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._q = state.get("q")
        # A checkpoint from before the warm-up existed ran at `rank` throughout.
        self._q_rank = state.get("q_rank", self.rank)

    # -- the layout --------------------------------------------------------------------------------

    def rank_at(self, step: int) -> int:
        """The rank approximated at compressed step `step` (0-based): RANK_WARMUP's multiples of
        `rank` over the warm-up, then `rank`."""
        return warmup_rank(self.rank, step, self.rank_warmup_steps)

    def layout(self, numel: int) -> Layout:
        """How an input of `numel` elements is approximated at the current step's rank: by the
        shapes given, where they add up to numel, else as one near-square matrix."""
        rank = self.rank_at(self.steps)
        layout = self._layout
        if layout is None or layout.numel != numel or layout.rank != rank:
            layout = self._layout = self._plan(numel, rank)
        return layout

    def _plan(self, numel: int, most: int) -> Layout:
        shapes = self._shapes
        if shapes is None or sum(s.numel() for s in shapes) != numel:
            rows = max(1, math.isqrt(max(0, numel - 1)) + 1)  # ceil(sqrt(numel))
            cols = max(1, -(-numel // rows))
            return Layout(numel, most, (Matrix(0, rows, cols, min(most, rows, cols)),), (), rows * cols)
        matrices, exact, start = [], [], 0
        for shape in shapes:
            size = shape.numel()
            rows = shape[0] if len(shape) >= 2 else 1
            cols = size // rows if rows else 0
            rank = min(most, rows, cols)
            if len(shape) >= 2 and rank > 0 and 2 * rank * (rows + cols) <= size:
                matrices.append(Matrix(start, rows, cols, rank))
            elif exact and exact[-1][1] == start:
                exact[-1] = (exact[-1][0], start + size)
            elif size:
                exact.append((start, start + size))
            start += size
        return Layout(numel, most, tuple(matrices), tuple(exact), numel)

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

    def _keep_q(self, q: torch.Tensor, layout: Layout) -> None:
        """Keep this step's summed Q to warm-start the next step, with the rank it was made at."""
        self._q_before = (self._q, self._q_rank)
        self._q, self._q_rank = q.clone(), layout.rank

    def undo(self) -> None:
        super().undo()
        if self._q_before is not None:  # kept already (a world of one's compress): put it back
            self._q, self._q_rank = self._q_before
            self._q_before = None

    def _start_q(self, layout: Layout, device: torch.device) -> torch.Tensor:
        """Q for this step's `layout`: the last step's, where warm-starting, its leading columns
        kept where the warm-up lowered the rank; else drawn afresh."""
        numel = _factor_numel(layout, "cols")
        if not self.warm_start or self._q is None:
            q = torch.empty(numel, device=device)
            return self._draw(q, self._views(q, layout, "cols"))
        kept = self._q.reshape(-1).to(device)  # flat; checkpoints before 2026-11 kept (cols, r)
        if self._q_rank == layout.rank:
            if kept.numel() != numel:
                raise _q_mismatch(kept.numel(), numel)
            return kept
        before = self._plan(layout.numel, self._q_rank)
        if kept.numel() != _factor_numel(before, "cols"):
            raise _q_mismatch(kept.numel(), _factor_numel(before, "cols"))
        old = {m.start: q for m, q in zip(before.matrices, self._views(kept, before, "cols"), strict=True)}
        q = torch.empty(numel, device=device)
        fresh = []
        for matrix, part in zip(layout.matrices, self._views(q, layout, "cols"), strict=True):
            last = old.get(matrix.start)
            width = 0 if last is None else min(last.shape[1], matrix.rank)
            if width:
                part[:, :width].copy_(last[:, :width])
            if width < matrix.rank:
                fresh.append(part[:, width:])
        return self._draw(q, fresh)

    def _draw(self, q: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """q, with each of `parts` (views into it) drawn afresh, in order, from the generator
        every rank seeds alike."""
        for part in parts:
            part.copy_(torch.randn(part.shape, generator=self.generator(q.device), device=q.device))
        return q


def _q_mismatch(held: int, needed: int) -> ValueError:
    return ValueError(
        f"powersgd warm-start Q has {held} elements but this group's matrices need {needed}: the "
        "state belongs to a group of another size or layout (a checkpoint from another model, "
        "bucket_cap_mb or gradsync version); register gradsync afresh"
    )


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
    """Orthonormal columns spanning those of p (float32), by Householder QR, as PyTorch's hook
    does above rank 2: the same bits on every rank from the same input. Where p has lower rank
    than its width (a gradient of fewer samples than the rank, a rank above the matrix's) QR
    still returns orthonormal columns, completing the span, so P^ P^T M stays a projection of M;
    Gram-Schmidt normalized such a column's rounding into a direction far from orthogonal to the
    others, and the decode was off by the input's own size. A zero column is completed too: after
    a step whose gradient was zero (a Q of zeros, warm-starting the next), P = M Q is zero, and
    the completed P^ still gives the next Q a start."""
    return torch.linalg.qr(p).Q
