"""gradsync on CUDA tensors: NCCL on one GPU, and gloo ranks sharing one GPU. Skipped without a GPU.

What only a GPU shows: a torch Future that carries CUDA tensors records their streams' events and
finds those tensors by pickling its value, so every value on the hook's path must show its tensors
(an exchange's outcome holds closures), and every future handed on must carry the device, or its
waiter may read a tensor before the GPU has written it. And tables built on the CPU (the sparse
schemes' row partitions) must meet indices on the GPU.

Checks against references, as the CPU tests do: uncompressed is DDP bit for bit; every codec
trains to finite parameters near DDP's (one rank: the codec's own error only); across two ranks
every rank ends with the same bits; a checkpoint lands on this process's own GPU.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import config, run_ranks
from torch import nn
from torch.futures import Future

import gradsync
from gradsync.comm import LocalComm
from gradsync.regroup import Regroup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CODECS = ["none", "int4", "int8", "fp16", "bf16", "powersgd", "topk", "qsgd", "randk", "signum"]
STEPS = 12


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)]
    return nn.Sequential(*layers).cuda()


def _train(
    model: nn.Module, rank: int, steps: int = STEPS, opt: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(32, 256, device="cuda", generator=g)
        y = torch.randint(0, 10, (32,), device="cuda", generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _ddp() -> nn.Module:
    return nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=1)  # several buckets


def _every_codec(rank: int, world_size: int) -> dict[str, Any]:
    reference = _train(_ddp(), rank)
    out: dict[str, Any] = {"ddp": reference}
    for name in CODECS:
        model = _ddp()
        state = gradsync.register(model, config(compressor=name))
        out[name] = _train(model, rank)
        out[f"{name} compressed"] = state.stats()["total"]["compressed_groups"]
    model = _ddp()
    state = gradsync.register(model, gradsync.SyncConfig(plan="auto", min_compress_numel=0))
    out["auto"] = _train(model, rank, steps=40)
    out["auto adopted at"] = state.stats()["auto"]["adopted_at_step"]
    return out


def test_every_codec_on_one_gpu_by_nccl() -> None:
    got = run_ranks(_every_codec, 1, backend="nccl", timeout_s=300)[0]
    reference = got["ddp"]
    assert torch.equal(got["none"], reference)  # uncompressed: DDP's own sums, bit for bit
    assert torch.isfinite(got["auto"]).all() and got["auto adopted at"] is not None
    for name in CODECS[1:]:
        assert torch.isfinite(got[name]).all(), name
        assert got[f"{name} compressed"] > 0, name
        if name != "signum":  # a sign's step is another optimizer's
            relative = float((got[name] - reference).norm() / reference.norm())
            assert relative < 0.05, (name, relative)


def _ranks_agree(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    out = {"ddp": _train(_ddp(), rank)}
    for name in CODECS:
        model = _ddp()
        gradsync.register(model, config(compressor=name))
        out[name] = _train(model, rank)
    return out


def test_gloo_ranks_on_one_gpu_end_with_the_same_bits() -> None:
    ranks = run_ranks(_ranks_agree, 2, timeout_s=300)
    for name in ["ddp", *CODECS]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    assert torch.equal(ranks[0]["none"], ranks[0]["ddp"])


def _sparse_and_sharded(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    for scheme in ("balanced", "recursive-doubling", "agsparse"):  # embedding rows from dense gradients
        net = nn.Sequential(nn.Embedding(4096, 32), nn.Flatten(), nn.Linear(32 * 8, 4)).cuda()
        model = nn.parallel.DistributedDataParallel(net)
        gradsync.register(model, gradsync.SyncConfig(compressor="none", sparse_scheme=scheme))
        reference = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Embedding(4096, 32), nn.Flatten(), nn.Linear(32 * 8, 4)).cuda()
        )
        reference.load_state_dict(model.state_dict())
        x = torch.randint(0, 4096, (64, 8), device="cuda")
        for m in (model, reference):
            m(x).sum().backward()
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        out[scheme] = all(torch.equal(a.grad, b.grad) for a, b in pairs)
    mesh = init_device_mesh("cuda", (1,))
    sharded = _mlp()
    fully_shard(sharded, mesh=mesh)
    gradsync.register(sharded, config(compressor="int8"))
    out["fsdp"] = _train(sharded, rank, steps=6)
    replicated = _mlp()
    fully_shard(replicated, mesh=mesh)
    gradsync.register(replicated, config(), replicate_group=dist.group.WORLD)
    out["hsdp"] = _train(replicated, rank, steps=6)
    model = _ddp()
    state = gradsync.register(model, config())
    _train(model, rank, steps=4)
    saved = io.BytesIO()
    torch.save(state.state_dict(), saved)
    for where, model in (("gpu", _ddp()), ("cpu", _mlp().cpu())):  # each: where its model is
        restored = gradsync.SyncState(config(), LocalComm(), model) if where == "cpu" else None
        restored = restored or gradsync.register(model, config())
        restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
        memories = [p.shard_error for p in restored.points.values() if p.shard_error is not None]
        memories += [p.feedback.error for p in restored.points.values()]
        out[f"restored on, {where} model"] = {memory.device.type for memory in memories}
    return out


def test_sparse_schemes_fsdp_and_checkpoints_on_one_gpu() -> None:
    got = run_ranks(_sparse_and_sharded, 1, backend="nccl", timeout_s=300)[0]
    for scheme in ("balanced", "recursive-doubling", "agsparse"):
        assert got[scheme], scheme  # the same gradients as DDP's
    assert torch.isfinite(got["fsdp"]).all() and torch.isfinite(got["hsdp"]).all()
    assert got["restored on, gpu model"] == {"cuda"}
    assert got["restored on, cpu model"] == {"cpu"}  # a GPU's checkpoint resumed on a CPU


def test_a_regrouped_bucket_waits_for_every_groups_gpu_work() -> None:
    # Group 0's average is written on a stream that first sleeps, group 1's at once: the bucket's
    # result must hold both, as its waiter's stream sees it.
    buffer = torch.zeros(2, device="cuda")
    regroup = Regroup({0: (0,), 1: (1,)})
    regroup.add(buffer, (0, 1), (1, 1), True)
    result = regroup.bucket_result(buffer, (0, 1), (1, 1))
    slow, fast = torch.cuda.Stream(), torch.cuda.Stream()
    first, second = Future(devices=[buffer.device]), Future(devices=[buffer.device])
    with torch.cuda.stream(slow):
        late = torch.zeros(1, device="cuda")
        torch.cuda._sleep(int(2e9))
        late.fill_(7.0)
        first.set_result(late)
    with torch.cuda.stream(fast):
        second.set_result(torch.full((1,), 9.0, device="cuda"))
    regroup.synced(0, first)
    regroup.synced(1, second)
    assert result.wait().tolist() == [7.0, 9.0]


def _nccl_transfer_clock(rank: int, world_size: int) -> dict[str, Any]:
    import time

    from gradsync.comm import TorchComm
    from gradsync.profile.collectives import _transfers_while

    comm = TorchComm()
    inputs = [torch.ones(1 << 20, device="cuda") for _ in range(2)]
    _transfers_while(comm, "allreduce", inputs, 1 << 20, None)  # NCCL's communicator, made once
    torch.cuda.synchronize()
    out: dict[str, Any] = {}
    steps: list[int] = []

    def compute(i: int) -> float:
        steps.append(i)
        started = time.perf_counter()
        torch.ones(256, 256, device="cuda").matmul(torch.ones(256, 256, device="cuda"))
        torch.cuda.current_stream().synchronize()
        return time.perf_counter() - started

    for name, work in (("alone", None), ("beside compute", compute)):
        # NCCL's stream waits for this stream's work: the transfers cannot end before this does.
        torch.cuda._sleep(int(2e8))
        seconds, busy = _transfers_while(comm, "allreduce", inputs, 1 << 20, work)
        out[name] = (seconds * len(inputs), busy)
    out["compute steps"] = len(steps)
    return out


def test_nccl_transfers_are_timed_to_the_gpus_end_not_to_their_launch() -> None:
    # NCCL's future completes once the collective is queued; the contention profile's clock must
    # read the transfers' end on the GPU (here held back by ~0.1 s of sleep on the compute stream).
    got = run_ranks(_nccl_transfer_clock, 1, backend="nccl", timeout_s=120)[0]
    for name in ("alone", "beside compute"):
        total, _ = got[name]
        assert total > 0.02, (name, total)  # a launch takes microseconds
    assert got["compute steps"] >= 1 and got["beside compute"][1] > 0


def _diloco_on_gpu(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain = _mlp()
    out["plain"] = _train(plain, rank)
    for name, options in (
        ("local sgd", {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}),
        ("half outer steps", {"sync_every": 2, "outer_lr": 0.5, "outer_momentum": 0.0}),
        ("streaming int4", {"sync_every": 2, "compressor": "int4", "fragments": 2, "delay": 1}),
    ):
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        outer = gradsync.DiLoCo(model, optimizer, **options)
        out[name] = _train(model, rank, opt=optimizer)
        outer.close()
        out[f"{name} syncs"] = outer.stats()["step"]
    return out


def test_diloco_on_one_gpu_by_nccl() -> None:
    got = run_ranks(_diloco_on_gpu, 1, backend="nccl", timeout_s=120)[0]
    # A world of one under Local SGD (H = 1, outer step 1, no momentum) is plain training.
    assert torch.allclose(got["local sgd"], got["plain"], atol=1e-6)
    # ... which a DiLoCo doing nothing would match too: half an outer step every 2nd step must not.
    moved = float((got["half outer steps"] - got["plain"]).norm() / got["plain"].norm())
    assert torch.isfinite(got["half outer steps"]).all() and moved > 1e-4, moved
    assert torch.isfinite(got["streaming int4"]).all()
    assert got["streaming int4 syncs"] == STEPS  # 2 fragments, each synced every 2nd step
