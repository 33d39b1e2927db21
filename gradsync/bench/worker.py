"""One rank of a training benchmark run: `python -m gradsync.bench.worker SPEC.json`.

The runner (bench/train.py) starts one such process per rank, on loopback or inside a testbed
host's network namespace, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME
set. Every rank trains the same workload with the same seeds; rank 0 prints one JSON line per step
on stdout (the runner's progress bar) and writes the run's measurements to the spec's `out`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import tuner, workloads
from ..workloads.base import heldout_sums
from . import strategies
from .rank import leave, serve
from .train import last_quarter_fall


def main(spec_path: str) -> int:
    return serve(spec_path, train)


def train(spec: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Train spec["steps"] steps and return what rank 0 reports; every rank must call it."""
    workload = workloads.build(spec["workload"], seed=spec["seed"], **spec["workload_options"])
    strategy = strategies.parse(spec["strategy"])
    model, optimizer, installed = strategies.install(
        strategy, workload.model(), workload.recommended_optimizer
    )
    steps, steady_from = spec["steps"], spec["steady_from"]
    # The schedule spans the steps asked for, the same for every strategy (a run that --until-flat
    # stops early was still on that schedule).
    schedule = workload.recommended_schedule(optimizer, spec["schedule_steps"])
    tx = TxCounter(os.environ.get("GLOO_SOCKET_IFNAME"))

    first, last_losses = _evaluate(
        workload, _held_out_model(model, installed), rank, world_size, step=0, wall_s=0.0
    )
    evals = [first]
    step_s: list[float] = []
    sent_nbytes: list[int] = []
    compression_s: list[float | None] = []
    wall_s = 0.0  # training time only: evaluations are not on the clock
    lr_last = optimizer.param_groups[0]["lr"]
    dist.barrier()  # start every rank's clock together
    for step in range(steps):
        if step == steady_from:
            tx.start()
        started = time.perf_counter()
        inputs, targets = workload.batch(step, rank, world_size)
        loss = workload.loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        lr_last = optimizer.param_groups[0]["lr"]  # the rate this step takes
        optimizer.step()
        if schedule is not None:
            schedule.step()
        elapsed = time.perf_counter() - started
        wall_s += elapsed
        step_s.append(elapsed)
        sent_nbytes.append(installed.sent_nbytes(step))
        compression_s.append(installed.compression_seconds(step))
        if rank == 0:
            print(json.dumps({"step": step + 1, "step_s": elapsed, "loss": loss.item()}), flush=True)
        if (step + 1) % spec["eval_every"] == 0 or step + 1 == steps:
            held_out = _held_out_model(model, installed)
            point, last_losses = _evaluate(workload, held_out, rank, world_size, step=step + 1, wall_s=wall_s)
            evals.append(point)
            # Every rank evaluated the same reduced losses, so every rank stops at the same step.
            fall = last_quarter_fall(evals) if spec.get("until_flat") else None
            if fall is not None and fall < spec["until_flat"] and step + 1 > steady_from + 1:
                steps = step + 1
                break
    wire_bytes = tx.per_step(steps - steady_from)
    # The last evaluation's every prediction, in held-out order, for comparisons paired over the
    # same predictions (train.paired_difference); gathered once, after the wire count.
    shards: list[Any] = [None] * world_size if rank == 0 else []
    dist.gather_object(last_losses, shards if rank == 0 else None, dst=0)
    if installed.diloco is not None:
        installed.diloco.close()  # the compute-only probe below must not sync
    compute_s = _compute_only(workload, model, optimizer, rank, world_size, steps, spec["probe_steps"])
    return {
        "strategy": spec["strategy"],
        "label": installed.strategy.label,
        "params": installed.numel,
        "samples_per_step": workload.batch_size * world_size,
        "step_s": step_s,
        "sent_nbytes": sent_nbytes,
        "compression_s": compression_s,
        "wire_bytes_per_step": _mean_over_ranks(wire_bytes),
        "compute_s": compute_s,
        "evals": evals,
        "final_prediction_losses": torch.cat(shards).tolist() if rank == 0 else [],
        "lr_last": lr_last,
        **_plan_made(installed),
    }


