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
of its own, so a global optimizer step pre-hook (one for the process, registered by the first
state that follows the scale, never removed: removing one while PyTorch iterates over them fails)
finds the scaler a frame or two up, at the first step it takes; the first one seen is followed
while it lives. A fresh run's first compressed step comes after two optimizer steps; a resumed
run's first may come before, and follows the scale from its second. The scale is then read once a
step: on a GPU, one number copied from the device, a sync. Without a scaler (bf16, or no AMP)
nothing is read, and the hook costs a look at a few frames per optimizer step.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.amp import GradScaler
from torch.optim.optimizer import register_optimizer_step_pre_hook

_FRAMES_UP = 4  # how far above the optimizer's step a GradScaler's method is looked for
# The GradScaler methods that call optimizer.step(): only their frames' locals are read (reading a
# frame's locals builds a dict, and an allocation inside a hook can run the garbage collector).
_STEPPING = frozenset({"_maybe_opt_step", "step"})
_scaler: weakref.ref[GradScaler] | None = None  # the GradScaler seen stepping an optimizer
_watching = False


def watch() -> None:
    """Look for the GradScaler that steps this process's optimizers, from now on."""
    global _watching
    if not _watching:
        _watching = True
        register_optimizer_step_pre_hook(_seen)


def now() -> float | None:
    """The scale this step's gradients are multiplied by; None where no enabled scaler has
    stepped an optimizer since watch()."""
    scaler = _scaler() if _scaler is not None else None
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler.get_scale()


def ratio(before: float | None, now: float | None) -> float:
    """What scales a memory held at scale `before` into scale `now`'s units: now / before, 1
    where either is unknown."""
    if before is None or now is None or before == now or not before > 0:
        return 1.0
    return now / before


def _seen(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global hook: notes the GradScaler stepping `optimizer`, where none is followed."""
    global _scaler
    if _scaler is not None and _scaler() is not None:
        return
    frame = sys._getframe(1)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return
        if frame.f_code.co_name in _STEPPING:
            caller = frame.f_locals.get("self")
            if isinstance(caller, GradScaler):
                _scaler = weakref.ref(caller)
                return
        frame = frame.f_back
