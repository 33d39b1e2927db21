"""The selector and the router, in one process: measurements against hand-made row sets, the
decision against the cost model, and the router's bookkeeping (forced schemes, decision steps,
stats, checkpoints)."""

from __future__ import annotations

import pytest
import torch

from gradsync import sparse
from gradsync.comm import LocalComm
from gradsync.sparse.cost import Network, seconds
from gradsync.sparse.router import Router
from gradsync.sparse.select import Selector, measure

NUM_ROWS = 1000


def rows_at(indices: list[int], width: int = 2, num_rows: int = NUM_ROWS) -> sparse.SparseRows:
    index = torch.tensor(sorted(indices), dtype=torch.int64)
    return sparse.SparseRows(index, torch.ones(len(indices), width), num_rows)


def test_measure_counts_density_overlap_and_unions_of_consecutive_ranks() -> None:
    parts = [
        rows_at(range(0, 100)),
        rows_at(range(50, 150)),
        rows_at(range(0, 100)),
        rows_at(range(200, 300)),
    ]
    measured = measure(parts)
    sparsity = measured.sparsity
    assert sparsity.density == pytest.approx(0.1)
    assert sparsity.max_density == pytest.approx(0.1)
    # Pairs of consecutive ranks: {0..149} (150 rows) and {0..99} + {200..299} (200 rows).
    assert sparsity.union_density[2] == pytest.approx((150 + 200) / 2 / NUM_ROWS)
    assert sparsity.union_density[4] == pytest.approx(250 / NUM_ROWS)
    assert sparsity.densification(4) == pytest.approx(2.5)
    # Overlaps over the 6 pairs: 0-1 .5, 0-2 1, 0-3 0, 1-2 .5, 1-3 0, 2-3 0.
    assert measured.overlap == pytest.approx(2 / 6)
    assert sparsity.width == 2 and sparsity.value_nbytes == 4


def test_measure_takes_the_whole_group_for_a_world_that_is_not_a_power_of_two() -> None:
    parts = [rows_at([1, 2]), rows_at([2, 3]), rows_at([9])]
    assert measure(parts).sparsity.union_density[3] == pytest.approx(4 / NUM_ROWS)
    assert set(measure(parts).sparsity.union_density) == {1, 2, 3}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_selector_sends_dense_rows_dense_and_sparse_rows_sparse(world: int) -> None:
    # Bandwidth only: at full density the sparse schemes' indices are pure overhead.
    selector = Selector(every=10, network=Network(alpha_s=0.0))
    generator = torch.Generator().manual_seed(world)
    full = [rows_at(range(NUM_ROWS), 64) for _ in range(world)]
    few = [rows_at(torch.randperm(NUM_ROWS, generator=generator)[:10].tolist(), 64) for _ in range(world)]
    assert selector.decide("full", full, step=0, comm=LocalComm()).scheme == "dense"
    choice = selector.decide("few", few, step=0, comm=LocalComm())
    assert choice.scheme != "dense"
    assert choice.predicted_s == seconds(measure(few).sparsity, world, Network(alpha_s=0.0))
    assert choice.scheme == min(choice.predicted_s, key=choice.predicted_s.get)


def test_a_choice_holds_for_every_steps_then_is_due_again() -> None:
    selector = Selector(every=3, network=Network())
    assert selector.due("t", 0)
    selector.decide("t", [rows_at([1]), rows_at([2])], step=5, comm=LocalComm())
    assert [selector.due("t", step) for step in (5, 6, 7, 8)] == [False, False, False, True]
    assert selector.due("other", 6)


@pytest.mark.parametrize("scheme", sparse.names())
def test_a_forced_scheme_is_used_and_reported(scheme: str) -> None:
    router = Router(scheme, every=10, seed=0)
    rows = rows_at([0, 5, NUM_ROWS - 1])
    result = router.sync("param 0", rows, LocalComm(), step=0)
    assert result.scheme == scheme
    assert torch.equal(result.total.dense(), rows.to_dense())
    stats = router.stats()["param 0"]
    assert stats["exchanged_by"] == scheme and stats["rows"] == 3 and stats["union_rows"] in (3, NUM_ROWS)
    assert "density" not in stats  # a forced scheme measures nothing


def test_auto_gathers_on_decision_steps_and_then_runs_the_choice() -> None:
    router = Router("auto", every=2, seed=0)
    router.selector.network = Network()
    rows = rows_at([3, 4])
    exchanged_by = [router.sync("t", rows, LocalComm(), step).scheme for step in range(5)]
    chosen = router.selector.choices["t"].scheme
    assert exchanged_by == ["agsparse", chosen, "agsparse", chosen, "agsparse"]
    stats = router.stats()["t"]
    assert stats["decided_at_step"] == 4 and stats["density"] == pytest.approx(2 / NUM_ROWS)


def test_choose_dense_decides_without_gathering_only_where_sparse_cannot_win() -> None:
    router = Router("auto", every=10, seed=0)
    like = torch.zeros(NUM_ROWS, 16)
    assert router.choose_dense("dense", 0.9, like, n=4, step=0)
    assert router.selector.choices["dense"].scheme == "dense"
    assert not router.choose_dense("sparse", 0.001, like, n=4, step=0)
    assert "sparse" not in router.selector.choices


def test_the_router_state_round_trips() -> None:
    router = Router("auto", every=2, seed=0)
    router.selector.network = Network(alpha_s=1e-4, bytes_per_s=1e8)
    router.sync("t", rows_at([3, 4]), LocalComm(), 0)
    restored = Router("auto", every=2, seed=0)
    restored.load_state_dict(router.state_dict())
    assert restored.state_dict() == router.state_dict()
    assert restored.selector.choices["t"].scheme == router.selector.choices["t"].scheme
    assert not restored.selector.due("t", 1)


def test_the_selector_decides_from_the_data_alone_on_a_fixed_network() -> None:
    # No timing enters a decision: two selectors given the same rows choose alike, on the
    # documented default network, without measuring anything.
    parts = [rows_at(range(r, 400, 7), width=4, num_rows=1000) for r in range(4)]
    first = Selector(every=10).decide("e", parts, 0, LocalComm())
    second = Selector(every=10).decide("e", parts, 0, LocalComm())
    assert Selector(every=10).network == Network()
    assert (first.scheme, first.predicted_s) == (second.scheme, second.predicted_s)


def test_a_small_dense_tensor_of_a_bucket_stays_in_the_buckets_allreduce() -> None:
    # Alone, a sparse scheme's few rounds (all_to_all, recursive doubling) beat a ring's 2 (n - 1)
    # for a small tensor; in a bucket, going dense costs no round of its own, so dense wins.
    slow_rounds = Network(alpha_s=1e-3, bytes_per_s=1e9)
    bias = [rows_at(range(512), width=1, num_rows=512) for _ in range(8)]
    alone = Selector(every=10, network=slow_rounds).decide("b", bias, 0, LocalComm())
    in_bucket = Selector(every=10, network=slow_rounds).decide("b", bias, 0, LocalComm(), dense_latency=False)
    assert alone.scheme != "dense"
    assert in_bucket.scheme == "dense"
    router = Router("auto", every=10, seed=0)
    router.selector.network = slow_rounds
    assert router.choose_dense("b", 1.0, bias[0].to_dense(), n=8, step=0)
