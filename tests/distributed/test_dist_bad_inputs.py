"""Bad inputs fail loudly and the same way on every rank, and never hang.

- Ranks given different SyncConfigs: a ValueError on every rank, naming the ranks and their
  configs, before any gradient is exchanged; the process group stays usable.
- A rank with a NaN or Inf gradient: the averaged gradient is NaN on every rank (so AMP's
  GradScaler skips the step everywhere; a cast with nothing to protect carries the bad entries
  through the sum instead, non-finite on every rank, as PyTorch's own fp16 hook does), no error
  memory absorbs it, codecs with state of their own (DGC, Signum, random streams) advance exactly
  as if the gradient had been zero, and the next finite step trains normally with the ranks
  still identical. Every registered codec, with
  the feedback "auto" picks, including those whose payload holds no float (natural, signsgd,
  signum): only the flag at the end of each frame can tell the other ranks.
- register() on a module that is not DistributedDataParallel: TypeError.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.distributed as dist
from dist_harness import batch, config, ddp, flat_params, make_mlp, run_ranks, sgd, train
from torch import nn

import gradsync
from gradsync import compress, exchange
from gradsync.strategy import default_collective

# -- ranks configured differently ------------------------------------------------------------------

WORLD_SIZE = 3
# scenario -> (the odd rank, its config, everyone else's config, the differing field as reported)
MISMATCHES = {
    "ratio": (2, {"compressor_args": {"ratio": 0.02}}, {"compressor_args": {"ratio": 0.01}}, "'ratio': 0.02"),
    "warmup_steps": (0, {"warmup_steps": 3}, {"warmup_steps": 2}, "warmup_steps=3"),
}


def differently_configured_ranks(rank: int, world_size: int) -> dict:
    out = {}
    for scenario, (odd_rank, odd, usual, _) in MISMATCHES.items():
        model = ddp(make_mlp(seed=0))
        state = gradsync.register(model, config(compressor="topk", **(odd if rank == odd_rank else usual)))
        try:
            train(model, sgd(model), rank, range(1))
            out[scenario] = ("no error", "", state.step)
        except Exception as e:
            out[scenario] = (type(e).__name__, str(e), state.step)
    # The failed check left no rank inside a collective: the group still works.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    out["all_reduce_after"] = total.item()
    return out


@pytest.fixture(scope="module")
def mismatch_runs() -> list[dict]:
    return run_ranks(differently_configured_ranks, WORLD_SIZE, timeout_s=60)


@pytest.mark.parametrize("scenario", list(MISMATCHES))
def test_different_configs_raise_value_error_on_every_rank_naming_the_ranks(
    mismatch_runs: list[dict], scenario: str
) -> None:
    odd_rank, _, _, odd_text = MISMATCHES[scenario]
    for rank, out in enumerate(mismatch_runs):
        kind, message, steps = out[scenario]
        assert kind == "ValueError", f"rank {rank} got {kind}: {message}"
        assert "Pass the same SyncConfig" in message, message
        groups = {m[1]: m[2] for m in re.finditer(r"ranks \[([\d, ]+)\]: (.*?)   \(full", message)}
        named = sorted(int(r) for ranks in groups for r in ranks.split(", "))
        assert named == list(range(WORLD_SIZE)), f"rank {rank}: not every rank is named once:\n{message}"
        others = ", ".join(str(r) for r in range(WORLD_SIZE) if r != odd_rank)
        assert odd_text in groups[str(odd_rank)], f"rank {rank}: the differing field is not named:\n{message}"
        assert groups[others] == "the most common config", message
        assert steps == 0, "a gradient was exchanged before the configs were compared"


def test_group_stays_usable_after_the_config_check_fails(mismatch_runs: list[dict]) -> None:
    assert all(out["all_reduce_after"] == sum(range(WORLD_SIZE)) for out in mismatch_runs)


# -- a non-finite gradient on one rank ------------------------------------------------------------

BAD_STEP = 4  # a compressed step (warm-up is 2), after compressed steps have filled the memories
AFTER_STEPS = 2
# (compressor, args, feedback, leaves_no_trace): the last says the bad step changes no state at
# all, so skipping it must give exactly the run that never had it. Not so where the bad step
# still draws random numbers (randk, qsgd): those stay in step across ranks, not with that run.
# None: not compared with such a run (it costs a second training per case).
# PowerSGD's warm-up ranks send this MLP's small weights exactly, leaving no memory to check.
STEADY = {"powersgd": {"rank_warmup_steps": 0}}
CASES = [
    ("topk", {"ratio": 0.05}, "ef", True),
    ("qsgd", {}, "ef", False),
    ("randk", {"ratio": 0.05}, "ef21", False),
    ("powersgd", {"rank": 1, "rank_warmup_steps": 0}, "ef", True),
    ("efsignsgd", {}, "econtrol", True),
    ("dgc", {"ratio": 0.05}, "none", True),  # its u and v are undone; sampled top-k is exact
    ("signum", {}, "none", True),  # its momentum is undone
] + [(name, STEADY.get(name, {}), "auto", None) for name in compress.names() if name != "none"]
# How a rank's gradient goes bad -> (the bad rank, bucket_cap_mb): all of its gradient NaN or
# Inf through the loss, over two buckets; or a single Inf entry in an otherwise finite gradient.
INJECTIONS = {"nan_loss": (1, 0.004), "inf_loss": (2, 0.004), "one_inf_entry": (0, None)}


def _memories(state: gradsync.SyncState) -> dict:
    """Every error-memory tensor, by (bucket, name): the feedback's and two-shot's second one."""
    memories = {}
    for index, point in state.points.items():
        named = {**point.feedback.state_dict(), "shard_error": point.shard_error}
        memories |= {(index, name): v for name, v in named.items() if isinstance(v, torch.Tensor)}
    return memories


def _same(a: object, b: object) -> bool:
    """Equal nested state dicts, tensors compared bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _without_generator(codec_state: dict) -> dict:
    return {k: v for k, v in codec_state.items() if k != "generator"}


