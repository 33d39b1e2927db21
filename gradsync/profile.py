"""Measuring this machine and this model: what the timeline simulator needs, saved as JSON.

A profile holds the compute timeline of one step (forward, backward with the moment each gradient
is ready, optimizer), the cost of each codec as a linear fit of its input size, and an alpha-beta
fit of each collective on the real process group. The simulator (gradsync.sim) predicts the step
of any strategy from these numbers alone.

Every measurement is a median over repeats. Across ranks, `run` takes the slowest rank's value of
each before fitting, so that every rank holds the same profile and plans made from it agree.

Example (a world of one):
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> data = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    >>> found = run(model, lambda i: model(data).square().mean(), optimizer, compressors=["fp16"])
    >>> [t.name for t in found.tensors]
    ['2.bias', '2.weight', '0.bias', '0.weight']
    >>> found.save("profile.json")
    >>> Profile.load("profile.json") == found
    True
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import compress, registry
from .comm import Comm, LocalComm, TorchComm
from .config import SyncConfig
from .cost import LinearFit, fit_linear
from .ddp import SyncState
from .sim import cluster as clusters
from .sim.cluster import Cluster
from .sim.compute import Compute, Gradient

VERSION = 1
# A collective may name the dtype it moves: "allreduce:float16" sums fp16 (gloo sums it far slower
# per byte than fp32 on a CPU); without one it moves fp32.
COLLECTIVES = ("allreduce", "allgather", "all_to_all")
CODEC_PHASES = ("compress", "decompress")
# gradsync's hook around a codec, on one rank: before its collective is issued (divide, finiteness
# check, error feedback, compress) and after it completes (decode, feedback update, copy back).
HOOK_PHASES = ("before", "after")
# One codec of each family: a cast, a sparsifier, a quantizer, one bit per element.
DEFAULT_COMPRESSORS = ("fp16", "topk:ratio=0.01", "qsgd", "efsignsgd")
# fp32 elements: 16 KiB to 16 MiB, a factor of 4 apart, the range of DDP buckets (25 MiB default).
DEFAULT_CODEC_SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
# Bytes per rank: from latency-bound to bandwidth-bound.
DEFAULT_COLLECTIVE_NBYTES = (4, 4096, 65536, 1 << 20, 4 << 20)
# CUDA events resolve about half a microsecond: the shortest interval they can tell from none.
CUDA_EVENT_RESOLUTION_S = 0.5e-6


@dataclass(frozen=True)
class TensorTiming:
    """One parameter's gradient: index in model.parameters(), numel, and when it was ready."""

    index: int  # position in model.parameters()
    name: str  # as in named_parameters() of the model DDP wraps ("module." stripped)
    numel: int
    ready_s: float  # median over steps of seconds from the start of backward to this gradient's accumulation


