"""The demo: plain DDP against gradsync on a small model, 2 ranks over gloo on this machine.

Both runs use the same seeds, data order and optimizer; only the gradient exchange differs.
The data are generated (a seeded 10-class Gaussian mixture), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from .config import SyncConfig
from .ddp import register

NUM_FEATURES = 64
NUM_CLASSES = 10


@dataclass(frozen=True)
class DemoRun:
    """One side of the comparison: a name and a gradsync config (None = plain DDP)."""

    name: str
    config: SyncConfig | None


def default_runs() -> list[DemoRun]:
    return [
        DemoRun("plain DDP (fp32 allreduce)", None),
        DemoRun(
            "gradsync topk 1% + error feedback",
            SyncConfig(
                compressor="topk", compressor_args={"ratio": 0.01}, error_feedback="ef", warmup_steps=10
            ),
        ),
    ]


def make_data(num_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded Gaussian mixture: one random mean per class, unit noise."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=generator) * 0.3
    labels = torch.randint(NUM_CLASSES, (num_samples,), generator=generator)
    features = means[labels] + torch.randn(num_samples, NUM_FEATURES, generator=generator)
    return features, labels


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank and in every run
    return torch.nn.Sequential(
        torch.nn.Linear(NUM_FEATURES, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, NUM_CLASSES),
    )


def _worker(rank: int, world_size: int, port: int, run: DemoRun, steps: int, width: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        features, labels = make_data(24_000, seed=1)
        train_x, train_y = features[:20_000], labels[:20_000]
        test_x, test_y = features[20_000:], labels[20_000:]
        shard_x, shard_y = train_x[rank::world_size], train_y[rank::world_size]
        model = DistributedDataParallel(make_model(width))
        state = register(model, run.config) if run.config is not None else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        batch = 64
        order = torch.randperm(shard_x.shape[0], generator=torch.Generator().manual_seed(rank))
        started = time.perf_counter()
        for step in range(steps):
            at = order[(step * batch) % (shard_x.shape[0] - batch) :][:batch]
            loss = torch.nn.functional.cross_entropy(model(shard_x[at]), shard_y[at])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - started
        with torch.no_grad():
            logits = model.module(test_x)
            test_loss = float(torch.nn.functional.cross_entropy(logits, test_y))
            accuracy = float((logits.argmax(1) == test_y).float().mean())
        numel = sum(p.numel() for p in model.parameters())
        fp32_per_step = 2 * (world_size - 1) * 4 * numel / world_size
        if state is not None:
            stats = state.stats()
            sent_per_step = stats["total"]["bytes_sent"] / steps
            compressed_ratio = stats["last_step"]["compression_ratio"]
        else:
            sent_per_step, compressed_ratio = fp32_per_step, 1.0
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "name": run.name,
                        "params": numel,
                        "seconds": elapsed,
                        "test_loss": test_loss,
                        "accuracy": accuracy,
                        "bytes_per_step": sent_per_step,
                        "fp32_bytes_per_step": fp32_per_step,
                        "compressed_step_ratio": compressed_ratio,
                    }
                )
            )
    finally:
        dist.destroy_process_group()


def run_demo(steps: int = 300, world_size: int = 2, width: int = 512) -> list[dict[str, Any]]:
    """Train each DemoRun with `world_size` spawned ranks and return rank 0's summaries."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, run in enumerate(default_runs()):
            out = str(Path(tmp) / f"run{i}.json")
            mp.spawn(_worker, args=(world_size, _free_port(), run, steps, width, out), nprocs=world_size)
            results.append(json.loads(Path(out).read_text()))
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    baseline = results[0]
    lines = [
        "| run | test accuracy | test loss | MB sent per step | less traffic | "
        "less traffic, compressed steps | train time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        saved = baseline["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("inf")
        lines.append(
            f"| {r['name']} | {r['accuracy']:.3f} | {r['test_loss']:.3f} | "
            f"{r['bytes_per_step'] / 1e6:.3f} | {saved:.1f}x | {r['compressed_step_ratio']:.1f}x | "
            f"{r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(steps: int = 300) -> int:
    print(f"gradsync demo: 2 ranks (gloo, loopback), {steps} steps each, same seeds and data order")
    results = run_demo(steps=steps)
    print(f"model: MLP with {results[0]['params']:,} parameters, 10-class generated data\n")
    print(format_table(results))
    print(
        "\nMB sent per step: bytes each rank puts on its link (ring algorithms), averaged over all "
        "steps including the 10 fp32 warm-up steps. On loopback the network is not the bottleneck, "
        "so train time shows the compression cost, not a speed-up."
    )
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
