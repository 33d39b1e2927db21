"""The identity compressor through gradsync's hook reproduces plain DDP bit for bit.

gradsync divides each bucket by the world size before the exchange, as DDP does (DDP multiplies
by 1/world_size, which is the same bits for a power of two), and sums with one allreduce of the
same size; so the parameters after training must be torch.equal, not merely close.

sparse_scheme="dense" keeps the warm-up steps on that one allreduce: "auto" may send a tensor
with many zero rows (a ReLU layer's dead units) through a sparse scheme, exact but summed in
another order, so equal only to float rounding.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import config, ddp, flat_params, make_mlp, run_ranks, sgd, train

import gradsync

STEPS = 10
BUCKET_CAP_MB = 0.004  # two buckets after DDP's rebuild: several compression points


def identity_and_plain_ddp(rank: int, world_size: int) -> dict:
    """Train plain DDP and gradsync-identity (feedback none / ef) from the same start on the same data."""
    initial = flat_params(make_mlp(seed=0))
    out: dict = {"initial": initial}
    for label, error_feedback in (("ddp", None), ("identity+none", "none"), ("identity+ef", "ef")):
        model = ddp(make_mlp(seed=0), bucket_cap_mb=BUCKET_CAP_MB)
        state = None
        if error_feedback is not None:
            state = gradsync.register(
                model, config(compressor="identity", error_feedback=error_feedback, sparse_scheme="dense")
            )
        train(model, sgd(model), rank, range(STEPS))
        out[label] = flat_params(model)
        if state is not None:
            out[label + " compressed_buckets"] = state.stats()["total"]["compressed_buckets"]
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_identity_compressor_gives_exactly_plain_ddp_parameters(world_size: int) -> None:
    results = run_ranks(identity_and_plain_ddp, world_size)
    for rank, out in enumerate(results):
        reference = out["ddp"]
        assert not torch.equal(reference, out["initial"]), "plain DDP did not train: the test is void"
        for label in ("identity+none", "identity+ef"):
            # Steps 2..9 go through the codec path, in each of the two buckets.
            assert out[label + " compressed_buckets"] == 2 * (STEPS - 2), label
            diff = (out[label] - reference).abs().max().item()
            assert torch.equal(out[label], reference), (
                f"rank {rank}: {label} differs from plain DDP by up to {diff:.3g} after {STEPS} steps"
            )