@dataclass(frozen=True)
class Profile:
    """What one data-parallel step costs on this machine, for this model: the simulator's input."""

    world_size: int
    backend: str  # "gloo", "nccl", or "local" for a world of one
    device: str  # where the model computes: "cpu" / "cuda"
    threads: int  # torch.get_num_threads() while measuring
    forward_s: float  # medians over the profiled steps, all ranks computing at once
    backward_s: float
    optimizer_s: float  # optimizer.step() and zero_grad()
    tensors: tuple[TensorTiming, ...]  # in ready order (backprop order), the order DDP buckets them
    # codec spec ("topk:ratio=0.01") -> {"compress": fit, "decompress": fit}: seconds vs fp32 numel
    compression: dict[str, dict[str, LinearFit]]
    collectives: dict[str, LinearFit]  # "allreduce", "allgather", "all_to_all": seconds vs bytes per rank
    meta: dict[str, Any]  # free-form: machine, torch version, model name, sizes probed, steps
    # codec spec -> {"before": fit, "after": fit}: gradsync's whole hook path alone, vs fp32 numel
    hook: dict[str, dict[str, LinearFit]] = field(default_factory=dict)
    # Per collective, how much compute and that collective slow each other when they overlap, as
    # fractions: {"allreduce": {"compute": 0.2, "transfer": 0.8}} (ranks sharing few CPU cores).
    # Empty where not measured.
    contention: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be an integer >= 1")
        for name in ("forward_s", "backward_s", "optimizer_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0 seconds")

    @property
    def compute_s(self) -> float:
        """A step with nothing to exchange: forward + backward + optimizer."""
        return self.forward_s + self.backward_s + self.optimizer_s

    def to_json(self) -> str:
        """The profile as JSON (indent 1, sorted keys); floats are written exactly (repr)."""
        data = {
            "version": VERSION,
            "world_size": self.world_size,
            "backend": self.backend,
            "device": self.device,
            "threads": self.threads,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "tensors": [asdict(t) for t in self.tensors],
            "compression": _table_dict(self.compression),
            "collectives": {name: fit.to_dict() for name, fit in self.collectives.items()},
            "hook": _table_dict(self.hook),
            "contention": self.contention,
            "meta": self.meta,
        }
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """The profile `to_json` wrote; ValueError naming any missing or unknown field."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a profile is a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != VERSION:
            raise ValueError(
                f"profile version {version!r} is not supported: this gradsync reads version {VERSION}; "
                "measure the profile again with this version"
            )
        where = f"profile (version {version})"
        checked = _fields(data, {f.name for f in fields(cls)} | {"version"}, where)
        return cls(
            world_size=checked["world_size"],
            backend=checked["backend"],
            device=checked["device"],
            threads=checked["threads"],
            forward_s=checked["forward_s"],
            backward_s=checked["backward_s"],
            optimizer_s=checked["optimizer_s"],
            tensors=tuple(
                TensorTiming(**_fields(t, {f.name for f in fields(TensorTiming)}, f"{where}: tensors[{i}]"))
                for i, t in enumerate(checked["tensors"])
            ),
            compression=_fit_table(checked["compression"], CODEC_PHASES, f"{where}: compression"),
            hook=_fit_table(checked["hook"], HOOK_PHASES, f"{where}: hook"),
            contention=checked["contention"],
            collectives={
                name: _fit(fit, f"{where}: collectives[{name!r}]")
                for name, fit in checked["collectives"].items()
            },
            meta=checked["meta"],
        )

    def compute(self) -> Compute:
        """The compute timeline this profile measured, as the simulator takes it."""
        # Medians of different tensors can cross by a hair; a gradient is ready no earlier than the
        # one before it in backprop order.
        gradients, ready = [], 0.0
        for t in self.tensors:
            ready = min(max(ready, t.ready_s), self.backward_s)
            gradients.append(Gradient(t.name, t.numel, ready))
        name = str(self.meta.get("model", self.meta.get("workload", "")))
        batch = int(self.meta.get("batch_size", 1))
        return Compute(self.forward_s, self.backward_s, self.optimizer_s, tuple(gradients), batch, name)

    def cluster(self) -> Cluster:
        """The measured cluster this profile describes: its world, collectives, codecs and hook path."""
        return clusters.measured(
            self.world_size, self.collectives, self.compression, self.hook, self.contention
        )

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """The profile saved at `path`; ValueError naming the file if it is not one this version reads."""
        try:
            return cls.from_json(Path(path).read_text())
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error


def _fields(data: Any, expected: set[str], where: str) -> dict[str, Any]:
    """`data` if it is an object with exactly the keys `expected`; else ValueError naming the first
    missing or unknown one."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    missing, unknown = sorted(expected - set(data)), sorted(set(data) - expected)
    if missing:
        raise ValueError(f"{where} lacks field {missing[0]!r} (missing: {missing})")
    if unknown:
        raise ValueError(
            f"{where} has unknown field {unknown[0]!r} (unknown: {unknown}); expected {sorted(expected)}"
        )
    return data


def _table_dict(table: Mapping[str, Mapping[str, LinearFit]]) -> dict[str, dict[str, dict[str, float]]]:
    return {spec: {phase: fit.to_dict() for phase, fit in fits.items()} for spec, fits in table.items()}


def _fit_table(data: Any, phases: Sequence[str], where: str) -> dict[str, dict[str, LinearFit]]:
    """{spec: {phase: fit}} from JSON, each spec with exactly `phases`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    return {
        spec: {
            phase: _fit(fit, f"{where}[{spec!r}][{phase!r}]")
            for phase, fit in _fields(fits, set(phases), f"{where}[{spec!r}]").items()
        }
        for spec, fits in data.items()
    }


def _fit(data: Any, where: str) -> LinearFit:
    try:
        return LinearFit.from_dict(data)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from error


# -- compute timeline ------------------------------------------------------------------------------


def parameter_names(model: nn.Module) -> list[str]:
    """The name of each of model.parameters(), in order; a DDP model's without "module."."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return [name for name, _ in module.named_parameters()]


