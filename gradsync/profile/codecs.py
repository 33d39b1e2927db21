"""Codecs on this machine: each codec's compress and decompress time, and gradsync's whole hook
path around it, timed at several sizes on every rank at once and fitted linearly."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import compress, registry
from ..comm import Comm, LocalComm
from ..compress.scratch import scratch
from ..config import SyncConfig
from ..cost import LinearFit, fit_linear
from ..sync import SyncState
from .collectives import slowest_rank
from .timeline import Clock

CODEC_PHASES = ("compress", "decompress")
# gradsync's hook around a codec, on one rank: before its collective is issued (divide, finiteness
# check, error feedback, compress) and after it completes (decode, feedback update, copy back).
HOOK_PHASES = ("before", "after")
# One codec of each family: a cast, a sparsifier, a quantizer, one bit per element.
DEFAULT_COMPRESSORS = ("fp16", "topk:ratio=0.01", "qsgd", "efsignsgd")
# fp32 elements: 16 KiB to 16 MiB, a factor of 4 apart, the range of DDP buckets (25 MiB default).
DEFAULT_CODEC_SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """("topk", {"ratio": 0.01}) from "topk:ratio=0.01": a codec name and its arguments."""
    return registry.parse_spec(spec, "codec spec")


def build_codec(spec: str) -> compress.Compressor:
    """The codec `spec` names, past any warm-up (profiles measure the codec as it runs after it);
    ValueError naming the spec and the registry's reason otherwise."""
    name, args = parse_spec(spec)
    try:
        return compress.warmed_up(compress.build(name, **args))
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
    clock = Clock(device)
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


def compression_errors(
    gradients: Sequence[torch.Tensor], specs: Sequence[str], seed: int = 0
) -> dict[str, tuple[float, ...]]:
    """Per codec spec, the squared error ||g - C(g)||^2 of compressing each of `gradients` alone
    once (a fresh codec each, seeded with `seed`; random codecs draw one sample): what
    gradsync.levels weighs against a budget.

    Example:
        >>> compression_errors([torch.randn(1000)], ["int8", "int4"])["int4"][0] > 0
        True
    """
    errors = {}
    for spec in specs:
        build_codec(spec)  # a bad spec fails before anything is compressed
        name, args = parse_spec(spec)
        if "seed" in compress.parameters(name):
            args = {**args, "seed": seed}
        found = []
        for gradient in gradients:
            if gradient.numel() == 0:
                found.append(0.0)
                continue
            codec = compress.warmed_up(compress.build(name, **args))
            if type(codec).uses_shapes:  # PowerSGD: the gradient as its own matrix, as the hook does
                codec.use_shapes([gradient.shape])
            flat = gradient.detach().reshape(-1).float()
            payload, ctx = codec.compress(flat)
            # g - C(g) in a warm buffer, by the codec's own in-place subtraction (sparse codecs
            # touch only what they sent): three passes, no fresh full-size tensor.
            residual = scratch("compression-error", flat.numel(), torch.float32, flat.device)
            residual.copy_(flat)
            codec.sub_decoded_(residual, payload, ctx)
            found.append(float(torch.dot(residual, residual)))
        errors[spec] = tuple(found)
    return errors


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
    time is in either. The config's warm-up steps run first, uncompressed and untimed, then one
    compressed step, untimed; a codec that warms up is then moved past its warm-up.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    clock = Clock(device)
    generator = torch.Generator().manual_seed(seed)
    seconds: dict[str, list[float]] = {phase: [] for phase in HOOK_PHASES}
    for numel in sizes:
        if numel < config.min_compress_numel:
            raise ValueError(
                f"size {numel} is below min_compress_numel={config.min_compress_numel}, which the hook "
                "sends uncompressed; time sizes at least that large"
            )
        comm = _IssueClock(clock)
        state = _TimedState(config, comm)
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
            if step == config.warmup_steps and 0 in state.points:  # timed as it runs after its warm-up
                compress.warmed_up(state.points[0].codec)
        for phase in HOOK_PHASES:
            if not times[phase]:
                raise ValueError(f"{config.compressor} sent nothing at {numel} elements: nothing to time")
            seconds[phase].append(statistics.median(times[phase]))
    return seconds


class _TimedState(SyncState):
    """A state that times the hook: only the run's own states log "compressing from step"."""

    says_compressing = False


class _IssueClock:
    """A world of one that notes when an exchange issues its first collective."""

    rank = 0
    world_size = 1

    def __init__(self, clock: Clock) -> None:
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


def fit_codecs(
    comm: Comm,
    specs: Sequence[str],
    sizes: Sequence[int],
    repeats: int,
    seed: int,
    device: torch.device,
    hooks: Mapping[str, SyncConfig] | None = None,
) -> tuple[dict[str, dict[str, LinearFit]], dict[str, dict[str, LinearFit]]]:
    """(compression, hook): each codec's compress and decompress fits, and the fits of gradsync's
    hook path around it (before and after its collective), at `sizes`; measured on every rank at
    once, the slowest rank's times fitted. `hooks`: the config each codec's hook path runs with
    (default hook_config). Every rank must call it with the same arguments."""
    hooks = {spec: hook_config(spec) for spec in specs} if hooks is None else dict(hooks)
    compression = {}
    for spec in specs:
        measured = measure_compression(spec, sizes, repeats, seed, device)
        slowest = slowest_rank(comm, measured["compress"] + measured["decompress"], device)
        halves = {"compress": slowest[: len(sizes)], "decompress": slowest[len(sizes) :]}
        compression[spec] = {phase: fit_linear(sizes, halves[phase]) for phase in CODEC_PHASES}
    hook = {}
    for spec, config in hooks.items():
        # Below min_compress_numel the hook sends a bucket uncompressed: time sizes it compresses.
        hook_sizes = sorted({max(n, config.min_compress_numel) for n in sizes})
        if len(hook_sizes) < 2:
            hook_sizes.append(4 * hook_sizes[-1])
        measured = measure_hook(config, hook_sizes, repeats, seed, device)
        slowest = slowest_rank(comm, measured["before"] + measured["after"], device)
        halves = {"before": slowest[: len(hook_sizes)], "after": slowest[len(hook_sizes) :]}
        hook[spec] = {phase: fit_linear(hook_sizes, halves[phase]) for phase in HOOK_PHASES}
    return compression, hook
