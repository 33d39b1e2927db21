"""The machine a measurement ran on: what it is, and how fast one thread computes and copies.

Benchmarks record both beside their numbers. Steps that are CPU-bound (4 ranks sharing 2 cores)
move with the machine's speed: on two machines of one kind the same code's int4 step on the
testbed differed by 20% (0.436 and 0.529 s), and later on one machine by 25% within hours (0.492
and 0.614 s) while one thread's matrix multiply held at 96 GFLOP/s and its copy of 64 MB took
7 ms, then 11: what moved was memory, not arithmetic.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from time import perf_counter
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """CPU (and its model name), cores, Python and torch versions; the same on every rank of one
    machine."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as info:
            models = (line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
            return next(models, None)
    except OSError:  # not Linux
        return None


def matmul_gflops(n: int = 512, repeats: int = 20) -> float:
    """fp32 GFLOP/s of one CPU thread multiplying n x n matrices: the best of `repeats`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(n, n)
        best = math.inf
        for _ in range(repeats):
            started = perf_counter()
            torch.mm(a, a)
            best = min(best, perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / best / 1e9


def copy_bandwidth(device: torch.device, numel: int = 1 << 24, repeats: int = 3) -> float:
    """Bytes per second one copy moves through memory (read and write), as the hook's copies of
    a group out of DDP's buckets and back: the median of `repeats` copies of one half of a 64 MB
    buffer into its other half, on as many threads as torch uses.

    32 MB read and 32 MB written, about a DDP bucket (25 MB) each way, go past this machine's
    32 MiB cache as the hook's copies do (a larger cache would flatter the result). The buffer
    is filled, not drawn, and is its own destination, written once before the timing: with four
    ranks on two cores, a random draw of 64 MB and a fresh destination per copy (the first touch
    of every page, which the hook's warm buffers do not pay) took 1.2 s of plan="auto"'s
    measuring step.
    """
    x = torch.ones(numel, device=device)
    half = numel // 2
    source, destination = x[:half], x[half : 2 * half]
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the fill is done before the first timing
    seconds = []
    for _ in range(repeats):
        started = perf_counter()
        destination.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(perf_counter() - started)
    return 2 * source.nbytes / statistics.median(seconds)


def one_thread_copy_gbytes_per_s(repeats: int = 7) -> float:
    """copy_bandwidth on one CPU thread, in GB/s, the median of `repeats`: a benchmark's record."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return copy_bandwidth(torch.device("cpu"), repeats=repeats) / 1e9
    finally:
        torch.set_num_threads(threads)
