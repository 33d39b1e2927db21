"""The learning rate the user's SGD applies to a model's parameters, which error memories follow.

An error memory holds gradient that compression held back: the optimizer applies it steps later,
at the learning rate of that later step. Under a decaying schedule that rate is smaller than the
one the gradient was computed for, so the held-back part moves the parameters less than it would
have under DDP, and what is still held when the rate nears zero is never applied. Scaled by the
ratio of the old rate to the new at each step, the memory holds parameter movement instead, as
in EF-SGD's formulation (Stich et al. 2018; Karimireddy et al. 2019), where the memory
accumulates learning rate times gradient. docs/compressors.md measures what that changes.

The hook does not see the optimizer, so this watches every optimizer's step (PyTorch's global
step pre-hook) and keeps those that are SGD and hold one of the model's parameters. Only SGD:
its step is the learning rate times the gradient (and its momentum); an adaptive optimizer's
(Adam's) is not proportional to the gradient, so the memory stays in gradient units there, and
everywhere where such an optimizer steps some of the model's parameters beside SGD (a memory
may hold both's gradients).
"""

from __future__ import annotations

import gc
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
        self._ids: dict[int, int] = {}  # each parameter's id -> its position among ours
        self.watch(params)
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []  # ours, SGD
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # An optimizer other than SGD over some of ours: a memory holding their gradients as well
        # as SGD's would be rescaled whole by SGD's rate, so none is.
        self._mixed: str | None = None
        self._warned = self._warned_mixed = False
        self._searched = False  # whether now() looked for optimizers among the live objects
        _watch(self)

    def watch(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Follow the rate over `params` too (parameters met one DDP bucket at a time), from the
        next optimizer met."""
        for p in params:
            self._ids.setdefault(id(p), len(self._ids))

    def close(self) -> None:
        """Stop watching optimizers' steps."""
        _WATCHERS.discard(self)

    def now(self) -> Rates | None:
        """The rates of the param groups holding the model's parameters, ordered by their first
        parameter's position (the same whichever optimizer stepped first, also after a restore);
        None where no SGD over them exists, or where another optimizer holds some of them."""
        if not self._optimizers and not self._searched:
            # No optimizer has stepped since this watcher was made: a state restored from a
            # checkpoint (or compressing from step 0) meets its first compressed step before the
            # optimizer's next step. Its memories need the rate now, so look for the optimizer
            # among the live objects, once.
            self._searched = True
            for obj in gc.get_objects():
                # type(), not isinstance: some objects (torch.distributed.reduce_op) warn when
                # asked for their __class__.
                if issubclass(type(obj), torch.optim.Optimizer):
                    self._seen(obj)
        if self._mixed is not None:
            return None
        first_and_rate = sorted(
            (min(self._ids[id(p)] for p in group["params"] if id(p) in self._ids), float(group["lr"]))
            for optimizer in (ref() for ref in self._optimizers)
            if optimizer is not None
            for group in optimizer.param_groups
            if any(id(p) in self._ids for p in group["params"])
        )
        return tuple(rate for _, rate in first_and_rate) or None

    @property
    def optimizers_known(self) -> bool:
        """Whether an optimizer over the model's parameters has been seen (now() looks for one)."""
        return bool(self._optimizers) or self._mixed is not None

    @property
    def other_optimizer(self) -> str | None:
        """The class name of an optimizer other than SGD seen stepping some of the model's
        parameters (None where only SGD has)."""
        return self._mixed

    def sgd_momenta(self) -> set[tuple[float, float, bool]]:
        """(momentum, dampening, nesterov) of each SGD param group over the model's parameters,
        among the optimizers seen stepping so far (empty before any has)."""
        return {
            (float(group["momentum"]), float(group["dampening"]), bool(group["nesterov"]))
            for optimizer in (ref() for ref in self._optimizers)
            if optimizer is not None
            for group in optimizer.param_groups
            if any(id(p) in self._ids for p in group["params"])
        }

    def ratio(self, before: Rates | None, now: Rates | None) -> float:
        """What scales a memory held at rates `before` so that it moves the parameters at rates
        `now` as far as it would have at `before`: before / now over the groups whose rate is
        positive at both (a zero rate applies nothing: what waits for it stays as it is), where
        they all moved by the same factor, as a scheduler moves them. 1 where either is unknown,
        or where groups moved apart: a memory is one tensor per group of gradients and may span
        param groups (warned once; the next change is followed again)."""
        if before is None or now is None or len(before) != len(now) or before == now:
            return 1.0
        ratios = [
            old / new
            for old, new in zip(before, now, strict=True)
            if 0 < old < math.inf and 0 < new < math.inf
        ]
        if not ratios:
            return 1.0
        if max(ratios) - min(ratios) > 1e-6 * max(ratios):
            if not self._warned:
                self._warned = True
                log.warning(
                    "gradsync: the learning rates of the param groups over the model changed by different "
                    "factors (%s): error memories were not rescaled for this change (warned once)",
                    ", ".join(f"{r:.6g}" for r in ratios),
                )
            return 1.0
        return ratios[0]

    def _seen(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._checked:
            return
        self._checked.add(optimizer)
        if isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer):
            # A wrapper (ZeroRedundancyOptimizer, PostLocalSGDOptimizer): the optimizer it wraps
            # steps too, and is judged then.
            return
        ours = any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])
        if ours and isinstance(optimizer, torch.optim.SGD):
            self._optimizers.append(weakref.ref(optimizer))
        elif ours and self._mixed is None:
            self._mixed = type(optimizer).__name__
        if self._mixed is not None and self._optimizers and not self._warned_mixed:
            self._warned_mixed = True  # once both are known, whichever stepped first
            log.warning(
                "gradsync: %s steps some of the model's parameters beside SGD: error memories "
                "stay in gradient units (not rescaled as SGD's rate changes)",
                self._mixed,
            )


def held_at(before: Rates | None, now: Rates | None) -> Rates | None:
    """The rates a memory is held at after a step at `now`: each group's rate where positive,
    else the rate the memory was last held at for it (a zero rate leaves the memory waiting)."""
    if now is None:
        return before
    if before is None or len(before) != len(now):
        return now if all(rate > 0 for rate in now) else None
    return tuple(new if new > 0 else old for old, new in zip(before, now, strict=True))


# The watchers PyTorch's one global optimizer step pre-hook tells of each step, held weakly. One
# hook for the process, never removed: a hook removed as its watcher is collected could go while
# PyTorch iterates over the hooks (a collection can run inside any hook), which fails there
# ("OrderedDict mutated during iteration").
_WATCHERS: weakref.WeakSet[LearningRate] = weakref.WeakSet()
_hooked = False


def _watch(watcher: LearningRate) -> None:
    global _hooked
    _WATCHERS.add(watcher)
    if not _hooked:
        _hooked = True
        register_optimizer_step_pre_hook(_seen)


def _seen(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for watcher in list(_WATCHERS):
        watcher._seen(optimizer)
