"""A step whose average is not finite in one group keeps nothing in any group.

AMP's GradScaler skips the optimizer step where any gradient is not finite. Where one rank's
gradient has an inf in one DDP bucket only, that bucket's average is NaN on every rank and the
other buckets' are finite; the step must leave no trace in those either: their error memories,
the two-shot owners' shard memories and their codecs' state are as before the step (put back where
their update ran before the bad bucket's exchange ended, never updated where it ran after), and
training goes on exactly as the run that never had that step. The inf sits in the first bucket
DDP sends (the last layer's bias) or in the last (the first layer's weight), so that the bad
bucket ends before the others and after them.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import batch, config, ddp, flat_params, make_mlp, run_ranks, sgd, train
from torch import nn

import gradsync

WORLD_SIZE = 3
BAD_RANK = 1
BAD_STEP = 4  # compressed (warm-up is 2), after compressed steps have filled the memories
AFTER_STEPS = 2
CAP_MB = 0.004  # several buckets of the small MLP
# (compressor, its arguments, error feedback): every memory form, the two-shot owners' memory
# (int4), a multi-round codec (PowerSGD) and codec state of its own (DGC); no random stream,
# which a skipped step advances on every rank alike (tests/distributed/test_dist_bad_inputs.py).
CASES = [
    ("int4", {}, "auto"),
    ("topk", {"ratio": 0.05}, "ef"),
    ("topk", {"ratio": 0.05}, "momentum"),
    ("topk", {"ratio": 0.05}, "ef21"),
    ("efsignsgd", {}, "econtrol"),
    ("powersgd", {"rank": 1, "rank_warmup_steps": 0}, "ef"),
    ("dgc", {"ratio": 0.05}, "none"),
]
CASE_IDS = [f"{name}+{form}" for name, _, form in CASES]
WHERE = {"first_bucket": -1, "last_bucket": 0}  # which parameter (of model.parameters()) goes bad


def _state(state: gradsync.SyncState) -> dict:
    """Every point's memories and codec state, by (bucket, name)."""
    out = {}
    for index, point in state.points.items():
        named = {**point.feedback.state_dict(), "shard_error": point.shard_error}
        out |= {(index, name): v for name, v in named.items() if isinstance(v, torch.Tensor)}
        out |= {(index, f"codec {name}"): v for name, v in point.codec.state_dict().items()}
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _bad_step(model: nn.Module, rank: int, where: str) -> int:
    """BAD_STEP's backward pass, with one inf entry in one parameter's gradient on BAD_RANK;
    returns that parameter's position."""
    position = WHERE[where] % len(list(model.parameters()))
    handle = None
    if rank == BAD_RANK:
        handle = list(model.parameters())[position].register_hook(_one_inf_entry)
    x, y = batch(rank, BAD_STEP)
    nn.functional.cross_entropy(model(x), y).backward()
    if handle is not None:
        handle.remove()
    return position


def _one_inf_entry(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[min(7, grad.numel() - 1)] = math.inf
    return grad


def one_bucket_not_finite(rank: int, world_size: int) -> dict:
    out = {}
    for name, args, form in CASES:
        cfg = config(compressor=name, compressor_args=args, error_feedback=form)
        for where in WHERE:
            model = ddp(make_mlp(seed=0), bucket_cap_mb=CAP_MB)
            state = gradsync.register(model, cfg)
            opt = sgd(model)
            train(model, opt, rank, range(BAD_STEP))
            before = _state(state)
            opt.zero_grad()
            bad = _bad_step(model, rank, where)
            grads = [p.grad.clone() for p in model.parameters()]
            after = _state(state)
            opt.zero_grad()  # the step is skipped, as GradScaler would
            train(model, opt, rank, range(BAD_STEP + 1, BAD_STEP + 1 + AFTER_STEPS))
            clean = ddp(make_mlp(seed=0), bucket_cap_mb=CAP_MB)
            gradsync.register(clean, cfg)
            clean_opt = sgd(clean)
            train(clean, clean_opt, rank, range(BAD_STEP))
            train(clean, clean_opt, rank, range(BAD_STEP + 1, BAD_STEP + 1 + AFTER_STEPS))
            out[name, form, where] = {
                "buckets": len(state.points),
                "bad_nan": bool(torch.isnan(grads[bad]).all()),
                "finite_params": sum(bool(torch.isfinite(g).all()) for g in grads),
                "held": any(bool(t.any()) for key, t in before.items() if isinstance(t, torch.Tensor)),
                "unchanged": {key: _same(before[key], after.get(key)) for key in before},
                "same_keys": before.keys() == after.keys(),
                "params": flat_params(model),
                "params_clean": flat_params(clean),
            }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(one_bucket_not_finite, WORLD_SIZE, timeout_s=120)


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_one_bucket_not_finite_leaves_every_bucket_as_before_the_step(
    runs: list[dict], case: tuple, where: str
) -> None:
    name, _, form = case
    for rank, out in enumerate(runs):
        result = out[name, form, where]
        # The check has teeth: several buckets, memories or state to keep, one bucket NaN and
        # others finite.
        assert result["buckets"] > 1 and result["held"], f"rank {rank}: nothing to check"
        assert result["bad_nan"] and result["finite_params"] > 0, f"rank {rank}: {result}"
        assert result["same_keys"], f"rank {rank}: the step made or dropped state"
        changed = [key for key, same in result["unchanged"].items() if not same]
        assert not changed, f"rank {rank}: the skipped step changed {changed}"


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_training_after_the_skipped_step_is_the_run_that_never_had_it(
    runs: list[dict], case: tuple, where: str
) -> None:
    name, _, form = case
    for rank, out in enumerate(runs):
        result = out[name, form, where]
        assert torch.equal(result["params"], result["params_clean"]), f"rank {rank}"