class _Clock:
    """Time marks on the host clock, or on the CUDA stream for a model on the GPU, where the host
    only enqueues work: there a mark is an event that completes when the work before it has."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: in a backward hook, the stream of that gradient
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        # An interval with no kernel in it reads as 0, which no cost can be fitted to.
        return max(start.elapsed_time(end) / 1e3, CUDA_EVENT_RESOLUTION_S)


def time_backward(
    model: nn.Module,
    step: Callable[[int], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    steps: int = 5,
    warmup: int = 2,
) -> tuple[float, float, float, list[TensorTiming]]:
    """(forward_s, backward_s, optimizer_s, tensors): medians over `steps` steps after `warmup`.

    `step(i)` runs the forward pass of step i (i = 0, 1, ...) and returns the loss. Each step is
    zero_grad, forward, backward, optimizer.step(); optimizer_s also counts the zero_grad. A
    tensor's ready_s is when its gradient was accumulated, from the start of backward (a
    post-accumulate-grad hook, removed again before returning). Parameters that get no gradient
    (requires_grad False, or unused) are left out; the others come in ready order.

    A DDP model runs under no_sync(): no communication, the pure compute timeline, which the
    simulator adds communication to. Its ranks still compute at once, so the CPU they share is
    measured too.

    Side effects: it trains. `warmup + steps` real optimizer steps change the parameters and the
    optimizer's state, so profile a throwaway copy or the start of training, as the caller sees
    fit. Gradients already accumulated are dropped, and all are None (zero_grad(set_to_none=True))
    on return.

    Example:
        >>> forward_s, backward_s, optimizer_s, tensors = time_backward(model, step, optimizer)
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    names = parameter_names(model)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    clock = _Clock(device)
    marks: dict[int, Any] = {}  # parameter index -> when its gradient was accumulated, this step

    def hook_for(index: int) -> Callable[[torch.Tensor], None]:
        def record(_: torch.Tensor) -> None:
            marks[index] = clock.mark()

        return record

    handles = [
        p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params) if p.requires_grad
    ]
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    ready: dict[int, list[float]] = {}  # parameter index -> ready_s of each measured step
    order: dict[int, list[int]] = {}  # parameter index -> its place in each step's firing order
    try:
        with model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            for i in range(warmup + steps):
                marks.clear()
                started = clock.mark()
                loss = step(i)
                backward_started = clock.mark()
                loss.backward()
                backward_ended = clock.mark()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ended = clock.mark()
                if i < warmup:
                    continue
                phases["forward"].append(clock.seconds(started, backward_started))
                phases["backward"].append(clock.seconds(backward_started, backward_ended))
                phases["optimizer"].append(clock.seconds(backward_ended, ended))
                # Dicts keep insertion order: the hooks' firing order.
                for place, (index, mark) in enumerate(marks.items()):
                    ready.setdefault(index, []).append(clock.seconds(backward_started, mark))
                    order.setdefault(index, []).append(place)
    finally:
        for handle in handles:
            handle.remove()
    tensors = [
        TensorTiming(index, names[index], params[index].numel(), statistics.median(seconds))
        for index, seconds in ready.items()
    ]
    # Medians keep each step's order: if a fires before b in every step, median(a) <= median(b).
    # Ties (a coarse clock) go by firing order.
    tensors.sort(key=lambda t: (t.ready_s, statistics.median(order[t.index]), t.index))
    medians = [statistics.median(phases[k]) for k in ("forward", "backward", "optimizer")]
    return medians[0], medians[1], medians[2], tensors


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
        return time.perf_counter() - started

    compute(0)  # warm-up
    slowest_rank(comm, [0.0])
    alone_compute = statistics.median(compute(i) for i in range(steps))
    found = {}
    for name in names:
        kind, dtype = _collective_kind(name)
        size = torch.empty((), dtype=dtype).element_size()
        per_rank = (
            max(1, nbytes // size // comm.world_size) if kind == "all_to_all" else max(1, nbytes // size)
        )
        numel = per_rank * comm.world_size if kind == "all_to_all" else per_rank
        inputs = [torch.ones(numel, dtype=dtype, device=device) for _ in range(transfers)]
        slowest_rank(comm, [0.0])
        alone_transfer, _ = _transfers_while(comm, kind, inputs, per_rank, None)
        slowest_rank(comm, [0.0])
        busy_transfer, busy_compute = _transfers_while(comm, kind, inputs, per_rank, compute)
        slowed = [busy_compute / alone_compute - 1, busy_transfer / alone_transfer - 1]
        compute_slowdown, transfer_slowdown = slowest_rank(comm, [max(0.0, v) for v in slowed])
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
    and compute steps run here until all are done (none if `compute` is None)."""
    started = time.perf_counter()
    futures = [_issue(comm, kind, x, per_rank) for x in inputs]
    steps: list[float] = []
    while compute is not None and not all(f.done() for f in futures):
        steps.append(compute(len(steps)))
    for future in futures:
        future.wait()
    per_transfer = (time.perf_counter() - started) / len(inputs)
    return per_transfer, statistics.median(steps) if steps else 0.0


# -- codec costs -----------------------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """("topk", {"ratio": 0.01}) from "topk:ratio=0.01": a codec name and its arguments."""
    return registry.parse_spec(spec, "codec spec")


def build_codec(spec: str) -> compress.Compressor:
    """The codec `spec` names; ValueError naming the spec and the registry's reason otherwise."""
    name, args = parse_spec(spec)
    try:
        return compress.build(name, **args)
    except (KeyError, TypeError, ValueError) as error:
        reason = error.args[0] if error.args else error
        raise ValueError(f"codec spec {spec!r}: {reason}") from error


def measure_compression(
    spec: str,
    sizes: Sequence[int] = DEFAULT_CODEC_SIZES,
    repeats: int = 5,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, list[float]]:
    """{"compress": seconds, "decompress": seconds}, one median over `repeats` per size in `sizes`
    (fp32 elements), after one warm-up call each.

    The input is standard normal from a torch.Generator seeded with `seed`. Each size gets a fresh
    codec, since stateful ones (DGC's accumulator) are tied to one tensor size.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    clock = _Clock(device)
    generator = torch.Generator().manual_seed(seed)
    build_codec(spec)  # a bad spec fails before anything is timed
    seconds: dict[str, list[float]] = {phase: [] for phase in CODEC_PHASES}
    for numel in sizes:
        if numel < 1:
            raise ValueError(f"size {numel} must be >= 1 elements")
        codec = build_codec(spec)
        x = torch.randn(numel, generator=generator).to(device)
        codec.decompress(*codec.compress(x))  # warm-up: allocator, lazy generators, first-call paths
        times: dict[str, list[float]] = {phase: [] for phase in CODEC_PHASES}
        for _ in range(repeats):
            started = clock.mark()
            payload, ctx = codec.compress(x)
            compressed = clock.mark()
            codec.decompress(payload, ctx)
            ended = clock.mark()
            times["compress"].append(clock.seconds(started, compressed))
            times["decompress"].append(clock.seconds(compressed, ended))
        for phase in CODEC_PHASES:
            seconds[phase].append(statistics.median(times[phase]))
    return seconds


def fit_compression(
    specs: Sequence[str],
    sizes: Sequence[int] = DEFAULT_CODEC_SIZES,
    repeats: int = 5,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, dict[str, LinearFit]]:
    """Per codec spec ("fp16", "topk:ratio=0.01"), linear fits of compress and decompress seconds
    vs fp32 numel, on this process alone (no network). A bad spec raises ValueError naming it.

    Example:
        >>> fits = fit_compression(["fp16", "topk:ratio=0.01"])
        >>> fits["topk:ratio=0.01"]["compress"](1 << 20)  # seconds for 1M elements
    """
    fits = {}
    for spec in specs:
        measured = measure_compression(spec, sizes, repeats, seed, device)
        fits[spec] = {phase: fit_linear(sizes, measured[phase]) for phase in CODEC_PHASES}
    return fits


def measure_hook(
    config: SyncConfig,
    sizes: Sequence[int] = DEFAULT_CODEC_SIZES,
    repeats: int = 5,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, list[float]]:
    """{"before": seconds, "after": seconds}: gradsync's hook path (SyncState.sync) on this rank
    alone, one median over `repeats` compressed steps per size in `sizes` (fp32 elements).

    "before" runs from the hook's call to its collective's issue (divide, finiteness check, error
    feedback, compress), "after" from the collective's completion to the averaged bucket (decode one
    payload, feedback update). In a world of one the collective completes at once, so no network
    time is in either. The config's warm-up steps run first, uncompressed and untimed.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    clock = _Clock(device)
    generator = torch.Generator().manual_seed(seed)
    seconds: dict[str, list[float]] = {phase: [] for phase in HOOK_PHASES}
    for numel in sizes:
        if numel < config.min_compress_numel:
            raise ValueError(
                f"size {numel} is below min_compress_numel={config.min_compress_numel}, which the hook "
                "sends uncompressed; time sizes at least that large"
            )
        comm = _IssueClock(clock)
        state = SyncState(config, comm)
        x = torch.randn(numel, generator=generator).to(device)
        times: dict[str, list[float]] = {phase: [] for phase in HOOK_PHASES}
        for step in range(config.warmup_steps + 1 + repeats):  # + 1: a warm-up compressed step
            buffer = x.clone()
            comm.issued = None
            started = clock.mark()
            state.sync(buffer, 0, is_last=True).wait()
            ended = clock.mark()
            if step > config.warmup_steps and comm.issued is not None:
                times["before"].append(clock.seconds(started, comm.issued))
                times["after"].append(clock.seconds(comm.issued, ended))
        for phase in HOOK_PHASES:
            if not times[phase]:
                raise ValueError(f"{config.compressor} sent nothing at {numel} elements: nothing to time")
            seconds[phase].append(statistics.median(times[phase]))
    return seconds


