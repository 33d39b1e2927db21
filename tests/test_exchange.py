"""exchange.start in a world of one (LocalComm): the majority vote, the finiteness flag and the
byte counts, for every registered codec. The same over real ranks: distributed/test_dist_exchange.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gradsync import compress, exchange, sparse
from gradsync.comm import LocalComm
from gradsync.exchange import Route

VOTERS = [n for n in compress.names() if compress.lookup(n).majority_vote]
NUMELS = [1, 30, 31, 32, 1000]  # below, at and above one int32 word of 31 one-bit fields
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def build(name: str) -> compress.Compressor:
    seed = {"seed": 5} if "seed" in compress.parameters(name) else {}
    return compress.build(name, **seed)


def vote_payload_bytes(numel: int, world_size: int) -> int:
    """The vote's int32 count words: fields of bit_length(world_size) bits, 31 bits a word."""
    return 4 * -(-numel // (31 // world_size.bit_length()))


def with_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Random signs, with +0.0 and -0.0 among them."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    x[::7] = 0.0
    x[3::7] = -0.0
    return x


def test_the_majority_vote_codecs_are_signsgd_and_signum() -> None:
    assert VOTERS == ["signsgd", "signum"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("name", VOTERS)
def test_a_vote_of_one_is_the_sign_of_the_input_with_zeros_positive(
    name: str, numel: int, dtype: torch.dtype
) -> None:
    # Signum's first step signs (1 - beta) x, whose sign is x's for these magnitudes.
    x = with_zeros(numel, dtype)
    result = exchange.start(build(name), x.clone(), Route(LocalComm())).wait()
    assert result.finite
    assert result.total.dtype == dtype
    assert torch.equal(result.total, torch.where(x >= 0, 1.0, -1.0).to(dtype))
    assert result.payload_nbytes == vote_payload_bytes(numel, 1)
    assert result.sent_nbytes == 0  # a ring of one sends nothing


@pytest.mark.parametrize("name", compress.names())
def test_a_non_finite_input_is_flagged_and_gives_no_total(name: str) -> None:
    # The caller passes finite=False; the codec gets zeros, so its own payload says nothing.
    result = exchange.start(build(name), torch.randn(500), Route(LocalComm()), finite=False).wait()
    assert not result.finite
    assert result.total is None


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "flagged"])
@pytest.mark.parametrize("name", [n for n in compress.names() if compress.lookup(n).fixed_size])
def test_payload_bytes_exclude_the_flag(name: str, finite: bool) -> None:
    numel = 1000
    codec = build(name)
    result = exchange.start(codec, torch.randn(numel), Route(LocalComm()), finite=finite).wait()
    if codec.majority_vote:
        assert result.payload_nbytes == vote_payload_bytes(numel, 1)
    elif codec.rounds > 1 and not finite:  # the flag of the first round ends the exchange
        assert 0 < result.payload_nbytes < codec.payload_bytes(numel)
    else:
        assert result.payload_nbytes == codec.payload_bytes(numel)


def test_a_payload_that_overflows_its_float_type_is_not_finite() -> None:
    # Finite in fp32, inf once cast to fp16: the flag says finite, the payload does not.
    x = torch.full((100,), 1e5)
    result = exchange.start(build("fp16"), x, Route(LocalComm())).wait()
    assert not result.finite
    assert result.total is None
    assert not math.isfinite(float(x.to(torch.float16)[0]))


@pytest.mark.parametrize("name", ["int4", "int8", "topk", "powersgd", "qsgd"])
def test_an_exchange_outcome_shows_torch_its_sum_and_nothing_it_cannot_pickle(name: str) -> None:
    # A GPU-aware Future finds the CUDA tensors of its value by pickling it with torch's tensor
    # extractor; an outcome's `local` and `subtract_local` are closures, which cannot be pickled.
    # (tests/distributed/test_dist_cuda.py runs the hook itself on a GPU, where one is present.)
    from torch._jit_internal import _extract_tensors

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    result = exchange.start(build(name), x.clone(), Route(LocalComm()), None, None, True).wait()
    found = _extract_tensors(result)
    assert len(found) == 1 and found[0] is result.total
    with pytest.raises(TypeError, match="not copied or pickled"):  # never restored as something else
        copy.copy(result)


@pytest.mark.parametrize("scheme", [None, *sparse.names()])
def test_a_payload_found_non_finite_is_flagged_by_every_sparse_scheme_too(scheme: str | None) -> None:
    # The caller checked its gradient; what it compressed (memory added) overflowed. The payload's
    # own check must flag it by a scheme as by the allgather, or inf enters the error memory.
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    x[3] = math.inf
    codec = compress.build("topk", ratio=0.1)
    result = exchange.start(codec, x, Route(LocalComm()), scheme=scheme, finite=True).wait()
    assert not result.finite
    assert result.total is None


def test_two_shot_is_refused_for_a_codec_whose_random_stream_the_ranks_share() -> None:
    # randk draws its support from a stream every rank keeps alike; an owner re-encoding its
    # shard's sum would draw for a shard of its own size and decode with another draw's support.
    with pytest.raises(ValueError, match="random stream the ranks share"):
        exchange.start(build("randk"), torch.randn(100), Route(LocalComm()), "two-shot")


def test_torch_comm_reduce_scatter_runs_on_torch_with_either_name(one_rank: None, monkeypatch) -> None:
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single; the H200 machine's torch
    # 2.11 has only the old name, and every FSDP run there failed on the new one.
    import warnings

    import torch.distributed as dist

    from gradsync.comm import TorchComm

    comm = TorchComm(None)
    x = torch.arange(6.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated name is not used where the new one exists
        assert torch.equal(comm.reduce_scatter(torch.empty(6), x, average=True).wait(), x)
    if hasattr(dist, "reduce_scatter_single"):
        monkeypatch.delattr(dist, "reduce_scatter_single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert torch.equal(comm.reduce_scatter(torch.empty(6), x, average=False).wait(), x)
