"""Saving and restoring mid-run continues the exact trajectory of an uninterrupted run, and a bad
checkpoint is refused on every rank before anything is loaded.

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

import copy
import io
import re

import pytest
import torch
from dist_harness import IN_FEATURES, config, ddp, flat_params, make_mlp, run_ranks, sgd, train
from torch import nn

import gradsync
from gradsync import checkpoint

STEPS = 12
SAVE_AT = 6
CASES = [
    # The default: int4 by two-shot, whose owners keep a residual of their shard's second
    # encoding besides each rank's own (a world of one never writes it).
    ("int4", {}, "auto"),
    ("topk", {"ratio": 0.05}, "ef"),
    ("randk", {"ratio": 0.05}, "ef21"),
    ("qsgd", {}, "none"),
    # Its rank warm-up over compressed steps 0-7 (ranks 32 and 16 send the MLP's weights
    # exactly, 8 and 4 approximate some, Q cut at each stage) runs across the checkpoint.
    ("powersgd", {"rank": 2, "rank_warmup_steps": 8}, "ef"),
    ("topk", {"ratio": 0.05}, "econtrol"),
    # Codec state of their own: DGC's u, v, step count (its sparsity schedule runs past the
    # checkpoint) and sampling stream; Signum's momentum.
    ("dgc", {"ratio": 0.05, "sparsity_warmup_steps": 8, "sample_ratio": 0.5}, "auto"),
    ("signum", {}, "auto"),
]
# None: DDP's default, one bucket; 0.004 MB: two buckets after the rebuild.
BUCKET_CAPS_MB = [None, 0.004]


def _run(
    rank: int,
    cfg: gradsync.SyncConfig,
    cap_mb: float | None,
    seed: int,
    steps: range,
    ckpt: bytes | None = None,
    model_width: int | None = None,
):
    net = make_mlp(seed=seed) if model_width is None else nn.Sequential(nn.Linear(IN_FEATURES, model_width))
    model = ddp(net, bucket_cap_mb=cap_mb)
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


# -- bad checkpoints are refused on every rank -----------------------------------------------------

REFUSALS = {
    "another rank's": r"rank 0's state, loaded on rank 1.*full_state_dict",
    "another step's": r"different steps \{0: 4, 1: 3\}",
    "a non-finite memory": r"rank 1: its group 0 feedback error hold NaN or inf",
    "missing keys": r"lacks \['points'\]",
    "a memory its feedback refuses": r"rank 1: its saved state cannot be rebuilt \(ValueError: .* keys \[\]",
    "damaged bytes": r"its entry for rank \d: it does not end with its digest: the file was cut short",
    "a flipped bit": r"its entry for rank \d: its bytes differ from those saved",
    "a negative step": r"step is -5",
    "another model": r"a model with other parameters",
    "another config": r"resume with the same SyncConfig",
    "another world size": r"run of 3 ranks, this run has 2",
    "not a state": r"a dict from SyncState.state_dict\(\), got a list",
}


def bad_checkpoints(rank: int, world_size: int) -> dict:
    cfg = config(compressor="topk", compressor_args={"ratio": 0.05}, error_feedback="ef")
    model, opt, state = _run(rank, cfg, None, 0, range(3))
    at_3 = state.state_dict()
    train(model, opt, rank, range(3, 4))
    at_4 = state.state_dict()
    everyone = state.full_state_dict()  # every rank's state at step 4, for one file
    own, _ = checkpoint.own_part(at_4, rank)  # unpacked, to be damaged
    error = own["points"][0]["feedback"]["error"]
    no_points = {k: v for k, v in own.items() if k != "points"}
    no_error = {**own, "points": {0: {**own["points"][0], "feedback": {}}}}
    nan = {**own, "points": {0: {**own["points"][0], "feedback": {"error": error * float("nan")}}}}
    bad = {
        "another rank's": {"format": everyone["format"], "rank 0": everyone["rank 0"]},
        "another step's": at_4 if rank == 0 else at_3,
        "a non-finite memory": checkpoint.pack(nan, rank) if rank == 1 else at_4,
        "missing keys": checkpoint.pack(no_points, rank) if rank == 0 else at_4,
        # Found only as rank 1 builds its points: rank 0, whose file is sound, restores nothing.
        "a memory its feedback refuses": checkpoint.pack(no_error, rank) if rank == 1 else at_4,
        "damaged bytes": {**at_4, f"rank {rank}": at_4[f"rank {rank}"][:-9]},
        "a flipped bit": {**at_4, f"rank {rank}": _flipped(at_4[f"rank {rank}"], rank)},
        "a negative step": checkpoint.pack({**own, "step": -5}, rank),
        "another model": _run(rank, cfg, None, 0, range(3), model_width=40)[2].state_dict(),
        "another config": _run(rank, config(compressor="qsgd"), None, 0, range(3))[2].state_dict(),
        "another world size": checkpoint.pack({**own, "world_size": 3}, rank),
        "not a state": [at_4],
    }
    out = {}
    for case, saved in bad.items():
        _, _, fresh = _run(rank, cfg, None, 0, range(0))
        try:
            fresh.load_state_dict(saved)
            out[case] = None
        except ValueError as error:
            out[case] = (str(error), fresh.step)
    # One file for all ranks: each takes its own part and continues as the uninterrupted run.
    model_b, opt_b, resumed = _run(rank, cfg, None, 0, range(0))
    model_b.module.load_state_dict(model.module.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))  # its momentum buffers, not shared
    resumed.load_state_dict(everyone)
    train(model, opt, rank, range(4, 6))
    train(model_b, opt_b, rank, range(4, 6))
    out["single file"] = torch.equal(flat_params(model), flat_params(model_b))
    return out


def _flipped(entry: bytes, rank: int) -> bytes:
    """`entry` with one bit flipped in the middle of the rank's error memory's bytes."""
    body = bytes(checkpoint.entry_body(entry))
    own, _ = checkpoint.own_part({"format": 3, f"rank {rank}": body}, rank)
    memory = own["points"][0]["feedback"]["error"]
    at = body.index(memory.numpy().tobytes()) + memory.numel() * 2  # its middle
    damaged = bytearray(entry)
    damaged[at] ^= 0x40
    return bytes(damaged)


def test_every_bad_checkpoint_is_refused_on_every_rank_and_one_file_for_all_resumes_exactly() -> None:
    results = run_ranks(bad_checkpoints, 2, timeout_s=120)
    for rank, out in enumerate(results):
        for case, expected in REFUSALS.items():
            refused = out[case]
            assert refused is not None, f"rank {rank} accepted {case} checkpoint"
            message, step = refused
            assert message.startswith("gradsync: load_state_dict refused, nothing was loaded"), message
            assert re.search(expected, message, re.S), f"{case}: {message}"
            assert step == 0, f"{case}: rank {rank} loaded part of it"
        assert out["single file"], f"rank {rank} left the trajectory after a single-file restore"
