"""Collectives on the real process group: timed at several sizes and fitted (alpha-beta), and how
much a collective and the compute slow each other when they overlap. Every number is the slowest
rank's (`slowest_rank`), so that every rank holds the same fits."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm import Comm, on_nccl
from ..cost import LinearFit, fit_linear
from .timeline import Clock, synchronize

# A collective may name the dtype it moves: "allreduce:float16" sums fp16 (gloo sums it far slower
# per byte than fp32 on a CPU); without one it moves fp32.
COLLECTIVES = ("allreduce", "allgather", "all_to_all")
# Bytes per rank: from latency-bound to bandwidth-bound.
DEFAULT_COLLECTIVE_NBYTES = (4, 4096, 65536, 1 << 20, 4 << 20)


def zero_fit() -> LinearFit:
    """The cost of a collective in a world of one: nothing."""
    return LinearFit(fixed_s=0.0, per_unit_s=0.0, rel_error=0.0, max_rel_error=0.0, points=0)


def measure_collectives(
    comm: Comm,
    sizes: Sequence[int] = DEFAULT_COLLECTIVE_NBYTES,
    repeats: int = 5,
    device: str | torch.device = "cpu",
    names: Sequence[str] = COLLECTIVES,
    longest_s: float | None = None,
) -> dict[str, tuple[list[int], list[float]]]:
    """Per collective: (bytes per rank as sent, this rank's median seconds), one per size in `sizes`
    it ran, smallest first.

    Every rank must call it with the same arguments. Sizes are rounded to whole elements (and
    all_to_all's to a whole number of elements per rank), at least one; the bytes returned are
    those actually sent. A name may carry a dtype, "allreduce:float16"; the default is fp32.
    `longest_s`: a size is not run where the collective is bandwidth-bound already and the line
    through the two sizes before it (their warm-ups, the slowest rank's) puts it past this
    (_bandwidth_bound); the three smallest always run. It would cost its repeats' time for no
    new point of the line (a slow link's largest probes were most of plan="auto"'s measuring
    step).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    clock = Clock(device)
    n = comm.world_size
    tiny = torch.zeros(1, device=device)
    sizes = sorted(sizes)
    cases = []  # (name, collective, elements each rank sends to each peer, elements, dtype, bytes)
    for name in names:
        kind, dtype = collective_kind(name)
        size = torch.empty((), dtype=dtype).element_size()
        for nbytes in sizes:
            per_rank = max(1, nbytes // (size * n)) if kind == "all_to_all" else max(1, nbytes // size)
            numel = per_rank * n if kind == "all_to_all" else per_rank
            cases.append((name, kind, per_rank, numel, dtype, numel * size))
    inputs: dict[int, torch.Tensor] = {}  # made as a case first runs: a size left out costs nothing
    times: list[list[float]] = [[] for _ in cases]
    warmed = [0.0] * len(cases)  # this rank's warm-up time of each case
    runs = [True] * len(cases)  # False: a size longest_s leaves out, on every rank alike
    # Round by round over every case rather than case by case: a burst of load from elsewhere on
    # the machine then spreads over the sizes instead of bending the fit at one of them.
    for attempt in range(repeats + 1):  # the first round is a warm-up: connections, buffers
        for index, (_, kind, per_rank, numel, dtype, _) in enumerate(cases):
            if not runs[index]:
                continue
            if index not in inputs:
                inputs[index] = torch.ones(numel, dtype=dtype, device=device)
            comm.allreduce(tiny).wait()  # start together, as far as one small message can tell
            synchronize(device)
            started = clock.mark()
            issue(comm, kind, inputs[index], per_rank).wait()
            ended = clock.mark()
            if attempt:
                times[index].append(clock.seconds(started, ended))
                continue
            warmed[index] = clock.seconds(started, ended)
            k = index % len(sizes)  # this size's place; the next case is the next size
            if longest_s is not None and 2 <= k < len(sizes) - 1:
                first = index - k  # this collective's smallest size
                agreed = slowest_rank(comm, [warmed[first], warmed[index - 1], warmed[index]], device)
                nbytes = [case[-1] for case in cases[index - 1 : index + 2]]
                if _bandwidth_bound(agreed, nbytes, longest_s):
                    runs[index + 1 : first + len(sizes)] = [False] * (len(sizes) - 1 - k)
    measured: dict[str, tuple[list[int], list[float]]] = {name: ([], []) for name in names}
    for (name, *_, nbytes), seconds in zip(cases, times, strict=True):
        if seconds:
            measured[name][0].append(nbytes)
            measured[name][1].append(statistics.median(seconds))
    return measured


def _bandwidth_bound(seconds: Sequence[float], nbytes: Sequence[int], longest_s: float) -> bool:
    """Whether a collective's next size may be left out: `seconds` of its smallest size, the size
    before this one and this one, `nbytes` of the size before, this one and the next. Where this
    size took twice the smallest's (bandwidth is at least half of it, so the line's slope shows)
    and the line through the last two would put the next past `longest_s`, the next would cost
    its repeats' time for no new point of that line."""
    smallest, before, now = seconds
    if nbytes[1] <= nbytes[0] or now < 2 * smallest:
        return False
    per_byte = max(0.0, now - before) / (nbytes[1] - nbytes[0])
    return now + per_byte * (nbytes[2] - nbytes[1]) > longest_s


def collective_kind(name: str) -> tuple[str, torch.dtype]:
    """("allreduce", torch.float16) from "allreduce:float16"; ValueError for an unknown one."""
    kind, _, dtype_name = name.partition(":")
    dtype = getattr(torch, dtype_name or "float32", None)
    if kind not in COLLECTIVES or not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"collective {name!r} is not one of {COLLECTIVES}, optionally with a torch dtype, "
            "e.g. 'allreduce:float16'"
        )
    return kind, dtype


def issue(comm: Comm, name: str, x: torch.Tensor, per_rank: int) -> Any:
    if name == "allreduce":
        return comm.allreduce(x)
    if name == "allgather":
        return comm.allgather(x)
    return comm.all_to_all(list(x.split(per_rank)), [per_rank] * comm.world_size)


def probe_collectives(
    comm: Comm,
    sizes: Sequence[int] = DEFAULT_COLLECTIVE_NBYTES,
    repeats: int = 5,
    device: str | torch.device = "cpu",
    names: Sequence[str] = COLLECTIVES,
    longest_s: float | None = None,
) -> dict[str, LinearFit]:
    """Alpha-beta fits of "allreduce", "allgather" and "all_to_all": seconds vs bytes per rank.

    `sizes` are bytes per rank: an fp32 tensor of that many bytes for allreduce, that many from each
    rank for allgather, and that many from each rank split evenly over the ranks for all_to_all.
    Each time is this rank's median over `repeats`, then the slowest rank's: every rank gets the
    same fits, so plans made from them agree. Every rank must call it with the same arguments.
    A world of one needs no collectives: every fit is zero. `longest_s`: as measure_collectives.

    Example:
        >>> fits = probe_collectives(TorchComm())
        >>> fits["allreduce"](4 << 20)  # seconds to allreduce 4 MiB
    """
    for name in names:
        collective_kind(name)  # a bad name fails on every rank before any collective
    if comm.world_size == 1:
        return {name: zero_fit() for name in names}
    measured = measure_collectives(comm, sizes, repeats, device, names, longest_s)
    slowest = iter(slowest_rank(comm, [s for name in names for s in measured[name][1]], device))
    return {
        name: fit_linear(nbytes, [next(slowest) for _ in nbytes]) for name, (nbytes, _) in measured.items()
    }


def slowest_rank(comm: Comm, values: Sequence[float], device: str | torch.device = "cpu") -> list[float]:
    """The largest of every rank's `values`, element by element (a collective: all ranks call it
    with as many values). Comm's allreduce only sums, so the values are gathered instead."""
    if comm.world_size == 1:
        return list(values)
    mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    return torch.stack(comm.allgather(mine).wait()).amax(dim=0).tolist()


# -- the whole profile -----------------------------------------------------------------------------


def measure_contention(
    model: nn.Module,
    step: Callable[[int], torch.Tensor],
    comm: Comm,
    nbytes: int = 8 << 20,
    names: Sequence[str] = ("allreduce",),
    transfers: int = 6,
    steps: int = 3,
) -> dict[str, dict[str, float]]:
    """Per collective in `names`: {"compute": c, "transfer": t}, how much slower forward + backward
    (by c) and that collective of `nbytes` per rank (by t) run while the other runs too, as
    fractions (0: no effect).

    Where ranks share few CPU cores, moving bytes costs CPU (the kernel's TCP stack, gloo's threads
    and its sums, slow ones for fp16) that the compute then lacks, and the other way round; on a
    GPU with its own network engine both stay near 0. `transfers` collectives are issued at once,
    as DDP issues its buckets' (gloo runs them on its own threads, with no Python thread waiting:
    one would hold the interpreter from the compute), and this thread runs forward + backward
    passes (no_sync: no collectives of its own, no optimizer step) until they are done; the same
    collectives alone, and the passes alone, are the reference. Every rank must call it; all get
    the slowest rank's fractions. A world of one has nothing to transfer: {}.
    """
    if comm.world_size == 1:
        return {}
    device = next(model.parameters()).device

    def compute(i: int) -> float:
        started = time.perf_counter()
        with model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext():
            model.zero_grad(set_to_none=True)
            step(i).backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":  # this stream's work, not its kernels' launch, nor NCCL's beside it
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter() - started

    compute(0)  # warm-up
    slowest_rank(comm, [0.0], device)
    alone_compute = statistics.median(compute(i) for i in range(steps))
    found = {}
    for name in names:
        kind, dtype = collective_kind(name)
        size = torch.empty((), dtype=dtype).element_size()
        per_rank = (
            max(1, nbytes // size // comm.world_size) if kind == "all_to_all" else max(1, nbytes // size)
        )
        numel = per_rank * comm.world_size if kind == "all_to_all" else per_rank
        inputs = [torch.ones(numel, dtype=dtype, device=device) for _ in range(transfers)]
        slowest_rank(comm, [0.0], device)
        alone_transfer, _ = _transfers_while(comm, kind, inputs, per_rank, None)
        slowest_rank(comm, [0.0], device)
        busy_transfer, busy_compute = _transfers_while(comm, kind, inputs, per_rank, compute)
        slowed = [busy_compute / alone_compute - 1, busy_transfer / alone_transfer - 1]
        compute_slowdown, transfer_slowdown = slowest_rank(comm, [max(0.0, v) for v in slowed], device)
        found[name] = {"compute": compute_slowdown, "transfer": transfer_slowdown}
    return found


def _transfers_while(
    comm: Comm,
    kind: str,
    inputs: list[torch.Tensor],
    per_rank: int,
    compute: Callable[[int], float] | None,
) -> tuple[float, float]:
    """(seconds per transfer, median seconds per compute step): one collective per input, issued at
    once as DDP issues its buckets' (queued behind each other, no Python thread waiting on them),
    and compute steps run here until all are done (none if `compute` is None).

    The transfers end when the last completes, timed by a callback, not when this thread next
    looks (after the compute step then running); the compute steps counted are those that began
    while transfers ran. NCCL completes a collective's future once its kernel is queued: there
    the end is an event on a side stream made to wait for each transfer (the compute's own stream
    is not), and every compute step counted began before the last such event completed. (gloo
    completes it when the transfer is over, on CUDA tensors too.)"""
    cuda = inputs[0].device.type == "cuda" and on_nccl(comm)
    started = time.perf_counter()
    if cuda:
        side = torch.cuda.Stream(inputs[0].device)
        begun = torch.cuda.Event(enable_timing=True)
        begun.record(side)
    futures = [issue(comm, kind, x, per_rank) for x in inputs]
    if cuda:
        ends = []
        with torch.cuda.stream(side):
            for future in futures:
                future.wait()  # the side stream waits for the transfer; the host does not
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record(side)
        pending = lambda: not all(end.query() for end in ends)  # noqa: E731
    else:
        # The time each completes; waiting for a chained future, unlike for the collective's
        # own, returns only once its callback has run.
        finished = [f.then(lambda _: time.perf_counter()) for f in futures]
        pending = lambda: not all(f.done() for f in futures)  # noqa: E731
    steps: list[tuple[float, float]] = []  # (start, seconds)
    while compute is not None and pending():
        steps.append((time.perf_counter(), compute(len(steps))))
    for future in futures:
        future.wait()  # raises a collective's error
    if cuda:
        for end in ends:
            end.synchronize()
        seconds = max(begun.elapsed_time(end) for end in ends) / 1e3
        busy = [step_s for _, step_s in steps]
    else:
        ended = max(f.wait() for f in finished)
        seconds = ended - started
        busy = [step_s for start, step_s in steps if start < ended]
    return seconds / len(inputs), statistics.median(busy) if busy else 0.0


# -- codec costs -----------------------------------------------------------------------------------
