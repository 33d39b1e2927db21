"""The timeline simulator: predict a data-parallel step on a cluster from a model and strategies.

Pieces, each a module: models (the architectures' tensors and FLOPs), cluster (devices, links,
presets), compute (one worker's backward timeline), groups (how gradients are merged),
phases (a group's phases and their costs) and engine (the discrete-event layout in time); gantt draws it.

Example:
    >>> from gradsync import sim
    >>> work = sim.compute.from_model(sim.models.build("gpt2"), sim.cluster.device("a100"))
    >>> result = sim.simulate(work, sim.cluster.cluster(8, 8, "a100", "25gbit"), "none")
    >>> 0 < result.scaling < 1
    True
"""

from . import cluster, compute, groups, models, phases
from .engine import GroupTiming, Result, Span, simulate

__all__ = ["GroupTiming", "Result", "Span", "cluster", "compute", "groups", "models", "phases", "simulate"]
