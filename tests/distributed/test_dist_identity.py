"""gradsync without compression reproduces plain DDP bit for bit.

gradsync divides each bucket by the world size before the exchange, as DDP does (DDP multiplies
by 1/world_size, which is the same bits for a power of two), and sums with one allreduce of the
same size; so the parameters after training must be torch.equal, not merely close. With
sparse_scheme "auto" too: only embedding tables, which this model has none of, may go as rows.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import config, ddp, flat_params, make_mlp, run_ranks, sgd, train

import gradsync

STEPS = 10
BUCKET_CAP_MB = 0.004  # two buckets after DDP's rebuild


def uncompressed_and_plain_ddp(rank: int, world_size: int) -> dict:
    """Train plain DDP and gradsync with compressor="none" from the same start on the same data."""
    initial = flat_params(make_mlp(seed=0))
    out: dict = {"initial": initial}
    for label, scheme in (("ddp", None), ("none, auto", "auto"), ("none, dense", "dense")):
        model = ddp(make_mlp(seed=0), bucket_cap_mb=BUCKET_CAP_MB)
        state = None
        if scheme is not None:
            state = gradsync.register(model, config(compressor="none", sparse_scheme=scheme))
        train(model, sgd(model), rank, range(STEPS))
        out[label] = flat_params(model)
        if state is not None:
            out[label + " groups"] = state.stats()["total"]["groups"]
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_compression_gives_exactly_plain_ddp_parameters(world_size: int) -> None:
    results = run_ranks(uncompressed_and_plain_ddp, world_size)
    for rank, out in enumerate(results):
        reference = out["ddp"]
        assert not torch.equal(reference, out["initial"]), "plain DDP did not train: the test is void"
        for label in ("none, auto", "none, dense"):
            assert out[label + " groups"] >= 2 * (STEPS - 1), f"{label}: the hook did not run"
            diff = (out[label] - reference).abs().max().item()
            assert torch.equal(out[label], reference), (
                f"rank {rank}: {label} differs from plain DDP by up to {diff:.3g} after {STEPS} steps"
            )
