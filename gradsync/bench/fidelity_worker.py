"""One rank of a fidelity run: `python -m gradsync.bench.fidelity_worker SPEC.json`.

First it profiles (gradsync.profile): the compute timeline with no communication, each codec's
cost and each collective's alpha-beta fit on the real process group. Then it trains the same
workload under each strategy and times the steps. Rank 0 writes both to the spec's `out`; the
runner (bench/fidelity.py) predicts each strategy's step from the profile and compares.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import profile, workloads
from ..comm import TorchComm
from . import strategies
from .rank import leave, serve


def main(spec_path: str) -> int:
    return serve(spec_path, measure)


def measure(spec: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The profile and each strategy's measured step times; every rank must call it."""
    workload = workloads.build(spec["workload"], seed=spec["seed"], **spec["workload_options"])
    model = DistributedDataParallel(workload.model(), gradient_as_bucket_view=True)
    optimizer = workload.recommended_optimizer(model.parameters())

    def step(i: int) -> torch.Tensor:
        inputs, targets = workload.batch(i, rank, world_size)
        return workload.loss(model, inputs, targets)

    hooked = {codec: strategies.parse(text).config for codec, text in spec["hooked"].items()}
    found = profile.run(
        model,
        step,
        optimizer,
        comm=TorchComm(),
        compressors=list(hooked),
        steps=spec["profile_steps"],
        collective_sizes=spec["collective_sizes"],
        codec_sizes=spec["codec_sizes"],
        meta={"workload": spec["workload"], "batch_size": workload.batch_size},
        collectives=spec["collectives"],
        hooks=hooked,
    )
    _say(rank, {"profiled": True})
    measured = {}
    for text in spec["strategies"]:
        measured[text] = _time_steps(spec, text, rank, world_size)
        _say(rank, {"strategy": text, "median_s": measured[text]["median_s"]})
    return {"profile": json.loads(found.to_json()), "measured": measured}


def _time_steps(spec: dict[str, Any], text: str, rank: int, world_size: int) -> dict[str, Any]:
    """Train `spec["steps"]` steps after `spec["warmup"]` under strategy `text`; the slowest rank's
    time per step."""
    workload = workloads.build(spec["workload"], seed=spec["seed"], **spec["workload_options"])
    strategy = strategies.parse(text)
    model, optimizer, _ = strategies.install(strategy, workload.model(), workload.recommended_optimizer)
    seconds = []
    dist.barrier()
    for i in range(spec["warmup"] + spec["steps"]):
        started = time.perf_counter()
        inputs, targets = workload.batch(i, rank, world_size)
        loss = workload.loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i >= spec["warmup"]:
            seconds.append(time.perf_counter() - started)
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"step_s": slowest.tolist(), "median_s": statistics.median(slowest.tolist())}


def _say(rank: int, event: dict[str, Any]) -> None:
    if rank == 0:
        print(json.dumps(event), flush=True)


if __name__ == "__main__":
    leave(main(sys.argv[1]))
