"""Every way a training script saves gradsync's state resumes the exact trajectory.

A run trains 16 steps. Another trains 8, saves, builds a fresh model (initialized differently),
DDP and gradsync state, loads, and trains the other 8: its parameters at step 16 must be
bit-identical to the uninterrupted run's on every rank. The savers:

  per-rank files  torch.save(state.state_dict()) on every rank, each loading its own;
  rank-0 file     full_state_dict() on every rank (a collective), torch.save on rank 0 only,
                  every rank loading that one file;
  rank-0 gather   the same with AllRanks(state).state_dict(): only rank 0 receives every rank's
                  state (the others get {}), as Accelerate and the Lightning callback save;
  every writer    AllRanks(state, to=None).state_dict() written by every rank to a file of its
                  own, each loading its own (Accelerate's save_on_each_node, a node a rank);
  dcp             torch.distributed.checkpoint, the state passed as a Stateful beside the
                  model's and optimizer's state dicts.

Top-k with error feedback keeps a different memory on every rank, so a saver that kept one
rank's memory for all (DCP deduplicating equal keys as replicated, a rank-0 saver of
state_dict()) would leave the trajectory. Dropping the state must change the result, which
shows the comparison has teeth.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import config, ddp, flat_params, make_mlp, run_ranks, sgd, train
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gradsync

STEPS, SAVE_AT = 16, 8
SAVERS = ("per-rank files", "rank-0 file", "rank-0 gather", "every writer", "dcp")
CFG = {"compressor": "topk", "compressor_args": {"ratio": 0.05}, "error_feedback": "ef"}


def _fresh(seed: int, cap_mb: float | None):
    model = ddp(make_mlp(seed=seed), bucket_cap_mb=cap_mb)
    state = gradsync.register(model, config(**CFG))
    return model, sgd(model), state


def _save(saver: str, where: str, rank: int, model, opt, state: gradsync.SyncState) -> None:
    if saver == "dcp":
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd, "gradsync": state}, checkpoint_id=where)
        return
    trained = {"model": model.module.state_dict(), "optim": opt.state_dict()}
    if saver == "per-rank files":
        torch.save({**trained, "gradsync": state.state_dict()}, os.path.join(where, f"rank{rank}.pt"))
        return
    if saver == "rank-0 file":
        everyone = state.full_state_dict()  # a collective
    else:
        everyone = gradsync.AllRanks(state, to=0 if saver == "rank-0 gather" else None).state_dict()
    if saver == "rank-0 gather" and rank != 0:
        assert everyone == {}, f"rank {rank} received the gathered state: {sorted(everyone)}"
    if saver == "every writer":
        torch.save({**trained, "gradsync": everyone}, os.path.join(where, f"node{rank}.pt"))
    elif rank == 0:
        torch.save({**trained, "gradsync": everyone}, os.path.join(where, "all.pt"))
    dist.barrier()


def _load(saver: str, where: str, rank: int, model, opt, state: gradsync.SyncState, with_state: bool) -> None:
    if saver == "dcp":
        model_sd, opt_sd = get_state_dict(model, opt)
        loaded = {"model": model_sd, "optim": opt_sd}
        if with_state:
            loaded["gradsync"] = state
        dcp.load(loaded, checkpoint_id=where)
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        return
    files = {"per-rank files": f"rank{rank}.pt", "every writer": f"node{rank}.pt"}
    saved = torch.load(os.path.join(where, files.get(saver, "all.pt")))
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    if with_state:
        state.load_state_dict(saved["gradsync"])


def save_and_resume(rank: int, world_size: int, saver: str, where: str, cap_mb: float | None) -> dict:
    continuous, opt, _ = _fresh(0, cap_mb)
    train(continuous, opt, rank, range(STEPS))
    first = _fresh(0, cap_mb)
    train(first[0], first[1], rank, range(SAVE_AT))
    _save(saver, where, rank, *first)
    out = {"continuous": flat_params(continuous)}
    for with_state in (True, False):
        model, opt, state = _fresh(1, cap_mb)
        _load(saver, where, rank, model, opt, state, with_state)
        train(model, opt, rank, range(SAVE_AT, STEPS))
        out["resumed" if with_state else "without_state"] = flat_params(model)
    return out


@pytest.mark.parametrize("saver", SAVERS)
def test_every_saver_resumes_the_exact_trajectory(saver: str, tmp_path) -> None:
    # Two buckets after DDP's rebuild: the fresh model's first step sees another layout.
    results = run_ranks(save_and_resume, 2, (saver, str(tmp_path), 0.004), timeout_s=120)
    for rank, out in enumerate(results):
        diff = (out["resumed"] - out["continuous"]).abs().max().item()
        assert torch.equal(out["resumed"], out["continuous"]), (
            f"{saver}: rank {rank} left the trajectory, by up to {diff:.3g}"
        )
        assert not torch.equal(out["without_state"], out["continuous"]), (
            f"{saver}: dropping gradsync's state changed nothing, so the test proves nothing"
        )
