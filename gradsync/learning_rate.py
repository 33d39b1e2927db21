"""The learning rate the user's SGD applies to a model's parameters, which error memories follow.

An error memory holds gradient that compression held back: the optimizer applies it steps later,
at the learning rate of that later step. Under a decaying schedule that rate is smaller than the
one the gradient was computed for, so the held-back part moves the parameters less than it would
have under DDP, and what is still held when the rate nears zero is never applied. On mlp-wide
(cosine decay to 0 over 400 steps) top-k 1% with momentum correction ended 4.8% above DDP's
held-out loss with memories in gradient units, and level with DDP with memories scaled by the
ratio of the old rate to the new at each step (docs/compressors.md): the memory then holds
parameter movement, as in EF-SGD's formulation (Stich et al. 2018; Karimireddy et al. 2019),
where the memory accumulates learning rate times gradient.

The hook does not see the optimizer, so this watches every optimizer's step (PyTorch's global
step pre-hook) and keeps those that are SGD and hold one of the model's parameters. Only SGD:
its step is the learning rate times the gradient (and its momentum); an adaptive optimizer's
(Adam's) is not proportional to the gradient, so the memory stays in gradient units there.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

log = logging.getLogger("gradsync")

Rates = tuple[float, ...]


class LearningRate:
    """The learning rates that SGD optimizers over `params` will apply at their next step: one
    per param group holding any of `params`, known once such an optimizer has stepped."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self._ids = {id(p) for p in params}
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []  # ours, in the order seen
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._warned = False
        # The global hook holds this object weakly, and is removed once it is collected.
        handle = register_optimizer_step_pre_hook(_Seen(weakref.ref(self)))
        self._release = weakref.finalize(self, handle.remove)

    def watch(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Follow the rate over `params` too (parameters met one DDP bucket at a time), from the
        next optimizer met."""
        self._ids.update(id(p) for p in params)

    def close(self) -> None:
        """Stop watching optimizers' steps."""
        self._release()

    def now(self) -> Rates | None:
        """The rates of the param groups holding the model's parameters, in the order the
        optimizers were seen; None before any SGD over them stepped."""
        rates = tuple(
            float(group["lr"])
            for optimizer in (ref() for ref in self._optimizers)
            if optimizer is not None
            for group in optimizer.param_groups
            if any(id(p) in self._ids for p in group["params"])
        )
        return rates or None

    def ratio(self, before: Rates | None, now: Rates | None) -> float:
        """What scales a memory held at rates `before` so that it moves the parameters at rates
        `now` as far as it would have at `before`: before / now, where every group's rate moved
        by the same factor (as a scheduler's do). 1 where either is unknown or not positive, or
        where groups' rates moved apart (warned once: the memory is one tensor per group of
        gradients, which may span param groups)."""
        if before is None or now is None or len(before) != len(now) or before == now:
            return 1.0
        if not all(0 < rate < math.inf for rate in before + now):
            return 1.0
        ratios = [old / new for old, new in zip(before, now, strict=True)]
        if max(ratios) - min(ratios) > 1e-6 * max(ratios):
            if not self._warned:
                self._warned = True
                log.warning(
                    "gradsync: the learning rates of the optimizer's param groups changed by different "
                    "factors (%s); error memories stay in gradient units from here on",
                    ", ".join(f"{r:.6g}" for r in ratios),
                )
            return 1.0
        return ratios[0]

    def _seen(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._checked:
            return
        self._checked.add(optimizer)
        ours = any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])
        if ours and isinstance(optimizer, torch.optim.SGD):
            self._optimizers.append(weakref.ref(optimizer))


class _Seen:
    """The global hook: tells the watcher, while it lives, which optimizer is stepping."""

    def __init__(self, watcher: weakref.ref[LearningRate]) -> None:
        self._watcher = watcher

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        watcher = self._watcher()
        if watcher is not None:
            watcher._seen(optimizer)