class _IssueClock:
    """A world of one that notes when an exchange issues its first collective."""

    rank = 0
    world_size = 1

    def __init__(self, clock: _Clock) -> None:
        self._clock = clock
        self._local = LocalComm()
        self.issued: Any = None

    def _note(self) -> None:
        if self.issued is None:
            self.issued = self._clock.mark()

    def allreduce(self, tensor: torch.Tensor) -> Any:
        self._note()
        return self._local.allreduce(tensor)

    def allgather(self, tensor: torch.Tensor) -> Any:
        self._note()
        return self._local.allgather(tensor)

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Any:
        self._note()
        return self._local.all_to_all(parts, recv_numels)

    def sendrecv(self, peer: int, send: torch.Tensor, recv_numel: int) -> torch.Tensor:
        return self._local.sendrecv(peer, send, recv_numel)


def hook_config(spec: str) -> SyncConfig:
    """The SyncConfig gradsync's hook runs codec `spec` with by default (warm-up shortened to 2)."""
    name, args = parse_spec(spec)
    return SyncConfig(compressor=name, compressor_args=args, warmup_steps=2)


# -- collectives -----------------------------------------------------------------------------------


def zero_fit() -> LinearFit:
    """The cost of a collective in a world of one: nothing."""
    return LinearFit(fixed_s=0.0, per_unit_s=0.0, rel_error=0.0, max_rel_error=0.0, points=0)


