"""Two-shot exchange over real gloo ranks: the owners' sums, their second encoding and its memory.

One spawned run of 4 ranks covers worlds of 2, 3 and 4 through process groups of the first n
ranks. Inputs are seeded, so the test process rebuilds every rank's input and computes the oracle
itself with the same (deterministic) int8 codec:
- owner j's sum is the sum over ranks, in rank order, of decode(encode(x_r[shard j])); the
  result's shard j is decode(encode(that sum)), the same bits on every rank;
- with error feedback on both encodings nothing is lost, only delayed: over any number of steps,
  the results plus every rank's memory of its first encoding plus every owner's memory of its
  second one add up to the inputs' sum;
- a rank sends about 2 (n-1)/n payloads, against allgather's n - 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

from gradsync import compress, exchange
from gradsync.comm import TorchComm
from gradsync.compress.absmax import Int8
from gradsync.exchange import Route
from gradsync.feedback import Corrected

NUM_RANKS = 4
WORLD_SIZES = [2, 3, 4]
NUMEL = 10_007  # not a multiple of any world size: shards of unequal length
STEPS = 6


class ThreePassInt8(Int8):
    """int8 without its fused feedback pass: the owner adds its memory, encodes, then subtracts."""

    fuses_feedback = False


def rank_input(world: int, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((world * 10 + rank) * 1_000 + step)
    return torch.randn(NUMEL, generator=g) * (1 + rank)


def _exchanges(rank: int, _: int) -> dict:
    out = {}
    for world in WORLD_SIZES:
        group = dist.new_group(list(range(world)))  # every rank takes part in creating each group
        if rank >= world:
            continue
        comm = TorchComm(group)
        codec = compress.build("int8")
        once = exchange.start(codec, rank_input(world, rank, 0), Route(comm), "two-shot").wait()
        gathered = exchange.start(codec, rank_input(world, rank, 0), Route(comm), "allgather").wait()
        # Error feedback on both encodings, as SyncState keeps it: p = x + e; e = p - local().
        lo, hi = exchange.shard_bounds(NUMEL, world)[rank]
        first, second, totals = torch.zeros(NUMEL), torch.zeros(hi - lo), []
        # The same with every feedback pass fused, as SyncState runs it: p computed as it is
        # encoded and its residual left in p (feedback.defer), the sum decoded into the gradient,
        # the owner's memory added, encoded and taken in one pass; against three passes each.
        fused_first, fused_second, fused_totals = torch.zeros(NUMEL), torch.zeros(hi - lo), []
        for step in range(STEPS):
            p = rank_input(world, rank, step) + first
            result = exchange.start(ThreePassInt8(), p, Route(comm), "two-shot", shard_error=second).wait()
            first = p - result.local()
            totals.append(result.total)
            p, g = torch.empty(NUMEL), rank_input(world, rank, step)
            result = exchange.start(
                codec,
                p,
                Route(comm),
                "two-shot",
                out=g,
                shard_error=fused_second,
                corrected=Corrected(g, fused_first, 1.0),
            ).wait()
            assert result.total is g
            fused_first = result.remove_local_(p)
            fused_totals.append(result.total)
        out[world] = {
            "once": once.total,
            "sent": once.sent_nbytes,
            "gathered_sent": gathered.sent_nbytes,
            "totals": torch.stack(totals),
            "first": first,
            "second": second,
            "fused": (torch.stack(fused_totals), fused_first, fused_second),
        }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_exchanges, NUM_RANKS, timeout_s=120)


def oracle(world: int) -> torch.Tensor:
    codec = compress.build("int8")
    inputs = [rank_input(world, rank, 0) for rank in range(world)]
    parts = []
    for lo, hi in exchange.shard_bounds(NUMEL, world):
        summed = torch.zeros(hi - lo)
        for x in inputs:
            payload, ctx = codec.compress(x[lo:hi])
            summed += codec.decompress(payload, ctx)
        payload, ctx = codec.compress(summed)
        parts.append(codec.decompress(payload, ctx))
    return torch.cat(parts)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_rank_gets_the_owners_re_encoded_sums_bit_for_bit(runs: list[dict], world: int) -> None:
    expected = oracle(world)
    for rank in range(world):
        assert torch.equal(runs[rank][world]["once"], expected), f"rank {rank}"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_with_feedback_on_both_encodings_nothing_is_lost(runs: list[dict], world: int) -> None:
    outs = [runs[rank][world] for rank in range(world)]
    for out in outs[1:]:
        assert torch.equal(out["totals"], outs[0]["totals"])
    sent = outs[0]["totals"].sum(dim=0, dtype=torch.float64)
    first = sum(out["first"].double() for out in outs)
    second = torch.cat([out["second"].double() for out in outs])  # owners' shards, in rank order
    inputs = sum(rank_input(world, r, s).double() for r in range(world) for s in range(STEPS))
    torch.testing.assert_close(sent + first + second, inputs, rtol=0, atol=1e-4)
    # The second memory holds something: without it, this sum would miss what it carries.
    assert float(second.abs().max()) > 0


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_feedback_fused_into_the_encodes_gives_the_same_bits(runs: list[dict], world: int) -> None:
    for rank in range(world):
        out = runs[rank][world]
        for got, expected in zip(out["fused"], (out["totals"], out["first"], out["second"]), strict=True):
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), f"rank {rank}"


@pytest.mark.parametrize("world", [3, 4])
def test_a_rank_sends_about_two_shards_worth_against_allgathers_n_minus_one(
    runs: list[dict], world: int
) -> None:
    payload = compress.build("int8").payload_bytes(NUMEL)
    for rank in range(world):
        out = runs[rank][world]
        assert out["sent"] == pytest.approx(2 * (world - 1) / world * payload, rel=0.01)
        assert out["gathered_sent"] == pytest.approx((world - 1) * payload, rel=0.01)


def _overflowing_sum(rank: int, world: int) -> dict:
    # fp16 shards of 40000 decode to 2^15 (natural compression rounds to a power of two), and the
    # owner's sum of two, 2^16, is past fp16's range; natural's payload would clamp it back.
    comm = TorchComm()
    x = torch.full((64,), 40000.0, dtype=torch.float16)
    lo, hi = exchange.shard_bounds(64, world)[rank]
    memory = torch.zeros(hi - lo, dtype=torch.float16)
    result = exchange.start(compress.build("natural"), x, Route(comm), "two-shot", shard_error=memory).wait()
    return {"finite": result.finite, "memory": memory}


def test_an_owner_sum_past_its_dtypes_range_skips_the_step_everywhere_and_keeps_the_memory() -> None:
    for out in run_ranks(_overflowing_sum, 2, timeout_s=60):
        assert out["finite"] is False
        assert torch.equal(out["memory"], torch.zeros_like(out["memory"]))
