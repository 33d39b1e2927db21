"""A Plan executed by the DDP hook on 2 real gloo ranks.

- The hook runs exactly the plan given: each group's codec and exchange, as stats() reports them
  from what ran; the fp32 group's gradient is the dense average bit for bit, the fp16 group's is
  the sum of the ranks' decoded fp16 payloads (allgathered, not summed in fp16), and its bytes
  follow the allgather formula.
- A plan whose groups are DDP's buckets, with the config's compressor as every group's strategy,
  trains to the same bits as the same config without a plan.
- A run restored from a checkpoint past warm-up continues the exact trajectory, although the
  fresh DDP model's first iteration has other buckets.
- Ranks given different plans fail with the rank-agreement error before exchanging anything.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import batch, config, ddp, flat_params, make_mlp, run_ranks, sgd, train
from torch import nn

import gradsync
from gradsync import sparse
from gradsync.comm import allgather_sent_nbytes
from gradsync.plan import GroupPlan, Plan, signature

WORLD = 2
WARMUP = config().warmup_steps
# make_mlp's parameters: 0 (48x32), 1 (48), 2 (24x48), 3 (24), 4 (8x24), 5 (8).
GROUPS = [
    ((5, 4), "none"),
    ((3, 2), "fp16:collective=allgather"),
    ((1,), "qsgd"),
    ((0,), "topk:ratio=0.1:scheme=auto"),
]
# (codec, collective, feedback) each group must report having run; the last also a sparse scheme.
EXECUTED = [("none", "allreduce", "none"), ("fp16", "allgather", "none"), ("qsgd", "two-shot", "none")]
EXECUTED += [("topk", "allgather", "ef")]
# (compressor, its arguments, error feedback, the same as a plan's strategy)
UNIFORM = [
    ("topk", {"ratio": 0.05}, "ef", "topk:ratio=0.05"),  # allgathered, as without a plan
    ("qsgd", {}, "auto", "qsgd"),
    # Its warm-up's ranks would send this MLP's weights exactly over the 8 steps.
    ("powersgd", {"rank": 2, "rank_warmup_steps": 0}, "ef", "powersgd:rank=2:rank_warmup_steps=0"),
]
STEPS = 8
TWO_BUCKETS_MB = 0.004  # make_mlp's gradients in two DDP buckets after the rebuild


def make_plan(model: nn.Module, groups: Sequence[tuple[Sequence[int], str]]) -> Plan:
    params = list(model.parameters())
    return Plan(
        signature(model),
        WORLD,
        tuple(GroupPlan(tuple(ps), sum(params[p].numel() for p in ps), text) for ps, text in groups),
    )


# -- the workers -----------------------------------------------------------------------------------


def executed(rank: int) -> dict[str, Any]:
    """Train past warm-up by GROUPS, then one more step: this rank's own gradients, the synced ones,
    and what stats() says ran."""
    model = ddp(make_mlp(seed=0))
    state = gradsync.register(model, config(plan=make_plan(model, GROUPS)))
    opt = sgd(model)
    train(model, opt, rank, range(WARMUP + 1))
    x, y = batch(rank, WARMUP + 1)
    loss_fn = nn.CrossEntropyLoss()
    # The module itself, not DDP: autograd.grad accumulates nothing, so DDP's hooks do not fire.
    local = torch.autograd.grad(loss_fn(model.module(x), y), list(model.module.parameters()))
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    return {
        "local": [g.clone() for g in local],
        "synced": [p.grad.clone() for p in model.parameters()],
        "groups": state.stats()["groups"],
    }


def same_as_without_plan(rank: int) -> dict[str, Any]:
    out = {}
    for name, args, form, text in UNIFORM:
        fields = {"compressor": name, "compressor_args": args, "error_feedback": form}
        without = ddp(make_mlp(seed=0), bucket_cap_mb=TWO_BUCKETS_MB)
        plain = gradsync.register(without, config(**fields))
        train(without, sgd(without), rank, range(STEPS))
        # The plan-free run's rebuilt buckets, in bucket order, are the groups.
        groups = [(plain.layout[index], text) for index in sorted(plain.layout)]
        planned = ddp(make_mlp(seed=0), bucket_cap_mb=TWO_BUCKETS_MB)
        state = gradsync.register(planned, config(plan=make_plan(planned, groups), **fields))
        train(planned, sgd(planned), rank, range(STEPS))
        uncompressed = ddp(make_mlp(seed=0), bucket_cap_mb=TWO_BUCKETS_MB)
        train(uncompressed, sgd(uncompressed), rank, range(STEPS))
        out[name] = {
            "without": flat_params(without),
            "planned": flat_params(planned),
            "uncompressed": flat_params(uncompressed),
            "num_groups": len(groups),
            "codecs": [g["codec"] for g in state.stats()["groups"]],
        }
    return out


def _run(rank: int, steps: range, seed: int = 0, checkpoint: bytes | None = None) -> tuple:
    model = ddp(make_mlp(seed=seed))
    state = gradsync.register(model, config(plan=make_plan(model, GROUPS)))
    opt = sgd(model)
    if checkpoint is not None:
        saved = torch.load(io.BytesIO(checkpoint))
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        if "gradsync" in saved:
            state.load_state_dict(saved["gradsync"])
    train(model, opt, rank, steps)
    return model, opt, state


def _checkpoint(model: nn.Module, opt: torch.optim.Optimizer, state: Any, with_state: bool = True) -> bytes:
    saved = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
    if with_state:
        saved["gradsync"] = state.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    return buffer.getvalue()


def resumed(rank: int) -> dict[str, torch.Tensor]:
    half = STEPS // 2
    continuous, _, _ = _run(rank, range(STEPS))
    first = _run(rank, range(half))
    # A fresh model, initialized otherwise, whose DDP has its first-iteration buckets again.
    restored, _, _ = _run(rank, range(half, STEPS), seed=1, checkpoint=_checkpoint(*first))
    stateless, _, _ = _run(rank, range(half, STEPS), seed=1, checkpoint=_checkpoint(*first, with_state=False))
    return {
        "continuous": flat_params(continuous),
        "restored": flat_params(restored),
        "stateless": flat_params(stateless),
    }


def different_plans(rank: int) -> tuple[str, str, int]:
    model = ddp(make_mlp(seed=0))
    groups = list(GROUPS)
    if rank == 1:
        groups[1] = ((3, 2), "bf16")
    state = gradsync.register(model, config(plan=make_plan(model, groups)))
    try:
        train(model, sgd(model), rank, range(1))
        outcome = ("no error", "")
    except Exception as error:
        outcome = (type(error).__name__, str(error))
    # The failed check left no rank inside a collective: the group still works.
    dist.barrier()
    return (*outcome, state.step)


def worker(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "executed": executed(rank),
        "same_as_without_plan": same_as_without_plan(rank),
        "resumed": resumed(rank),
        "different_plans": different_plans(rank),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(worker, WORLD, timeout_s=120)


# -- the tests -------------------------------------------------------------------------------------


def _group(grads: Sequence[torch.Tensor], params: Sequence[int]) -> torch.Tensor:
    return torch.cat([grads[p].reshape(-1) for p in params])


def test_the_hook_reports_running_each_groups_own_strategy(runs: list[dict]) -> None:
    for rank, out in enumerate(runs):
        groups = out["executed"]["groups"]
        ran = [(g["codec"], g["collective"], g["feedback"]) for g in groups]
        assert ran == EXECUTED, f"rank {rank} ran {ran}"
        assert [g["scheme"] for g in groups[:3]] == [None, None, None]
        assert groups[3]["scheme"] in sparse.names()  # the payload's rows by the selector's pick
        assert [g["strategy"] for g in groups] == [text for _, text in GROUPS]
        assert [g["tensors"] for g in groups] == [len(params) for params, _ in GROUPS]
        assert all(g["step"] == WARMUP + 1 for g in groups)


def test_every_rank_ends_with_the_same_gradients(runs: list[dict]) -> None:
    first, second = (out["executed"]["synced"] for out in runs)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_fp32_group_is_the_dense_average_bit_for_bit(runs: list[dict]) -> None:
    params = GROUPS[0][0]
    local = [_group(out["executed"]["local"], params) for out in runs]
    average = local[0] / WORLD + local[1] / WORLD  # as the hook: divide, then sum
    assert torch.equal(_group(runs[0]["executed"]["synced"], params), average)


def test_the_fp16_group_is_allgathered_and_decoded_in_fp32(runs: list[dict]) -> None:
    params = GROUPS[1][0]
    local = [_group(out["executed"]["local"], params) for out in runs]
    decoded = torch.zeros_like(local[0])
    for g in local:  # rank order, each rank's fp16 payload decoded and added in fp32
        decoded += (g / WORLD).half().float()
    assert torch.equal(_group(runs[0]["executed"]["synced"], params), decoded)
    numel = decoded.numel()
    for out in runs:
        fp16 = out["executed"]["groups"][1]
        assert fp16["numel"] == numel and fp16["payload_nbytes"] == 2 * numel
        assert fp16["sent_nbytes"] == allgather_sent_nbytes(2 * numel + 1, WORLD)  # + the finite flag


@pytest.mark.parametrize("name", [case[0] for case in UNIFORM])
def test_a_plan_of_ddps_buckets_with_the_configs_compressor_trains_to_the_same_bits(
    runs: list[dict], name: str
) -> None:
    for rank, out in enumerate(runs):
        result = out["same_as_without_plan"][name]
        assert result["num_groups"] == 2, "the model was meant to fill two DDP buckets"
        assert result["codecs"] == [name] * 2
        diff = (result["planned"] - result["without"]).abs().max().item()
        assert torch.equal(result["planned"], result["without"]), f"rank {rank}: differs by up to {diff:.3g}"
        assert not torch.equal(result["planned"], result["uncompressed"]), "compression changed nothing"


def test_a_plan_run_restored_past_warm_up_continues_the_exact_trajectory(runs: list[dict]) -> None:
    for rank, out in enumerate(runs):
        result = out["resumed"]
        assert torch.equal(result["restored"], result["continuous"]), f"rank {rank} left the trajectory"
        assert not torch.equal(result["stateless"], result["continuous"]), "the state carried nothing"


def test_ranks_given_different_plans_fail_before_exchanging_a_gradient(runs: list[dict]) -> None:
    for rank, out in enumerate(runs):
        kind, message, steps = out["different_plans"]
        assert kind == "ValueError", f"rank {rank} got {kind}: {message}"
        assert "given different SyncConfigs" in message and "plan=" in message, message
        assert steps == 0