def _codecs_given_zeros(state: gradsync.SyncState) -> dict[int, compress.Compressor]:
    """Per bucket, a twin of its codec that has compressed zeros, as the exchange does for a rank
    whose input is not finite (a multi-round codec stops after the first round's flag)."""
    twins = {}
    for index, point in state.points.items():
        twin = copy.deepcopy(point.codec)  # its state, and PowerSGD's shapes
        zeros = torch.zeros(point.numel)
        if twin.rounds > 1:
            twin.begin(zeros)  # type: ignore[attr-defined]
        elif default_collective(state.config.compressor) == "two-shot":
            bounds = exchange.shard_bounds(point.numel, state.world_size)
            for lo, hi in bounds:  # every shard, then the sum of the shard this rank owns
                twin.compress(zeros[lo:hi])
            lo, hi = bounds[state.rank]
            twin.compress(zeros[lo:hi])
        else:
            twin.compress(zeros)
        twins[index] = twin
    return twins


def _bad_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, injection: str, bad_rank: int) -> None:
    x, y = batch(rank, BAD_STEP)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    handle = None
    if rank == bad_rank and injection == "nan_loss":
        loss = loss * math.nan
    elif rank == bad_rank and injection == "inf_loss":
        loss = loss * math.inf
    elif rank == bad_rank and injection == "one_inf_entry":
        handle = next(model.parameters()).register_hook(_one_inf_entry)
    loss.backward()
    if handle is not None:
        handle.remove()


def _one_inf_entry(grad: torch.Tensor) -> torch.Tensor:
    """The gradient with one entry set to +inf: the rest of the bucket stays finite."""
    grad = grad.clone()
    grad.view(-1)[7] = math.inf
    return grad


def non_finite_on_one_rank(rank: int, world_size: int) -> dict:
    out = {}
    for name, args, form, leaves_no_trace in CASES:
        cfg = config(compressor=name, compressor_args=args, error_feedback=form)
        for injection, (bad_rank, cap_mb) in INJECTIONS.items():
            model = ddp(make_mlp(seed=0), bucket_cap_mb=cap_mb)
            state = gradsync.register(model, cfg)
            opt = sgd(model)
            train(model, opt, rank, range(BAD_STEP))
            memories_before = _memories(state)
            codecs_before = {i: point.codec.state_dict() for i, point in state.points.items()}
            twins = _codecs_given_zeros(state)
            params_before = flat_params(model)
            _bad_step(model, opt, rank, injection, bad_rank)
            grads_nan = [bool(torch.isnan(p.grad).all()) for p in model.parameters()]
            grads_finite = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
            memories_after = _memories(state)
            codecs_after = {i: point.codec.state_dict() for i, point in state.points.items()}
            opt.zero_grad()  # the step is skipped, as GradScaler would
            train(model, opt, rank, range(BAD_STEP + 1, BAD_STEP + 1 + AFTER_STEPS))
            result = {
                "bad_rank": bad_rank,
                "feedback": state.config.feedback_name,
                "grads_nan": grads_nan,
                "grads_finite": grads_finite,
                "memories_before": memories_before,
                "memories_after": memories_after,
                # The skipped step is undone: codec state as before it, but for random streams,
                # which advance as compressing zeros advances them (every rank compressed).
                "codecs_undone": {
                    i: _same(_without_generator(codecs_after[i]), _without_generator(codecs_before[i]))
                    and _same(codecs_after[i].get("generator"), twins[i].state_dict().get("generator"))
                    for i in twins
                },
                # Whether compressing zeros would have moved the state: the check above has teeth.
                "zeros_would_move": {
                    i: not _same(*(_without_generator(d) for d in (twins[i].state_dict(), codecs_before[i])))
                    for i in twins
                },
                "params_before": params_before,
                "params_after": flat_params(model),
            }
            if leaves_no_trace is not None:
                # The same run without the bad step, for the codecs that it leaves no trace in.
                clean = ddp(make_mlp(seed=0), bucket_cap_mb=cap_mb)
                gradsync.register(clean, cfg)
                clean_opt = sgd(clean)
                train(clean, clean_opt, rank, range(BAD_STEP))
                train(clean, clean_opt, rank, range(BAD_STEP + 1, BAD_STEP + 1 + AFTER_STEPS))
                result["params_clean"] = flat_params(clean)
            out[name, form, injection] = result
    return out


