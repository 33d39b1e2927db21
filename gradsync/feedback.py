"""Error feedback: what each compression point remembers of what compression lost.

One Feedback object per compression point (per DDP bucket). A step with feedback is:

    p = fb.prepare(g, n)               # what to compress, from this rank's share g / n
    ... compress p, exchange, decode ...
    out = fb.update(g, p, local, total, remove_local_)

or, where the codec fuses feedback (Compressor.fuses_feedback) and the form can defer:

    p, corrected = fb.defer(g, n)      # p's buffer, unwritten, and the formula for it
    ... the codec computes p as it encodes (compress_corrected), leaving p - decoded in p ...
    out = fb.update(g, p, local, total, remove_local_)   # remove_local_ from that exchange

where `local` is this rank's own decoded payload (a function, called only by forms that need
it), `remove_local_(t)` subtracts it from t in place and returns t (sparse codecs do so without
a dense temporary), and `total` the decoded sum over ranks, bit-identical on every rank.
`update` changes the memory and returns the gradient to apply; it may overwrite `p`, and a form
that declares reads_gradient False may find `g` overwritten by then (the hook decodes the sum
into it). The caller calls `update` only for steps whose compressed tensors were finite on every
rank (p, the memory included, not only g: in fp16 a finite g plus its memory can overflow), so
non-finite values never enter a memory, but for EF21's and EControl's estimates, sums that can
overflow in `update` itself: there the rank raises (_check_estimates). A point's steps run one
after the other.

`prepare` (and `defer`) may be given a non-finite `g` (the hook checks what prepare returns, or
leaves that to a codec whose payload shows it: Compressor.reveals_nonfinite), so it must leave
every memory as it was (but for creating a zero one where none was yet): it writes only spares,
and `update` alone changes state. Each memory's next value is written into its spare, which then
becomes the memory, the old memory the next spare: so `undo`, right after `update`, puts every
memory back as it was, for a step found skipped after all (another group's average was not
finite: the optimizer skips the whole step). `prepare` returns `g` itself
or a tensor that shares no memory with `g`. It divides by the world size n where that costs
nothing extra: residual feedback writes e + g / n straight into its spare
buffer and leaves `g` alone; the others divide `g` in place first (they read it in update).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch

from . import registry
from .compress.base import check_real, is_finite

Local = Callable[[], torch.Tensor]
RemoveLocal = Callable[[torch.Tensor], torch.Tensor]


class Corrected(NamedTuple):
    """A tensor given by how to compute it, base + alpha * g: residual error feedback's p, its
    memory `base` and this rank's share alpha = 1 / world size of the gradient `g`."""

    g: torch.Tensor
    base: torch.Tensor
    alpha: float


