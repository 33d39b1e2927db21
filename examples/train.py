"""A plain DDP training script, as a user writes one, with gradsync in one line.

    torchrun --nproc-per-node 4 examples/train.py --sync gradsync

An MLP of 22.3M parameters (1024 -> 3 x 3072 -> 100) learns a 100-class Gaussian mixture with
SGD and momentum, 16 samples per rank and step, one CPU thread per rank. `--sync` picks how the
gradients are averaged: plain DDP, PyTorch's own communication hooks, or gradsync, each with the
settings a user would write first. `gradsync bench script` runs it on emulated hosts and compares.

Rank 0 prints one JSON line per step ({"step", "step_s", "loss"}) and, with --json, writes the
run's step times, its CPU time per step (every thread of rank 0's process), held-out losses and,
for plan="auto", the plan it adopted there and the candidates it tried.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gradsync

FEATURES, WIDTH, DEPTH, CLASSES = 1024, 3072, 3, 100
BATCH = 16  # per rank
HELDOUT = 1024


def install(sync: str, model: DistributedDataParallel) -> object | None:
    """The one line each way of averaging gradients takes; returns its state, if any."""
    if sync == "ddp":
        return None
    if sync == "torch-fp16":
        return model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if sync == "torch-bf16":
        return model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if sync == "torch-powersgd":
        # From step 2, as gradsync's default warm-up: the earliest torch allows with error feedback.
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    configs = {
        "gradsync": gradsync.SyncConfig(),
        "gradsync-topk": gradsync.SyncConfig(compressor="topk", compressor_args={"ratio": 0.01}),
        "gradsync-fp16": gradsync.SyncConfig(compressor="fp16"),
        "gradsync-bf16": gradsync.SyncConfig(compressor="bf16"),
        "gradsync-powersgd": gradsync.SyncConfig(compressor="powersgd", compressor_args={"rank": 4}),
        "gradsync-auto": gradsync.SyncConfig(plan="auto"),
    }
    return gradsync.register(model, configs[sync])


SYNCS = (
    "ddp",
    "torch-fp16",
    "torch-bf16",
    "torch-powersgd",
    "gradsync",
    "gradsync-topk",
    "gradsync-fp16",
    "gradsync-bf16",
    "gradsync-powersgd",
    "gradsync-auto",
)


def make_model() -> nn.Module:
    layers: list[nn.Module] = []
    fan_in = FEATURES
    for _ in range(DEPTH):
        layers += [nn.Linear(fan_in, WIDTH), nn.ReLU()]
        fan_in = WIDTH
    layers.append(nn.Linear(fan_in, CLASSES))
    return nn.Sequential(*layers)


def samples(count: int, generator: torch.Generator, means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(CLASSES, (count,), generator=generator)
    return means[labels] + torch.randn(count, FEATURES, generator=generator), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", choices=SYNCS, default="gradsync")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--eval-every", type=int, default=0, help="steps between held-out evaluations (0: at the end)"
    )
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json", default=None, help="where rank 0 writes the run's measurements")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    # torch's PowerSGD hook issues its second allreduce from the first's completion callback: with
    # several buckets, two ranks may issue them in different orders on gloo and hang. One bucket.
    buckets = {"bucket_cap_mb": 1 << 16} if args.sync == "torch-powersgd" else {}
    model = DistributedDataParallel(make_model(), **buckets)
    state = install(args.sync, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    means = 0.25 * torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1))
    heldout = samples(HELDOUT, torch.Generator().manual_seed(2), means)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own samples
    loss_fn = nn.CrossEntropyLoss()

    def evaluate(step: int, wall_s: float) -> dict:
        with torch.no_grad():
            loss = loss_fn(model.module(heldout[0]), heldout[1]).item()
        return {"step": step, "wall_s": wall_s, "heldout_loss": loss}

    step_s, cpu_s, evals, wall_s = [], [], [evaluate(0, 0.0)], 0.0
    dist.barrier()
    for step in range(args.steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        inputs, labels = samples(BATCH, data, means)
        loss = loss_fn(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - started
        step_s.append(elapsed)
        cpu_s.append(time.process_time() - cpu_started)  # this process's threads: compute, hook, comms
        wall_s += elapsed
        if rank == 0:
            print(json.dumps({"step": step + 1, "step_s": elapsed, "loss": loss.item()}), flush=True)
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.steps:
            evals.append(evaluate(step + 1, wall_s))
    if rank == 0 and args.json:
        params = sum(p.numel() for p in model.parameters())
        auto = state.stats().get("auto") if isinstance(state, gradsync.SyncState) else None
        with open(args.json, "w") as out:
            json.dump(
                {
                    "sync": args.sync,
                    "world_size": world,
                    "params": params,
                    "step_s": step_s,
                    "cpu_s": cpu_s,
                    "evals": evals,
                    "plan": auto["chosen"] if auto else None,  # what plan="auto" adopted
                    # ... and each candidate it tried: label, predicted step, rank 0's counted steps
                    "tried": auto["candidates"] if auto else None,
                },
                out,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
