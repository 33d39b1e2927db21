"""The harness itself: a failing rank fails the test with its traceback; a hang times out."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import RankError, run_ranks


def rank_one_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()  # rank 1 never arrives
    return rank


def sleeps_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def sums_ranks(rank: int, world_size: int) -> tuple[int, float, int]:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, total.item(), torch.get_num_threads()


def test_ranks_return_their_results_in_rank_order() -> None:
    assert run_ranks(sums_ranks, 2, timeout_s=60) == [(0, 1.0, 1), (1, 1.0, 1)]


def test_a_failing_rank_fails_the_test_with_its_traceback_while_its_peer_waits() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 ---.*RuntimeError: deliberate failure on rank 1"):
        run_ranks(rank_one_raises, 2, timeout_s=60)
    assert time.monotonic() - start < 30, "the waiting peer was not cut short"


def test_a_hang_fails_at_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match="no result within 4 s"):
        run_ranks(sleeps_forever, 2, timeout_s=4)
    assert time.monotonic() - start < 20
