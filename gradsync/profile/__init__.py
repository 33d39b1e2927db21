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

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm import Comm, LocalComm, TorchComm
from ..config import SyncConfig
from ..cost import LinearFit
from ..sim import cluster as clusters
from ..sim.cluster import Cluster
from ..sim.compute import Compute, Gradient
from .codecs import (
    CODEC_PHASES,
    DEFAULT_CODEC_SIZES,
    DEFAULT_COMPRESSORS,
    HOOK_PHASES,
    build_codec,
    compression_errors,
    fit_codecs,
    fit_compression,
    hook_config,
    measure_compression,
    measure_hook,
    parse_spec,
)
from .collectives import (
    COLLECTIVES,
    DEFAULT_COLLECTIVE_NBYTES,
    measure_collectives,
    measure_contention,
    probe_collectives,
    slowest_rank,
    zero_fit,
)
from .host import copy_bandwidth, machine, matmul_gflops, one_thread_copy_gbytes_per_s
from .timeline import CUDA_EVENT_RESOLUTION_S, TensorTiming, parameter_names, time_backward

__all__ = [
    "CODEC_PHASES",
    "COLLECTIVES",
    "CUDA_EVENT_RESOLUTION_S",
    "DEFAULT_CODEC_SIZES",
    "DEFAULT_COLLECTIVE_NBYTES",
    "DEFAULT_COMPRESSORS",
    "HOOK_PHASES",
    "VERSION",
    "Profile",
    "TensorTiming",
    "build_codec",
    "compression_errors",
    "copy_bandwidth",
    "fit_codecs",
    "fit_compression",
    "hook_config",
    "machine",
    "matmul_gflops",
    "measure_collectives",
    "measure_compression",
    "measure_contention",
    "measure_hook",
    "one_thread_copy_gbytes_per_s",
    "parameter_names",
    "parse_spec",
    "probe_collectives",
    "run",
    "slowest_rank",
    "time_backward",
    "zero_fit",
]

VERSION = 1


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
    if comm is None:
        comm = TorchComm(model.process_group) if isinstance(model, DistributedDataParallel) else LocalComm()
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    slowest_rank(comm, [0.0], device)  # start the compute timeline together
    forward_s, backward_s, optimizer_s, tensors = time_backward(model, step, optimizer, steps, warmup)
    forward_s, backward_s, optimizer_s = slowest_rank(comm, [forward_s, backward_s, optimizer_s], device)
    tensors = _agreed_tensors(comm, model, tensors, device)
    compression, hook = fit_codecs(comm, compressors, codec_sizes, repeats, seed, device, hooks)
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
