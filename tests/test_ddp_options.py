"""gradsync under DDP's own options and PyTorch's training tools, each against a reference run:
static_graph and find_unused_parameters must not change a bit of what gradsync does; gradient
accumulation under no_sync, autocast and torch.compile must train as their reference does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync import SyncConfig, tuner
from gradsync.tuner import AutoState

STEPS = 6
CONFIGS = {
    "int4": {},  # the default codec (two-shot), compressing every bucket
    "plan": {"compressor": "fp16", "plan": "auto"},
}


class Net(nn.Module):
    """Two layers and one parameter the forward pass never uses (DDP must be told)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(32, 256)
        self.spare = nn.Linear(3, 3)  # never used in the forward pass
        self.out = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


class Used(Net):
    """Every parameter used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0 * sum(p.sum() for p in self.spare.parameters())


def batch(step: int, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + part)
    return torch.randn(8, 32, generator=generator), torch.randint(8, (8,), generator=generator)


def train(
    config: dict[str, Any] | None,
    ddp_options: dict[str, Any] | None = None,
    step_fn: Callable[[nn.Module, int], None] | None = None,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    net: Callable[[], nn.Module] = Net,
    steps: int = STEPS,
) -> list[torch.Tensor]:
    """STEPS steps of SGD on `net` under DDP with `ddp_options` (default: two buckets, unused
    parameters found), gradsync with `config` (None: plain DDP); the parameters after."""
    options = {"bucket_cap_mb": 0.01, "find_unused_parameters": True, **(ddp_options or {})}
    ddp = DistributedDataParallel(net(), **options)
    state = None
    if config is not None:
        state = gradsync.register(ddp, SyncConfig(warmup_steps=2, min_compress_numel=0, **config))
    model = wrap(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        if step_fn is None:
            x, y = batch(step)
            nn.functional.cross_entropy(model(x), y).backward()
        else:
            step_fn(model, step)
        optimizer.step()
    if isinstance(state, AutoState):
        assert state.plan is not None  # planned, and executed its plan since
    elif state is not None:
        assert state.stats()["total"]["compressed_groups"] > 0  # gradsync did compress
    return [p.detach().clone() for p in ddp.parameters()]


def test_static_graph_and_find_unused_parameters_change_nothing_an_elementwise_codec_does(
    one_rank: None,
) -> None:
    fp16 = {"compressor": "fp16"}
    reference = train(fp16)
    for options, net in (
        ({"static_graph": True, "find_unused_parameters": False}, Net),
        ({"find_unused_parameters": False}, Used),
    ):
        other = train(fp16, options, net=net)
        if net is Used:
            reference = train(fp16, net=Used)
        assert all(torch.equal(a, b) for a, b in zip(other, reference, strict=True)), options


@pytest.mark.parametrize("name", CONFIGS)
def test_static_graph_compresses_ddps_rebuilt_buckets_from_the_end_of_warm_up(
    one_rank: None, name: str
) -> None:
    # DDP rebuilds its buckets after the second iteration under static_graph, not the first: its
    # buckets differ from a dynamic graph's, so blockwise codecs round other blocks (close, not equal).
    steps = tuner.warmup_steps(SyncConfig(**CONFIGS[name])) + 3
    static = train(CONFIGS[name], {"static_graph": True, "find_unused_parameters": False}, steps=steps)
    dynamic = train(CONFIGS[name], steps=steps)
    for a, b in zip(static, dynamic, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


def test_accumulating_under_no_sync_equals_one_backward_of_the_summed_loss(one_rank: None) -> None:
    def accumulated(model: nn.Module, step: int) -> None:
        with model.no_sync():
            x, y = batch(step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
        x, y = batch(step, 1)
        nn.functional.cross_entropy(model(x), y).backward()  # this backward syncs

    def summed(model: nn.Module, step: int) -> None:
        loss = sum(nn.functional.cross_entropy(model(x), y) for x, y in (batch(step, 0), batch(step, 1)))
        loss.backward()

    fp16 = {"compressor": "fp16"}
    for a, b in zip(train(fp16, step_fn=accumulated), train(fp16, step_fn=summed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_autocast_trains_as_plain_ddp_does_within_fp16_rounding(one_rank: None) -> None:
    def autocast(model: nn.Module, step: int) -> None:
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()

    with_gradsync = train({"compressor": "fp16"}, step_fn=autocast)
    plain = train(None, step_fn=autocast)
    for a, b in zip(with_gradsync, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(with_gradsync, plain, strict=True))  # fp16 did round


def test_torch_compile_trains_as_eager_does(one_rank: None) -> None:
    # One bucket: DDP's graph splitter under torch.compile wants its first bucket no larger.
    one_bucket = {"bucket_cap_mb": 25, "find_unused_parameters": False}
    fp16 = {"compressor": "fp16"}
    compiled = train(fp16, one_bucket, wrap=lambda m: torch.compile(m, backend="aot_eager"), net=Used)
    eager = train(fp16, one_bucket, net=Used)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
