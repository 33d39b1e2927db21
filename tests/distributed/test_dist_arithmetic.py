"""The arithmetic that only shows with more than one rank: each error-feedback form's division by
the world size, and each rank's own random stream.

A world of one hides both: n = 1 makes g and g / n alike, and one rank's stream is every rank's.
Bit-identical ranks do not show them either, since every rank would make the same mistake. So each
test here compares with a reference: the dense mean of the ranks' gradients, or a world of one.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

import gradsync
from gradsync.comm import LocalComm, TorchComm

FORMS = ["ef", "ef21", "econtrol", "momentum"]
NUMEL, STEPS = 4096, 4


def _gradient(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * step + rank))


def _lossless(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    out = {}
    for form in FORMS:
        config = gradsync.SyncConfig(
            compressor="topk",
            compressor_args={"ratio": 1.0, "sparsity_warmup_steps": 0},  # sends every entry
            error_feedback=form,
            warmup_steps=0,
            min_compress_numel=0,
        )
        state = gradsync.SyncState(config, TorchComm(None))
        out[form] = [state.sync(_gradient(rank, step), 0, True).wait().clone() for step in range(STEPS)]
    return out


@pytest.fixture(scope="module")
def lossless() -> list[dict[str, list[torch.Tensor]]]:
    return run_ranks(_lossless, 2)


@pytest.mark.parametrize("form", FORMS)
def test_every_feedback_form_over_a_lossless_codec_gives_the_dense_mean(lossless: list, form: str) -> None:
    # Nothing is held back, so every form must hand the optimizer the mean of the ranks'
    # gradients: EF21's and EControl's mirrors the mean itself, momentum correction
    # u_t - beta u_(t-1) = mean g. A form that divides by n in the wrong place is off n-fold.
    for step in range(STEPS):
        mean = (_gradient(0, step) + _gradient(1, step)) / 2
        for rank in range(2):
            torch.testing.assert_close(lossless[rank][form][step], mean, rtol=1e-5, atol=1e-6)


def _seeds(rank: int, world: int, seed: int) -> dict[str, tuple[int, list[torch.Tensor]]]:
    # Every rank compresses the same gradient; what seed each codec drew from, and the outputs.
    out = {}
    for name in ("qsgd", "randk"):  # "local" randomness, and "shared"
        config = gradsync.SyncConfig(
            compressor=name, error_feedback="none" if name == "qsgd" else "ef", warmup_steps=0,
            min_compress_numel=0, seed=seed,
        )  # fmt: skip
        state = gradsync.SyncState(config, TorchComm(None) if world > 1 else LocalComm())
        outputs = [state.sync(_gradient(0, step), 0, True).wait().clone() for step in range(3)]
        out[name] = (state.points[0].codec.seed, outputs)
    return out


def test_local_randomness_is_seeded_per_rank_and_shared_randomness_alike() -> None:
    # QSGD's stochastic rounding must be independent across ranks, or averaging n ranks' noise
    # would not shrink it; random-k's indices must be the same on every rank, or the sum of
    # their payloads would not line up.
    ranks = run_ranks(_seeds, 2, (0,))
    assert ranks[0]["qsgd"][0] != ranks[1]["qsgd"][0]
    assert ranks[0]["randk"][0] == ranks[1]["randk"][0]


def test_the_configs_seed_decides_the_random_streams() -> None:
    first, again, other = (_seeds(0, 1, seed)["qsgd"][1] for seed in (0, 0, 1))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, other, strict=True))
