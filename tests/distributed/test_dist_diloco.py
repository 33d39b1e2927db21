"""gradsync.DiLoCo over real gloo ranks (one spawned run of 3 ranks):
- syncing every step with outer_lr 1, no momentum and a momentum-free inner SGD is DDP, up to
  float rounding, even from different initial parameters (rank 0's are broadcast);
- with a compressed outer gradient (int4, two-shot, error feedback) every rank ends each sync with
  the same global and local parameters, bit for bit, sending a fraction of the uncompressed bytes,
  which are H times fewer than DDP's;
- a non-finite outer gradient on one rank skips that sync on every rank;
- ranks given different options or models all fail at construction with one message, and
  options one rank finds invalid fail every rank;
- files of two runs at the same step are refused on every rank;
- a rank killed before a sync makes every other raise within the timeout, no outer step taken.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import torch
from dist_harness import batch, ddp, make_mlp, run_ranks
from torch import nn

import gradsync
from gradsync.comm import allreduce_sent_nbytes

WORLD = 3
STEPS = 6


def _digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    optimizer.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()


def _wide(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 640), nn.Tanh(), nn.Linear(640, 8))  # 26,248: int4 compresses it


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    # DDP, and DiLoCo as DDP: H = 1, outer_lr 1, no momentum anywhere.
    reference = ddp(make_mlp(0))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(STEPS):
        _step(reference, optimizer, rank, step)
    out["ddp"] = [p.detach().clone() for p in reference.parameters()]
    net = make_mlp(rank)  # different on every rank: DiLoCo starts from rank 0's
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    for step in range(STEPS):
        _step(net, optimizer, rank, step)
    out["as_ddp"] = [p.detach().clone() for p in net.parameters()]
    outer.close()

    # Compressed and uncompressed outer gradients, DiLoCo's outer optimizer, H = 3.
    for compressor in ("int4", "none"):
        net = _wide(rank)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        outer = gradsync.DiLoCo(net, optimizer, sync_every=3, compressor=compressor)
        digests = []
        for step in range(STEPS):
            _step(net, optimizer, rank, step)
            if step % 3 == 2:
                digests.append((_digest(outer._global), _digest(list(net.parameters()))))
        out[compressor] = {
            "digests": digests,
            "sent": outer.stats()["total"]["sent_nbytes"],
            "numel": sum(p.numel() for p in net.parameters()),
            "groups": outer.stats()["groups"],
        }
        outer.close()

    # A non-finite outer gradient on rank 1 only: sent as it is, and by int4 with error feedback.
    for compressor in ("none", "int4"):
        net = _wide(0)
        start = _digest(list(net.parameters()))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        outer = gradsync.DiLoCo(net, optimizer, sync_every=2, compressor=compressor)
        _step(net, optimizer, rank, 0)
        if rank == 1:
            with torch.no_grad():
                next(net.parameters())[0, 0] = float("inf")
        _step(net, optimizer, rank, 1)
        out[f"non_finite {compressor}"] = {
            "skipped": outer.skipped,
            "same_as_start": _digest(list(net.parameters())) == start,
        }
        outer.close()

    # Different options on the last rank.
    net = make_mlp(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    try:
        gradsync.DiLoCo(net, optimizer, sync_every=5 if rank == world - 1 else 4)
        out["mismatch"] = None
    except ValueError as error:
        out["mismatch"] = str(error)
        out["hooks_left"] = len(optimizer._optimizer_step_post_hooks)

    # Options only the last rank finds invalid (5 fragments in rounds of 4 steps): every rank
    # fails, where the others used to wait for it in the comparison's collective.
    net = make_mlp(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    try:
        gradsync.DiLoCo(net, optimizer, sync_every=4 if rank == world - 1 else 5, fragments=5)
        out["invalid"] = None
    except ValueError as error:
        out["invalid"] = str(error)

    # Another model on the last rank: it would issue another number of broadcasts.
    net = _wide(0) if rank == world - 1 else make_mlp(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    try:
        gradsync.DiLoCo(net, optimizer, sync_every=2)
        out["other_model"] = None
    except ValueError as error:
        out["other_model"] = str(error)

    # The same tensors and the same set of dtypes, but another tensor in fp64 on the last rank:
    # a fragment's global tensor would be fp64 on one rank and fp32 on another.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    net[0 if rank == world - 1 else 1].double()
    try:
        gradsync.DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.05), sync_every=2, fragments=2)
        out["dtypes"] = None
    except ValueError as error:
        out["dtypes"] = str(error)

    # outer_momentum=0 on rank 0 and 0.0 elsewhere: the same option, and accepted.
    net = make_mlp(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    gradsync.DiLoCo(net, optimizer, sync_every=2, outer_momentum=0 if rank == 0 else 0.0).close()

    # Rank 0 given a file of another run at the same step: its global parameters differ.
    net = make_mlp(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2)
    for step in range(2):
        _step(net, optimizer, rank, step)
    saved = outer.state_dict()
    if rank == 0:
        saved["global"][0][0] += 1.0
    try:
        outer.load_state_dict(saved)
        out["two_runs"] = None
    except ValueError as error:
        out["two_runs"] = str(error)
    outer.close()
    return out


def test_diloco_over_three_ranks() -> None:
    results = run_ranks(_worker, WORLD)

    # H = 1 Local SGD is DDP up to rounding, on every rank, from rank 0's initial parameters.
    for r in results:
        for got, want in zip(r["as_ddp"], results[0]["ddp"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    for compressor in ("int4", "none"):
        runs = [r[compressor] for r in results]
        assert all(run["digests"] == runs[0]["digests"] for run in runs)  # bit-identical ranks
        assert all(glob == local for glob, local in runs[0]["digests"])  # alpha 0: local = global
        assert len(runs[0]["digests"]) == 2
    numel, n = results[0]["none"]["numel"], WORLD
    # Uncompressed: one fp32 allreduce per sync, 2 syncs in 6 steps: a third of DDP's bytes.
    assert results[0]["none"]["sent"] == 2 * allreduce_sent_nbytes(4 * numel, n)
    compressed = results[0]["int4"]
    assert compressed["groups"][0]["codec"] == "int4" and compressed["groups"][0]["collective"] == "two-shot"
    assert compressed["sent"] < results[0]["none"]["sent"] / 6  # 4.25 bits and scales against 32

    for compressor in ("none", "int4"):
        assert all(r[f"non_finite {compressor}"] == {"skipped": 1, "same_as_start": True} for r in results)

    messages = [r["mismatch"] for r in results]
    assert all(m is not None and "different DiLoCo options" in m and "sync_every=5" in m for m in messages)
    assert len(set(messages)) == 1 and all(r["hooks_left"] == 0 for r in results)

    last = WORLD - 1
    assert "fragments=5" in results[last]["invalid"]  # its own error
    for r in results[:last]:
        assert f"other ranks' options are invalid: rank {last}: ValueError: fragments=5" in r["invalid"]
    assert all(r["other_model"] is not None and "shapes=" in r["other_model"] for r in results)
    assert all(r["dtypes"] is not None and "dtypes=" in r["dtypes"] for r in results)
    assert all(r["two_runs"] is not None and "different global parameters" in r["two_runs"] for r in results)


PG_TIMEOUT_S = 2.0


def _killed_before_a_sync(rank: int, world: int, compressor: str) -> dict:
    net = _wide(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    outer = gradsync.DiLoCo(net, optimizer, sync_every=2, compressor=compressor)
    for step in range(4):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # dies before the second sync (inner step 4)
        before = _digest(outer.global_parameters())
        started = time.monotonic()
        try:
            _step(net, optimizer, rank, step)
        except Exception as error:
            return {
                "raised": f"{type(error).__name__}: {error}",
                "seconds": time.monotonic() - started,
                "step": step,
                "global_unchanged": _digest(outer.global_parameters()) == before,
            }
    return {"raised": None}


@pytest.mark.parametrize("compressor", ["none", "int4"])
def test_a_rank_that_dies_before_a_sync_makes_every_other_raise(compressor: str) -> None:
    results = run_ranks(
        _killed_before_a_sync, WORLD, args=(compressor,), timeout_s=60, pg_timeout_s=PG_TIMEOUT_S, may_die=[1]
    )
    for rank, result in enumerate(results):
        if rank == 1:
            continue
        raised = result["raised"]
        assert raised is not None and "CollectiveError" in raised and "gradsync: " in raised, result
        assert "fragment 0's outer gradient at outer sync 1 " in raised, raised  # its second sync
        assert result["step"] == 3 and result["seconds"] <= PG_TIMEOUT_S + 5, result
        assert result["global_unchanged"], raised  # no outer step from a broken exchange
