"""FSDP2's side of gradsync in one process: what ShardedState says and reads of FSDP's own state.
tests/distributed/test_dist_fsdp.py runs fully_shard-ed models on several ranks."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from gradsync import SyncConfig
from gradsync.comm import LocalComm
from gradsync.fsdp import ShardedState, _divide_factors


@pytest.mark.parametrize("min_compress_numel", [2500, 1500])
def test_an_fsdp_model_too_small_to_compress_is_said_once_too(
    caplog: pytest.LogCaptureFixture, min_compress_numel: int
) -> None:
    # FSDP's reduce-scatter never passes through the DDP hook's step counting, and said nothing.
    config = SyncConfig(compressor="int4", warmup_steps=2, min_compress_numel=min_compress_numel)
    state, comm = ShardedState(config, LocalComm(), torch.nn.Linear(40, 50)), LocalComm()
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="gradsync"):
        for _ in range(5):
            for group, numel in ((0, 2000), (1, 1000)):
                x = torch.randn(numel, generator=generator)
                state.reduce_scatter(x, torch.empty(numel), group, comm, True)
    said = [r.getMessage() for r in caplog.records if "nothing is compressed" in r.getMessage()]
    if min_compress_numel > 2000:
        assert said == [
            "gradsync: nothing is compressed: the largest fully_shard-ed module's gradient, 2000 "
            "elements, is below min_compress_numel=2500 (where compressing costs more than it saves); "
            "lower SyncConfig(min_compress_numel=...) to compress smaller ones"
        ]
    else:  # group 0 is compressed from step 2 on
        assert said == [] and state.stats()["total"]["compressed_groups"] == 3
        started = [r.getMessage() for r in caplog.records if "compressing from step" in r.getMessage()]
        assert started == ["gradsync: compressing from step 2 on, group 0 first: int4 by two-shot"]


def test_a_large_module_that_lags_the_small_ones_is_not_said_uncompressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Each module counts its own reduce-scatters: one that joins the graph two steps late is at
    # its step 1 when the small one passes warmup_steps, and compresses once it reaches them.
    config = SyncConfig(compressor="int4", warmup_steps=2, min_compress_numel=2500)
    state, comm = ShardedState(config, LocalComm(), torch.nn.Linear(40, 50)), LocalComm()
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="gradsync"):
        for outer in range(6):
            for group, numel in ((0, 1000), (1, 4000))[: 1 if outer < 2 else 2]:
                x = torch.randn(numel, generator=generator)
                state.reduce_scatter(x, torch.empty(numel), group, comm, True)
    assert not [r for r in caplog.records if "nothing is compressed" in r.getMessage()]
    assert state.stats()["total"]["compressed_groups"] == 2  # group 1 at its steps 2 and 3


@pytest.mark.parametrize("attribute", ["_fsdp_param_groups", "_fsdp_param_group"])
def test_a_divide_factor_is_found_where_either_torch_keeps_it(attribute: str) -> None:
    # torch 2.13 keeps a list of parameter groups per module; torch before it one group, under
    # another name: the check against a divide factor beside replicas must read both.
    group = SimpleNamespace(gradient_divide_factor=2.0)
    held = [group] if attribute == "_fsdp_param_groups" else group
    module = SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**{attribute: held}))
    assert _divide_factors(module) == {2.0}
    unset = SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(_fsdp_param_group=None))
    assert _divide_factors(unset) == set()


def test_a_memory_that_overflows_with_a_finite_gradient_skips_the_step_and_stays_finite() -> None:
    # 3e38 is finite in float32 (whose largest value is 3.4e38); natural compression sends it as
    # 2^127 and keeps 1.3e38 in the memory, which the next 3e38 takes past the range. Its payload
    # saturates and would hide that inf: the compressed tensor is checked, not the gradient.
    config = SyncConfig(compressor="natural", error_feedback="ef", warmup_steps=0, min_compress_numel=0)
    state, comm = ShardedState(config, LocalComm(), torch.nn.Linear(4, 4)), LocalComm()
    outs = []
    for _ in range(2):
        out = torch.empty(20)
        state.reduce_scatter(torch.full((20,), 3e38), out, 0, comm, True)
        outs.append(out)
    assert bool(torch.isfinite(outs[0]).all()) and bool(torch.isnan(outs[1]).all())
    memory = state.points[0].feedback.error
    assert memory is not None and bool(torch.isfinite(memory).all())


@pytest.mark.parametrize("shard_ranks", [1, 2])
def test_hsdp_says_nothing_is_compressed_where_only_the_replica_average_could_compress(
    caplog: pytest.LogCaptureFixture, shard_ranks: int
) -> None:
    # FSDP runs no reduce-scatter on a one-rank shard group: only the replicas' average runs, and
    # it must say, as the reduce-scatter does, that nothing is compressed. Over two ranks the
    # reduce-scatter compresses the 4000-element gradient, and its 2000-element shard staying
    # below min_compress_numel across replicas is no reason to say so.
    config = SyncConfig(compressor="int4", warmup_steps=2, min_compress_numel=2500)
    state = ShardedState(config, LocalComm(), torch.nn.Linear(40, 50), replicas=LocalComm())
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="gradsync"):
        for _ in range(5):
            if shard_ranks > 1:
                x = torch.randn(4000, generator=generator)
                state.reduce_scatter(x, torch.empty(4000), 0, LocalComm(), True)
            state.all_reduce_replicas(torch.randn(2000, generator=generator), 0)
    said = [r.getMessage() for r in caplog.records if "nothing is compressed" in r.getMessage()]
    if shard_ranks > 1:
        assert said == [] and state.stats()["total"]["compressed_groups"] == 3
    else:
        assert said == [
            "gradsync: nothing is compressed: the largest shard averaged across replicas, 2000 "
            "elements, is below min_compress_numel=2500 (where compressing costs more than it "
            "saves); lower SyncConfig(min_compress_numel=...) to compress smaller ones"
        ]
