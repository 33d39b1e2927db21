"""DiLoCo on a cluster: the mean inner step and the bytes of syncing every H steps. Pure.

An inner step is one worker's compute alone: nothing is exchanged. Every H inner steps each
fragment's outer gradient is exchanged by its strategy (sim/phases.py), alone on the links, after
the optimizer step; with `delay` the exchange overlaps that many inner steps and only what is
left of it stalls training. So a round of H inner steps takes H x compute + the exposed part of
every fragment's exchange, and its bytes are every fragment's payload once.

    >>> result = simulate(work, where, "diloco:sync_every=50:compressor=int4")

`diloco` takes DiLoCo's options (gradsync.diloco.DEFAULTS) and `compressor=NAME`; other keys are
NAME's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import registry
from ..config import NO_COMPRESSION
from ..diloco import DEFAULTS, check_options, cut
from ..strategy import Strategy, default_collective
from .cluster import Cluster
from .compute import Compute
from .engine import COMPUTE, NETWORK, GroupTiming, Result, Span
from .phases import payload_nbytes, phases

NAME = "diloco"


@dataclass(frozen=True)
class OuterStrategy:
    """How often, in how many fragments and by which strategy the outer gradient is exchanged."""

    text: str
    sync_every: int
    fragments: int
    delay: int
    exchange: Strategy


def is_outer(text: str) -> bool:
    return text.split(":", 1)[0] == NAME


def parse(text: str) -> OuterStrategy:
    """`diloco[:sync_every=H][:fragments=F][:delay=D][:compressor=NAME][:key=value...]`: the other
    keys are NAME's arguments; its exchange is NAME's default collective (none: fp32 allreduce)."""
    name, options = registry.parse_spec(text, "strategy")
    if name != NAME:
        raise ValueError(f"{text!r} is not a {NAME} strategy; e.g. {NAME}:sync_every=50:compressor=int4")
    # The outer optimizer and the mix change the trajectory, not the time: accepted and not used.
    outer = {key: options.pop(key, default) for key, default in DEFAULTS.items()}
    check_options(**outer)
    codec = options.pop("compressor", NO_COMPRESSION)
    if codec == NO_COMPRESSION and options:
        raise ValueError(
            f"{text!r}: unknown option(s) {sorted(options)}; {NAME} takes {', '.join(DEFAULTS)}, compressor"
        )
    args = tuple(sorted(options.items()))
    exchange = Strategy(codec, args, default_collective(codec)) if codec != NO_COMPRESSION else Strategy()
    return OuterStrategy(text, outer["sync_every"], outer["fragments"], outer["delay"], exchange)


def simulate(compute: Compute, cluster: Cluster, text: str) -> Result:
    """The mean inner step of DiLoCo (`text`, see parse) on `cluster`. Its groups are the fragments,
    with their payloads per inner step (a payload / H); meta holds each fragment's exchange time,
    what of it stalls training, and the bytes of the largest fragment (the peak of one step)."""
    outer = parse(text)
    fragments = cut(compute.numels, outer.fragments, outer.sync_every)
    numels = [fragment.numel for fragment in fragments]
    exchange_s = [sum(p.seconds for p in phases(outer.exchange, n, cluster)) for n in numels]
    overlap_s = outer.delay * compute.step_s  # the inner steps an exchange in flight runs beside
    exposed_s = [max(0.0, s - overlap_s) for s in exchange_s]
    payloads = [payload_nbytes(outer.exchange, n, cluster) if cluster.world_size > 1 else 0 for n in numels]
    step_s = compute.step_s + sum(exposed_s) / outer.sync_every

    spans = [
        Span(COMPUTE, "forward", 0.0, compute.forward_s),
        Span(COMPUTE, "backward", compute.forward_s, compute.forward_s + compute.backward_s),
        Span(COMPUTE, "optimizer", compute.forward_s + compute.backward_s, compute.step_s),
    ]
    t = compute.step_s
    groups = []
    for index, numel in enumerate(numels):
        label = f"outer sync (1 step in {outer.sync_every})"
        spans.append(Span(NETWORK, label, t, t + exposed_s[index], index))
        t += exposed_s[index]
        per_step = round(payloads[index] / outer.sync_every)
        end = compute.step_s + exchange_s[index]
        groups.append(
            GroupTiming(
                index,
                numel,
                outer.exchange.text,
                per_step,
                compute.step_s,
                compute.step_s,
                compute.step_s,
                end,
            )
        )
    return Result(
        step_s=step_s,
        compute_s=compute.step_s,
        world_size=cluster.world_size,
        batch_size=compute.batch_size,
        spans=tuple(spans),
        groups=tuple(groups),
        cluster=cluster.describe(),
        strategy=text,
        meta={
            "model": compute.name,
            "sync_every": outer.sync_every,
            "fragments": outer.fragments,
            "delay": outer.delay,
            "exchange_s": exchange_s,
            "exposed_s": exposed_s,
            "sent_nbytes_per_step": sum(payloads) / outer.sync_every,
            "peak_nbytes": max(payloads),
        },
    )
