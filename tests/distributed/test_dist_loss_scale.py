"""Error memories follow AMP's loss scale: a run under GradScaler trains as the run without it.

GradScaler multiplies every gradient by its scale S, a power of two, which scales floats exactly,
and the codecs here are scale-equivariant (int4's blockwise absmax, top-k's magnitudes, DGC's
accumulators): so where the memories are scaled by S_now / S_then as S moves, the averaged
gradients are S times the unscaled run's bit for bit, and after GradScaler divides them by S the
two runs step alike. S doubles every 2 good steps here, and an overflow on one rank halves it
(that step is skipped: the reference skips its batch too). Without following, the runs differ.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import batch, config, ddp, flat_params, make_mlp, run_ranks, sgd
from torch import nn

import gradsync

WORLD_SIZE = 2
STEPS = 10
OVERFLOW_STEP = 6  # a compressed step after the scale has doubled twice
CAP_MB = 0.004  # several buckets
CASES = [
    ("int4", {}, "auto"),  # residual memory and the two-shot owners' shard memory
    ("topk", {"ratio": 0.05}, "ef"),
    ("topk", {"ratio": 0.05}, "momentum"),  # velocity and the applied direction too
    ("topk", {"ratio": 0.05}, "ef21"),  # mirrors of the gradient
    ("dgc", {"ratio": 0.05}, "none"),  # the codec's own momentum and accumulator
]
CASE_IDS = [f"{name}+{form}" for name, _, form in CASES]


def _train(rank: int, cfg: gradsync.SyncConfig, scaled: bool, follow: bool, overflow: bool) -> torch.Tensor:
    """The parameters after STEPS steps (OVERFLOW_STEP skipped where `overflow`): under
    GradScaler where `scaled`, with the memories following its scale where `follow`."""
    model = ddp(make_mlp(seed=0), bucket_cap_mb=CAP_MB)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaled else None
    state = gradsync.register(model, cfg)
    if not follow:
        state._follows_scale = False
    opt = sgd(model)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if overflow and step == OVERFLOW_STEP:
            if scaler is None:
                continue  # the reference never has this batch
            loss = loss * (math.inf if rank == 1 else 1.0)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    del scaler
    return flat_params(model)


def loss_scale_runs(rank: int, world_size: int) -> dict:
    out = {}
    for name, args, form in CASES:
        cfg = config(compressor=name, compressor_args=args, error_feedback=form)
        for overflow in (False, True):
            out[name, form, overflow] = {
                "reference": _train(rank, cfg, scaled=False, follow=True, overflow=overflow),
                "scaled": _train(rank, cfg, scaled=True, follow=True, overflow=overflow),
                "unfollowed": _train(rank, cfg, scaled=True, follow=False, overflow=overflow),
            }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(loss_scale_runs, WORLD_SIZE, timeout_s=120)


@pytest.mark.parametrize("overflow", [False, True], ids=["growing", "overflow"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_run_under_grad_scaler_trains_as_the_run_without_it(
    runs: list[dict], case: tuple, overflow: bool
) -> None:
    name, _, form = case
    for rank, out in enumerate(runs):
        result = out[name, form, overflow]
        assert torch.isfinite(result["scaled"]).all()
        assert torch.equal(result["scaled"], result["reference"]), f"rank {rank}"
        # The check has teeth: memories left at the scale they were made at train otherwise.
        assert not torch.equal(result["unfollowed"], result["reference"]), f"rank {rank}: void"
