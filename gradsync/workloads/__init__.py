"""Built-in training workloads for benchmarks: models and data in plain torch, nothing downloaded.

Example:
    >>> from gradsync import workloads
    >>> workloads.names()
    ['gpt-tiny', 'mlp-wide', 'embed-lm', 'convnet']
    >>> w = workloads.build("mlp-wide", seed=0, batch_size=8)
    >>> inputs, targets = w.batch(step=0, rank=1, world_size=2)
"""

from __future__ import annotations

from typing import Any

from .. import registry
from .base import Workload
from .convnet import Convnet
from .embed_lm import EmbedLm
from .gpt import GptTiny
from .mlp import MlpWide

REGISTRY: dict[str, type[Workload]] = {
    # character-level transformer on stdlib source: compute and communication both heavy
    "gpt-tiny": GptTiny,
    # few wide Linear layers: communication dominates
    "mlp-wide": MlpWide,
    # word LM with a large input embedding: mostly-zero (sparse) gradients
    "embed-lm": EmbedLm,
    # small residual CNN on 8x8 digits: cheap, few parameters
    "convnet": Convnet,
}

__all__ = ["REGISTRY", "Workload", "build", "lookup", "names", "options"]


def names() -> list[str]:
    """Every registered workload name, in registry order."""
    return list(REGISTRY)


def lookup(name: str) -> type[Workload]:
    """The workload class registered as `name`; KeyError listing the valid names otherwise."""
    return registry.lookup(REGISTRY, "workload", name)


def options(name: str) -> dict[str, Any]:
    """The options `name` accepts with their defaults (the seed is build's own argument)."""
    return {key: default for key, default in registry.parameters(lookup(name)).items() if key != "seed"}


def build(name: str, seed: int = 0, **opts: Any) -> Workload:
    """Construct the workload registered as `name`; this loads its data (cached per process).

    Unknown name: KeyError listing the names. Unknown option: TypeError listing the valid
    options. Out-of-range value: ValueError naming the value, the constraint and the fix.
    """
    valid = options(name)
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        raise TypeError(f"workload {name!r} got unknown option(s) {unknown}; valid options: {sorted(valid)}")
    return lookup(name)(seed=seed, **opts)
