"""exchange.start over real gloo ranks: the majority vote, the finiteness flag and byte counts.

One spawned run of 4 ranks covers worlds of 2, 3 and 4 through process groups of the first n
ranks. Every rank's input is seeded, so the test process rebuilds all of them and computes the
oracle itself:
- signSGD's vote is sign(sum over ranks of sign(x_r)), with sign(0) = +1 for a rank's own sign
  and 0 where the ranks tie (even worlds), in x's dtype, the same bits on every rank; Signum
  votes with the signs of its momentum.
- When one rank's input is not finite, every rank learns it (finite False, no total), whatever
  the codec, including those whose payload holds no float (natural, signsgd, signum); the next
  exchange is finite and bit-identical on every rank.
- payload_nbytes counts this rank's payload (for the vote, its count words) without the flag;
  sent_nbytes is what a ring algorithm sends of the frame, flag and padding included (an
  allreduced float payload has no flag: a rank whose input is not finite sends a NaN).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

from gradsync import compress, exchange, strategy
from gradsync.comm import TorchComm
from gradsync.exchange import Route

NUM_RANKS = 4
WORLD_SIZES = [2, 3, 4]
VOTERS = [n for n in compress.names() if compress.lookup(n).majority_vote]
VOTE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOTE_NUMELS = [1, 7, 1000, 4097]  # less than a word; many words with a partial last one
BETA = 0.9
CODEC_NUMEL = 3000
SEED = 5  # every codec's seed, on every rank: shared streams must agree


def build(name: str) -> compress.Compressor:
    seed = {"seed": SEED} if "seed" in compress.parameters(name) else {}
    return compress.build(name, **seed)


def rank_input(world: int, rank: int, numel: int, step: int = 0, dtype: torch.dtype = torch.float32):
    """Rank `rank`'s input: random signs with +0.0 and -0.0 among them, at a scale of 2^-rank (so
    that a threshold passes a different number of entries on each rank)."""
    g = torch.Generator().manual_seed(((world * 10 + rank) * 10_007 + numel) * 10 + step)
    x = torch.randn(numel, generator=g).mul_(2.0**-rank)
    x[rank::5] = 0.0
    x[rank + 1 :: 11] = -0.0
    return x.to(dtype)


def vote_payload_bytes(numel: int, world: int) -> int:
    """Bytes of the vote's int32 count words: fields of bit_length(world) bits, 31 bits a word."""
    return 4 * -(-numel // (31 // world.bit_length()))


def sign_with_zero_positive(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1, -1)


def majority(signs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(signs).sum(dim=0).sign()


def _exchange(codec: compress.Compressor, x: torch.Tensor, comm: TorchComm, finite: bool = True) -> dict:
    result = exchange.start(codec, x, Route(comm), finite=finite).wait()
    return {
        "finite": result.finite,
        "total": result.total,
        "payload_nbytes": result.payload_nbytes,
        "sent_nbytes": result.sent_nbytes,
    }


def _votes(comm: TorchComm, world: int, rank: int) -> dict:
    out = {}
    for name in VOTERS:
        for dtype in VOTE_DTYPES:
            for numel in VOTE_NUMELS:
                x = rank_input(world, rank, numel, dtype=dtype)
                out[name, dtype, numel] = _exchange(build(name), x, comm)
    signum = compress.build("signum", beta=BETA)
    out["signum_steps"] = [
        _exchange(signum, rank_input(world, rank, CODEC_NUMEL, step), comm)["total"] for step in (1, 2)
    ]
    return out


def _codecs(comm: TorchComm, world: int, rank: int) -> dict:
    """Per codec: a finite exchange with its byte counts, one where the last rank's input is not
    finite, then a finite one again."""
    out = {}
    for name in compress.names():
        codec = build(name)
        x = rank_input(world, rank, CODEC_NUMEL)
        # What the byte counts are checked against, from a twin codec in the same state.
        reference_payload, _ = build(name).compress(x)
        bound = codec.payload_bytes(CODEC_NUMEL)  # before the exchange: DGC's follows its steps
        clean = _exchange(codec, x.clone(), comm)
        bad = rank_input(world, rank, CODEC_NUMEL, step=1)
        flagged = rank == world - 1
        if flagged:
            bad[11] = math.nan
        poisoned = _exchange(codec, bad, comm, finite=not flagged)
        after = _exchange(codec, rank_input(world, rank, CODEC_NUMEL, step=2), comm)
        out[name] = {
            "clean": clean,
            "poisoned": poisoned,
            "after": after,
            "bound": bound,
            "reference_nbytes": [t.nbytes for t in reference_payload],
            "reference_itemsize": reference_payload[0].element_size(),
        }
    return out


def exchange_in_groups(rank: int, world_size: int) -> dict:
    # Every rank creates every group, in the same order, as torch.distributed requires.
    groups = {world: dist.new_group(list(range(world))) for world in WORLD_SIZES}
    out = {}
    for world, group in groups.items():
        if rank < world:
            comm = TorchComm(group)
            assert (comm.rank, comm.world_size) == (rank, world)
            out[world] = {"votes": _votes(comm, world, rank), "codecs": _codecs(comm, world, rank)}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(exchange_in_groups, NUM_RANKS, timeout_s=120)


def results(runs: list[dict], world: int) -> list[dict]:
    """The results of the ranks in the group of `world` ranks, in rank order."""
    return [runs[rank][world] for rank in range(world)]


# -- the majority vote -----------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", VOTERS)
def test_vote_is_the_sign_of_the_summed_signs_with_zero_on_ties_on_every_rank(
    runs: list[dict], name: str, world: int
) -> None:
    # Signum's first step signs (1 - beta) x: the sign of x for these magnitudes.
    ties = 0
    for dtype in VOTE_DTYPES:
        for numel in VOTE_NUMELS:
            xs = [rank_input(world, r, numel, dtype=dtype) for r in range(world)]
            expected = majority([sign_with_zero_positive(x) for x in xs]).to(dtype)
            ties += int((expected == 0).sum())
            for rank, out in enumerate(results(runs, world)):
                got = out["votes"][name, dtype, numel]
                assert got["finite"]
                assert got["total"].dtype == dtype
                assert torch.equal(got["total"], expected), f"rank {rank}, {dtype}, {numel} elements"
                assert got["payload_nbytes"] == vote_payload_bytes(numel, world)
                # One int32 ring allreduce of the count words and the flag word.
                frame_nbytes = vote_payload_bytes(numel, world) + 4
                assert got["sent_nbytes"] == 2 * (world - 1) * frame_nbytes // world
    # An even number of ranks ties somewhere in these inputs; an odd number never can.
    assert (ties > 0) == (world % 2 == 0)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_signum_votes_with_the_signs_of_each_ranks_momentum(runs: list[dict], world: int) -> None:
    # m_1 = (1 - beta) x_1, m_2 = beta m_1 + (1 - beta) x_2, in float64; entries whose momentum
    # is so close to zero that float32 rounding could flip its sign are left out.
    momenta = []
    for r in range(world):
        x1, x2 = (rank_input(world, r, CODEC_NUMEL, step).double() for step in (1, 2))
        m1 = (1 - BETA) * x1
        momenta.append([m1, BETA * m1 + (1 - BETA) * x2])
    for step in range(2):
        ms = [m[step] for m in momenta]
        expected = majority([sign_with_zero_positive(m) for m in ms]).float()
        clear = torch.stack([(m == 0) | (m.abs() > 1e-6) for m in ms]).all(dim=0)
        assert int(clear.sum()) > 0.99 * CODEC_NUMEL
        totals = [out["votes"]["signum_steps"][step] for out in results(runs, world)]
        for rank, total in enumerate(totals):
            assert torch.equal(total, totals[0]), f"rank {rank} differs from rank 0 at step {step + 1}"
            assert torch.equal(total[clear], expected[clear]), f"rank {rank}, step {step + 1}"


# -- every codec: the flag and the byte counts ------------------------------------------------------

CODEC_CASES = [(name, world) for name in compress.names() for world in WORLD_SIZES]
CODEC_IDS = [f"{name}-{world}ranks" for name, world in CODEC_CASES]


@pytest.mark.parametrize(("name", "world"), CODEC_CASES, ids=CODEC_IDS)
def test_one_ranks_non_finite_input_makes_the_exchange_non_finite_on_every_rank(
    runs: list[dict], name: str, world: int
) -> None:
    outs = [out["codecs"][name] for out in results(runs, world)]
    for rank, out in enumerate(outs):
        assert out["clean"]["finite"], f"rank {rank}: a finite exchange came out non-finite"
        assert not out["poisoned"]["finite"], (
            f"rank {rank} did not learn that rank {world - 1} was not finite"
        )
        assert out["poisoned"]["total"] is None
        after = out["after"]
        assert after["finite"], f"rank {rank}: the exchange after the non-finite one is still non-finite"
        assert bool(torch.isfinite(after["total"]).all())
        for key in ("clean", "after"):
            assert torch.equal(out[key]["total"], outs[0][key]["total"]), f"rank {rank} differs from rank 0"


@pytest.mark.parametrize(("name", "world"), CODEC_CASES, ids=CODEC_IDS)
def test_payload_bytes_exclude_the_flag_and_bytes_sent_include_it(
    runs: list[dict], name: str, world: int
) -> None:
    codec = compress.lookup(name)
    outs = [out["codecs"][name] for out in results(runs, world)]
    sizes = [sum(out["reference_nbytes"]) for out in outs]
    longest = max(sizes)
    if not codec.fixed_size:
        assert len(set(sizes)) > 1, f"{name}: the same size on every rank leaves the padding untested"
    for rank, out in enumerate(outs):
        got = out["clean"]
        own = sizes[rank]
        if strategy.default_collective(name) == "two-shot":
            # Each shard's payload to its owner (a flag byte each), then the owners' payloads of
            # their sums allgathered, padded to the longest shard's and flagged.
            shards = [
                compress.build(name).payload_bytes(hi - lo)
                for lo, hi in exchange.shard_bounds(CODEC_NUMEL, world)
            ]
            assert got["payload_nbytes"] == sum(shards) + shards[rank], f"rank {rank}"
            to_owners = sum(size + 1 for owner, size in enumerate(shards) if owner != rank)
            assert got["sent_nbytes"] == to_owners + (world - 1) * (max(shards) + 1), f"rank {rank}"
            continue
        if codec.majority_vote:
            assert got["payload_nbytes"] == vote_payload_bytes(CODEC_NUMEL, world)
            continue  # sent_nbytes: see the vote test
        assert got["payload_nbytes"] == own, f"rank {rank}"
        if codec.fixed_size:
            assert own == out["bound"]
        else:
            assert own <= out["bound"]
        if codec.rounds > 1:  # one ring allreduce per round; a NaN tells of a non-finite input
            expected = sum(exchange.allreduce_sent_nbytes(n, world) for n in out["reference_nbytes"])
        elif codec.summable:  # one ring allreduce of the payload itself, no flag (a NaN instead)
            expected = exchange.allreduce_sent_nbytes(own, world)
        else:  # a ring allgather of bytes, padded to the longest payload, and a flag byte
            expected = (world - 1) * (longest + 1)
        assert got["sent_nbytes"] == expected, f"rank {rank}"


def _owner_overflow(rank: int, world: int) -> bool:
    # Every input is finite, but rank 1's entry 6, in its own shard, is past fp16's range: only
    # rank 1, as that shard's owner, sees its sum overflow.
    x = torch.full((8,), 0.5)
    if rank == 1:
        x[6] = 1e5
    out = torch.empty(4)
    return exchange.reduce_scatter(build("fp16"), x, out, TorchComm(None), average=True, agree=True).finite


def test_a_reduce_scatter_that_overflows_at_one_owner_is_skipped_by_every_rank() -> None:
    # With error feedback (agree=True) the ranks must skip alike, or one owner's memories and
    # parameters part from the others'.
    assert run_ranks(_owner_overflow, 2) == [False, False]
