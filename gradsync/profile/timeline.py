"""The compute timeline of one training step: forward, backward with the moment each gradient is
ready, and optimizer, timed on this rank (CUDA events on a GPU, wall time on a CPU)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# CUDA events resolve about half a microsecond: the shortest interval they can tell from none.
CUDA_EVENT_RESOLUTION_S = 0.5e-6


@dataclass(frozen=True)
class TensorTiming:
    """One parameter's gradient: index in model.parameters(), numel, and when it was ready."""

    index: int  # position in model.parameters()
    name: str  # as in named_parameters() of the model DDP wraps ("module." stripped)
    numel: int
    ready_s: float  # median over steps of seconds from the start of backward to this gradient's accumulation


def parameter_names(model: nn.Module) -> list[str]:
    """The name of each of model.parameters(), in order; a DDP model's without "module."."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return [name for name, _ in module.named_parameters()]


class Clock:
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
    clock = Clock(device)
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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
