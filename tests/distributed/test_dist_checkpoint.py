"""Saving and restoring mid-run continues the exact trajectory of an uninterrupted run.

Run A trains 12 steps. Run B trains 6, saves model, optimizer and gradsync state to bytes, then
builds a fresh model (initialized differently), DDP and gradsync state, loads all three and trains
the remaining 6. Their parameters must be torch.equal. Run C restores the model and optimizer but
not gradsync's state: it must differ from A, which shows the state carries what matters (error
memories, random streams, PowerSGD's warm start, DGC's accumulators and Signum's momentum) and
the comparison has teeth.

The fresh DDP model matters: in its first iteration DDP puts all parameters into one bucket in
definition order, and it only rebuilds its buckets (in gradient-ready order) afterwards, so the
first step after the restore sees a bucket layout other than the one the state was saved with.
"""

from __future__ import annotations

import io

import pytest
import torch
from dist_harness import config, ddp, flat_params, make_mlp, run_ranks, sgd, train

import gradsync

STEPS = 12
SAVE_AT = 6
CASES = [
    ("topk", {"ratio": 0.05}, "ef"),
    ("randk", {"ratio": 0.05}, "ef21"),
    ("qsgd", {}, "none"),
    ("powersgd", {"rank": 2}, "ef"),
    ("topk", {"ratio": 0.05}, "econtrol"),
    # Codec state of their own: DGC's u, v, step count (its sparsity schedule runs past the
    # checkpoint) and sampling stream; Signum's momentum.
    ("dgc", {"ratio": 0.05, "sparsity_warmup_steps": 8, "sample_ratio": 0.5}, "auto"),
    ("signum", {}, "auto"),
]
# None: DDP's default, one bucket; 0.004 MB: two buckets after the rebuild.
BUCKET_CAPS_MB = [None, 0.004]


def _run(rank: int, cfg: gradsync.SyncConfig, cap_mb: float | None, seed: int, steps: range, ckpt=None):
    model = ddp(make_mlp(seed=seed), bucket_cap_mb=cap_mb)
    state = gradsync.register(model, cfg)
    opt = sgd(model)
    if ckpt is not None:
        saved = torch.load(io.BytesIO(ckpt))  # weights_only: a checkpoint needs no pickled code
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        if "gradsync" in saved:
            state.load_state_dict(saved["gradsync"])
    train(model, opt, rank, steps)
    return model, opt, state


def _checkpoint(model, opt, state, with_gradsync: bool = True) -> bytes:
    saved = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
    if with_gradsync:
        saved["gradsync"] = state.state_dict()
    buf = io.BytesIO()
    torch.save(saved, buf)
    return buf.getvalue()


def continuous_and_resumed(
    rank: int, world_size: int, cap_mb: float | None, cases: list = CASES, save_at: int = SAVE_AT
) -> dict:
    out = {}
    for name, args, form in cases:
        cfg = config(compressor=name, compressor_args=args, error_feedback=form)
        continuous, _, _ = _run(rank, cfg, cap_mb, 0, range(STEPS))
        first_half = _run(rank, cfg, cap_mb, 0, range(save_at))
        resumed, _, state = _run(rank, cfg, cap_mb, 1, range(save_at, STEPS), _checkpoint(*first_half))
        without_state, _, _ = _run(
            rank, cfg, cap_mb, 1, range(save_at, STEPS), _checkpoint(*first_half, with_gradsync=False)
        )
        out[name, form] = {
            "continuous": flat_params(continuous),
            "resumed": flat_params(resumed),
            "without_state": flat_params(without_state),
            "step": state.step,
        }
    return out


@pytest.fixture(scope="module", params=BUCKET_CAPS_MB, ids=["one_bucket", "two_buckets"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(continuous_and_resumed, 2, (request.param,), timeout_s=120)


@pytest.mark.parametrize("case", [(n, f) for n, _, f in CASES], ids=[f"{n}+{f}" for n, _, f in CASES])
def test_restored_run_continues_the_exact_trajectory(runs: list[dict], case: tuple[str, str]) -> None:
    for rank, out in enumerate(runs):
        result = out[case]
        assert result["step"] == STEPS
        diff = (result["resumed"] - result["continuous"]).abs().max().item()
        assert torch.equal(result["resumed"], result["continuous"]), (
            f"rank {rank}: the resumed run differs from the continuous one by up to {diff:.3g}"
        )
        assert not torch.equal(result["without_state"], result["continuous"]), (
            f"rank {rank}: dropping gradsync's state changed nothing, so the test proves nothing"
        )


def test_a_checkpoint_taken_as_warm_up_ends_resumes_exactly() -> None:
    """Saved before any compressed step, the state has no memories yet, but it knows DDP's
    rebuilt buckets (seen in warm-up), so the first, compressed, step after the restore uses them."""
    warmup = config().warmup_steps
    case = ("topk", {"ratio": 0.05}, "ef")
    runs = run_ranks(continuous_and_resumed, 2, (0.004, [case], warmup), timeout_s=120)
    for rank, out in enumerate(runs):
        result = out["topk", "ef"]
        assert torch.equal(result["resumed"], result["continuous"]), f"rank {rank} left the trajectory"
