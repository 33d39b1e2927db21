"""Exchange: every collective of a step, from one rank's tensor to the decoded sum over ranks.

How a group's tensor travels follows its codec's declared capabilities and its strategy:
  allreduce  no codec: the tensor itself, in place. Summable payloads (casts, randk): one
             allreduce of the payload. Multi-round codecs (PowerSGD): one allreduce per round.
             Majority votes (signSGD, Signum): each rank's sign bits become 0/1 votes in fields of
             ceil(log2(n + 1)) bits packed into int32 words, one int32 allreduce sums every field
             at once, and the result is sign(2 * votes - n): +1, -1 or 0 on a tie.
  allgather  any other payload: one allgather of each rank's payload bytes; codecs whose payload
             size varies from rank to rank exchange their sizes first.
  a sparse scheme (gradsync.sparse, through the state's Router): a sparsifier's payload (top-k,
             DGC, threshold) as rows of width 1 where the strategy names a scheme; and the rows
             of an uncompressed group's embedding tables, each by the router's choice, its other
             tensors in allreduces between them.

An exchange is issued through the state's Lane: at once where it never waits, on the lane's
thread where it must wait for one collective before issuing the next (multi-round codecs, size
exchanges, the sparse schemes). Either way the caller gets a future at once.

Every rank decodes the payloads in rank order (or from one sum), so the result is bit-identical
on every rank. Each rank's share is its tensor divided by the world size (by the caller, or by
the codec as it compresses: `divisor`, `corrected`), so the sum is the average.

Non-finite gradients, where the caller guards (a compressed group: error memories and codec state
must never take them in): a rank whose tensor is not finite compresses zeros instead, so its codec
state stays in step with the other ranks, and tells the others: an allreduced float payload
carries a NaN (the sum is then NaN everywhere), other frames end in a flag. So does any non-finite
value in a payload (an fp16 overflow). Every rank then sees `finite` False.

(Over 400 lines: every collective of a step is here, in one module, so that what goes out in
which order, which every rank must agree on, reads in one place. Frames are gradsync.wire's.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from .comm import Comm, allgather_sent_nbytes, allgather_sizes, allreduce_sent_nbytes, completed, then
from .compress import Compressor, Payload
from .feedback import Corrected, Local, RemoveLocal
from .lane import Lane
from .sparse.router import Router, Table
from .sparse.rows import SparseRows
from .strategy import sums, two_shot
from .wire import (
    decode_indices,
    field_bits,
    frame_into,
    framed,
    from_bytes,
    layout_nbytes,
    pack_fields,
    split_frame,
    unpack_bits,
    unpack_fields,
)


@dataclass
class Exchanged:
    """The outcome of one exchange, as seen by one rank."""

    collective: str  # "allreduce", "allgather" or "two-shot": how the payloads combined
    scheme: str | None  # the sparse scheme that carried rows, if any
    total: torch.Tensor | None  # decoded sum over ranks, same bits on every rank; None if not finite
    local: Local  # this rank's own decoded payload, for error feedback
    finite: bool  # False when any rank's input was not finite
    payload_nbytes: int  # this rank's payload as exchanged (votes: the count fields), all rounds
    sent_nbytes: int  # bytes this rank sends over its links (ring algorithms), flags and padding included
    seconds: dict[str, float] = field(default_factory=dict)  # compress, communicate, decompress
    # t -= local() in place, by the codec's sub_decoded_ (sparse codecs touch only what they sent);
    # None where the payload is decoded only as a whole (multi-round codecs): local() is subtracted.
    # With start's `corrected`, the codec already left x - local() in x: x is returned as it is.
    subtract_local: RemoveLocal | None = None

    @classmethod
    def skipped(
        cls,
        collective: str,
        payload_nbytes: int,
        sent_nbytes: int,
        seconds: dict[str, float],
        scheme: str | None = None,
    ) -> Exchanged:
        """The outcome where some rank's input or a sum was not finite: no total, and no local
        part to feed back (the step is skipped on every rank alike)."""
        return cls(collective, scheme, None, _not_finite, False, payload_nbytes, sent_nbytes, seconds)

    def __reduce__(self) -> tuple[Any, ...]:
        # A GPU-aware torch Future finds the CUDA tensors of the value it is completed with by
        # pickling it (to record their streams' events for its waiters), and `local` and
        # `subtract_local` are closures, which cannot be pickled; they hold nothing to wait for
        # (this rank's own payloads, made before the collective). So only the sum is shown, and
        # a copy or an unpickling raises rather than return something else.
        return (_not_restorable, (self.total,))

    def remove_local_(self, t: torch.Tensor) -> torch.Tensor:
        """t -= local(), in place, the same bits as t - local(); returns t.

        Where t is the tensor that was compressed, call local() before, not after: a payload may
        be a view of its input (the "none" codec), and would then change with it.
        """
        if self.subtract_local is None:
            return t.sub_(self.local())
        return self.subtract_local(t)


@dataclass(frozen=True)
class Route:
    """Where and how one exchange runs: the state's collectives, lane and sparse router. A
    SyncState passes its own; Route(comm) alone is a fresh lane and an "auto" router."""

    comm: Comm
    lane: Lane = field(default_factory=Lane)
    router: Router = field(default_factory=lambda: Router("auto", every=100, seed=0))
    key: str = "tensor"  # the router's name for the group ("group 3", "bucket 1"): its scheme choices
    step: int = 0


def uncompressed(
    x: torch.Tensor, route: Route, tables: Sequence[Table] = (), scheme: str | None = None
) -> Future[Exchanged]:
    """Sum `x` over the ranks, in place: one allreduce, or, where `tables` name embedding tables
    in it (at their offsets, ascending), their rows by sparse `scheme` ("auto" or None: the
    router's choice) and the tensors between them allreduced."""
    if not tables:
        return route.lane.run(lambda: _plain(x, route.comm), blocking=False, device=x.device)
    return route.lane.run(lambda: _tables(x, tables, route, scheme), blocking=True, device=x.device)


def start(
    codec: Compressor,
    x: torch.Tensor,
    route: Route,
    collective: str | None = None,
    scheme: str | None = None,
    finite: bool = True,
    out: torch.Tensor | None = None,
    keep_local: bool = True,
    guard: bool = True,
    shard_error: torch.Tensor | None = None,
    divisor: int = 1,
    corrected: Corrected | None = None,
    shard_error_out: torch.Tensor | None = None,
) -> Future[Exchanged]:
    """Compress `x`, exchange the payload as `collective` (or, for a sparsifier, by sparse `scheme`)
    and return a future of the decoded sum. By default the collective is the codec's own (as in
    strategy.default_collective): allreduce where ranks sum the codec's payloads (summable,
    multi-round, votes), two-shot for the other dense quantizers, else allgather.

    `finite` False: this rank's `x` is not finite; it sends zeros and tells the others. `out`
    (shaped like `x`) receives the sum instead of a fresh tensor; it may be `x` itself (not with
    `corrected`) or corrected.g, as both are read before `out` is first written (two-shot builds
    the owner's sum in its shard of `out`), and it holds nothing meaningful when the result is not
    finite.
    `keep_local` False promises that the caller never asks for its own decoded payload (no error
    feedback), so a summable payload is allreduced in place. `guard` False: nothing keeps state a
    non-finite step could poison, and the codec carries NaN and inf by itself (its declared
    preserves_nonfinite), so no rank checks the result: it is decoded as it is, `finite` True.
    `shard_error` (two-shot only): the error memory of this rank's second encoding, shaped like
    its shard (shard_bounds), updated in place when the step is finite, or written into
    `shard_error_out` instead where given (so that the caller can still undo the step); None: no
    memory.
    `divisor`: `x` is not yet divided by it (the world size) and nothing was added to it: the codec
    divides as it compresses (Compressor.compress_mean), and `x` may be left divided.
    `corrected` (two-shot, a codec that fuses_feedback, `finite`): `x` is a buffer not yet written;
    the codec computes x = base + alpha * g shard by shard as it encodes and leaves x - its decoded
    payload in x (Compressor.compress_corrected), so the result's remove_local_(x) has nothing left
    to subtract: residual error feedback in one pass instead of three.
    """
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(
            f"out is {out.dtype} {tuple(out.shape)} on {out.device} but x is {x.dtype} {tuple(x.shape)} "
            f"on {x.device}: the sum is decoded into out, so it must match x"
        )
    kind = type(codec)
    collective = collective or ("allreduce" if sums(kind) else "two-shot" if two_shot(kind) else "allgather")
    if collective == "allgather" and (kind.rounds > 1 or kind.majority_vote):
        raise ValueError(
            f"collective='allgather' for {kind.__name__}, which combines ranks by allreduces of its own "
            "(rounds or a vote), not by decoding each rank's payload; leave the collective to the codec"
        )
    if collective == "two-shot" and not two_shot(kind):
        raise ValueError(
            f"collective='two-shot' for {kind.__name__}: only fixed-size, dense, single-round codecs "
            "without a vote or a random stream the ranks share can have a shard's sum encoded again "
            "by its owner; leave the collective to the codec"
        )
    if corrected is not None:
        _check_corrected(corrected, x, kind, collective, finite, out, divisor)
    fused = collective == "allreduce" and kind.rounds == 1 and not kind.majority_vote and scheme is None
    if divisor != 1 and not fused:  # only a plain allreduce's one compress divides as it goes
        x, divisor = x.div_(divisor), 1
    source = x if finite else torch.zeros_like(x)
    if collective == "two-shot":
        program = lambda: _two_shot(  # noqa: E731
            codec, source, route.comm, finite, out, shard_error, corrected, shard_error_out
        )
        return route.lane.run(program, blocking=True, device=x.device)
    if kind.rounds > 1:
        program = lambda: _rounds(codec, source, route.comm, finite, out)  # noqa: E731
        return route.lane.run(program, blocking=True, device=x.device)
    if scheme is not None:
        if not kind.sparse_rows:
            raise ValueError(f"scheme={scheme!r} for {kind.__name__}, whose payload is not sparse rows")
        return route.lane.run(
            lambda: _sparse(codec, source, route, scheme, finite, out), blocking=True, device=x.device
        )
    if kind.majority_vote:
        return route.lane.run(
            lambda: _vote(codec, source, route.comm, finite), blocking=False, device=x.device
        )
    if collective == "allreduce":
        if not kind.summable:
            raise ValueError(f"collective='allreduce' for {kind.__name__}, whose payloads are not summable")
        program = lambda: _allreduce(  # noqa: E731
            codec, source, route.comm, finite, keep_local, out, guard, divisor
        )
        return route.lane.run(program, blocking=False, device=x.device)
    if collective != "allgather":
        raise ValueError(
            f"collective={collective!r} is not run by gradsync's hook; use allreduce, allgather or two-shot"
        )
    blocking = not kind.fixed_size  # sizes first, then the payloads
    return route.lane.run(
        lambda: _allgather(codec, source, route.comm, finite, out), blocking=blocking, device=x.device
    )


# -- the programs: each issues its collectives and returns the future of the result ---------------


def _plain(x: torch.Tensor, comm: Comm) -> Future[Exchanged]:
    nbytes = x.numel() * x.element_size()
    clock = _Clock()

    def done(summed: torch.Tensor) -> Exchanged:
        clock.lap("communicate")
        sent = allreduce_sent_nbytes(nbytes, comm.world_size)
        return Exchanged("allreduce", None, summed, lambda: x, True, nbytes, sent, clock.seconds)

    return then(comm.allreduce(x), done, x.device)


def _tables(x: torch.Tensor, tables: Sequence[Table], route: Route, scheme: str | None) -> Future[Exchanged]:
    """Runs of dense tensors by one allreduce each, embedding tables by the router's schemes."""
    comm, router = route.comm, route.router
    clock = _Clock()
    flat = x.view(-1)
    sparse = router.choose_tables(tables, flat, comm, route.step, scheme)
    pending: list[Future] = []
    sent, start = 0, 0
    for table, by_rows in [*zip(tables, sparse, strict=True), (None, True)]:
        end = flat.numel() if table is None else table.offset
        if by_rows and end > start:  # the dense run before it
            run = flat[start:end]
            pending.append(comm.allreduce(run))
            sent += allreduce_sent_nbytes(run.nbytes, comm.world_size)
            start = end
        if table is None or not by_rows:
            continue
        rows = table.view(flat)
        result = router.sync(
            table.key, SparseRows.from_dense(rows), comm, route.step, in_bucket=True, scheme=scheme
        )
        result.total.into(rows)
        sent += result.sent_nbytes
        start = table.offset + table.numel
    schemes = sorted({router.last[t.key]["exchanged_by"] for t, s in zip(tables, sparse, strict=True) if s})
    carried = "+".join(schemes) or None  # the schemes the rows went by

    def done(_: object) -> Exchanged:
        for run in pending:
            run.wait()  # each run's error, and on a GPU its stream, not only the last one's
        clock.lap("communicate")
        return Exchanged("allreduce", carried, x, lambda: x, True, x.nbytes, sent, clock.seconds)

    return then(torch.futures.collect_all(pending), done, x.device)


def _allreduce(
    codec: Compressor,
    x: torch.Tensor,
    comm: Comm,
    finite: bool,
    keep_local: bool,
    out: torch.Tensor | None,
    guard: bool = True,
    divisor: int = 1,
) -> Future[Exchanged]:
    clock = _Clock()
    payload, ctx = codec.compress_mean(x, divisor)
    clock.lap("compress")
    if len(payload) == 1 and payload[0].is_floating_point() and not keep_local:
        frame = payload[0].view(-1)  # summed in place: nothing reads this rank's own payload after
    else:  # a copy: error feedback decodes the unsummed payload after the exchange
        frame = torch.cat([t.reshape(-1) for t in payload])
    flagged = not frame.is_floating_point()
    if flagged:
        frame = torch.cat([frame, frame.new_full((1,), 0 if finite else 1)])
    elif not finite:
        frame[0] = float("nan")  # the sum is NaN on every rank
    payload_nbytes = sum(t.nbytes for t in payload)
    sent = allreduce_sent_nbytes(frame.nbytes, comm.world_size)

    def done(summed: torch.Tensor) -> Exchanged:
        clock.lap("communicate")
        body = summed[:-1] if flagged else summed
        if guard and ((flagged and summed[-1] != 0) or not _all_finite((body,))):
            return Exchanged.skipped("allreduce", payload_nbytes, sent, clock.seconds)
        summed_payload = split_frame(body, payload)
        if out is None:
            total = codec.decompress(summed_payload, ctx)
        else:
            total = codec.decompress_into(out, summed_payload, ctx)
        clock.lap("decompress")
        return Exchanged(
            "allreduce",
            None,
            total,
            _local(codec, payload, ctx),
            True,
            payload_nbytes,
            sent,
            clock.seconds,
            _subtract(codec, payload, ctx),
        )

    return then(comm.allreduce(frame), done, frame.device)


def _vote(codec: Compressor, x: torch.Tensor, comm: Comm, finite: bool) -> Future[Exchanged]:
    """Majority vote over ranks' sign bits: counts summed in packed int32 fields by one allreduce."""
    clock = _Clock()
    payload, ctx = codec.compress(x)
    numel = x.numel()
    bits = field_bits(comm.world_size)  # a field must hold a count of up to world_size votes
    words = pack_fields(unpack_bits(payload[0], 1, numel), bits)
    frame = torch.cat([words, words.new_full((1,), 0 if finite else 1)])
    sent = allreduce_sent_nbytes(frame.nbytes, comm.world_size)
    clock.lap("compress")

    def done(summed: torch.Tensor) -> Exchanged:
        clock.lap("communicate")
        if summed[-1] != 0:
            return Exchanged.skipped("allreduce", words.nbytes, sent, clock.seconds)
        votes_for_plus = unpack_fields(summed[:-1], bits, numel)
        total = votes_for_plus.mul_(2).sub_(comm.world_size).sign_().to(x.dtype).view(x.shape)
        clock.lap("decompress")
        return Exchanged(
            "allreduce",
            None,
            total,
            _local(codec, payload, ctx),
            True,
            words.nbytes,
            sent,
            clock.seconds,
            _subtract(codec, payload, ctx),
        )

    return then(comm.allreduce(frame), done, frame.device)


def _allgather(
    codec: Compressor, x: torch.Tensor, comm: Comm, finite: bool, out: torch.Tensor | None
) -> Future[Exchanged]:
    clock = _Clock()
    payload, ctx = codec.compress(x)
    clock.lap("compress")
    frame = framed([t.reshape(-1).view(torch.uint8) for t in payload], finite)
    if type(codec).fixed_size:
        layouts = [[(t.dtype, t.shape) for t in payload]] * comm.world_size
    else:  # waits for every rank's sizes: runs on the lane's thread
        numels = allgather_sizes(comm, [t.numel() for t in payload], frame.device)
        layouts = [[(t.dtype, (n,)) for t, n in zip(payload, row, strict=True)] for row in numels]
        longest = max(sum(layout_nbytes(layout)) for layout in layouts) + 1  # + the flag
        frame = torch.cat([frame, frame.new_zeros(longest - frame.numel())])
    sent = allgather_sent_nbytes(frame.numel(), comm.world_size)
    payload_nbytes = sum(t.nbytes for t in payload)

    def done(frames: list[torch.Tensor]) -> Exchanged:
        clock.lap("communicate")
        payloads = [from_bytes(f, layout) for f, layout in zip(frames, layouts, strict=True)]
        flags = [f[sum(layout_nbytes(layout))] for f, layout in zip(frames, layouts, strict=True)]
        if not (all(flag == 0 for flag in flags) and all(_all_finite(p) for p in payloads)):
            return Exchanged.skipped("allgather", payload_nbytes, sent, clock.seconds)
        total = torch.empty_like(x) if out is None else out
        codec.sum_decoded_(total, payloads, ctx)  # rank order: the same sum on every rank
        clock.lap("decompress")
        return Exchanged(
            "allgather",
            None,
            total,
            _local(codec, payload, ctx),
            True,
            payload_nbytes,
            sent,
            clock.seconds,
            _subtract(codec, payload, ctx),
        )

    return then(comm.allgather(frame), done, frame.device)


def _sparse(
    codec: Compressor, x: torch.Tensor, route: Route, scheme: str, finite: bool, out: torch.Tensor | None
) -> Future[Exchanged]:
    """The payload as rows of width 1 by a sparse scheme (the router's choice for "auto")."""
    clock = _Clock()
    payload, ctx = codec.compress(x)
    clock.lap("compress")
    encoded, values = payload
    numel = x.numel()
    rows = SparseRows(decode_indices(encoded, numel, values.numel()), values.view(-1, 1), numel)
    # The values checked here, as _allgather checks every payload: the caller checked the
    # gradient, and what was compressed (error memory added, DGC's accumulators) may not be finite.
    finite = finite and _all_finite((values,))
    result = route.router.sync(route.key, rows, route.comm, route.step, finite, scheme=scheme)
    clock.lap("communicate")
    payload_nbytes = encoded.nbytes + values.nbytes
    if not result.finite:
        return completed(
            Exchanged.skipped("allgather", payload_nbytes, result.sent_nbytes, clock.seconds, result.scheme)
        )
    total = result.total.into(torch.empty_like(x) if out is None else out)
    clock.lap("decompress")
    return completed(
        Exchanged(
            "allgather",
            result.scheme,
            total,
            _local(codec, payload, ctx),
            True,
            payload_nbytes,
            result.sent_nbytes,
            clock.seconds,
            _subtract(codec, payload, ctx),
        )
    )


def _rounds(
    codec: Compressor, x: torch.Tensor, comm: Comm, finite: bool, out: torch.Tensor | None
) -> Future[Exchanged]:
    """Multi-round summable protocol: every round but the last waits, since the next depends on it."""
    clock = _Clock()
    payload, ctx = codec.begin(x)  # type: ignore[attr-defined]
    payload_nbytes = sent = 0
    for _ in range(codec.rounds - 1):
        clock.lap("compress")
        frame = torch.cat([t.reshape(-1) for t in payload])
        if not finite:
            frame[0] = float("nan")
        payload_nbytes += frame.nbytes
        sent += allreduce_sent_nbytes(frame.nbytes, comm.world_size)
        summed = comm.allreduce(frame).wait()
        clock.lap("communicate")
        if not _all_finite((summed,)):
            return completed(Exchanged.skipped("allreduce", payload_nbytes, sent, clock.seconds))
        payload, ctx = codec.next_round(split_frame(summed, payload), ctx)  # type: ignore[attr-defined]
    clock.lap("compress")
    frame = torch.cat([t.reshape(-1) for t in payload])
    payload_nbytes += frame.nbytes
    sent += allreduce_sent_nbytes(frame.nbytes, comm.world_size)

    def done(summed: torch.Tensor) -> Exchanged:
        clock.lap("communicate")
        if not _all_finite((summed,)):
            return Exchanged.skipped("allreduce", payload_nbytes, sent, clock.seconds)
        total, local, subtract = codec.finish(split_frame(summed, payload), ctx, out)  # type: ignore[attr-defined]
        clock.lap("decompress")
        return Exchanged("allreduce", None, total, local, True, payload_nbytes, sent, clock.seconds, subtract)

    return then(comm.allreduce(frame), done, frame.device)


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's shard in a two-shot exchange: contiguous, in rank order, their
    sizes differing by at most one element."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        end = start + base + (rank < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _two_shot(
    codec: Compressor,
    x: torch.Tensor,
    comm: Comm,
    finite: bool,
    out: torch.Tensor | None,
    shard_error: torch.Tensor | None,
    corrected: Corrected | None = None,
    shard_error_out: torch.Tensor | None = None,
) -> Future[Exchanged]:
    """Every shard encoded and sent to its owner; the owners' sums encoded again and allgathered.
    Waits for the all_to_all before it can encode the sum: runs on the lane's thread."""
    clock = _Clock()
    mine = comm.rank
    bounds = shard_bounds(x.numel(), comm.world_size)
    # The owner's sum is built in its own shard of `out`, which the decoded total overwrites last.
    into = out.view(-1)[slice(*bounds[mine])] if out is not None and comm.world_size > 1 else None
    summed, ok, frames, layouts, ctxs, payloads = _to_owners(
        codec, x.view(-1), comm, bounds, finite, clock, corrected, into
    )
    alone = comm.world_size == 1  # a shard of one rank's payload: forwarded as it is, not re-encoded
    # The second encoding's error memory is added to the sum, and its next value, the residual, is
    # kept only once every owner's payload is known finite. A codec that fuses feedback does the
    # add, the encode and the residual in one pass, writing the residual straight into
    # `shard_error_out` where there is one (the memory's spare: the memory stays untouched);
    # else the residual is taken in `summed` itself (no fresh tensor) and copied on.
    one_pass = ok and not alone and shard_error is not None and type(codec).fuses_feedback
    kept_in = shard_error if shard_error_out is None else shard_error_out  # the residual's home
    residual_into = shard_error_out if one_pass and shard_error_out is not None else summed
    if alone:
        payload = payloads[0]
    elif one_pass:
        payload, ctx = codec.compress_corrected(summed, shard_error, 1.0, residual_into)
    else:
        if ok and shard_error is not None:
            summed.add_(shard_error)
        if ok and not type(codec).reveals_nonfinite:
            # A sum past its dtype's range (fp16) that the payload would hide: natural compression
            # clamps an inf to the largest power of two, and the memory would keep the inf.
            ok = _all_finite((summed,))
        payload, ctx = codec.compress(summed)  # zeros where a rank was not finite: streams in step
    nbytes = [sum(layout_nbytes(layout)) for layout in layouts]
    frame = torch.empty(max(nbytes) + 1, dtype=torch.uint8, device=x.device)  # equal frames
    frame[nbytes[mine] + 1 :].zero_()
    frame_into(frame[: nbytes[mine] + 1], [t.reshape(-1).view(torch.uint8) for t in payload], ok)
    residual = None
    if not alone and shard_error is not None:
        if not one_pass:  # after framing: a payload may be a view of summed
            codec.sub_decoded_(summed, payload, ctx)
        residual = residual_into
    clock.lap("compress")
    payload_nbytes = sum(nbytes) + (0 if alone else nbytes[mine])
    sent = sum(f.numel() for rank, f in enumerate(frames) if rank != mine)
    sent += allgather_sent_nbytes(frame.numel(), comm.world_size)

    def done(gathered: list[torch.Tensor]) -> Exchanged:
        clock.lap("communicate")
        sums = [from_bytes(f, layout) for f, layout in zip(gathered, layouts, strict=True)]
        flags = [f[size] for f, size in zip(gathered, nbytes, strict=True)]
        if not (all(flag == 0 for flag in flags) and all(_all_finite(p) for p in sums)):
            return Exchanged.skipped("two-shot", payload_nbytes, sent, clock.seconds)
        if residual is not None and residual is not kept_in:
            kept_in.copy_(residual)  # type: ignore[union-attr]
        total = torch.empty_like(x) if out is None else out
        for (lo, hi), shard_sum, shard_ctx in zip(bounds, sums, ctxs, strict=True):
            codec.decompress_into(total.view(-1)[lo:hi], shard_sum, shard_ctx)
        clock.lap("decompress")
        local, subtract = _own_decoded(codec, frames, layouts, ctxs, bounds, x)
        if corrected is not None:
            subtract = _already_subtracted(x)
        return Exchanged("two-shot", None, total, local, True, payload_nbytes, sent, clock.seconds, subtract)

    return then(comm.allgather(frame), done, frame.device)