def measure_collectives(
    comm: Comm,
    sizes: Sequence[int] = DEFAULT_COLLECTIVE_NBYTES,
    repeats: int = 5,
    device: str | torch.device = "cpu",
    names: Sequence[str] = COLLECTIVES,
) -> dict[str, tuple[list[int], list[float]]]:
    """Per collective: (bytes per rank as sent, this rank's median seconds), one per size in `sizes`.

    Every rank must call it with the same arguments. Sizes are rounded to whole elements (and
    all_to_all's to a whole number of elements per rank), at least one; the bytes returned are
    those actually sent. A name may carry a dtype, "allreduce:float16"; the default is fp32.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    clock = _Clock(device)
    n = comm.world_size
    tiny = torch.zeros(1, device=device)
    cases = []  # (collective, elements each rank sends to each peer, input)
    for name in names:
        kind, dtype = _collective_kind(name)
        size = torch.empty((), dtype=dtype).element_size()
        for nbytes in sizes:
            per_rank = max(1, nbytes // (size * n)) if kind == "all_to_all" else max(1, nbytes // size)
            numel = per_rank * n if kind == "all_to_all" else per_rank
            cases.append((kind, per_rank, torch.ones(numel, dtype=dtype, device=device)))
    times: list[list[float]] = [[] for _ in cases]
    # Round by round over every case rather than case by case: a burst of load from elsewhere on
    # the machine then spreads over the sizes instead of bending the fit at one of them.
    for attempt in range(repeats + 1):  # the first round is a warm-up: connections, buffers
        for (name, per_rank, x), seconds in zip(cases, times, strict=True):
            comm.allreduce(tiny).wait()  # start together, as far as one small message can tell
            _synchronize(device)
            started = clock.mark()
            _issue(comm, name, x, per_rank).wait()
            ended = clock.mark()
            if attempt:
                seconds.append(clock.seconds(started, ended))
    measured: dict[str, tuple[list[int], list[float]]] = {name: ([], []) for name in names}
    case_names = [name for name in names for _ in sizes]
    for name, (_, _, x), seconds in zip(case_names, cases, times, strict=True):
        measured[name][0].append(x.nbytes)
        measured[name][1].append(statistics.median(seconds))
    return measured


def _collective_kind(name: str) -> tuple[str, torch.dtype]:
    """("allreduce", torch.float16) from "allreduce:float16"; ValueError for an unknown one."""
    kind, _, dtype_name = name.partition(":")
    dtype = getattr(torch, dtype_name or "float32", None)
    if kind not in COLLECTIVES or not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"collective {name!r} is not one of {COLLECTIVES}, optionally with a torch dtype, "
            "e.g. 'allreduce:float16'"
        )
    return kind, dtype


def _issue(comm: Comm, name: str, x: torch.Tensor, per_rank: int) -> Any:
    if name == "allreduce":
        return comm.allreduce(x)
    if name == "allgather":
        return comm.allgather(x)
    return comm.all_to_all(list(x.split(per_rank)), [per_rank] * comm.world_size)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_collectives(
    comm: Comm,
    sizes: Sequence[int] = DEFAULT_COLLECTIVE_NBYTES,
    repeats: int = 5,
    device: str | torch.device = "cpu",
    names: Sequence[str] = COLLECTIVES,
) -> dict[str, LinearFit]:
    """Alpha-beta fits of "allreduce", "allgather" and "all_to_all": seconds vs bytes per rank.

    `sizes` are bytes per rank: an fp32 tensor of that many bytes for allreduce, that many from each
    rank for allgather, and that many from each rank split evenly over the ranks for all_to_all.
    Each time is this rank's median over `repeats`, then the slowest rank's: every rank gets the
    same fits, so plans made from them agree. Every rank must call it with the same arguments.
    A world of one needs no collectives: every fit is zero.

    Example:
        >>> fits = probe_collectives(TorchComm())
        >>> fits["allreduce"](4 << 20)  # seconds to allreduce 4 MiB
    """
    for name in names:
        _collective_kind(name)  # a bad name fails on every rank before any collective
    if comm.world_size == 1:
        return {name: zero_fit() for name in names}
    measured = measure_collectives(comm, sizes, repeats, device, names)
    slowest = slowest_rank(comm, [s for name in names for s in measured[name][1]], device)
    fits = {}
    for i, name in enumerate(names):
        nbytes = measured[name][0]
        fits[name] = fit_linear(nbytes, slowest[i * len(nbytes) : (i + 1) * len(nbytes)])
    return fits


def slowest_rank(comm: Comm, values: Sequence[float], device: str | torch.device = "cpu") -> list[float]:
    """The largest of every rank's `values`, element by element (a collective: all ranks call it
    with as many values). Comm's allreduce only sums, so the values are gathered instead."""
    if comm.world_size == 1:
        return list(values)
    mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    return torch.stack(comm.allgather(mine).wait()).amax(dim=0).tolist()


