"""Exchange: from one rank's tensor to the decoded sum over all ranks.

The scheme follows the compressor's declared capabilities:
  allreduce  summable payloads: one allreduce of the payload tensors concatenated (one dtype).
  allgather  any other payload, or a summable one when the caller asks (a plan's
             exchange=allgather): one allgather of each rank's payload bytes; codecs whose payload
             size varies from rank to rank exchange their sizes first.
  rounds     multi-round summable codecs (PowerSGD): one allreduce per round.
  vote       majority-vote codecs (signSGD, Signum): each rank's sign bits become 0/1 votes in
             fields of ceil(log2(n + 1)) bits packed into int32 words, one int32 allreduce sums
             every field at once, and the result is sign(2 * votes - n): +1, -1 or 0 on a tie.
  sparse     codecs whose payload is sparse rows (top-k, DGC, threshold), when the caller passes
             a `sparse` route: the rows go to gradsync.sparse, whose scheme (agsparse, Zen's
             balanced, hierarchical, dense) the route picks.
  plain      no codec: the tensor itself is allreduced (warm-up steps, small buckets).

Every rank decodes the payloads in rank order into a zeroed tensor (fresh, or the caller's
`out`), so the sum is bit-identical on every rank. The callers pre-divide by the world size, so
the sum is the average.

Non-finite gradients: a rank whose tensor is not finite compresses zeros instead, so its codec
state stays in step with the other ranks, and raises a flag: every frame ends in one element
(one byte for allgather) that is 0 on ranks whose input was finite. Summed or gathered, it tells
every rank that the step is non-finite; so does any non-finite value in a float payload (an fp16
overflow), so a non-finite decode never reaches error feedback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.futures import Future

from .comm import Comm, allgather_sent_bytes, allgather_sizes, allreduce_sent_bytes, completed, then
from .compress import Compressor, Payload
from .sparse.result import SparseResult
from .sparse.rows import SparseRows
from .wire import decode_indices, field_bits, pack_fields, unpack_bits, unpack_fields

Local = Callable[[], torch.Tensor]
RemoveLocal = Callable[[torch.Tensor], torch.Tensor]
SCHEMES = ("plain", "allreduce", "allgather", "rounds", "vote", "sparse")
SparseRoute = Callable[[SparseRows, bool], SparseResult]  # (this rank's rows, finite) -> the sum


@dataclass
class Exchanged:
    """The outcome of one exchange, as seen by one rank."""

    scheme: str  # the scheme that ran: one of SCHEMES
    total: torch.Tensor | None  # decoded sum over ranks, same bits on every rank; None if not finite
    local: Local  # this rank's own decoded payload, for error feedback
    finite: bool  # False when any rank's input was not finite
    payload_bytes: int  # bytes of this rank's payload as exchanged (votes: the count fields), all rounds
    bytes_sent: int  # bytes this rank sends over its links (ring algorithms), flags and padding included
    seconds: dict[str, float] = field(default_factory=dict)  # compress, communicate, decompress
    # t -= local() in place, by the codec's sub_decoded_ (sparse codecs touch only what they sent);
    # None where the payload is decoded only as a whole (multi-round codecs): local() is subtracted.
    subtract_local: RemoveLocal | None = None

    def remove_local_(self, t: torch.Tensor) -> torch.Tensor:
        """t -= local(), in place, the same bits as t - local(); returns t.

        Where t is the tensor that was compressed, call local() before, not after: a payload may
        be a view of its input (identity), and would then change with it.
        """
        if self.subtract_local is None:
            return t.sub_(self.local())
        return self.subtract_local(t)


def start(
    codec: Compressor | None,
    x: torch.Tensor,
    comm: Comm,
    finite: bool = True,
    out: torch.Tensor | None = None,
    sparse: SparseRoute | None = None,
    allgather: bool = False,
) -> Future[Exchanged]:
    """Compress `x`, launch its exchange and return a future of the result.

    Collectives are launched before returning (blocking only where a second collective depends on
    the first), so all ranks issue them in the same order; decoding runs when the data arrives.
    `codec=None` allreduces `x` itself, in place. `out` (shaped like `x`, sharing no memory with
    it) is where the allgather scheme decodes the sum, which is then `out` itself, instead of a
    fresh tensor; the other schemes take the sum from the collective's own buffer and ignore it.
    `sparse` exchanges the payloads of sparse-row codecs (declared `sparse_rows`) instead of the
    allgather; the sum is then written into `out` too. `allgather` takes the allgather scheme
    whatever the codec's other capabilities (summable, sparse rows); codecs without a decode per
    payload (see can_allgather) refuse it.
    """
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(
            f"out is {out.dtype} {tuple(out.shape)} on {out.device} but x is {x.dtype} {tuple(x.shape)} "
            f"on {x.device}: the sum is decoded into out, so it must match x"
        )
    if allgather:
        _check_allgather(codec, sparse)
    clock = _Clock()
    if codec is None:
        return _plain(x, comm, clock)
    if codec.rounds > 1:
        return _rounds(codec, x, comm, finite, clock)
    payload, ctx = codec.compress(x if finite else torch.zeros_like(x))
    clock.lap("compress")

    def local() -> torch.Tensor:
        return codec.decompress(payload, ctx)

    def subtract_local(t: torch.Tensor) -> torch.Tensor:
        codec.sub_decoded_(t, payload, ctx)
        return t

    def decode_summed(summed: Payload) -> tuple[torch.Tensor, Local, RemoveLocal]:
        return codec.decompress(summed, ctx), local, subtract_local

    if type(codec).majority_vote:
        return _vote(payload, x, comm, finite, clock, local, subtract_local)
    if type(codec).summable and not allgather:
        return _allreduce(payload, comm, finite, clock, decode_summed)
    if type(codec).sparse_rows and sparse is not None:
        return _sparse(payload, x, finite, clock, local, subtract_local, out, sparse)
    return _allgather(codec, payload, ctx, x, comm, finite, clock, local, subtract_local, out)


def can_allgather(codec: Compressor) -> bool:
    """Whether `codec`'s payloads can be allgathered and decoded one by one into the sum.

    Not so for multi-round codecs (PowerSGD: each round's sum feeds the next) and majority votes
    (signSGD: the ranks' signs combine by vote, not by sum); they always take their own scheme.
    """
    return codec.rounds == 1 and not type(codec).majority_vote


def _check_allgather(codec: Compressor | None, sparse: SparseRoute | None) -> None:
    if codec is None or not can_allgather(codec) or sparse is not None:
        what = "no codec" if codec is None else type(codec).__name__
        what += " and a sparse route" if sparse is not None else ""
        raise ValueError(
            f"allgather=True with {what}: the allgather scheme decodes each rank's payload on its own, "
            "which needs a single-round codec that is not a majority vote, and no sparse route; "
            "drop allgather=True (or the sparse route)"
        )


def _plain(x: torch.Tensor, comm: Comm, clock: _Clock) -> Future[Exchanged]:
    nbytes = x.numel() * x.element_size()

    def done(summed: torch.Tensor) -> Exchanged:
        clock.lap("communicate")
        sent = allreduce_sent_bytes(nbytes, comm.world_size)
        return Exchanged("plain", summed, lambda: x, True, nbytes, sent, clock.seconds)

    return then(comm.allreduce(x), done, x.device)


def _allreduce(
    payload: Payload,
    comm: Comm,
    finite: bool,
    clock: _Clock,
    decode: Callable[[Payload], tuple[torch.Tensor, Local, RemoveLocal | None]],
    spent: tuple[int, int] = (0, 0),
    scheme: str = "allreduce",
) -> Future[Exchanged]:
    """Sum the payload over ranks; `decode` turns the summed payload into (total, local,
    subtract_local). `spent`: bytes (payload, sent) of earlier rounds of `scheme`."""
    # The frame is a copy: error feedback decodes the unsummed payload after the exchange.
    frame = _framed([t.reshape(-1) for t in payload], finite)
    payload_bytes = spent[0] + frame.nbytes - frame.element_size()
    sent = spent[1] + allreduce_sent_bytes(frame.nbytes, comm.world_size)

    def done(summed_frame: torch.Tensor) -> Exchanged:
        clock.lap("communicate")
        if summed_frame[-1] != 0 or not _all_finite((summed_frame,)):
            return Exchanged(scheme, None, _not_finite, False, payload_bytes, sent, clock.seconds)
        total, local, subtract_local = decode(_split(summed_frame[:-1], payload))
        clock.lap("decompress")
        return Exchanged(scheme, total, local, True, payload_bytes, sent, clock.seconds, subtract_local)

    return then(comm.allreduce(frame), done, frame.device)


def _vote(
    payload: Payload,
    like: torch.Tensor,
    comm: Comm,
    finite: bool,
    clock: _Clock,
    local: Local,
    subtract_local: RemoveLocal,
) -> Future[Exchanged]:
    """Majority vote over ranks' sign bits: counts summed in packed int32 fields by one allreduce."""
    numel = like.numel()
    bits = field_bits(comm.world_size)  # a field must hold a count of up to world_size votes
    words = pack_fields(unpack_bits(payload[0], 1, numel), bits)
    frame = _framed([words], finite)
    sent = allreduce_sent_bytes(frame.nbytes, comm.world_size)
    clock.lap("compress")

    def done(summed: torch.Tensor) -> Exchanged:
        clock.lap("communicate")
        if summed[-1] != 0:
            return Exchanged("vote", None, _not_finite, False, words.nbytes, sent, clock.seconds)
        votes_for_plus = unpack_fields(summed[:-1], bits, numel)
        total = votes_for_plus.mul_(2).sub_(comm.world_size).sign_().to(like.dtype).view(like.shape)
        clock.lap("decompress")
        return Exchanged("vote", total, local, True, words.nbytes, sent, clock.seconds, subtract_local)

    return then(comm.allreduce(frame), done, frame.device)


def _allgather(
    codec: Compressor,
    payload: Payload,
    ctx: object,
    like: torch.Tensor,
    comm: Comm,
    finite: bool,
    clock: _Clock,
    local: Local,
    subtract_local: RemoveLocal,
    out: torch.Tensor | None,
) -> Future[Exchanged]:
    frame = _framed([t.reshape(-1).view(torch.uint8) for t in payload], finite)
    if type(codec).fixed_size:
        layouts = [[(t.dtype, t.shape) for t in payload]] * comm.world_size
    else:
        numels = allgather_sizes(comm, [t.numel() for t in payload], frame.device)
        layouts = [[(t.dtype, (n,)) for t, n in zip(payload, row, strict=True)] for row in numels]
        longest = max(sum(_nbytes(layout)) for layout in layouts) + 1  # + the flag
        frame = torch.cat([frame, frame.new_zeros(longest - frame.numel())])
    sent = allgather_sent_bytes(frame.numel(), comm.world_size)

    def done(frames: list[torch.Tensor]) -> Exchanged:
        clock.lap("communicate")
        payloads = [_from_bytes(f, layout) for f, layout in zip(frames, layouts, strict=True)]
        flags = [f[sum(_nbytes(layout))] for f, layout in zip(frames, layouts, strict=True)]
        finite = all(flag == 0 for flag in flags) and all(_all_finite(p) for p in payloads)
        total = None
        if finite:
            total = torch.zeros_like(like) if out is None else out.zero_()
            for rank_payload in payloads:  # rank order: the same sum on every rank
                codec.add_decoded_(total, rank_payload, ctx)
        clock.lap("decompress")
        payload_bytes = sum(t.nbytes for t in payload)
        if not finite:
            return Exchanged("allgather", None, _not_finite, False, payload_bytes, sent, clock.seconds)
        return Exchanged("allgather", total, local, True, payload_bytes, sent, clock.seconds, subtract_local)

    return then(comm.allgather(frame), done, frame.device)


def _sparse(
    payload: Payload,
    like: torch.Tensor,
    finite: bool,
    clock: _Clock,
    local: Local,
    subtract_local: RemoveLocal,
    out: torch.Tensor | None,
    route: SparseRoute,
) -> Future[Exchanged]:
    """The payload as rows of width 1 through gradsync.sparse; blocks until the sum is here."""
    encoded, values = payload
    numel = like.numel()
    rows = SparseRows(decode_indices(encoded, numel, values.numel()), values.view(-1, 1), numel)
    result = route(rows, finite)
    clock.lap("communicate")
    payload_bytes = encoded.nbytes + values.nbytes
    if not result.finite:
        return completed(
            Exchanged("sparse", None, _not_finite, False, payload_bytes, result.bytes_sent, clock.seconds)
        )
    total = result.total.into(torch.empty_like(like) if out is None else out)
    clock.lap("decompress")
    sent = result.bytes_sent
    return completed(
        Exchanged("sparse", total, local, True, payload_bytes, sent, clock.seconds, subtract_local)
    )


def _rounds(codec: Compressor, x: torch.Tensor, comm: Comm, finite: bool, clock: _Clock) -> Future[Exchanged]:
    """Multi-round summable protocol: every round but the last blocks, since the next depends on it."""
    payload, ctx = codec.begin(x if finite else torch.zeros_like(x))  # type: ignore[attr-defined]
    payload_bytes = sent = 0
    for _ in range(codec.rounds - 1):
        clock.lap("compress")
        frame = _framed([t.reshape(-1) for t in payload], finite)
        payload_bytes += frame.nbytes - frame.element_size()
        sent += allreduce_sent_bytes(frame.nbytes, comm.world_size)
        summed_frame = comm.allreduce(frame).wait()
        clock.lap("communicate")
        if summed_frame[-1] != 0 or not _all_finite((summed_frame,)):
            failed = Exchanged("rounds", None, _not_finite, False, payload_bytes, sent, clock.seconds)
            return completed(failed)
        payload, ctx = codec.next_round(_split(summed_frame[:-1], payload), ctx)  # type: ignore[attr-defined]
    clock.lap("compress")
    finish = codec.finish  # type: ignore[attr-defined]
    # The local decode comes from the last round as a whole: feedback subtracts local().
    return _allreduce(
        payload,
        comm,
        True,
        clock,
        lambda summed: (*finish(summed, ctx), None),
        spent=(payload_bytes, sent),
        scheme="rounds",
    )


def _not_finite() -> torch.Tensor:
    raise AssertionError("a non-finite step has no decoded payload; feedback must not be updated")


def _framed(parts: list[torch.Tensor], finite: bool) -> torch.Tensor:
    """The parts concatenated (one dtype), then the flag: 0 if this rank's input was finite, else 1."""
    flag = torch.full((1,), 0 if finite else 1, dtype=parts[0].dtype, device=parts[0].device)
    return torch.cat([*parts, flag])


def _all_finite(tensors: Payload) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _split(frame: torch.Tensor, like: Payload) -> Payload:
    """Cut a concatenated frame back into tensors shaped like `like`."""
    parts = frame.split([t.numel() for t in like])
    return tuple(part.view(t.shape) for part, t in zip(parts, like, strict=True))


def _nbytes(layout: list) -> list[int]:
    return [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in layout]


def _from_bytes(frame: torch.Tensor, layout: list) -> Payload:
    tensors = []
    offset = 0
    for (dtype, shape), nbytes in zip(layout, _nbytes(layout), strict=True):
        chunk = frame[offset : offset + nbytes]
        if offset % dtype.itemsize:
            chunk = chunk.clone()  # a misaligned slice cannot be viewed as a wider type
        tensors.append(chunk.view(dtype).view(shape))
        offset += nbytes
    return tuple(tensors)


class _Clock:
    """Wall time per phase; a phase ends at each lap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
