"""A rank that dies, stalls or fails never goes unnoticed: every other rank raises.

The fault matrix: one rank (the victim) of three is
  kill_before_step   killed (SIGKILL) between two steps;
  kill_mid_backward  killed inside its backward pass, after some buckets were exchanged;
  stall              stopped inside its backward pass for twice the process group's timeout;
  forward_error      raising in its forward pass and staying alive (a caught exception);
for every collective family gradsync issues: allreduce (fp16), the majority vote (signsgd),
allgather (topk), two-shot (int4: all_to_all, then allgather), allgather of variable sizes
(threshold), all_to_all (Zen's balanced scheme),
send/receive (recursive doubling), multi-round (PowerSGD), the dense sparse scheme, and a plan
whose groups cut across DDP's buckets (regrouped: each bucket's future waits for other groups').

Every survivor must raise a CollectiveError naming the collective, the bucket and the step within
the process group's timeout + 5 s, with its parameters as they were before the failed step: no
result of the broken exchange is applied. A stalled rank that wakes up raises too, rather than
training on alone.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from dist_harness import batch, config, ddp, make_mlp, run_ranks, sgd
from torch import nn

import gradsync
from gradsync.plan import GroupPlan, Plan, signature

WORLD_SIZE = 3
VICTIM = 1
FAULT_STEP = 4  # past warm-up (2 steps): the codec's own exchange runs
PG_TIMEOUT_S = 2.0

# family -> (SyncConfig arguments, the collectives a survivor's error may name). Two-shot's
# first collective can complete before the victim dies (its share was already sent), so the
# survivors then fail in the second.
FAMILIES = {
    "allreduce": ({"compressor": "fp16"}, ("allreduce",)),
    "vote": ({"compressor": "signsgd"}, ("allreduce",)),
    "allgather": ({"compressor": "topk"}, ("allgather",)),
    "two_shot": ({"compressor": "int4"}, ("all_to_all", "allgather")),
    "allgather_sizes": ({"compressor": "threshold", "compressor_args": {"threshold": 0.01}}, ("allgather",)),
    "all_to_all": ({"compressor": "topk", "sparse_scheme": "balanced"}, ("all_to_all",)),
    "sendrecv": ({"compressor": "topk", "sparse_scheme": "recursive-doubling"}, ("sendrecv",)),
    "multi_round": ({"compressor": "powersgd"}, ("allreduce",)),
    "sparse_dense": ({"compressor": "topk", "sparse_scheme": "dense"}, ("allreduce",)),
    "regrouped": ({}, ("allreduce", "allgather")),  # REGROUPED's plan (fp16's collective)
}
REGROUPED = (((0, 5), "fp16"), ((1, 2, 3, 4), "fp16"))  # the first and last layers' tensors together
FAULTS = ("kill_before_step", "kill_mid_backward", "stall", "forward_error")
# The fast suite covers every family and every fault once; the whole matrix runs as slow.
FAST = {
    ("allreduce", "kill_mid_backward"),
    ("vote", "kill_before_step"),
    ("allgather", "stall"),
    ("two_shot", "kill_mid_backward"),
    ("allgather_sizes", "kill_mid_backward"),
    ("all_to_all", "forward_error"),
    ("sendrecv", "kill_mid_backward"),
    ("multi_round", "stall"),
    ("sparse_dense", "kill_before_step"),
    ("regrouped", "kill_mid_backward"),
}


def faulty_training(rank: int, world_size: int, family: str, fault: str) -> dict:
    # Small buckets: several exchanges per step, so a rank can die between two of them.
    model = ddp(make_mlp(seed=0), bucket_cap_mb=0.002)
    args = FAMILIES[family][0]
    if family == "regrouped":
        params = list(model.parameters())
        groups = tuple(GroupPlan(ps, sum(params[p].numel() for p in ps), text) for ps, text in REGROUPED)
        args = {"plan": Plan(signature(model), world_size, groups)}
    gradsync.register(model, config(**args))
    opt = sgd(model)
    loss_fn = nn.CrossEntropyLoss()
    victim = rank == VICTIM
    first = next(model.parameters())  # the input layer's weight: among the last gradients ready
    if victim and fault in ("kill_mid_backward", "stall"):

        def strike(_: torch.Tensor) -> None:
            if strike.step == FAULT_STEP:
                if fault == "stall":
                    time.sleep(2 * PG_TIMEOUT_S)
                else:
                    os.kill(os.getpid(), signal.SIGKILL)

        strike.step = 0
        first.register_post_accumulate_grad_hook(strike)
    for step in range(FAULT_STEP + 3):
        if victim and fault in ("kill_mid_backward", "stall"):
            strike.step = step
        if victim and fault == "kill_before_step" and step == FAULT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        before = [p.detach().clone() for p in model.parameters()]
        started = time.monotonic()
        try:
            if victim and fault == "forward_error" and step == FAULT_STEP:
                raise ValueError("a bad batch")
            x, y = batch(rank, step)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        except Exception as error:
            if victim and fault == "forward_error":
                time.sleep(PG_TIMEOUT_S + 3)  # alive, holding its connections, but gone from training
            unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            return {
                "raised": f"{type(error).__name__}: {error}",
                "seconds": time.monotonic() - started,
                "step": step,
                "unchanged": unchanged,
            }
    return {"raised": None, "step": FAULT_STEP + 3}


def _cases(fast: bool) -> list:
    cases = []
    for family in FAMILIES:
        for fault in FAULTS:
            if ((family, fault) in FAST) == fast:
                marks = () if fast else (pytest.mark.slow,)
                cases.append(pytest.param(family, fault, id=f"{family}-{fault}", marks=marks))
    return cases


@pytest.mark.parametrize(("family", "fault"), _cases(fast=True) + _cases(fast=False))
def test_every_survivor_raises_naming_the_exchange_and_applies_nothing(family: str, fault: str) -> None:
    results = run_ranks(
        faulty_training,
        WORLD_SIZE,
        args=(family, fault),
        timeout_s=60,
        pg_timeout_s=PG_TIMEOUT_S,
        may_die=[VICTIM] if fault.startswith("kill") else [],
    )
    collectives = FAMILIES[family][1]
    for rank, result in enumerate(results):
        if rank == VICTIM:
            if fault == "stall":  # woke up to find its peers gone: it must not train on alone
                assert result["raised"] is not None and "CollectiveError" in result["raised"], result
            continue
        raised = result["raised"]
        assert raised is not None, f"rank {rank} trained on after rank {VICTIM}'s {fault}: {result}"
        assert "CollectiveError" in raised and "gradsync: " in raised, raised
        exchanged = "group " if family == "regrouped" else "bucket "
        assert f"at step {FAULT_STEP}" in raised and exchanged in raised, raised
        assert result["step"] == FAULT_STEP
        assert result["seconds"] <= PG_TIMEOUT_S + 5, result
        assert result["unchanged"], f"rank {rank} applied a result of the failed step: {raised}"
        assert any(f"{name} of " in raised for name in collectives), raised
