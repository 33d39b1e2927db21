"""FSDP2 (fully_shard) with gradsync as its gradient reduce-scatter, on 2 gloo ranks.

- On 3 ranks (FSDP pads every dimension of 256 or 8 rows): uncompressed ("none"), gradsync's
  reduce-scatter is FSDP's own, bit for bit; with bf16 every element of the averaged gradient is
  (bf16(g_0) + bf16(g_1) + bf16(g_2)) / 3 of the ranks' own gradients (computed by an unsharded
  copy of the model and gathered), summed in rank order, and a step sends half the bytes.
- Training with bf16 ends within 0.5% of FSDP's loss on held-out data; int4 (error feedback) too.
- A checkpoint (DCP: model, optimizer and gradsync's state) resumes the exact trajectory, also
  under HSDP.
- HSDP on 4 ranks (2 replicas of 2 shards): with the replicas' group, gradsync averages each
  shard across replicas too: the gradient is the mean over all 4 ranks', bit-identical on every
  rank, and bf16 halves the replica all-reduce's bytes.
- What it cannot run is refused by name: a sparsifier, a plan, a feedback form that mirrors the
  whole sum, a reduction in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import gradsync

# gradsync's FSDP path is FSDP2's custom reduce-scatter: on a torch without it (2.6 here)
# register() refuses FSDP by name, and FSDP2 itself did not run on the CPU.
pytestmark = pytest.mark.skipif(
    not hasattr(FSDPModule, "set_custom_reduce_scatter"),
    reason=f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter",
)

IN, HIDDEN, OUT = 32, 256, 8


def make(seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)
    )
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    return net


def shard(net: nn.Module, mesh=None, policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    # Every rank's CPU, also where a GPU is present (fully_shard's own default is the GPU's mesh).
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    options = {"mp_policy": policy} if policy is not None else {}
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(net, mesh=mesh, **options)
    return net


def hsdp_mesh(shards: int = 2):
    """2 replicas, each sharding the model over `shards` ranks."""
    return init_device_mesh("cpu", (2, shards), mesh_dim_names=("replicate", "shard"))


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed linear teacher's labels: a task the model can learn, so losses can be compared."""
    teacher = torch.Generator().manual_seed(99)
    w = torch.randn(IN, OUT, generator=teacher)
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    x = torch.randn(size, IN, generator=g)
    return x, (x @ w).argmax(dim=1)


def train(net: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def full(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])


def held_out_loss(net: nn.Module) -> float:
    x, y = batch(rank=7, step=10_000, size=2048)  # no rank trains on it
    with torch.no_grad():
        return float(nn.functional.cross_entropy(net(x), y))


def config(**kwargs) -> gradsync.SyncConfig:
    return gradsync.SyncConfig(**{"warmup_steps": 2, "min_compress_numel": 0, **kwargs})


def same_as_fsdp_and_bf16_formula(rank: int, world_size: int) -> dict:
    out = {}
    for name in ("fsdp", "none"):
        net = shard(make(0))
        if name != "fsdp":
            gradsync.register(net, config(compressor=name))
        opt = sgd(net)
        train(net, opt, rank, range(6))
        out[name] = full(net)
    # One bf16 step past warm-up: the averaged gradient against the formula.
    net, plain = shard(make(0)), make(0)
    state = gradsync.register(net, config(compressor="bf16", warmup_steps=0))
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(net(x), y).backward()
    nn.functional.cross_entropy(plain(x), y).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    summed = torch.zeros_like(mine)
    for g in every:  # rank order, as the owners sum
        summed += g.bfloat16().float()
    out["bf16 grad"] = torch.cat([p.grad.full_tensor().reshape(-1) for p in net.parameters()])
    out["bf16 formula"] = summed / world_size
    out["bf16 ratio"] = state.stats()["last_step"]["compression_ratio"]
    return out


def test_uncompressed_is_fsdps_own_and_bf16_averages_the_rounded_gradients() -> None:
    for rank, out in enumerate(run_ranks(same_as_fsdp_and_bf16_formula, 3, timeout_s=120)):
        assert torch.equal(out["none"], out["fsdp"]), f"rank {rank}: gradsync's fp32 reduce-scatter differs"
        assert torch.equal(out["bf16 grad"], out["bf16 formula"]), f"rank {rank}: bf16 average differs"
        assert out["bf16 ratio"] >= 1.9, out["bf16 ratio"]