# -- the whole profile -----------------------------------------------------------------------------


def run(
    model: nn.Module,
    step: Callable[[int], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    comm: Comm | None = None,
    compressors: Sequence[str] = DEFAULT_COMPRESSORS,
    steps: int = 5,
    warmup: int = 2,
    codec_sizes: Sequence[int] = DEFAULT_CODEC_SIZES,
    collective_sizes: Sequence[int] = DEFAULT_COLLECTIVE_NBYTES,
    repeats: int = 5,
    seed: int = 0,
    meta: Mapping[str, Any] | None = None,
    collectives: Sequence[str] = COLLECTIVES,
    hooks: Mapping[str, SyncConfig] | None = None,
    contention: bool = True,
) -> Profile:
    """Profile `model` on this machine: its compute timeline, the codecs' costs and the collectives'.

    Every rank must call it. `step(i)` runs step i's forward pass and returns the loss (see
    time_backward, which also says what training steps this costs). `comm` defaults to the DDP
    model's process group, or a world of one for a plain module. Codecs are timed on every rank at
    once, as they run in training, on the model's device. All numbers are the slowest rank's, so
    every rank returns the same profile (meta aside: it is this rank's).

    Example:
        >>> found = run(ddp_model, step, optimizer, compressors=["fp16", "topk:ratio=0.01"])
        >>> found.save("profile.json")  # gradsync simulate --profile profile.json
    """
    for spec in compressors:
        build_codec(spec)  # a bad spec fails before any rank trains a step
    hooks = {spec: hook_config(spec) for spec in compressors} if hooks is None else dict(hooks)
    if comm is None:
        comm = TorchComm(model.process_group) if isinstance(model, DistributedDataParallel) else LocalComm()
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    slowest_rank(comm, [0.0], device)  # start the compute timeline together
    forward_s, backward_s, optimizer_s, tensors = time_backward(model, step, optimizer, steps, warmup)
    forward_s, backward_s, optimizer_s = slowest_rank(comm, [forward_s, backward_s, optimizer_s], device)
    tensors = _agreed_tensors(comm, model, tensors, device)
    compression = {}
    for spec in compressors:
        measured = measure_compression(spec, codec_sizes, repeats, seed, device)
        slowest = slowest_rank(comm, measured["compress"] + measured["decompress"], device)
        halves = {"compress": slowest[: len(codec_sizes)], "decompress": slowest[len(codec_sizes) :]}
        compression[spec] = {phase: fit_linear(codec_sizes, halves[phase]) for phase in CODEC_PHASES}
    hook = {}
    for spec, config in hooks.items():
        # Below min_compress_numel the hook sends a bucket uncompressed: time sizes it compresses.
        hook_sizes = sorted({max(n, config.min_compress_numel) for n in codec_sizes})
        if len(hook_sizes) < 2:
            hook_sizes.append(4 * hook_sizes[-1])
        measured = measure_hook(config, hook_sizes, repeats, seed, device)
        slowest = slowest_rank(comm, measured["before"] + measured["after"], device)
        halves = {"before": slowest[: len(hook_sizes)], "after": slowest[len(hook_sizes) :]}
        hook[spec] = {phase: fit_linear(hook_sizes, halves[phase]) for phase in HOOK_PHASES}
    fits = probe_collectives(comm, collective_sizes, repeats, device, collectives)
    overlap = measure_contention(model, step, comm, max(collective_sizes), collectives) if contention else {}
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return Profile(
        world_size=comm.world_size,
        backend=dist.get_backend(comm.group) if isinstance(comm, TorchComm) else "local",
        device=device.type,
        threads=torch.get_num_threads(),
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=optimizer_s,
        tensors=tuple(tensors),
        compression=compression,
        collectives=fits,
        hook=hook,
        contention=overlap,
        meta={
            **_default_name(module, meta or {}),
            "module": type(module).__name__,
            "machine": machine(),
            "steps": steps,
            "warmup": warmup,
            "repeats": repeats,
            "codec_sizes": list(codec_sizes),
            "collective_sizes": list(collective_sizes),
            **(meta or {}),
        },
    )


def _agreed_tensors(
    comm: Comm, model: nn.Module, tensors: list[TensorTiming], device: torch.device
) -> list[TensorTiming]:
    """Every gradient any rank saw, each ready at the slowest rank's time, in one order on every rank.

    Each rank sends one value per parameter (-inf where it saw no gradient, a parameter its data
    left unused), so that every rank sends as many values whatever its data did.
    """
    if comm.world_size == 1:
        return tensors
    params, names = list(model.parameters()), parameter_names(model)
    mine = [-math.inf] * len(params)
    for t in tensors:
        mine[t.index] = t.ready_s
    slowest = slowest_rank(comm, mine, device)
    place = {t.index: i for i, t in enumerate(tensors)}  # this rank's firing order breaks ties
    agreed = [
        TensorTiming(i, names[i], params[i].numel(), ready_s)
        for i, ready_s in enumerate(slowest)
        if ready_s > -math.inf
    ]
    agreed.sort(key=lambda t: (t.ready_s, place.get(t.index, len(params)), t.index))
    return agreed


def _default_name(module: nn.Module, meta: Mapping[str, Any]) -> dict[str, Any]:
    """{"model": the class name} unless the caller named the model or its workload: the simulator
    names a profiled model by meta["model"], else meta["workload"]."""
    return {} if "model" in meta or "workload" in meta else {"model": type(module).__name__}


def machine() -> dict[str, Any]:
    """The machine a measurement ran on: CPU, cores, Python and torch versions."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
