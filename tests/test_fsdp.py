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
