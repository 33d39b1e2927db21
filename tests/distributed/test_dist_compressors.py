"""Every registered compressor, and every error-feedback form, keeps all ranks bit-identical.

Each rank decodes every rank's payload in rank order, so the averaged gradient, and with it every
parameter, must be the same bits on every rank, step after step. One spawned run per world size
trains a fresh model for each case in turn; the cases come from the registries, so a newly
registered compressor or feedback form is covered without touching this file.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_harness import config, ddp, flat_params, make_mlp, run_ranks, sgd, train

import gradsync
from gradsync import compress, feedback

STEPS = 20
WARMUP_STEPS = 2
BUCKET_CAP_MB = 0.004  # two buckets after DDP's rebuild: several compression points
NUM_BUCKETS = 2
# (compressor, error_feedback): every codec with the feedback "auto" picks for it (residual
# feedback for biased codecs); every feedback form with a codec exchanged by allgather (topk) and
# one exchanged by allreduce (randk).
CASES = [(name, "auto") for name in compress.names() if name != "none"] + [
    (name, form) for form in feedback.names() for name in ("topk", "randk")
]
CASES = list(dict.fromkeys(CASES))
# PowerSGD's rank warm-up, shortened to run its every stage (ranks 16, 8, 4, 2: this MLP's weights
# sent exactly at first) within the run and end compressing.
ARGS = {"powersgd": {"rank_warmup_steps": 8}}


def train_every_case(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, form in [("none", "none"), *CASES]:
        model = ddp(make_mlp(seed=0), bucket_cap_mb=BUCKET_CAP_MB)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # biased codec without feedback: on purpose here
            cfg = config(
                compressor=name,
                compressor_args=ARGS.get(name, {}),
                error_feedback=form,
                warmup_steps=WARMUP_STEPS,
            )
        state = gradsync.register(model, cfg)
        train(model, sgd(model), rank, range(STEPS))
        stats = state.stats()
        out[name, form] = {
            "params": flat_params(model),
            "compressed_groups": stats["total"]["compressed_groups"],
            "last_payload_bytes": stats["last_step"]["payload_nbytes"],
            "last_numel": stats["last_step"]["numel"],
        }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def runs(request: pytest.FixtureRequest) -> list[dict]:
    """Every case trained on 2 and on 4 ranks: one spawned run per world size."""
    return run_ranks(train_every_case, request.param, timeout_s=120)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}+{f}" for n, f in CASES])
def test_all_ranks_end_with_bit_identical_parameters(runs: list[dict], case: tuple[str, str]) -> None:
    reference = runs[0][case]["params"]
    assert torch.isfinite(reference).all()
    for rank, out in enumerate(runs[1:], start=1):
        diff = (out[case]["params"] - reference).abs().max().item()
        assert torch.equal(out[case]["params"], reference), f"rank {rank} differs from rank 0 by {diff:.3g}"


@pytest.mark.parametrize("case", CASES, ids=[f"{n}+{f}" for n, f in CASES])
def test_compressed_steps_happened_and_lossy_codecs_send_less_than_fp32(
    runs: list[dict], case: tuple[str, str]
) -> None:
    name, _ = case
    uncompressed = runs[0]["none", "none"]["params"]
    for rank, out in enumerate(runs):
        result = out[case]
        assert result["compressed_groups"] == NUM_BUCKETS * (STEPS - WARMUP_STEPS), f"rank {rank}"
        fp32_bytes = 4 * result["last_numel"]
        assert result["last_payload_bytes"] < fp32_bytes, f"rank {rank}: {name} sent no less than fp32"
        # The lossy exchange changed the trajectory: it was not silently the uncompressed one.
        assert not torch.equal(result["params"], uncompressed), f"rank {rank}: {name} trained as fp32"