def reduce_scatter(
    codec: Compressor | None,
    x: torch.Tensor,
    out: torch.Tensor,
    comm: Comm,
    average: bool,
    finite: bool = True,
    agree: bool = False,
) -> Exchanged:
    """A reduce-scatter of `x` (world_size equal shards, in rank order) into `out`, this rank's
    shard of the sum (`average`: the mean); FSDP's gradient reduction. Blocks.

    With a codec, each shard is encoded and sent to the rank that owns it, which decodes and sums
    them in rank order (two-shot's first half). Each owner sees only its own shard's payloads;
    with `agree` (where anything keeps state that a non-finite step must not touch: the same on
    every rank), one more one-element allreduce makes every rank skip the step alike. Without a
    codec (None), the backend's own reduce-scatter."""
    n = comm.world_size
    if codec is None:
        comm.reduce_scatter(out, x, average).wait()
        sent = (n - 1) * out.numel() * out.element_size()
        return Exchanged("reduce-scatter", None, out, lambda: x, True, x.numel() * x.element_size(), sent)
    clock = _Clock()
    bounds = shard_bounds(x.numel(), n)
    summed, ok, frames, layouts, ctxs, payloads = _to_owners(codec, x.view(-1), comm, bounds, finite, clock)
    if n == 1:
        codec.add_decoded_(summed, payloads[0], ctxs[0])  # the one rank's own payload
    clock.lap("decompress")
    nbytes = sum(layout_nbytes(layouts[0])) * n
    sent = sum(f.numel() for rank, f in enumerate(frames) if rank != comm.rank)
    if agree:  # an owner's payload may overflow (fp16) where every input was finite
        ok = bool(comm.allreduce(torch.tensor([float(ok)], device=x.device)).wait() == n)
    if not ok:
        return Exchanged.skipped("reduce-scatter", nbytes, sent, clock.seconds)
    out.copy_(summed.div_(n) if average else summed)
    local, subtract = _own_decoded(codec, frames, layouts, ctxs, bounds, x)
    return Exchanged("reduce-scatter", None, out, local, True, nbytes, sent, clock.seconds, subtract)