def losses(rank: int, world_size: int, steps: int) -> dict:
    out = {}
    for name in ("fsdp", "bf16", "int4"):
        net = shard(make(0))
        if name != "fsdp":
            state = gradsync.register(net, config(compressor=name))
        opt = sgd(net)
        train(net, opt, rank, range(steps))
        out[name] = held_out_loss(net)
        if name != "fsdp":
            out[f"{name} ratio"] = state.stats()["last_step"]["compression_ratio"]
    return out


@pytest.mark.slow  # a convergence run (~17 s): `make test-all`
def test_compressed_training_ends_within_half_a_percent_of_fsdps_held_out_loss() -> None:
    out = run_ranks(losses, 2, (200,), timeout_s=180)[0]
    assert out["fsdp"] < 0.5 * held_out_loss_at_start(), out  # it learned: the comparison means something
    for name in ("bf16", "int4"):
        assert abs(out[name] - out["fsdp"]) <= 0.005 * out["fsdp"], out
    assert out["int4 ratio"] > 5, out


def held_out_loss_at_start() -> float:
    return held_out_loss(make(0))


def resume(rank: int, world_size: int, where: str, replicated: bool = False) -> dict:
    cfg = config(compressor="int4")  # error feedback: a memory per rank
    mesh = hsdp_mesh() if replicated else None

    def sharded(seed: int) -> tuple[nn.Module, gradsync.SyncState]:
        net = shard(make(seed), mesh["shard"] if mesh else None)
        replicas = mesh["replicate"].get_group() if mesh else None
        return net, gradsync.register(net, cfg, replicate_group=replicas)

    continuous, _ = sharded(0)
    opt = sgd(continuous)
    train(continuous, opt, rank, range(16))
    first, state = sharded(0)
    opt = sgd(first)
    train(first, opt, rank, range(8))
    model_sd, optim_sd = get_state_dict(first, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "gradsync": state}, checkpoint_id=where)
    out = {"continuous": full(continuous)}
    for with_state in (True, False):
        net, state = sharded(1)
        opt = sgd(net)
        model_sd, optim_sd = get_state_dict(net, opt)
        loaded = {"model": model_sd, "optim": optim_sd, **({"gradsync": state} if with_state else {})}
        dcp.load(loaded, checkpoint_id=where)
        set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        train(net, opt, rank, range(8, 16))
        out["resumed" if with_state else "without_state"] = full(net)
    return out


@pytest.mark.parametrize("replicated", [False, True], ids=["fsdp", "hsdp"])
def test_a_dcp_checkpoint_resumes_the_exact_trajectory(tmp_path, replicated: bool) -> None:
    ranks = 4 if replicated else 2
    for rank, out in enumerate(run_ranks(resume, ranks, (str(tmp_path), replicated), timeout_s=180)):
        assert torch.equal(out["resumed"], out["continuous"]), f"rank {rank} left the trajectory"
        assert not torch.equal(out["without_state"], out["continuous"]), "gradsync's state made no difference"