def _plan_made(installed: strategies.Installed) -> dict[str, Any]:
    """plan="auto": the plan adopted and what it measured to choose it."""
    state = installed.gradsync
    if not isinstance(state, tuner.AutoState):
        return {}
    return {"plan": state.plan.to_dict() if state.plan else None, "auto": state.stats()["auto"]}


def _held_out_model(model: nn.Module, installed: strategies.Installed) -> nn.Module:
    """The model evaluated: DDP's module; under DiLoCo a copy holding the global parameters (between
    syncs each rank's own differ); under FSDP2 an unsharded copy (a collective: every rank calls it)."""
    if installed.unsharded is not None:
        with torch.no_grad():
            for p, sharded in zip(installed.unsharded.parameters(), model.parameters(), strict=True):
                p.copy_(sharded.full_tensor())
        return installed.unsharded
    if installed.diloco is None:
        return model.module
    held_out = copy.deepcopy(model)
    trainable = [p for p in held_out.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, value in zip(trainable, installed.diloco.global_parameters(), strict=True):
            p.copy_(value)
    return held_out


def _evaluate(
    workload: workloads.Workload,
    model: nn.Module,
    rank: int,
    world_size: int,
    step: int,
    wall_s: float,
) -> tuple[dict[str, Any], torch.Tensor]:
    """The held-out metric over all ranks' shards (each rank evaluates its own, sums are reduced),
    and this rank's shard's per-prediction losses (float32, which they were computed in)."""
    losses, correct = workload.heldout_losses(model, rank, world_size)
    sums = heldout_sums(losses, correct, workload.counts_correct)
    keys = sorted(sums)
    totals = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(totals)
    total = dict(zip(keys, totals.tolist(), strict=True))
    mean = total["loss_sum"] / total["count"]
    variance = max(0.0, total["loss_sq_sum"] / total["count"] - mean**2)
    # The mean's standard error over held-out predictions: how far another held-out draw could
    # move this loss. Two runs' difference is judged by its own, paired, standard error
    # (train.summarize), which the per-prediction losses make possible.
    point = {"step": step, "wall_s": wall_s, "loss": mean, "loss_se": math.sqrt(variance / total["count"])}
    if "correct" in total:
        point["accuracy"] = total["correct"] / total["count"]
    return point, losses.float()


def _compute_only(
    workload: workloads.Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
    first_step: int,
    repeats: int,
) -> list[float]:
    """Seconds per step with no gradient exchange (DDP's no_sync), all ranks computing at once.

    Runs after training, so it cannot change the trajectory; it measures the compute part of a
    step under the same CPU sharing as training.
    """
    dist.barrier()
    seconds = []
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: its parameter all-gathers still run
        model.set_requires_gradient_sync(False)
    with model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext():
        for i in range(repeats):
            started = time.perf_counter()
            inputs, targets = workload.batch(first_step + i, rank, world_size)
            loss = workload.loss(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seconds.append(time.perf_counter() - started)
    return seconds


class TxCounter:
    """Bytes this rank's network interface transmitted: the real traffic, headers included.

    Only meaningful on a testbed host, where the interface is this rank's own; on loopback every
    rank shares `lo`, so nothing is counted there.
    """

    def __init__(self, ifname: str | None) -> None:
        path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
        self.path = path if ifname and ifname != "lo" and path.exists() else None
        self.started: int | None = None

    def start(self) -> None:
        if self.path is not None:
            self.started = int(self.path.read_text())

    def per_step(self, steps: int) -> float | None:
        if self.path is None or self.started is None or steps <= 0:
            return None
        return (int(self.path.read_text()) - self.started) / steps


def _mean_over_ranks(value: float | None) -> float | None:
    """The mean of every rank's value (a collective: all ranks call it); None if any has none."""
    mine = torch.tensor([value if value is not None else float("nan")], dtype=torch.float64)
    dist.all_reduce(mine)
    total = float(mine)
    return None if total != total else total / dist.get_world_size()


if __name__ == "__main__":
    leave(main(sys.argv[1]))