def _own_decoded(
    codec: Compressor,
    frames: list[torch.Tensor],
    layouts: list[Any],
    ctxs: list[object],
    bounds: list[tuple[int, int]],
    x: torch.Tensor,
) -> tuple[Local, RemoveLocal]:
    """local() and remove_local_ of a sharded exchange: this rank's own shard payloads, decoded."""
    own = [from_bytes(f, layout) for f, layout in zip(frames, layouts, strict=True)]

    def local() -> torch.Tensor:
        return torch.cat([codec.decompress(p, c).view(-1) for p, c in zip(own, ctxs, strict=True)]).view(
            x.shape
        )

    def subtract(t: torch.Tensor) -> torch.Tensor:
        for (lo, hi), p, c in zip(bounds, own, ctxs, strict=True):
            codec.sub_decoded_(t.view(-1)[lo:hi], p, c)
        return t

    return local, subtract


def _to_owners(
    codec: Compressor,
    flat: torch.Tensor,
    comm: Comm,
    bounds: list[tuple[int, int]],
    finite: bool,
    clock: _Clock,
    corrected: Corrected | None = None,
    into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool, list[torch.Tensor], list[Any], list[object], list[Payload]]:
    """Each shard of `flat` encoded and sent to its owner by one all_to_all; the owner's sum of the
    decoded shards it received (zero where any was not finite), whether all were finite, and this
    rank's frames, payload layouts, contexts and the payloads received. `corrected`: `flat` is
    computed as it is encoded (start's argument). `into`: where the sum goes, else a fresh tensor."""
    mine = comm.rank
    layouts, ctxs = [], []
    # The frames lie end to end in one buffer, which the all_to_all sends as it is: two-shot's
    # payloads are fixed-size, and payload_bytes exact for float32 input. Else framed one by one.
    frames: list[torch.Tensor | None] = [None] * len(bounds)
    if flat.dtype == torch.float32:
        sizes = [codec.payload_bytes(end - start) + 1 for start, end in bounds]
        frames = list(torch.empty(sum(sizes), dtype=torch.uint8, device=flat.device).split(sizes))
    for shard, (start, end) in enumerate(bounds):
        if corrected is None:
            payload, ctx = codec.compress(flat[start:end])
        else:
            g, base = (t.view(-1)[start:end] for t in (corrected.g, corrected.base))
            payload, ctx = codec.compress_corrected(g, base, corrected.alpha, flat[start:end])
        # Framed before the next compress can reuse scratch memory the payload may lie in.
        parts = [t.reshape(-1).view(torch.uint8) for t in payload]
        frame = frames[shard]
        frames[shard] = framed(parts, finite) if frame is None else frame_into(frame, parts, finite)
        layouts.append([(t.dtype, t.shape) for t in payload])
        ctxs.append(ctx)
    clock.lap("compress")
    # Fixed-size payloads: a shard's payload has the same layout on every rank.
    received = comm.all_to_all(frames, [frames[mine].numel()] * comm.world_size).wait()
    clock.lap("communicate")
    start, end = bounds[mine]
    summed = into if into is not None else flat.new_empty(end - start)
    payloads = [from_bytes(frame, layouts[mine]) for frame in received]
    ok = all(frame[-1] == 0 for frame in received) and all(_all_finite(p) for p in payloads)
    if ok and comm.world_size > 1:
        # Rank order: the owner's sum has the same bits on every run.
        codec.sum_decoded_(summed, payloads, ctxs[mine])
    else:
        summed.zero_()
    return summed, ok, frames, layouts, ctxs, payloads