def hsdp_gradients(rank: int, world_size: int) -> dict:
    mesh = hsdp_mesh(world_size // 2)
    out = {}
    for name in ("none", "bf16"):
        net, plain = shard(make(0), mesh["shard"]), make(0)
        cfg = config(compressor=name, warmup_steps=0)
        state = gradsync.register(net, cfg, replicate_group=mesh["replicate"].get_group())
        x, y = batch(rank, 0)
        nn.functional.cross_entropy(net(x), y).backward()
        nn.functional.cross_entropy(plain(x), y).backward()
        mine = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        out[f"{name} mean"] = torch.stack(every).mean(dim=0)
        out[f"{name} grad"] = torch.cat([p.grad.full_tensor().reshape(-1) for p in net.parameters()])
        out[f"{name} ratio"] = state.replica_state.stats()["last_step"]["compression_ratio"]
    return out


@pytest.mark.parametrize("shards", [2, 1])  # with one, FSDP runs no reduce-scatter at all
def test_hsdp_averages_over_every_rank_and_replicas_hold_the_same_bits(shards: int) -> None:
    results = run_ranks(hsdp_gradients, 2 * shards, timeout_s=120)
    for name, tolerance in (("none", 1e-6), ("bf16", 1e-2)):
        mean, grad = results[0][f"{name} mean"], results[0][f"{name} grad"]
        assert torch.allclose(grad, mean, rtol=tolerance, atol=tolerance * mean.abs().max()), name
        assert not torch.allclose(grad, mean / 2, rtol=tolerance), "the test cannot tell a half-average"
        for rank, out in enumerate(results[1:], start=1):
            assert torch.equal(out[f"{name} grad"], grad), (
                f"{name}: rank {rank}'s gradient differs from rank 0's"
            )
    assert results[0]["bf16 ratio"] >= 1.9 and results[0]["none ratio"] == 1.0, results[0]


def hsdp_skipped_step(rank: int, world_size: int) -> dict:
    """Replica 1 (ranks 2 and 3) meets a non-finite loss at step 3; replica 0's is finite."""
    mesh = hsdp_mesh(2)
    net = shard(make(0), mesh["shard"])
    state = gradsync.register(net, config(), replicate_group=mesh["replicate"].get_group())  # int4, ef
    opt = sgd(net)
    train(net, opt, rank, range(3))
    before = {g: p.feedback.error.clone() for g, p in state.points.items()}  # type: ignore[attr-defined]
    x, y = batch(rank, 3)
    loss = nn.functional.cross_entropy(net(x), y)
    (loss * math.nan if rank >= 2 else loss).backward()
    finite = all(bool(p.grad.full_tensor().isfinite().all()) for p in net.parameters())
    after = {g: p.feedback.error for g, p in state.points.items()}  # type: ignore[attr-defined]
    return {
        "finite": finite,
        "kept": all(torch.equal(before[g], after[g]) for g in before),
        "groups": len(before),
    }


def test_an_hsdp_step_skipped_on_one_replica_leaves_no_trace_on_the_others() -> None:
    results = run_ranks(hsdp_skipped_step, 4, timeout_s=120)
    for rank, out in enumerate(results):
        assert out["groups"] > 0
        assert not out["finite"], f"rank {rank}: the step must be NaN everywhere (AMP skips it)"
        assert out["kept"], f"rank {rank}: the skipped step changed its error memories"


def hsdp_rates(rank: int, world_size: int) -> dict:
    mesh = hsdp_mesh(2)
    net = shard(make(0), mesh["shard"])
    state = gradsync.register(net, config(), replicate_group=mesh["replicate"].get_group())  # int4, ef
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(5):
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    replicas = state.replica_state
    assert replicas is not None
    return {
        "shard": {p.rates for p in state.points.values()},
        "replicas": {p.rates for p in replicas.points.values()},
        "lr": opt.param_groups[0]["lr"],
    }


def test_hsdp_memories_follow_the_learning_rate_in_both_exchanges() -> None:
    # Held at the rate of the step that last added to them (the step before the scheduler's
    # last halving): in parameter units, as DDP's and the shard's memories are.
    for out in run_ranks(hsdp_rates, 4, timeout_s=120):
        assert out["shard"] == out["replicas"] == {(out["lr"] * 2,)}, out


def backward_refused(net: nn.Module, rank: int) -> str | None:
    """What one backward pass of `net` is refused with (a ValueError's message), or None."""
    x, y = batch(rank, 0)
    try:
        nn.functional.cross_entropy(net(x), y).backward()
    except ValueError as error:
        return str(error)
    return None


def refusals(rank: int, world_size: int) -> dict:
    out = {}
    cases = {
        "topk": config(compressor="topk"),
        "plan": config(plan="auto"),
        "ef21": config(compressor="int8", error_feedback="ef21"),
    }
    for name, cfg in cases.items():
        try:
            gradsync.register(shard(make(0)), cfg)
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    two_d = shard(make(0), init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    ddp = torch.nn.parallel.DistributedDataParallel(make(0))
    for name, model in (("native hsdp", two_d), ("ddp", ddp), ("crossing", shard(make(0)))):
        try:
            gradsync.register(model, config(compressor="bf16"), replicate_group=dist.group.WORLD)
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduces in bf16, the gradients' dtype
    net = shard(make(0), policy=policy)
    gradsync.register(net, config(compressor="bf16"))
    out["bf16 reduction"] = backward_refused(net, rank)
    return out


def test_what_fsdp_cannot_run_is_refused_by_name() -> None:
    out = run_ranks(refusals, 2, timeout_s=60)[0]
    assert "fixed-size dense payloads" in out["topk"] and "'topk'" in out["topk"], out
    assert "drop plan" in out["plan"], out
    assert "'ef21'" in out["ef21"] and "('none', 'ef')" in out["ef21"], out
    assert "reduce_dtype=torch.float32" in out["bf16 reduction"], out
    assert "2-D mesh" in out["native hsdp"] and 'mesh=mesh["shard"]' in out["native hsdp"], out
    assert "drop replicate_group" in out["ddp"], out
    assert "[0, 1]" in out["crossing"] and "meet at this rank" in out["crossing"], out  # WORLD shards too


def registration_checks(rank: int, world_size: int) -> dict:
    out: dict = {}
    mesh = hsdp_mesh(2)
    replicas = mesh["replicate"].get_group()
    # Replica 1 (ranks 2 and 3) warms up longer: each shard group agrees within itself, so only a
    # check over every rank sees it, before anything is exchanged.
    cfg = config(compressor="int4", warmup_steps=3 if rank >= 2 else 2)
    try:
        gradsync.register(shard(make(0), mesh["shard"]), cfg, replicate_group=replicas)
        out["differing"] = None
    except ValueError as error:
        out["differing"] = str(error)
    # A gradient divide factor with replicas: FSDP divides, then gradsync averages again.
    net = shard(make(0), mesh["shard"])
    gradsync.register(net, config(compressor="int4"), replicate_group=replicas)
    for layer in net:  # each module's own (the root's holds no parameters)
        if isinstance(layer, nn.Linear):
            layer.set_gradient_divide_factor(2.0)  # type: ignore[operator]
    out["divide factor"] = backward_refused(net, rank)
    # A state saved sharded over all 4 ranks, loaded where the model is sharded over 2 of them.
    net = shard(make(0))
    state = gradsync.register(net, config(compressor="int4", warmup_steps=0))
    train(net, sgd(net), rank, range(2))
    saved, calls = state.state_dict(), dict(state._calls)
    again = gradsync.register(shard(make(0)), config(compressor="int4", warmup_steps=0))
    again.load_state_dict(saved)
    out["calls kept"] = again._calls == calls and len(calls) > 0
    other = gradsync.register(shard(make(0), mesh["shard"]), config(compressor="int4", warmup_steps=0))
    try:
        other.load_state_dict(saved)
        out["sharding"] = None
    except ValueError as error:
        out["sharding"] = str(error)
    return out


def part_of_the_ranks(rank: int, world_size: int) -> dict:
    # A model sharded over ranks 0 and 1 of 4 (a pipeline stage, a second model), registered by
    # those two only: its configs are compared among them, not over every rank (which would wait).
    pair = dist.new_group([0, 1])  # every rank makes it, as new_group asks
    if rank >= 2:
        return {"stepped": None}
    mesh = DeviceMesh.from_group(pair, "cpu")
    net = shard(make(0), mesh)
    state = gradsync.register(net, config(compressor="int4", warmup_steps=0))
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(net(x), y).backward()
    return {"stepped": state.step}


def one_rank_shards(rank: int, world_size: int) -> dict:
    # Shards of one rank: FSDP runs no reduce-scatter, so only the replica hook sees the dtype.
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    net = shard(make(0), mesh["shard"], MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    gradsync.register(net, config(compressor="int4"), replicate_group=mesh["replicate"].get_group())
    return {"bf16": backward_refused(net, rank)}


def test_registration_compares_every_ranks_config_and_what_cannot_be_averaged_is_refused() -> None:
    results = run_ranks(registration_checks, 4, timeout_s=120)
    for rank, out in enumerate(results):
        assert out["differing"] is not None and "warmup_steps" in out["differing"], (rank, out)
        assert out["differing"] == results[0]["differing"], "every rank raises the same message"
        assert "set_gradient_divide_factor" in out["divide factor"], (rank, out)
        assert out["calls kept"], rank
        assert "sharded over groups of 4 ranks" in out["sharding"], (rank, out)
        assert "this run shards them over 2" in out["sharding"], (rank, out)
    for rank, out in enumerate(run_ranks(one_rank_shards, 2, timeout_s=60)):
        assert "reduce_dtype=torch.float32" in out["bf16"], (rank, out)
    stepped = [out["stepped"] for out in run_ranks(part_of_the_ranks, 4, timeout_s=60, pg_timeout_s=20)]
    assert stepped == [1, 1, None, None], stepped
