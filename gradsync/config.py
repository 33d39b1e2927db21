"""SyncConfig: what the hook does, validated when it is made."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from . import compress, feedback, sparse
from .compress.base import check_int

_SEED_BOUND = 2**63 - 1
NO_COMPRESSION = "none"


@dataclass(frozen=True)
class SyncConfig:
    """Configuration of gradsync's DDP hook; the same on every rank.

    Example:
        >>> cfg = SyncConfig(compressor="topk", compressor_args={"ratio": 0.01},
        ...                  error_feedback="ef", warmup_steps=10)
    """

    # Compressor name from gradsync.compress.names() and its parameters (see `gradsync list`), or
    # "none": no compression, every bucket exchanged as it is (sparse tensors by sparse_scheme).
    compressor: str = "topk"
    compressor_args: Mapping[str, Any] = field(default_factory=dict)
    # Error feedback: "none", "ef" (residual), "ef21" or "econtrol"; and its parameters
    # (econtrol: {"eta": float}). "auto": "ef" for codecs that need it (biased ones such as
    # top-k), "none" for the others (casts, unbiased codecs, DGC, the majority vote).
    error_feedback: str = "auto"
    error_feedback_args: Mapping[str, Any] = field(default_factory=dict)
    # Steps of plain fp32 allreduce before compressing; >= 2, since DDP rebuilds its buckets
    # after the first step and compression state is kept per bucket.
    warmup_steps: int = 10
    # Buckets with fewer elements go uncompressed (fp32 allreduce): for them latency, not
    # bandwidth, dominates, and compressing only costs time.
    min_compress_numel: int = 16384
    # Root of every random stream: shared streams (randk, powersgd) are seeded per bucket,
    # local ones (qsgd, terngrad, natural, dgc, sampled topk) per bucket and rank.
    seed: int = 0
    # How sparse data is exchanged (gradsync.sparse): sparse gradients (nn.Embedding(sparse=True)),
    # the payloads of sparsifying compressors (topk, dgc, threshold) and uncompressed buckets.
    # "auto": per tensor, the scheme of least predicted time from measured density, overlap and
    # densification; or one of "dense", "agsparse", "balanced", "hierarchical" for every tensor.
    sparse_scheme: str = "auto"
    # Steps between two measurements of a tensor by the "auto" selector.
    sparse_every: int = 100

    def __post_init__(self) -> None:
        if "seed" in self.compressor_args:
            raise ValueError(
                f"compressor_args sets seed={self.compressor_args['seed']!r}; set SyncConfig(seed=...) "
                "instead: gradsync derives each bucket's seed from it so that ranks agree"
            )
        # Frozen copies, so that a config cannot change after it was validated.
        object.__setattr__(self, "compressor_args", ReadOnlyDict(self.compressor_args))
        object.__setattr__(self, "error_feedback_args", ReadOnlyDict(self.error_feedback_args))
        if self.compressor == NO_COMPRESSION:
            self._check_uncompressed()
        else:
            codec = compress.build(self.compressor, **self.compressor_args)
            self._check_feedback(type(codec))
            feedback.build(self.feedback_name, **self.error_feedback_args)
        check_int("warmup_steps", self.warmup_steps, 2, why="DDP rebuilds its buckets after the first step")
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
        if self.error_feedback != "auto" or self.compressor == NO_COMPRESSION:
            return "none" if self.compressor == NO_COMPRESSION else self.error_feedback
        return "ef" if compress.lookup(self.compressor).needs_feedback else "none"

    def build_compressor(self, seed: int) -> compress.Compressor:
        """A fresh compressor; `seed` goes to those that draw random numbers."""
        args = dict(self.compressor_args)
        if "seed" in compress.parameters(self.compressor):
            args["seed"] = seed
        return compress.build(self.compressor, **args)

    def build_feedback(self) -> feedback.Feedback:
        return feedback.build(self.feedback_name, **self.error_feedback_args)

    def _check_uncompressed(self) -> None:
        if self.compressor_args:
            raise ValueError(
                f"compressor_args={dict(self.compressor_args)} given with compressor='none', which takes "
                "none; drop them or name a compressor"
            )
        if self.error_feedback not in ("auto", "none") or self.error_feedback_args:
            raise ValueError(
                f"error_feedback={self.error_feedback!r} given with compressor='none': nothing is lost "
                "without compression, so there is no error to feed back; leave it at 'auto'"
            )

    def _check_feedback(self, codec: type[compress.Compressor]) -> None:
        form = self.error_feedback
        if form == "auto" and self.error_feedback_args:
            raise ValueError(
                f"error_feedback_args={dict(self.error_feedback_args)} given with error_feedback='auto'; "
                "name the form they belong to, e.g. error_feedback='econtrol'"
            )
        if form in ("auto", "none"):
            if form == "none" and codec.needs_feedback:
                warnings.warn(
                    f"compressor {self.compressor!r} is biased and error_feedback='none': what it drops "
                    "is lost for good, which usually costs accuracy; use error_feedback='ef'",
                    stacklevel=4,
                )
            return
        if codec.owns_memory:
            raise ValueError(
                f"compressor {self.compressor!r} keeps its own error memory, so error_feedback="
                f"{form!r} would count what it holds back twice; use error_feedback='none' or 'auto'"
            )
        if codec.majority_vote:
            raise ValueError(
                f"compressor {self.compressor!r} combines ranks by majority vote, a unit step per "
                f"element rather than an estimate of the gradient, so error_feedback={form!r} does "
                "not apply; use error_feedback='none' or 'auto'"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: dict(value) if isinstance(value, Mapping) else value
            for f in fields(self)
            for value in [getattr(self, f.name)]
        }

    def fingerprint(self) -> str:
        """Canonical text of the config: equal on two ranks exactly when their configs are."""
        return json.dumps(self.to_dict(), sort_keys=True, default=repr)


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