# -- helpers -------------------------------------------------------------------------------------


def _check_corrected(
    corrected: Corrected,
    x: torch.Tensor,
    kind: type[Compressor],
    collective: str,
    finite: bool,
    out: torch.Tensor | None,
    divisor: int,
) -> None:
    """Refuse a `corrected` start() cannot honour, naming what to change."""
    if not (collective == "two-shot" and kind.fuses_feedback and finite):
        raise ValueError(
            f"corrected given for {kind.__name__} by {collective} (finite={finite}): only a finite "
            "two-shot exchange by a codec that fuses_feedback computes its input as it encodes"
        )
    if corrected.g.shape != x.shape or corrected.base.shape != x.shape or divisor != 1:
        raise ValueError(
            f"corrected's g {tuple(corrected.g.shape)} and base {tuple(corrected.base.shape)} for x "
            f"{tuple(x.shape)}, divisor {divisor}: x is computed from them, so shapes must match and "
            "the division is corrected's alpha (divisor 1)"
        )
    if out is not None and out.data_ptr() == x.data_ptr():
        raise ValueError(
            "out is x, which keeps the residual when corrected is given: decode into g or another buffer"
        )


def _already_subtracted(x: torch.Tensor) -> RemoveLocal:
    """remove_local_ where the codec left x - local() in x as it encoded (`corrected`)."""

    def subtract(t: torch.Tensor) -> torch.Tensor:
        if t is not x:
            raise ValueError("the residual was computed into the compressed tensor itself; only it has it")
        return t

    return subtract


def _local(codec: Compressor, payload: Payload, ctx: object) -> Local:
    return lambda: codec.decompress(payload, ctx)


def _subtract(codec: Compressor, payload: Payload, ctx: object) -> RemoveLocal:
    def subtract(t: torch.Tensor) -> torch.Tensor:
        codec.sub_decoded_(t, payload, ctx)
        return t

    return subtract


def _not_restorable(_: object) -> None:
    raise TypeError("an Exchanged holds closures over this step's payloads: it is not copied or pickled")


def _not_finite() -> torch.Tensor:
    raise AssertionError("a non-finite step has no decoded payload; feedback must not be updated")


def _all_finite(tensors: Payload) -> bool:
    # One reduction pass: the least and the greatest value are finite only where every value is
    # (a NaN makes both NaN), and unlike a sum they cannot overflow.
    return all(
        all(bool(torch.isfinite(v)) for v in torch.aminmax(t.view(-1))) if t.numel() else True
        for t in tensors
        if t.is_floating_point()
    )


class _Clock:
    """Wall time per phase; a phase ends at each lap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
