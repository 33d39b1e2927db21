"""The loss scale of AMP's GradScaler, which error memories follow.

Under fp16 autocast, `torch.amp.GradScaler` multiplies the loss, and with it every gradient the
hook sees, by its scale S, and divides the gradients by S before the optimizer steps. Error
memories therefore hold gradients in S's units, and GradScaler moves S: it halves it after a step
it skipped for an overflow, and doubles it after `growth_interval` (2,000) good steps in a row. A
memory kept at the old S would count double (or half) against the next gradients, so the hook
scales each point's memories by S_now / S_then before a step adds to them
(CompressionPoint.rescale_units). S moves by powers of two, which scale floats exactly: a run under
GradScaler trains bit for bit as the same run without it (tests/distributed/test_dist_loss_scale.py).

The hook does not see the scaler. GradScaler.step(optimizer) calls optimizer.step() from a method
of its own, so PyTorch's global optimizer step pre-hook finds the scaler one or two frames up,
at the first step it takes (a fresh run's first compressed step comes after two optimizer steps;
a resumed run's first may come before, and then follows the scale from its second). Its scale is
then read once a step: on a GPU, one number copied from the device, a sync. Without a scaler (bf16,
or no AMP) nothing is read, and the hook costs a frame lookup per optimizer step.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.amp import GradScaler
from torch.optim.optimizer import register_optimizer_step_pre_hook

_FRAMES_UP = 4  # how far above the optimizer's step a GradScaler's method is looked for


class LossScale:
    """The scale of the GradScaler that steps this process's optimizers, once seen."""

    def __init__(self) -> None:
        self._scaler: weakref.ref[GradScaler] | None = None
        # The global hook holds this object weakly, and is removed once it is collected.
        handle = register_optimizer_step_pre_hook(_Seen(weakref.ref(self)))
        self._release = weakref.finalize(self, handle.remove)

    def now(self) -> float | None:
        """The scale this step's gradients are multiplied by; None where no enabled scaler has
        stepped an optimizer yet."""
        scaler = self._scaler() if self._scaler is not None else None
        if scaler is None or not scaler.is_enabled():
            return None
        return scaler.get_scale()

    def close(self) -> None:
        """Stop watching optimizers' steps."""
        self._release()

    def _seen(self, scaler: GradScaler) -> None:
        self._scaler = weakref.ref(scaler)

    @property
    def found(self) -> bool:
        return self._scaler is not None and self._scaler() is not None


def ratio(before: float | None, now: float | None) -> float:
    """What scales a memory held at scale `before` into scale `now`'s units: now / before, 1
    where either is unknown."""
    if before is None or now is None or before == now or not before > 0:
        return 1.0
    return now / before


class _Seen:
    """The global hook: tells the watcher, while it lives and has not found one, which
    GradScaler (if any) is stepping the optimizer."""

    def __init__(self, watcher: weakref.ref[LossScale]) -> None:
        self._watcher = watcher

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        watcher = self._watcher()
        if watcher is None or watcher.found:
            return
        frame = sys._getframe(1)
        for _ in range(_FRAMES_UP):
            if frame is None:
                return
            caller = frame.f_locals.get("self")
            if isinstance(caller, GradScaler):
                watcher._seen(caller)
                return
            frame = frame.f_back
