"""DGC without sparsity or masking is momentum SGD: a comparison with plain DDP.

With ratio=1 and masking=False, each rank's DGC sends its whole accumulator, which is then just
its momentum-corrected gradient u_r <- m u_r + g_r / n (the accumulator v is zero after every
send). The decoded sum over ranks is sum_r u_r = m U + mean_r g_r: exactly the momentum buffer of
the averaged gradient, which torch.optim.SGD(momentum=m) keeps (dampening 0, first buffer = the
gradient). gradsync does not compress during its warm-up, so the reference is plain DDP with
SGD without momentum for the warm-up steps and a fresh SGD(momentum=m) from then on.

The sums are taken in another order (per rank, then over ranks; against over ranks, then the
momentum), so the parameters agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import config, ddp, flat_params, make_mlp, run_ranks, train

import gradsync

STEPS = 12
WARMUP_STEPS = 2
LR = 0.05
MOMENTUM = 0.9
BUCKET_CAP_MB = 0.004  # two buckets after DDP's rebuild: two DGC states
RTOL, ATOL = 1e-5, 1e-7


def _sgd(model: torch.nn.Module, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)


def dgc_and_momentum_sgd(rank: int, world_size: int) -> dict:
    out = {"initial": flat_params(make_mlp(seed=0))}

    model = ddp(make_mlp(seed=0), bucket_cap_mb=BUCKET_CAP_MB)
    args = {"ratio": 1.0, "masking": False, "momentum": MOMENTUM}
    state = gradsync.register(
        model, config(compressor="dgc", compressor_args=args, warmup_steps=WARMUP_STEPS)
    )
    train(model, _sgd(model, 0.0), rank, range(STEPS))
    out["dgc"] = flat_params(model)
    out["compressed_groups"] = state.stats()["total"]["compressed_groups"]

    # Plain DDP: no momentum during gradsync's warm-up, momentum SGD (a fresh buffer) after it.
    reference = ddp(make_mlp(seed=0), bucket_cap_mb=BUCKET_CAP_MB)
    train(reference, _sgd(reference, 0.0), rank, range(WARMUP_STEPS))
    train(reference, _sgd(reference, MOMENTUM), rank, range(WARMUP_STEPS, STEPS))
    out["reference"] = flat_params(reference)

    # Near misses that the tolerance must tell apart: momentum from the first step, and none.
    for label, momentum in (("momentum_from_step_0", MOMENTUM), ("no_momentum", 0.0)):
        other = ddp(make_mlp(seed=0), bucket_cap_mb=BUCKET_CAP_MB)
        train(other, _sgd(other, momentum), rank, range(STEPS))
        out[label] = flat_params(other)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(dgc_and_momentum_sgd, 2, timeout_s=120)


def test_dgc_with_ratio_one_and_no_masking_trains_as_momentum_sgd(runs: list[dict]) -> None:
    for rank, out in enumerate(runs):
        assert out["compressed_groups"] == 2 * (STEPS - WARMUP_STEPS), f"rank {rank}"
        assert not torch.equal(out["reference"], out["initial"]), "the reference did not train"
        diff = (out["dgc"] - out["reference"]).abs().max().item()
        assert torch.allclose(out["dgc"], out["reference"], rtol=RTOL, atol=ATOL), (
            f"rank {rank}: DGC differs from momentum SGD by up to {diff:.3g}"
        )
        assert torch.equal(out["dgc"], runs[0]["dgc"]), f"rank {rank} differs from rank 0"


@pytest.mark.parametrize("label", ["momentum_from_step_0", "no_momentum"])
def test_the_tolerance_tells_other_momentum_schedules_apart(runs: list[dict], label: str) -> None:
    # Otherwise the comparison above would hold for a DGC that ignored its momentum, or that
    # started it during the warm-up.
    for out in runs:
        tolerance = ATOL + RTOL * out["reference"].abs()
        assert bool(((out[label] - out["reference"]).abs() > 100 * tolerance).any()), label
