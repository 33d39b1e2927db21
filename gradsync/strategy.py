"""Strategy: how one group of gradients is exchanged, in the runtime's words.

A strategy is written `codec[:key=value...]`: the codec's own arguments, plus
  collective=allreduce|allgather|two-shot|two-level   how the ranks' payloads combine; by default
                      allreduce where payloads can be summed (casts, randk) or combine by a sum of
                      their own (PowerSGD's rounds, the sign vote), two-shot for the other dense
                      quantizers (int8, qsgd, ...: each shard's owner sums and re-encodes it),
                      allgather otherwise (the sparsifiers);
  scheme=auto|dense|agsparse|balanced|recursive-doubling   sparse rows go by this sparse scheme
                      (gradsync.sparse): a sparsifier's payload (topk, dgc, threshold), or the
                      embedding rows of an uncompressed group; "auto" lets the selector pick per
                      tensor. Without it, payloads go by the collective and uncompressed groups
                      in one allreduce;
  on=device|cpu       where the codec runs (cpu: offloaded to a CPU thread; planned, not run yet).
`none` is no compression: the group's fp32 gradients, allreduced. `fp16`, `topk:ratio=0.01`,
`topk:scheme=balanced`, `qsgd:collective=two-level` are others.

Plans (gradsync.plan) hold one strategy per group; the hook executes them; the simulator prices
them (gradsync.sim.phases).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from . import compress, registry, sparse

NONE = "none"  # the one spelling of "no compression"
COLLECTIVES = ("allreduce", "allgather", "two-shot", "two-level")
AUTO_SCHEME = "auto"
PLACES = ("device", "cpu")


@dataclass(frozen=True)
class Strategy:
    """One group's exchange: a codec with its arguments, a collective, a sparse scheme, a place."""

    codec: str = NONE
    args: tuple[tuple[str, Any], ...] = ()
    collective: str = "allreduce"
    scheme: str | None = None  # sparse rows by this scheme (or "auto"); None: by the collective
    on: str = "device"

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ValueError(
                f"strategy {self.text!r}: collective={self.collective!r} is not one of {COLLECTIVES}"
            )
        if self.on not in PLACES:
            raise ValueError(f"strategy {self.text!r}: on={self.on!r} is not one of {PLACES}")
        schemes = (AUTO_SCHEME, *sparse.names())
        if self.scheme is not None and self.scheme not in schemes:
            raise ValueError(f"strategy {self.text!r}: scheme={self.scheme!r} is not one of {schemes}")
        if not self.compressed:
            if self.args:
                raise ValueError(f"strategy {self.text!r}: 'none' takes no codec arguments")
            if self.collective in ("allgather", "two-shot"):
                raise ValueError(
                    f"strategy {self.text!r}: uncompressed gradients are summed, in one level or two; "
                    f"drop collective={self.collective}"
                )
            if self.on == "cpu":
                raise ValueError(f"strategy {self.text!r}: nothing to offload without a codec; drop on=cpu")
            return
        kind = codec_class(self.codec)
        if self.scheme is not None and not kind.sparse_rows:
            raise ValueError(
                f"strategy {self.text!r}: {self.codec}'s payload is not sparse rows, so no sparse scheme "
                "can send it; a scheme takes 'none' (an embedding's rows) or a sparsifier such as topk"
            )
        if self.collective == "allreduce" and not sums(kind):
            raise ValueError(
                f"strategy {self.text!r}: {self.codec}'s payloads cannot be summed, so they cannot be "
                "allreduced; use collective=allgather or collective=two-level"
            )
        if self.collective == "allgather" and (kind.rounds > 1 or kind.majority_vote):
            raise ValueError(
                f"strategy {self.text!r}: {self.codec} combines ranks by its own allreduces "
                f"({'a vote' if kind.majority_vote else f'{kind.rounds} rounds'}), not by decoding "
                "each rank's payload; drop collective=allgather"
            )
        if self.collective == "two-shot" and not two_shot(kind):
            raise ValueError(
                f"strategy {self.text!r}: two-shot needs a fixed-size, dense, single-round codec "
                "without a vote or a random stream the ranks share, whose shard sums its owner can "
                f"encode again; {self.codec} is not one. Drop collective=two-shot"
            )
        codec(self.codec, self.args)  # unknown arguments and bad values fail here

    @property
    def compressed(self) -> bool:
        return self.codec != NONE

    @property
    def spec(self) -> str:
        """The codec with its arguments, as measured fits are named: `topk:ratio=0.01`."""
        return ":".join([self.codec, *(f"{k}={v}" for k, v in self.args)])

    @property
    def text(self) -> str:
        """The canonical text: parse(s.text) == s; defaults are left out."""
        extra = [f"collective={self.collective}"] if self.collective != default_collective(self.codec) else []
        extra += [f"scheme={self.scheme}"] if self.scheme is not None else []
        extra += [f"on={self.on}"] if self.on != "device" else []
        return ":".join([self.spec, *extra])

    def payload_bytes(self, numel: int) -> int:
        """Bytes one rank's payload for `numel` fp32 elements takes on the wire, once warmed up
        (Compressor.warms_up): plans are made for the steps after a codec's warm-up."""
        if not self.compressed:
            return 4 * numel
        return codec(self.codec, self.args).payload_bytes(numel)

    def __str__(self) -> str:
        return self.text


