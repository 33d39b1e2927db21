"""The contract every compressor follows, and the checks their constructors share."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

log = logging.getLogger("gradsync")

Payload = tuple[torch.Tensor, ...]


class Compressor:
    """Turns a tensor into a packed payload and back; never talks to the network.

    `compress(x) -> (payload, ctx)`: `payload` is a tuple of tensors, exactly the bytes that cross
    the wire; `ctx` stays local and holds only what every rank knows without communicating (shape,
    dtype, a support drawn from a shared seed). So any rank can decode any rank's payload with its
    own ctx, and all ranks decode identically. A payload may live in a buffer the codec reuses:
    it stays valid until the codec's next compress.

    Capabilities are declared on the class and callers branch on them:
      summable   payloads of different ranks may be summed elementwise (allreduce), and
                 decompress(sum of payloads) == sum of decompress(payload).
      unbiased   E[decompress(compress(x))] == x.
      fixed_size payload shapes depend only on x.numel() (and, for codecs that warm up, on the
                 step, which every rank shares), so no sizes need exchanging.
      randomness "none"; "shared": the same stream on every rank (the hook seeds it identically);
                 "local": an independent stream per rank.
      rounds     > 1: a multi-round summable protocol (PowerSGD) driven by the exchange layer
                 through begin / next_round / finish instead of one compress.
      needs_feedback  biased and lossy enough that, without error feedback, what it drops is lost
                 for good (top-k, sign, ...); casts and unbiased codecs are not.
      owns_memory  keeps what it did not send in its own state (DGC's accumulator): the hook's
                 error feedback would count it twice, so it must be "none".
      sparse_rows  the payload is (encoded indices, values) as made by compress.sparse's
                 sparse_payload: entries of the tensor, which gradsync.sparse can exchange as
                 rows of width 1 by any of its schemes (top-k, DGC, threshold).
      preserves_nonfinite  a NaN or inf in the input is one in the payload too, in its place, and
                 the codec keeps no state: a non-finite step needs no check of its own (casts).
      reveals_nonfinite  a NaN or inf in the input makes the payload non-finite (a cast's entry,
                 absmax's block scale), and the codec keeps no state: the exchange, which checks
                 every payload or sum it decodes, finds such a step, so the hook does not read
                 the input a second time to look for one.
      fuses_feedback  compress_corrected encodes base + alpha * g and leaves what it lost in
                 the caller's buffer in one pass: residual error feedback's add, encode and
                 residual, otherwise three full-size passes (absmax's int8 and int4). Requires
                 reveals_nonfinite (checked as the class is made).
      uses_shapes  the hook tells it the shapes of the tensors a group holds, in buffer order
                 (use_shapes), and it compresses each by its own shape: PowerSGD approximates
                 each weight as its own matrix.
      warms_up   its payload follows a schedule over its compressed steps, which it counts in
                 `steps` (public and checkpointed; the WarmsUp mixin): a sparsifier sends more
                 entries over its first `sparsity_warmup_steps` (DGC's warm-up), PowerSGD
                 approximates at higher ranks over its first `rank_warmup_steps`. The hook sets
                 `steps` on a codec it makes mid-run (a new plan), so the schedule follows
                 training, not the codec's age; payload_bytes is the next payload's size.
      majority_vote  the payload is one sign bit per element, and ranks combine by majority
                 vote, sign(sum of signs), instead of a sum (signSGD, Signum). The result is a
                 unit step per element, not an estimate of the gradient, so error feedback
                 does not apply either.

    payload_bytes(numel) is exact for fixed-size codecs; for the others (threshold) it is the
    largest payload.
    """

    summable: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    randomness: ClassVar[str] = "none"
    rounds: ClassVar[int] = 1
    needs_feedback: ClassVar[bool] = False
    owns_memory: ClassVar[bool] = False
    majority_vote: ClassVar[bool] = False
    sparse_rows: ClassVar[bool] = False
    preserves_nonfinite: ClassVar[bool] = False
    reveals_nonfinite: ClassVar[bool] = False
    fuses_feedback: ClassVar[bool] = False
    uses_shapes: ClassVar[bool] = False
    warms_up: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A fused encode computes what it compresses as it goes, so only its payload can show a
        # NaN or inf there: neither the hook nor a two-shot owner looks again before the memory
        # keeps it. Checked where the class is written, for codecs added to REGISTRY too.
        if cls.fuses_feedback and not cls.reveals_nonfinite:
            raise TypeError(
                f"{cls.__name__} declares fuses_feedback but not reveals_nonfinite: a fused encode "
                "must make its payload non-finite wherever its input is, or an inf would enter the "
                "error memory unseen; declare reveals_nonfinite (and test it), or drop fuses_feedback"
            )

    def compress(self, x: torch.Tensor) -> tuple[Payload, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement compress")

    def compress_mean(self, x: torch.Tensor, world_size: int) -> tuple[Payload, Any]:
        """compress(x / world_size): this rank's share of the average, where nothing else is added
        to it. `x` may be left divided; its values are the caller's to overwrite. Casts fuse the
        division into their one pass."""
        return self.compress(x.div_(world_size) if world_size != 1 else x)

    def compress_corrected(
        self, g: torch.Tensor, base: torch.Tensor, alpha: float, out: torch.Tensor
    ) -> tuple[Payload, Any]:
        """compress(p) for p = base + alpha * g, computed into `out` (shaped like g; it may be g
        itself), which is left holding p - decompress(payload): what residual error feedback keeps
        (base its memory, alpha 1 / world size). Only codecs that declare fuses_feedback have it."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse error feedback (fuses_feedback)")

    def use_shapes(self, shapes: Sequence[Sequence[int]]) -> None:
        """The shapes of the tensors every input holds, flattened end to end; only codecs that
        declare uses_shapes take them."""
        raise NotImplementedError(f"{type(self).__name__} compresses flat inputs (uses_shapes)")

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement decompress")

    def decompress_into(self, out: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        """decompress(payload, ctx) written into `out` (its shape and dtype) and returned; casts
        override it to skip the fresh full-size tensor (a fresh tensor of tens of MiB costs as much
        in page faults as a copy)."""
        out.view(-1).copy_(self.decompress(payload, ctx).view(-1))
        return out

    def add_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        """out += decompress(payload, ctx); sparse codecs override it to skip the dense temporary."""
        out += self.decompress(payload, ctx)

    def sum_decoded_(self, out: torch.Tensor, payloads: Sequence[Payload], ctx: Any) -> None:
        """out = the sum of `payloads` decoded (each compressed from a tensor shaped as `ctx`
        says), added in their order to a zero: an allgather's total, a two-shot owner's sum of its
        shard. Quantizers override it to decode and add every payload in one pass over `out`."""
        out.zero_()
        for payload in payloads:
            self.add_decoded_(out, payload, ctx)

    def sub_decoded_(self, out: torch.Tensor, payload: Payload, ctx: Any) -> None:
        """out -= decompress(payload, ctx), bit for bit, where `out` has the compressed tensor's
        dtype; sparse codecs override it to touch only the entries they sent. Error feedback
        takes its residual this way, in place."""
        out -= self.decompress(payload, ctx)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the payload for an fp32 tensor of `numel` elements (sum of its nbytes); the
        largest payload where the size depends on the data (fixed_size False)."""
        raise NotImplementedError(f"{type(self).__name__} must implement payload_bytes")

    def undo(self) -> None:
        """Undo what the last compress changed in this codec's state (momentum, accumulator).

        The hook calls it when the exchange finds the step non-finite on some rank, so that a
        skipped step leaves no trace, as it leaves none in error-feedback memories. Random
        streams are not rewound: every rank compressed, so they stay in step anyway.
        """

    def rescale_units(self, ratio: float) -> None:
        """The gradients' units changed by `ratio` (AMP's loss scale): scale whatever state holds
        gradients in them (momentum, an accumulator). Nothing here; PowerSGD's warm-start Q is
        orthogonalized before it is used, so its scale does not matter."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the exact same sequence of payloads after a restart."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


class SeededCompressor(Compressor):
    """A compressor that draws random numbers from its own seeded torch.Generator.

    The generator is created on the device of the first input, so CPU and GPU runs each keep one
    stream; its state is part of state_dict so a resumed run draws the same numbers.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        self._generator: torch.Generator | None = None
        self._pending_state: torch.Tensor | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
            pending, self._pending_state = self._pending_state, None
            if pending is not None:
                try:
                    self._generator.set_state(pending)
                except RuntimeError:
                    # Saved by a generator of another kind (a GPU's Philox state is 16 bytes, the
                    # CPU's Mersenne Twister 5056): no stream of this device continues it. Every
                    # rank meets this alike, so a stream that ranks share stays shared.
                    log.warning(
                        "gradsync: %s's saved random stream (%d bytes) is not one a %s generator "
                        "keeps: it draws afresh from its seed (%d), as a new run would",
                        *(type(self).__name__, pending.numel(), device.type, self.seed),
                    )
        return self._generator

    def state_dict(self) -> dict[str, Any]:
        if self._generator is None:
            return {"generator": self._pending_state}
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._generator = None
        pending = state.get("generator")
        # A generator's state is a CPU byte tensor whatever its device; a checkpoint's tensors
        # are loaded onto the model's device (checkpoint.onto).
        self._pending_state = pending.cpu() if pending is not None else None


# A count of compressed steps that every warm-up has ended by: where a codec made to run as after
# its warm-up stands (plans, profiles, plan="auto"'s candidates, DiLoCo's outer gradients, and a
# checkpoint from before a codec had a warm-up).
PAST_WARMUP = sys.maxsize


class WarmsUp:
    """The step count of a codec whose payload follows a schedule over its compressed steps
    (Compressor.warms_up): `steps`, public and checkpointed, taken back with a skipped step.

    Mixed in before the codec's base class. The codec gives the schedule (SparsityWarmup.density,
    PowerSGD.rank_at), reads it at `steps` and calls count_step once per compressed step.
    """

    warms_up: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0  # compressed steps so far: the position in the schedule
        self._counted = False  # whether the last step's count may still be undone

    def count_step(self) -> None:
        self.steps += 1
        self._counted = True

    def undo(self) -> None:
        super().undo()  # type: ignore[misc]
        if self._counted:
            self.steps -= 1
            self._counted = False

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": self.steps}  # type: ignore[misc]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "steps"})  # type: ignore[misc]
        self.steps = state.get("steps", PAST_WARMUP)
        self._counted = False


class Undoable:
    """A state tensor kept in two buffers: an update reads one and writes the other, so the last
    update can be undone by swapping back. It costs a second buffer, not a copy per step."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # named in errors
        self.current: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None
        self._can_undo = False

    def update(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(old, new): the current value (zeros at first) and a buffer for the next one; the
        caller writes new out of place, and `new` becomes current."""
        old = self.current
        if old is None:
            old = torch.zeros_like(like)
        elif old.shape != like.shape:
            raise ValueError(
                f"{self.owner} state has {old.numel()} elements but the tensor has {like.numel()}: "
                "the state belongs to a tensor of another size"
            )
        elif old.device != like.device or old.dtype != like.dtype:
            old = old.to(like.device, like.dtype)
        new = self._spare
        if new is None or new.shape != old.shape or new.device != old.device or new.dtype != old.dtype:
            new = torch.empty_like(old)
        self.current, self._spare, self._can_undo = new, old, True
        return old, new

    def undo(self) -> bool:
        """Swap back to the value before the last update; False if there is none to go back to."""
        if not self._can_undo:
            return False
        self.current, self._spare, self._can_undo = self._spare, self.current, False
        return True

    def state(self) -> torch.Tensor | None:
        return None if self.current is None else self.current.clone()

    def scale(self, ratio: float) -> None:
        """Scale the current value in place (its units changed)."""
        if self.current is not None:
            self.current.mul_(ratio)

    def load(self, value: torch.Tensor | None) -> None:
        # A copy: the buffers are written in place, and the state dict may be loaded again.
        self.current = None if value is None else value.clone()
        self._spare, self._can_undo = None, False


def flat_float32(x: torch.Tensor) -> torch.Tensor:
    """x flattened, as float32: a copy only where x is not float32 already."""
    flat = x.reshape(-1)
    return flat if flat.dtype == torch.float32 else flat.float()


def shape_ctx(x: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return x.shape, x.dtype


def count_for(numel: int, ratio: float) -> int:
    """Elements kept at `ratio`: round(ratio * numel), at least 1 and at most numel.

    Rounding (not ceil) keeps 0.01 * 100 == 1 although the product is 1.0000000000000002.
    """
    if numel == 0:
        return 0
    return min(numel, max(1, int(numel * ratio + 0.5)))


def check_fraction(name: str, value: Any) -> float:
    """`value` as a float if it is a number in (0, 1] (a string is told to be a number)."""
    return check_real(name, value, 0.0, 1.0, "(]", "pass a fraction such as 0.01")


def check_int(name: str, value: Any, lo: int, hi: int | float = math.inf, why: str = "") -> int:
    """`value` if it is an integer in [lo, hi]; else ValueError naming it, the range and `why`."""
    reason = f": {why}" if why else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer in [{lo}, {hi}]{reason}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range [{lo}, {hi}]{reason}")
    return value


def check_real(name: str, value: Any, lo: float, hi: float, closed: str = "[)", hint: str = "") -> float:
    """`value` as a float if it is a real number in the interval from lo to hi, whose ends are
    included or not as `closed` says ("[)", "(]", "()", "[]"); else ValueError naming the value,
    the interval and `hint`."""
    interval = f"{closed[0]}{lo:g}, {hi:g}{closed[1]}"
    reason = f"; {hint}" if hint else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be a number in {interval}{reason}")
    above = value >= lo if closed[0] == "[" else value > lo
    below = value <= hi if closed[1] == "]" else value < hi
    if not (above and below):
        raise ValueError(f"{name}={value!r} is out of range {interval}{reason}")
    return float(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}")
    return value


def check_corrected(g: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> None:
    """Refuse compress_corrected's tensors where one pass cannot read g and base and write out."""
    if not g.shape == base.shape == out.shape:
        raise ValueError(
            f"compress_corrected: g {tuple(g.shape)}, base {tuple(base.shape)} and out {tuple(out.shape)} "
            "differ in shape; pass the gradient, its error memory and a buffer of one shape"
        )
    if overlaps(base, out) or (overlaps(g, out) and g.data_ptr() != out.data_ptr()):
        raise ValueError(
            "compress_corrected: out overlaps base, or part of g; out may be g itself or a buffer of "
            "its own, never the memory being read"
        )


def is_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite: one reduction pass instead of an isfinite() mask; a
    sum that overflows is checked exactly."""
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of `a` and `b` intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_end = a.data_ptr() + a.numel() * a.element_size()  # contiguous spans, as the codecs take them
    return a.data_ptr() < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < a_end
