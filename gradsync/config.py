"""SyncConfig: what the hook does, validated when it is made."""

from __future__ import annotations

import difflib
import inspect
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from . import compress, feedback, registry, sparse
from .compress.base import check_int
from .strategy import NONE as NO_COMPRESSION
from .strategy import Strategy

_SEED_BOUND = 2**63 - 1
AUTO_PLAN = "auto"  # SyncConfig(plan="auto"): gradsync makes the plan itself (gradsync.tuner)
AUTO_CASTS = ("fp16", "bf16")  # the codecs plan="auto" may choose whatever the compressor


class PlanLike(Protocol):
    """What the runtime reads of a plan (gradsync.plan.Plan): its groups' parameters and
    strategies, and its dict for a checkpoint. The runtime never imports the plans layer."""

    @property
    def groups(self) -> Sequence[Any]: ...

    @property
    def strategies(self) -> list[Strategy]: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class SyncConfig:
    """Configuration of gradsync's DDP hook; the same on every rank.

    Example:
        >>> cfg = SyncConfig(compressor="topk", compressor_args={"ratio": 0.01},
        ...                  error_feedback="ef", warmup_steps=2)
    """

    # Compressor name from gradsync.compress.names() and its parameters (see `gradsync list`), or
    # "none": no compression, every bucket exchanged as it is (sparse tensors by sparse_scheme).
    # Not used to compress when `plan` is a plan (its groups' strategies name their codecs); with
    # plan="auto" it is the codec the planner may choose besides fp16 and bf16. The default, int4
    # (4-bit blockwise quantization, error feedback, two-shot exchange: 2 (n-1)/n x 4.25 bits per
    # element on each rank's links, against DDP's 2 (n-1)/n x 32), followed DDP's held-out loss
    # curve step for step where top-k at 1% fell behind (docs/compressors.md).
    compressor: str = "int4"
    compressor_args: Mapping[str, Any] = field(default_factory=dict)
    # Error feedback: "none", "ef" (residual), "ef21", "econtrol" or "momentum" (DGC's momentum
    # correction under your momentum SGD: set {"momentum": your optimizer's}); and its parameters
    # (econtrol: {"eta": float}). "auto": "ef" for codecs that need it (biased ones such as
    # top-k), "none" for the others (casts, unbiased codecs, DGC, the majority vote). With a plan,
    # "auto" is resolved per group for the group's codec, and an explicit form applies to every
    # compressed group (each group's codec must accept it).
    error_feedback: str = "auto"
    error_feedback_args: Mapping[str, Any] = field(default_factory=dict)
    # Steps of plain fp32 allreduce before compressing. The DDP hook needs >= 2 (register() checks),
    # since DDP rebuilds its buckets after the first step and compression state is kept per
    # bucket; gradsync.DiLoCo's outer syncs may compress from the first (0). The default is that
    # least: on mlp-wide and gpt-tiny (three seeds) compressing from step 2 ended as close to
    # DDP's held-out loss as after 10 fp32 steps, which cost 6 to 9% of the time to it
    # (docs/compressors.md). Codecs that need a gentler start ramp up themselves (top-k's
    # sparsity and PowerSGD's rank warm-ups).
    warmup_steps: int = 2
    # Buckets with fewer elements go uncompressed (fp32 allreduce): for them latency, not
    # bandwidth, dominates, and compressing only costs time. Not applied to a plan's groups: the
    # plan decided which to compress.
    min_compress_numel: int = 16384
    # Root of every random stream: shared streams (randk, powersgd) are seeded per bucket,
    # local ones (qsgd, terngrad, natural, dgc, sampled topk) per bucket and rank.
    seed: int = 0
    # How sparse data is exchanged (gradsync.sparse): sparse gradients (nn.Embedding(sparse=True)),
    # the payloads of sparsifying compressors (topk, dgc, threshold) and uncompressed buckets.
    # "auto": per tensor, the scheme of least predicted time from measured density, overlap and
    # densification; or one of "dense", "agsparse", "balanced", "recursive-doubling" for every tensor.
    sparse_scheme: str = "auto"
    # Steps between two measurements of a tensor by the "auto" selector.
    sparse_every: int = 100
    # Per-group strategies (gradsync.plan.Plan): from the first compressed step on, the hook cuts
    # the gradients into the plan's groups and exchanges each by its own strategy (codec,
    # collective, sparse scheme); warm-up steps stay uncompressed on DDP's buckets. A Plan, the
    # path of a plan file, a plan's dict as to_dict() writes it (both read and checked by
    # register(), before training), or "auto" (gradsync makes the plan in the first steps). None:
    # `compressor` on every DDP bucket. Not hashed: a plan holds dicts.
    plan: PlanLike | Mapping[str, Any] | str | os.PathLike | None = field(default=None, hash=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> SyncConfig:
        # Python's own error for a misspelt field names it but not the fields there are. (Here,
        # not around __init__: a wrapper would shift the caller's line that warnings point at.)
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
            hints = "".join(
                f"; {name!r}: did you mean {match[0]!r}?" for name, match in close.items() if match
            )
            raise TypeError(f"SyncConfig got unknown field(s) {unknown}{hints} (its fields: {known})")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in ("compressor_args", "error_feedback_args"):
            value = getattr(self, name)
            if value is None:  # as DiLoCo takes it: no arguments
                object.__setattr__(self, name, {})
            elif not isinstance(value, Mapping):
                raise TypeError(f"{name}={value!r} must be a mapping of argument names to values, e.g. {{}}")
        if "seed" in self.compressor_args:
            raise ValueError(
                f"compressor_args sets seed={self.compressor_args['seed']!r}; set SyncConfig(seed=...) "
                "instead: gradsync derives each bucket's seed from it so that ranks agree"
            )
        # Frozen copies, so that a config cannot change after it was validated; a whole number
        # given for a parameter annotated as a float is kept as that float, so that ranks given
        # ratio=1 and ratio=1.0 (or DGC's clip_norm=1 and 1.0) have one fingerprint.
        given = dict(self.compressor_args)  # as the user wrote them, for the errors below
        codec = compress.lookup(self.compressor) if self.compressor in compress.names() else None
        form = feedback.REGISTRY.get(self.error_feedback)
        object.__setattr__(self, "compressor_args", ReadOnlyDict(_as_floats(given, codec)))
        object.__setattr__(
            self, "error_feedback_args", ReadOnlyDict(_as_floats(self.error_feedback_args, form))
        )
        object.__setattr__(self, "plan", _plan_value(self.plan))
        if self.compressor == NO_COMPRESSION:
            if self.compressor_args:
                raise ValueError(
                    f"compressor_args={dict(self.compressor_args)} given with compressor='none', which "
                    "takes none; drop them or name a compressor"
                )
        else:
            # Built even where a plan decides the codecs: a misspelt compressor should not pass.
            compress.build(self.compressor, **given)
        if self.plan is None and self.compressor == NO_COMPRESSION:
            self._check_nothing_compressed()
        elif self.planned and not self._codecs() and self.error_feedback not in ("auto", "none"):
            warnings.warn(
                f"error_feedback={self.error_feedback!r} has no effect: the plan compresses no group",
                stacklevel=3,
            )
        for name in self._codecs():
            self._check_feedback(name)
            feedback.build(self.feedback_for(name), **self.error_feedback_args)
        check_int("warmup_steps", self.warmup_steps, 0, why="a count of steps")
        check_int("min_compress_numel", self.min_compress_numel, 0, why="a count of elements")
        check_int("seed", self.seed, 0, _SEED_BOUND, why="a non-negative integer")
        schemes = ("auto", *sparse.names())
        if self.sparse_scheme not in schemes:
            raise ValueError(
                f"sparse_scheme={self.sparse_scheme!r} is not a sparse scheme; choose one of "
                f"{', '.join(schemes)} ('auto' lets gradsync pick per tensor)"
            )
        check_int("sparse_every", self.sparse_every, 1, why="steps between the selector's measurements")

    @property
    def feedback_name(self) -> str:
        """The error-feedback form in use: error_feedback, with "auto" resolved for the codec."""
        return self.feedback_for(self.compressor)

    def feedback_for(self, codec: str) -> str:
        """The error-feedback form for the codec named `codec` ("none": uncompressed): error_feedback,
        with "auto" resolved for that codec."""
        if codec == NO_COMPRESSION:
            return "none"
        if self.error_feedback != "auto":
            return self.error_feedback
        return "ef" if compress.lookup(codec).needs_feedback else "none"

    def build_compressor(self, seed: int) -> compress.Compressor:
        """A fresh compressor; `seed` goes to those that draw random numbers."""
        return build_codec(self.compressor, self.compressor_args, seed)

    def build_feedback(self, codec: str | None = None) -> feedback.Feedback:
        """A fresh error-feedback form for the codec named `codec` (default: `compressor`)."""
        return feedback.build(self.feedback_for(codec or self.compressor), **self.error_feedback_args)

    @property
    def planned(self) -> bool:
        """Whether `plan` holds a plan read already (not a file, a dict, "auto" or None)."""
        return hasattr(self.plan, "strategies")

    def _codecs(self) -> list[str]:
        """The codecs compression may use: a read plan's (each once, in group order); plan="auto"'s
        casts, which it may choose whatever the compressor, and the compressor; else the
        compressor (a plan still to be read is checked by register())."""
        if self.planned:
            return list(dict.fromkeys(s.codec for s in self.plan.strategies if s.compressed))  # type: ignore[union-attr]
        own = [] if self.compressor == NO_COMPRESSION else [self.compressor]
        if self.plan == AUTO_PLAN:
            return list(dict.fromkeys([*AUTO_CASTS, *own]))
        return own

    def _check_nothing_compressed(self) -> None:
        given = []
        if self.error_feedback not in ("auto", "none"):
            given.append(f"error_feedback={self.error_feedback!r}")
        if self.error_feedback_args:
            given.append(f"error_feedback_args={dict(self.error_feedback_args)}")
        if given:
            raise ValueError(
                f"{' and '.join(given)} given, but compressor='none': nothing is lost without "
                "compression, so there is no error to feed back; leave error_feedback at 'auto' and "
                "drop error_feedback_args"
            )

    def _check_feedback(self, name: str) -> None:
        """Refuse an error-feedback form the codec named `name` cannot take; warn where a biased
        codec goes without one."""
        codec, form = compress.lookup(name), self.error_feedback
        if form == "auto" and self.error_feedback_args:
            raise ValueError(
                f"error_feedback_args={dict(self.error_feedback_args)} given with error_feedback='auto'; "
                "name the form they belong to, e.g. error_feedback='econtrol'"
            )
        if form in ("auto", "none"):
            if form == "none" and codec.needs_feedback:
                warnings.warn(
                    f"compressor {name!r} is biased and error_feedback='none': what it drops "
                    "is lost for good, which usually costs accuracy; use error_feedback='ef'",
                    stacklevel=4,  # the caller of SyncConfig(...)
                )
            return
        if codec.owns_memory:
            raise ValueError(
                f"compressor {name!r} keeps its own error memory, so error_feedback="
                f"{form!r} would count what it holds back twice; use error_feedback='none' or 'auto'"
            )
        if codec.majority_vote:
            raise ValueError(
                f"compressor {name!r} combines ranks by majority vote, a unit step per "
                f"element rather than an estimate of the gradient, so error_feedback={form!r} does "
                "not apply; use error_feedback='none' or 'auto'"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data: mappings as dicts, a plan as its dict (a plan's path as a string);
        SyncConfig(**to_dict()) has the same fingerprint."""
        out = {
            f.name: dict(value) if isinstance(value, Mapping) else value
            for f in fields(self)
            for value in [getattr(self, f.name)]
        }
        if self.planned:
            out["plan"] = self.plan.to_dict()  # type: ignore[union-attr]
        elif isinstance(self.plan, os.PathLike):
            out["plan"] = os.fspath(self.plan)
        return out

    def fingerprint(self) -> str:
        """Canonical text of the config: equal on two ranks exactly when their configs are."""
        return json.dumps(self.to_dict(), sort_keys=True, default=repr)


# inspect.signature (help(), IDEs, config tools such as LightningCLI) reads a class's own __new__
# before its __init__: without this it would show (*args, **kwargs) instead of the fields.
_init = inspect.signature(SyncConfig.__init__)
SyncConfig.__signature__ = _init.replace(parameters=list(_init.parameters.values())[1:])  # type: ignore[attr-defined]


def require_config(config: object) -> SyncConfig:
    """`config` if it is a SyncConfig, else TypeError saying how to make one."""
    if isinstance(config, SyncConfig):
        return config
    fix = ": make one with gradsync.SyncConfig(**config)" if isinstance(config, Mapping) else ""
    raise TypeError(f"config must be a gradsync.SyncConfig, got {type(config).__name__}{fix}")


def _as_floats(args: Mapping[str, Any], cls: type | None) -> dict[str, Any]:
    """`args`, each int given for a parameter `cls` takes as a float made that float."""
    floats = registry.float_parameters(cls) if cls is not None else set()
    return {k: float(v) if type(v) is int and k in floats else v for k, v in args.items()}


def build_codec(name: str, args: Mapping[str, Any], seed: int) -> compress.Compressor:
    """A fresh compressor `name` with `args`; `seed` goes to those that draw random numbers."""
    args = dict(args)
    if "seed" in compress.parameters(name):
        args["seed"] = seed
    return compress.build(name, **args)


def _plan_value(value: Any) -> Any:
    """`value` as SyncConfig keeps it: None, "auto", a path, a read-only dict or a plan; or TypeError."""
    if (
        isinstance(value, str)
        and value != AUTO_PLAN
        and value.lower() == AUTO_PLAN
        and not os.path.exists(value)
    ):
        raise ValueError(f"plan={value!r} is no plan file here; did you mean plan={AUTO_PLAN!r}?")
    if value is None or isinstance(value, (str, os.PathLike)) or hasattr(value, "strategies"):
        return value
    if isinstance(value, Mapping):
        return ReadOnlyDict(value)
    raise TypeError(
        f"plan={value!r} is a {type(value).__name__}; give a gradsync.plan.Plan, the path of a plan "
        f"file (`gradsync plan` writes one), a plan's dict, or {AUTO_PLAN!r}"
    )


class ReadOnlyDict(dict):
    """A dict that refuses changes but pickles and copies like a dict."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("SyncConfig arguments are read-only; make a new config with dataclasses.replace")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (type(self), (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=repr))