class Feedback:
    """No memory: the decoded average is the gradient.

    Public attributes are the state (state_dict); private ones are spare buffers, rebuilt on
    demand, never checkpointed or pickled.
    """

    _spares: dict[str, torch.Tensor] | None = None  # per memory, where its next value is written
    _kept: tuple[str, ...] = ()  # the memories the last update replaced, which undo() puts back

    uses_local: ClassVar[bool] = False  # whether update() calls `local` (or `remove_local_`)
    reads_gradient: ClassVar[bool] = False  # whether update() reads the values of `g`
    # Whether the memory holds back part of the update as such (residual feedback), so that
    # rescale() scales it and a later gradient takes it back; EF21's and EControl's mirrors do not.
    holds_back: ClassVar[bool] = False

    def prepare(self, g: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        return g.div_(world_size) if world_size != 1 else g

    def defer(self, g: torch.Tensor, world_size: int = 1) -> tuple[torch.Tensor, Corrected] | None:
        """prepare's p left for a codec that fuses feedback to compute as it encodes: the buffer p
        will be written into, and how (Compressor.compress_corrected). The codec leaves p - decoded
        there, which update then finds. None where this form cannot defer (all but residual)."""
        return None

    def update(
        self,
        g: torch.Tensor,
        p: torch.Tensor,
        local: Local,
        total: torch.Tensor,
        remove_local_: RemoveLocal | None = None,
    ) -> torch.Tensor:
        return total

    def undo(self) -> None:
        """Put every memory back as it was before the last update: the step is skipped after all.
        Only right after that update, before the next prepare (whose spares overwrite what the
        memories were)."""
        spares = self._spares or {}
        for name in self._kept or ():  # None once unpickled
            before = spares[name]
            spares[name] = getattr(self, name)
            setattr(self, name, before)
        self._kept = ()

    def held_back(self) -> torch.Tensor | None:
        """What compression held back of the gradient, in the gradient's units, where the memory
        holds it as such: adding it to a later gradient loses nothing (SyncState.use_plan carries
        it into a new plan's groups this way). None here: EF21's and EControl's mirrors estimate
        the gradient, they hold nothing back."""
        return None

    def rescale(self, ratio: float) -> None:
        """The learning rate changed by 1 / `ratio`: scale what the memory holds back so that it
        moves the parameters as far at the new rate (gradsync.learning_rate). Nothing here: only
        residual feedback's memory holds back part of the update as such (EF21's and EControl's
        mirrors estimate the gradient; EControl's own residual enters p damped by eta, and was
        left in gradient units, unmeasured)."""

    def rescale_units(self, ratio: float) -> None:
        """The gradients' units changed by `ratio` (AMP's loss scale, gradsync.loss_scale): every
        memory holds gradients in those units, so every one is scaled, mirrors and velocities
        included."""
        for value in self._state().values():
            if isinstance(value, torch.Tensor):
                value.mul_(ratio)

    def state_dict(self) -> dict[str, Any]:
        return {name: _copy(value) for name, value in self._state().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = set(self._state())
        if set(state) != expected:
            raise ValueError(
                f"{type(self).__name__} state has keys {sorted(state)}, expected {sorted(expected)}: "
                "the checkpoint was made with another error_feedback setting"
            )
        for name, value in state.items():
            setattr(self, name, _copy(value))
        self._kept = ()  # what the spares held belongs to the memories replaced

    def __getstate__(self) -> dict[str, Any]:
        # Spare buffers hold nothing worth keeping; pickled, they would double the state's size.
        return {name: None if name.startswith("_") else value for name, value in vars(self).items()}

    def _state(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self).items() if not name.startswith("_")}

    def _spare_for(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer the next value of memory `name` is written into (its previous value, where
        it can hold one like `like`). Once it is written, the memories can no longer be undone."""
        if self._spares is None:
            self._spares = {}
        self._kept = ()
        spare = self._spares[name] = _spare_like(self._spares.get(name), like)
        return spare

    def _keep(self, **new: torch.Tensor) -> None:
        """Each named memory becomes its new value (written into its _spare_for); the old one becomes
        the spare, which undo() swaps back."""
        assert self._spares is not None, "a new value is written into its spare first"
        for name, value in new.items():
            self._spares[name] = getattr(self, name)
            setattr(self, name, value)
        self._kept = tuple(new)

    def _memory(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The named memory, zero on first use and on the device of `like`."""
        value = getattr(self, name)
        if value is None:
            value = torch.zeros_like(like)
        elif value.shape != like.shape:
            raise ValueError(
                f"{type(self).__name__} memory {name!r} has shape {tuple(value.shape)} but the "
                f"gradient has {tuple(like.shape)}: the state belongs to another bucket layout"
            )
        elif value.device != like.device or value.dtype != like.dtype:
            value = value.to(like.device, like.dtype)
        setattr(self, name, value)
        return value


class NoFeedback(Feedback):
    """Sends C(g); the step is the mean of the decoded payloads."""


class ErrorFeedback(Feedback):
    """Residual error feedback (Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech
    2014; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019).

    p = g + e; send C(p); e <- p - decoded(C(p)). So g + e_old == decoded + e_new: nothing is lost,
    only delayed.

    p is written into the memory's spare and becomes the memory in update, where the old memory
    becomes the next spare: no full-size tensor is allocated per step (a fresh one of tens of
    MiB costs as much in page faults as a copy), and the memory stays untouched until update,
    so a step skipped as non-finite leaves no trace.
    """

    uses_local = True
    holds_back = True

    def __init__(self) -> None:
        self.error: torch.Tensor | None = None

    def prepare(self, g: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        error = self._memory("error", g)
        spare = self._spare_for("error", g)
        if world_size == 1:
            return torch.add(g, error, out=spare)
        return torch.add(error, g, alpha=1 / world_size, out=spare)  # one pass: e + g / n

    def defer(self, g: torch.Tensor, world_size: int = 1) -> tuple[torch.Tensor, Corrected] | None:
        if type(self).prepare is not ErrorFeedback.prepare:  # a subclass computes another p
            return None
        # The same p as prepare's (torch.add with alpha 1 adds exactly), in the same spare.
        return self._spare_for("error", g), Corrected(g, self._memory("error", g), 1 / world_size)

    def held_back(self) -> torch.Tensor | None:
        return self.error

    def rescale(self, ratio: float) -> None:
        if self.error is not None:
            self.error.mul_(ratio)

    def update(
        self,
        g: torch.Tensor,
        p: torch.Tensor,
        local: Local,
        total: torch.Tensor,
        remove_local_: RemoveLocal | None = None,
    ) -> torch.Tensor:
        self._keep(error=_residual(p, local, remove_local_))
        return total


class EF21(Feedback):
    """EF21 (Richtarik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically Better, and
    Practically Faster Error Feedback", NeurIPS 2021).

    Each rank keeps h_i and sends C(g_i - h_i); h_i <- h_i + decoded. Every rank mirrors the mean
    h = mean_i h_i by adding the decoded average, and the step uses h.
    """

    uses_local = True

    def __init__(self) -> None:
        self.h_local: torch.Tensor | None = None
        self.h_mean: torch.Tensor | None = None

    def prepare(self, g: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        if world_size != 1:
            g.div_(world_size)
        return g - self._memory("h_local", g)

    def update(
        self,
        g: torch.Tensor,
        p: torch.Tensor,
        local: Local,
        total: torch.Tensor,
        remove_local_: RemoveLocal | None = None,
    ) -> torch.Tensor:
        h_local = torch.add(self._memory("h_local", g), local(), out=self._spare_for("h_local", g))
        h_mean = torch.add(self._memory("h_mean", g), total, out=self._spare_for("h_mean", g))
        self._keep(h_local=h_local, h_mean=h_mean)
        _check_estimates(self, h_mean=h_mean, h_local=h_local)
        return h_mean.clone()  # the caller may hand the result to DDP, which can alias it


class EControl(Feedback):
    """EControl (Gao, Islamov, Stich, "EControl: Fast Distributed Optimization with Compression
    and Error Control", ICLR 2024).

    Delta_i = C(eta * e_i + g_i - h_i); e_i <- e_i + g_i - h_i - Delta_i; h_i <- h_i + Delta_i.
    The step is mean h before the update + mean Delta, i.e. the updated mean h. With eta = 0
    it is exactly EF21; theory sets eta on the order of delta / 400, and eta = delta works in
    practice, while large eta diverges.
    """

    uses_local = True
    reads_gradient = True

    def __init__(self, eta: float = 0.01) -> None:
        self.eta = check_real("eta", eta, 0, 1, "[]", "try the compressor's delta, e.g. 0.01")
        self.error: torch.Tensor | None = None
        self.h_local: torch.Tensor | None = None
        self.h_mean: torch.Tensor | None = None

    def prepare(self, g: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        if world_size != 1:
            g.div_(world_size)
        innovation = g - self._memory("h_local", g)
        return innovation.add_(self._memory("error", g), alpha=self.eta)

    def update(
        self,
        g: torch.Tensor,
        p: torch.Tensor,
        local: Local,
        total: torch.Tensor,
        remove_local_: RemoveLocal | None = None,
    ) -> torch.Tensor:
        delta = local()
        h_local = self._memory("h_local", g)
        error = torch.sub(g, h_local, out=self._spare_for("error", g))
        error = torch.add(self._memory("error", g), error, out=error).sub_(delta)  # e + (g - h) - delta
        h_local = torch.add(h_local, delta, out=self._spare_for("h_local", g))
        h_mean = torch.add(self._memory("h_mean", g), total, out=self._spare_for("h_mean", g))
        self._keep(error=error, h_local=h_local, h_mean=h_mean)
        _check_estimates(self, h_mean=h_mean, h_local=h_local, error=error)
        return h_mean.clone()


class MomentumCorrection(ErrorFeedback):
    """Error feedback on the momentum's velocity, not the gradient: DGC's momentum correction (Lin
    et al., "Deep Gradient Compression", ICLR 2018), under the user's own momentum optimizer.

    Per rank, with this rank's share g / n and `momentum` beta:
        u <- beta u + g / n           the velocity, as the optimizer would build it
        p  = e + u                    accumulated; what the codec compresses
        e <- p - decoded(C(p))        what was not sent waits, as in residual feedback
    The sum over ranks, D, is the step's update direction, as DGC applies it. The optimizer gets
    D - beta * D_prev: SGD with momentum beta then holds exactly D in its momentum buffer (its old
    buffer from before compression fades as beta^t), so the user's optimizer steps as usual.

    Sparsifiers pick the coordinates whose accumulated velocity is largest, and an entry's delayed
    contribution arrives as momentum would have applied it. Without compression the correction
    cancels out: u_t - beta u_{t-1} is the gradient, exactly. With `momentum=0` it is residual
    feedback. Set `momentum` to the optimizer's (SGD's momentum=); under other optimizers it still
    feeds back error, in the velocity's terms.
    """

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()  # e, the residual memory
        self.momentum = check_real("momentum", momentum, 0, 1, "[)", "your optimizer's, e.g. 0.9")
        self.velocity: torch.Tensor | None = None  # u
        self.applied: torch.Tensor | None = None  # D_prev: what the optimizer's buffer holds

    def prepare(self, g: torch.Tensor, world_size: int = 1) -> torch.Tensor:
        # Written into spares: the memories stay untouched until update, so a skipped step leaves
        # no trace.
        velocity = self._spare_for("velocity", g)
        torch.add(g, self._memory("velocity", g), alpha=self.momentum * world_size, out=velocity)
        if world_size != 1:
            velocity.div_(world_size)  # beta u + g / n, from (g + n beta u) / n
        return torch.add(self._memory("error", g), velocity, out=self._spare_for("error", g))

    def held_back(self) -> torch.Tensor | None:
        # e is velocity held back: added to a gradient, SGD's momentum would apply it 1 / (1 -
        # beta) times over. Not carried.
        return None

    def update(
        self,
        g: torch.Tensor,
        p: torch.Tensor,
        local: Local,
        total: torch.Tensor,
        remove_local_: RemoveLocal | None = None,
    ) -> torch.Tensor:
        velocity = self._spares["velocity"]  # type: ignore[index]  # beta u + g / n, from prepare
        previous = self._memory("applied", total)
        applied = self._spare_for("applied", total).copy_(total)
        # e <- p - decoded, as residual feedback
        self._keep(error=_residual(p, local, remove_local_), velocity=velocity, applied=applied)
        return total.sub_(previous, alpha=self.momentum)  # D - beta * D_prev, in the decoded sum


REGISTRY: dict[str, type[Feedback]] = {
    "none": NoFeedback,
    "ef": ErrorFeedback,
    "ef21": EF21,
    "econtrol": EControl,
    "momentum": MomentumCorrection,
}


def names() -> list[str]:
    return list(REGISTRY)


def build(name: str, **params: Any) -> Feedback:
    """Construct the error-feedback form registered as `name` (errors as compress.build)."""
    return registry.construct(REGISTRY, "error_feedback", name, params)


def _check_estimates(form: Feedback, **memories: torch.Tensor) -> None:
    """FloatingPointError where a memory updated from a finite step is not finite: EF21's and
    EControl's estimates of the gradient are sums, which can pass a narrow dtype's range (fp16's
    65504) where the gradient did not. An inf kept there would make every later step non-finite
    (under a GradScaler, every step skipped), so the rank stops and says so instead. The mean
    estimate comes first: it has the same bits on every rank, so where it overflows every rank
    stops at once; a rank's own memories can overflow on that rank alone, whose peers then fail
    at their next exchange (docs/failures.md)."""
    for name, memory in memories.items():
        if is_finite(memory):
            continue
        if memory.dtype == torch.float16:
            fix = (
                "keep the gradients in float32 or bfloat16 (autocast trains an fp16 model with "
                "float32 gradients), or use error_feedback='ef', whose memory is checked before it is sent"
            )
        else:
            fix = "the training diverged: lower the learning rate, or use error_feedback='ef'"
        raise FloatingPointError(
            f"gradsync: {type(form).__name__}'s memory {name!r} is no longer finite: its estimate of "
            f"the gradient passed {memory.dtype}'s largest value, {torch.finfo(memory.dtype).max:g}; {fix}"
        )


def _residual(p: torch.Tensor, local: Local, remove_local_: RemoveLocal | None) -> torch.Tensor:
    """p - decoded, computed in p (a memory's spare, from prepare): the same bits as p - local(),
    without a full-size tensor; sparse codecs touch only the entries they sent. After defer the
    codec left it there already, and the exchange's remove_local_ says so."""
    return remove_local_(p) if remove_local_ is not None else p.sub_(local())


def _spare_like(spare: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`spare` if it can hold a tensor like `like`, else a fresh one."""
    if spare is None or spare.shape != like.shape or spare.dtype != like.dtype or spare.device != like.device:
        return torch.empty_like(like)
    return spare


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
