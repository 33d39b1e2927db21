"""One worker's compute in one step, without communication: what the simulator lays out.

It comes from a model profile and a device (FLOPs / achieved FLOP/s), or from a profile measured
on real ranks (gradsync.profile), where the ready times already include whatever the ranks share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .cluster import Device
from .models import ModelProfile, backward_schedule

# An Adam-style update reads the parameter, its gradient and two moments and writes three of
# them back: 7 fp32 values per parameter stream through device memory.
OPTIMIZER_NBYTES_PER_PARAM = 28


@dataclass(frozen=True)
class Gradient:
    """One tensor's gradient: its size and when backward has produced it."""

    name: str
    numel: int
    ready_s: float  # seconds from the start of the backward pass
    rows: int | None = None  # an embedding table's rows, whose gradient touches only some
    density: float | None = None  # the fraction of rows one worker's gradient touches


@dataclass(frozen=True)
class Compute:
    """Forward, backward and optimizer time of one worker, and each gradient's ready time."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    gradients: tuple[Gradient, ...]  # backprop order; ready_s non-decreasing, <= backward_s
    batch_size: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        readies = [g.ready_s for g in self.gradients]
        if any(b < a for a, b in itertools.pairwise(readies)) or (readies and readies[-1] > self.backward_s):
            raise ValueError("gradients must be in ready order, each ready within the backward pass")
        if min(self.forward_s, self.backward_s, self.optimizer_s) < 0:
            raise ValueError("compute times must be >= 0 seconds")

    @property
    def step_s(self) -> float:
        """A step with nothing to exchange: one worker alone."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def numels(self) -> list[int]:
        return [g.numel for g in self.gradients]

    @property
    def num_params(self) -> int:
        return sum(self.numels)


def from_model(
    model: ModelProfile, device: Device, precision: str = "mixed", batch_size: int | None = None
) -> Compute:
    """The compute of `model` on `device`: each layer's FLOPs over the achieved FLOP/s.

    Example:
        >>> from gradsync.sim import cluster, models
        >>> from_model(models.build("resnet50"), cluster.device("v100")).num_params
        25557032
    """
    batch = model.batch_size if batch_size is None else batch_size
    if batch < 1:
        raise ValueError(f"batch_size={batch} must be >= 1 samples per worker")
    flops = device.flops(precision)
    sparse = {
        tensor: (layer.embedding_rows, layer.density)
        for layer in model.layers
        if layer.density is not None
        for tensor, _ in layer.tensors
    }
    gradients = tuple(
        Gradient(name, numel, cumulative * batch / flops, *sparse.get(name, (None, None)))
        for name, numel, cumulative in backward_schedule(model)
    )
    forward_s = model.forward_flops * batch / flops
    optimizer_s = model.num_params * OPTIMIZER_NBYTES_PER_PARAM / device.memory_bytes_per_s
    return Compute(forward_s, 2 * forward_s, optimizer_s, gradients, batch, model.name)
