"""Compressors and the one registry table that names them.

Example:
    >>> from gradsync import compress
    >>> c = compress.build("topk", ratio=0.01)
    >>> payload, ctx = c.compress(torch.randn(1000))
    >>> y = c.decompress(payload, ctx)
"""

from __future__ import annotations

from typing import Any

from .. import registry
from .absmax import Int4, Int8
from .base import PAST_WARMUP, Compressor, Payload
from .cast import BF16, FP16
from .dgc import DGC
from .natural import Natural
from .none import NoCompression
from .powersgd import PowerSGD
from .qsgd import QSGD
from .randk import RandK
from .sign import EFSignSGD, OneBit, SignSGD, Signum
from .terngrad import TernGrad
from .threshold import Threshold
from .topk import TopK

REGISTRY: dict[str, type[Compressor]] = {
    # no loss, or the loss of a narrower float
    "none": NoCompression,
    "fp16": FP16,
    "bf16": BF16,
    # sparsification
    "topk": TopK,
    "randk": RandK,
    "threshold": Threshold,
    "dgc": DGC,
    # quantization
    "int8": Int8,
    "int4": Int4,
    "qsgd": QSGD,
    "terngrad": TernGrad,
    "natural": Natural,
    # one bit per element
    "signsgd": SignSGD,
    "signum": Signum,
    "efsignsgd": EFSignSGD,
    "onebit": OneBit,
    # low rank
    "powersgd": PowerSGD,
}

__all__ = ["REGISTRY", "Compressor", "Payload", "build", "lookup", "names", "parameters"]


def names() -> list[str]:
    """Every registered compressor name, in registry order."""
    return list(REGISTRY)


def lookup(name: str) -> type[Compressor]:
    """The compressor class registered as `name`; KeyError listing the valid names otherwise."""
    return registry.lookup(REGISTRY, "compressor", name)


def parameters(name: str) -> dict[str, Any]:
    """The parameters `name` accepts, with their defaults."""
    return registry.parameters(lookup(name))


def build(name: str, **params: Any) -> Compressor:
    """Construct the compressor registered as `name`.

    Unknown name: KeyError listing the names. Unknown parameter: TypeError listing the valid
    parameters. Out-of-range value: ValueError with the value and the allowed range.
    """
    return registry.construct(REGISTRY, "compressor", name, params)


def warmed_up(codec: Compressor) -> Compressor:
    """`codec` moved past its warm-up (Compressor.warms_up), as it runs after it: what plans,
    profiles and `gradsync list` describe. Other codecs are returned as they are."""
    if type(codec).warms_up:
        codec.steps = PAST_WARMUP  # type: ignore[attr-defined]
    return codec