def parse(text: str) -> Strategy:
    """A Strategy from `codec[:key=value...]`; unknown names and options raise ValueError."""
    name, options = registry.parse_spec(text, "strategy")
    if not name:
        raise ValueError(f"strategy {text!r} names no codec; e.g. 'none', 'fp16' or 'topk:ratio=0.01'")
    if name not in compress.names():
        raise ValueError(
            f"strategy {text!r}: unknown codec {name!r}; choose none or one of {compress.names()}"
        )
    collective = options.pop("collective", default_collective(name))
    scheme = options.pop("scheme", None)
    on = options.pop("on", "device")
    if name == NONE and options:
        raise ValueError(f"strategy {text!r}: none takes no codec arguments, got {sorted(options)}")
    unknown = sorted(set(options) - set(compress.parameters(name)))
    if unknown:
        raise ValueError(
            f"strategy {text!r}: unknown option(s) {unknown}; a strategy takes collective=, scheme=, on= "
            f"and {name}'s own arguments: {sorted(compress.parameters(name)) or 'none'}"
        )
    try:
        return Strategy(name, tuple(sorted(options.items())), collective, scheme, on)
    except (TypeError, KeyError) as error:
        raise ValueError(f"strategy {text!r}: {error}") from None


def default_collective(name: str) -> str:
    """allreduce where the codec's payloads are summed (or it sums in rounds or votes of its own),
    two-shot where a shard's sum can be encoded again (the dense quantizers), else allgather."""
    if name == NONE or sums(codec_class(name)):
        return "allreduce"
    return "two-shot" if two_shot(codec_class(name)) else "allgather"


def sums(kind: type[compress.Compressor]) -> bool:
    """Whether ranks combine `kind`'s payloads by allreduce: summable payloads, multi-round
    protocols and majority votes."""
    return kind.summable or kind.rounds > 1 or kind.majority_vote


def shards(kind: type[compress.Compressor]) -> bool:
    """Whether a shard's owner can decode and sum `kind`'s payloads of that shard (FSDP's
    reduce-scatter, two-shot's first half): fixed-size dense payloads of one round and no vote."""
    return kind.fixed_size and not kind.sparse_rows and kind.rounds == 1 and not kind.majority_vote


def two_shot(kind: type[compress.Compressor]) -> bool:
    """Whether ranks can combine `kind`'s payloads by two-shot: shards(), and its owners' encoding
    of their shards' sums draws from no stream the ranks share (randk's supports: each owner would
    draw for a shard of its own size, the ranks' streams would part, and its payload would be
    decoded with the support of another draw)."""
    return shards(kind) and kind.randomness != "shared"


def codec_class(name: str) -> type[compress.Compressor]:
    return compress.lookup(name)


@lru_cache(maxsize=256)
def codec(name: str, args: tuple[tuple[str, Any], ...]) -> compress.Compressor:
    """An instance of the codec, to ask its declared payload size and flags (cached: planners ask
    often). Never used to compress: it has no seed of its own. A codec that warms up stands past
    its warm-up: plans are made for the steps that follow it."""
    return compress.warmed_up(compress.build(name, **dict(args)))