@pytest.fixture(scope="module")
def non_finite_runs() -> list[dict]:
    return run_ranks(non_finite_on_one_rank, WORLD_SIZE, timeout_s=90)


CASE_IDS = [f"{n}+{f}" for n, _, f, _ in CASES]
# Codecs whose own state compressing zeros would move: for them the undo check has teeth.
MOVED_BY_ZEROS = {"dgc", "signum"}


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_non_finite_gradient_on_one_rank_is_nan_on_every_rank(
    non_finite_runs: list[dict], case: tuple, injection: str
) -> None:
    for rank, out in enumerate(non_finite_runs):
        result = out[case[0], case[2], injection]
        if compress.lookup(case[0]).preserves_nonfinite and result["feedback"] == "none":
            # A cast with nothing to protect carries the bad entries through the sum as they are,
            # as PyTorch's own fp16 hook does: non-finite on every rank, so GradScaler skips the step.
            assert not all(result["grads_finite"]), f"rank {rank}: the bad step came out finite"
            continue
        # A bucket with a bad entry goes NaN as a whole, and each injection reaches every bucket
        # (the loss poisons every gradient; the single entry sits in a one-bucket model).
        grads_nan = result["grads_nan"]
        assert all(grads_nan), f"rank {rank}: gradients not all NaN {grads_nan} after a bad step"


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_non_finite_gradient_never_enters_an_error_memory(
    non_finite_runs: list[dict], case: tuple, injection: str
) -> None:
    for rank, out in enumerate(non_finite_runs):
        result = out[case[0], case[2], injection]
        before, after = result["memories_before"], result["memories_after"]
        if result["feedback"] == "none":
            assert not before and not after
            continue
        assert before and any(bool(t.any()) for t in before.values()), "memories were empty: test is void"
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), f"rank {rank}: memory {key} changed in the bad step"


def _check_codec_state_undone(runs: list[dict], case: tuple, injection: str, bad: bool) -> None:
    name = case[0]
    for rank, out in enumerate(runs):
        result = out[name, case[2], injection]
        if (rank == result["bad_rank"]) != bad:
            continue
        assert result["codecs_undone"], "no compression point: test is void"
        for bucket, same in result["codecs_undone"].items():
            assert same, f"rank {rank}, bucket {bucket}: {name}'s state was not restored after the bad step"
        if name in MOVED_BY_ZEROS:
            assert all(result["zeros_would_move"].values()), f"rank {rank}: {name}'s state would not move"


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_codec_state_of_the_rank_with_the_bad_gradient_is_undone(
    non_finite_runs: list[dict], case: tuple, injection: str
) -> None:
    # The exchange compresses zeros in place of a non-finite input; the hook then undoes it.
    _check_codec_state_undone(non_finite_runs, case, injection, bad=True)


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_codec_state_of_the_other_ranks_is_undone(
    non_finite_runs: list[dict], case: tuple, injection: str
) -> None:
    # Ranks whose input was finite compressed their real gradient before learning that the step
    # is void; DGC's u and v and Signum's momentum must not keep it.
    _check_codec_state_undone(non_finite_runs, case, injection, bad=False)


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_next_finite_steps_train_normally_with_ranks_identical(
    non_finite_runs: list[dict], case: tuple, injection: str
) -> None:
    name, _, form, leaves_no_trace = case
    reference = non_finite_runs[0][name, form, injection]["params_after"]
    for rank, out in enumerate(non_finite_runs):
        result = out[name, form, injection]
        assert torch.isfinite(result["params_after"]).all(), f"rank {rank}"
        assert not torch.equal(result["params_after"], result["params_before"]), f"rank {rank} did not train"
        assert torch.equal(result["params_after"], reference), f"rank {rank} differs from rank 0"
        if leaves_no_trace:
            assert torch.equal(result["params_after"], result["params_clean"]), (
                f"rank {rank}: the skipped bad step changed the trajectory"
            )


# -- not a DDP model ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", [nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 2))], ids=["Linear", "Sequential"]
)
def test_register_on_a_module_that_is_not_ddp_raises_type_error(module: nn.Module) -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        gradsync.register(module, gradsync.SyncConfig())
