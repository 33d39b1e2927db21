"""Kernel benchmark: compress + decompress time of every codec as a ratio to a plain copy.

Each codec is timed on one fp32 tensor against `x.clone()` of the same tensor in the same run, so
the ratio cancels out most of the machine's memory bandwidth and is comparable across machines.
Its encode is also timed alone, as the hook runs it by default (a codec that needs error feedback
and fuses it encodes with its memory and writes the residual as it goes: compress_corrected),
against a copy of x into a tensor written before: neither side pays page faults there, which
swamp the round trip's (the corrected encode's loop, left scalar, took 2.6x as long for a while,
and int4's ratio to the clone moved within its noise).

Example:
    >>> from gradsync.bench import kernels
    >>> results = kernels.run(numel=4096, repeats=2, labels=["fp16", "topk-sampled"])
    >>> print(kernels.format_table(results, threads=1))
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import compress
from ..profile.timeline import synchronize

Variant = tuple[str, str, dict[str, Any]]  # (label, compressor name, constructor args)

# Extra argument sets benchmarked besides each codec's defaults; skipped while not registered.
_EXTRA_VARIANTS: list[Variant] = [("topk-torch", "topk", {"mode": "exact"})]  # torch.topk: the reference
# Arguments instead of the defaults where the defaults do not fit the benchmark's N(0, 1) input:
# |x| >= 2.5758 holds for 1% of it, the density of top-k's default ratio.
_BENCH_ARGS: dict[str, dict[str, Any]] = {"threshold": {"threshold": 2.5758}}


def _variants() -> list[Variant]:
    """One row per registered codec with default args, then the registered extra rows."""
    rows: list[Variant] = [(name, name, _BENCH_ARGS.get(name, {})) for name in compress.names()]
    registered = set(compress.names())
    return rows + [row for row in _EXTRA_VARIANTS if row[1] in registered]


VARIANTS: list[Variant] = _variants()

# Target time per label, as a multiple of the clone time (from the kernel-benchmark issue). Labels
# missing here (none, torch.topk, powersgd) are only reported.
TARGETS: dict[str, float] = {
    "fp16": 2,
    "bf16": 2,
    "randk": 2,
    "signsgd": 3,
    "signum": 3,
    "efsignsgd": 3,
    "onebit": 3,
    "int8": 3,
    "topk": 4,
    "dgc": 4,
    "threshold": 4,
    "qsgd": 6,
    "terngrad": 6,
    "natural": 6,
}


@dataclasses.dataclass(frozen=True)
class KernelResult:
    """The timing of one variant; target and meets_target are None for a report-only variant."""

    label: str
    compressor: str  # registry name
    args: dict[str, Any]  # constructor args besides the defaults (seed excluded)
    numel: int  # fp32 elements of the benchmarked tensor
    seconds: float  # median compress + decompress time
    clone_seconds: float  # median x.clone() time of the same run
    ratio: float  # seconds / clone_seconds; lower is better
    encode_seconds: float  # median encode alone, as the hook's default runs it
    copy_seconds: float  # median copy of x into a tensor written before, timed beside it
    encode_ratio: float  # encode_seconds / copy_seconds
    bits_per_element: float  # payload bits actually produced, per input element
    target: float | None  # the ratio to stay at or below
    meets_target: bool | None


def variant_labels() -> list[str]:
    """Every label `run` accepts, in benchmark order."""
    return [label for label, _, _ in VARIANTS]


def run(
    numel: int = 2**24,
    repeats: int = 7,
    labels: Sequence[str] | None = None,
    threads: int = 1,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> list[KernelResult]:
    """Time compress + decompress of every variant (or those in `labels`) on `threads` threads, the
    tensor on `device` ("cpu", or "cuda" for the current GPU)."""
    variants = _select(labels)
    where = timing_device(device)
    if numel < 1:
        raise ValueError(f"numel={numel} must be >= 1; pass a tensor size such as 2**24")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1; pass e.g. 5 (the median of the timed calls)")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1; pass 1 for the single-thread benchmark")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(where)
        results = []
        for i, variant in enumerate(variants, start=1):
            if progress is not None:
                progress(f"[{i}/{len(variants)}] {variant[0]} ...")
            results.append(_time_variant(variant, x, repeats, seed))
    finally:
        torch.set_num_threads(previous_threads)
    return results


def format_table(results: Sequence[KernelResult], threads: int | None) -> str:
    """A Markdown table of `results`, a header line naming the set-up, and the missed targets.
    `threads`: the CPU threads timed on; None for a GPU's run, where they time nothing."""
    numel = results[0].numel if results else 0
    clone_ms = f"{1e3 * statistics.median(r.clone_seconds for r in results):.3f}" if results else "-"
    on = "" if threads is None else f", threads={threads}"
    lines = [
        f"numel={numel:,} fp32{on}, clone={clone_ms} ms (median over rows)",
        "",
        "| compressor | args | ms | clone ms | x clone | bits/elem | target | met | encode ms | x copy |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        args = ", ".join(f"{k}={v}" for k, v in r.args.items()) or "-"
        target = "-" if r.target is None else f"<= {r.target:g}x"
        met = {None: "-", True: "yes", False: "**no**"}[r.meets_target]
        lines.append(
            f"| {r.label} | {args} | {_ms(r.seconds)} | {_ms(r.clone_seconds)} | {r.ratio:.2f} | "
            f"{r.bits_per_element:.3f} | {target} | {met} | {_ms(r.encode_seconds)} | "
            f"{r.encode_ratio:.2f} |"
        )
    missed = [f"{r.label} ({r.ratio:.2f}x > {r.target:g}x)" for r in results if r.meets_target is False]
    lines.append("")
    lines.append(f"Missed: {', '.join(missed)}" if missed else "All targets met.")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    """Milliseconds to three significant figures from 0.001 up (a GPU's times are below one), to a
    tenth from 10 on."""
    ms = 1e3 * seconds
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def metadata(numel: int, threads: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """The set-up of a run, stored next to its results, with the commit and machine it ran at (and
    the GPU's name, where the tensor was on one)."""
    from .report import provenance

    where = timing_device(device)
    gpu = {"gpu": torch.cuda.get_device_name(where)} if where.type == "cuda" else {}
    return {"numel": numel, "threads": threads, "repeats": repeats, **gpu, **provenance()}


def table(document: dict[str, Any]) -> str:
    """The Markdown table of a results document as write_json stores it."""
    from .report import cores_note, tree_note

    results = [KernelResult(**r) for r in document["results"]]
    meta = document["meta"]
    where = f"one {meta['gpu']}" if "gpu" in meta else cores_note(meta["machine"])
    return format_table(results, threads=None if "gpu" in meta else meta["threads"]) + (
        f"\n\nMedian of {meta['repeats']} calls each, on {where}, torch {meta['machine']['torch']}; "
        f"commit {meta['commit'][:12]}{tree_note(meta.get('dirty', False))}, {meta['date']}."
    )


def to_json(results: Sequence[KernelResult], meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` and the results as plain dicts, ready for json.dump."""
    return {"meta": meta, "results": [dataclasses.asdict(r) for r in results]}


def write_json(document: dict[str, Any], path: str | Path) -> Path:
    """Write a results document (to_json's) to `path`, creating its parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def timing_device(name: str) -> torch.device:
    """`name` as a device the benchmark can time on: the CPU, or a GPU that is present."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r}: the benchmark times on 'cpu' or 'cuda' (or 'cuda:N')")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: torch sees no CUDA GPU here; pass device='cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device={name!r}: torch sees {torch.cuda.device_count()} GPU(s) here; pass 'cuda' or "
            f"'cuda:N' with N below {torch.cuda.device_count()}"
        )
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _select(wanted: Sequence[str] | None) -> list[Variant]:
    if wanted is None:
        return list(VARIANTS)
    valid = variant_labels()
    unknown = [label for label in wanted if label not in valid]
    if unknown or not wanted:
        what = f"unknown label(s) {unknown}" if unknown else "no labels given"
        raise ValueError(f"{what}; valid labels: {', '.join(valid)}")
    return [v for v in VARIANTS if v[0] in wanted]


def _time_variant(variant: Variant, x: torch.Tensor, repeats: int, seed: int) -> KernelResult:
    """Median compress + decompress seconds of one variant against the median clone, interleaved.

    Fresh allocations cost page faults whose price drifts with the machine's memory state, so each
    codec call is paired with a clone timed right before it: the ratio compares like with like.
    The encode alone is paired the same way with a copy into a tensor written before.
    One untimed call of each first: lazy initialisation is not a per-call cost.
    """
    _, name, args = variant
    if "seed" in compress.parameters(name):
        args = {**args, "seed": seed}
    codec = compress.warmed_up(compress.build(name, **args))  # timed as it runs after any warm-up

    def round_trip() -> compress.Payload:
        payload, ctx = codec.compress(x)
        codec.decompress(payload, ctx)
        return payload

    encode = _encode_as_the_hook_does(codec, x)
    copied = torch.empty_like(x)
    payload = round_trip()
    encode()
    x.clone()
    copied.copy_(x)
    codec_times, clone_times, encode_times, copy_times = [], [], [], []
    for _ in range(repeats):
        clone_times.append(_seconds(x.clone, x.device))
        codec_times.append(_seconds(round_trip, x.device))
        copy_times.append(_seconds(lambda: copied.copy_(x), x.device))
        encode_times.append(_seconds(encode, x.device))
    median = statistics.median
    return _result(
        variant,
        payload,
        x.numel(),
        seconds=median(codec_times),
        clone_seconds=median(clone_times),
        encode_seconds=median(encode_times),
        copy_seconds=median(copy_times),
    )


def _encode_as_the_hook_does(codec: compress.Compressor, x: torch.Tensor) -> Callable[[], Any]:
    """The encode of `x` as error_feedback="auto" runs it: with the codec's fused feedback where it
    needs feedback and fuses it (into an error memory and a spare buffer made once, alpha 1/4: four
    ranks' shares), else plain compress."""
    kind = type(codec)
    if not (kind.needs_feedback and kind.fuses_feedback):
        return lambda: codec.compress(x)
    memory, spare = torch.zeros_like(x), torch.zeros_like(x)
    return lambda: codec.compress_corrected(x, memory, 0.25, spare)


def _seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall time of `fn`; on a GPU, of its kernels too (a launch returns before they run)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _result(
    variant: Variant,
    payload: compress.Payload,
    numel: int,
    *,
    seconds: float,
    clone_seconds: float,
    encode_seconds: float,
    copy_seconds: float,
) -> KernelResult:
    label, name, args = variant
    ratio = seconds / clone_seconds
    target = TARGETS.get(label)
    return KernelResult(
        label=label,
        compressor=name,
        args=dict(args),
        numel=numel,
        seconds=seconds,
        clone_seconds=clone_seconds,
        ratio=ratio,
        encode_seconds=encode_seconds,
        copy_seconds=copy_seconds,
        encode_ratio=encode_seconds / copy_seconds,
        bits_per_element=8 * sum(t.nbytes for t in payload) / numel,
        target=target,
        meets_target=None if target is None else ratio <= target,
    )
