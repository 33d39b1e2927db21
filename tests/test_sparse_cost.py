"""cost.py's traffic formulas against values worked out by hand, the latency steps, the alpha-beta
time, densification, and the scheme fastest() picks at high and at low density.

(That the formulas match what the schemes really send is checked over gloo ranks in
tests/distributed/test_dist_sparse.py.)
"""

from __future__ import annotations

import math

import pytest

from gradsync.sparse import names
from gradsync.sparse.cost import Network, Sparsity, fastest, latency_steps, seconds, traffic


def sparsity(
    num_rows: int, width: int, union_density: dict[int, float], value_nbytes: int = 4, **kw
) -> Sparsity:
    return Sparsity(num_rows, width, value_nbytes, union_density, **kw)


def test_traffic_names_every_scheme() -> None:
    s = sparsity(100, 1, {1: 0.1, 2: 0.2})
    assert list(traffic(s, 2)) == names() == list(latency_steps(2))


@pytest.mark.parametrize(("n", "expected"), [(2, 124), (4, 186), (3, 165)])
def test_dense_is_a_ring_allreduce_of_the_table_and_a_flag(n: int, expected: int) -> None:
    # M = 10 rows x 3 x 4 bytes + one 4-byte flag = 124; 2 (n - 1) / n M, rounded down
    # (n = 3: 165.33 -> 165) as comm.allreduce_sent_nbytes counts it.
    s = sparsity(10, 3, {1: 0.3, 2: 0.5, 4: 0.7, 3: 0.6})
    assert traffic(s, n)["dense"] == expected
    assert traffic(s, n)["dense"] == pytest.approx(2 * (n - 1) / n * 124, abs=1)


def test_agsparse_sends_the_densest_ranks_frame_to_every_other_rank() -> None:
    # 1000 rows of width 2, fp32: 10 rows per rank = 40 bytes of COO indices (the bitmap would be
    # 125) + 80 bytes of values; + the 16-byte size pair; to 3 other ranks.
    s = sparsity(1000, 2, {1: 0.01, 2: 0.02, 4: 0.04})
    assert traffic(s, 4)["agsparse"] == 3 * (16 + 40 + 80)
    # Padded to the densest rank: 50 rows, whose indices go as a 125-byte bitmap (< 200 of COO).
    padded = sparsity(1000, 2, {1: 0.01, 2: 0.02, 4: 0.04}, max_density=0.05)
    assert traffic(padded, 4)["agsparse"] == 3 * (16 + 125 + 400)


def test_balanced_pushes_rows_out_and_pulls_the_mean_owners_sum_from_every_owner() -> None:
    # 1200 rows, width 1, fp32, 4 ranks of 12 rows each, 36 in the union (9 per owner, 300 owned).
    s = sparsity(1200, 1, {1: 0.01, 2: 0.02, 4: 0.03})
    push = 3 / 4 * 12 * (4 + 4)  # 3/4 of a rank's rows leave it, each 4 index + 4 value bytes
    pull = 4 * 9 + 9 * 4  # COO (36 bytes) beats the 38-byte hash bitmap over 300 rows
    assert traffic(s, 4)["balanced"] == pytest.approx(3 * (8 + 24 + pull) + push)  # 384
    assert traffic(s, 4)["balanced"] == pytest.approx(384)
    # Imbalances scale the push and the owner's pull; 18 rows pulled take the 38-byte bitmap.
    skewed = sparsity(1200, 1, {1: 0.01, 2: 0.02, 4: 0.03}, push_imbalance=1.5, pull_imbalance=2.0)
    assert traffic(skewed, 4)["balanced"] == pytest.approx(3 * (8 + 24 + 38 + 18 * 4) + 1.5 * push)  # 498


def test_recursive_doubling_sends_the_growing_union_capped_at_dense_each_round() -> None:
    # 1000 rows, width 1, fp32 (dense 4000 bytes). Round i sends the union of 2^i ranks: 10 rows
    # = 16 header + 40 COO + 40 values; 20 rows = 16 + 80 + 80.
    s = sparsity(1000, 1, {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04})
    assert traffic(s, 2)["recursive-doubling"] == 96
    assert traffic(s, 4)["recursive-doubling"] == 96 + 176
    # 3 ranks: the rank that folds in the third sends the union of 2 (20 rows) in the one round,
    # then the total (30 rows: 16 + 120 + 120) back to the third.
    assert traffic(s, 3)["recursive-doubling"] == 176 + 256
    # Half the rows: 125-byte bitmap + 2000 bytes of values; then 750 rows: 125 + 3000.
    half = sparsity(1000, 1, {1: 0.5, 2: 0.75, 4: 1.0})
    assert traffic(half, 4)["recursive-doubling"] == (16 + 2125) + (16 + 3125)
    # Past the dense size a message goes dense: fp16, 950 rows = 125 + 1900 > 2000 dense bytes.
    assert (
        traffic(sparsity(1000, 1, {1: 0.9, 2: 1.0}, value_nbytes=2), 2)["recursive-doubling"]
        == 16 + 125 + 1800
    )
    assert traffic(sparsity(1000, 1, {1: 0.95, 2: 1.0}, value_nbytes=2), 2)["recursive-doubling"] == 16 + 2000


def test_latency_steps_and_seconds_follow_the_alpha_beta_model() -> None:
    assert latency_steps(4) == {"dense": 6, "agsparse": 6, "balanced": 4, "recursive-doubling": 4}
    assert latency_steps(3)["recursive-doubling"] == 2 + 4  # one round, and the fold's two messages each way
    assert latency_steps(8)["recursive-doubling"] == 6
    network = Network(alpha_s=1e-3, bytes_per_s=1e6)
    assert network.seconds(2e6, ("allreduce", "all_to_all"), 4) == pytest.approx(7e-3 + 2.0)
    s = sparsity(1000, 4, {1: 0.05, 2: 0.09, 4: 0.16})
    predicted = seconds(s, 4, network)
    for name, nbytes in traffic(s, 4).items():
        assert predicted[name] == pytest.approx(latency_steps(4)[name] * 1e-3 + nbytes / 1e6)


def test_measured_rounds_replace_the_alpha_model_where_known() -> None:
    measured = Network(alpha_s=1e-3, bytes_per_s=1e6, round_s={"all_to_all": 0.03, "sendrecv": 0.002})
    assert measured.latency_s("all_to_all", 8) == 0.03
    assert measured.latency_s("allgather", 8) == pytest.approx(7e-3)  # not measured: alpha per step
    s = sparsity(1000, 4, {1: 0.05, 2: 0.09, 4: 0.16, 8: 0.25})
    predicted = seconds(s, 8, measured)
    assert predicted["balanced"] == pytest.approx(4 * 0.03 + traffic(s, 8)["balanced"] / 1e6)
    assert predicted["recursive-doubling"] == pytest.approx(
        6 * 0.002 + traffic(s, 8)["recursive-doubling"] / 1e6
    )


def test_densification_is_the_union_density_over_one_ranks() -> None:
    s = sparsity(1000, 1, {1: 0.01, 2: 0.015, 4: 0.02})
    assert s.densification(2) == pytest.approx(1.5) and s.densification(4) == pytest.approx(2.0)
    assert s.densification(1) == 1.0
    assert sparsity(1000, 1, {1: 0.0, 2: 0.0}).densification(2) == 1.0
    assert s.density == 0.01 and s.rows(4) == pytest.approx(20.0) and s.dense_nbytes == 4000


def test_fastest_picks_dense_at_high_density() -> None:
    network = Network()
    # Half of a flat tensor (width 1) per rank, the ranks' halves covering it: a 4-byte index per
    # 4-byte value makes every sparse scheme dearer than one allreduce.
    half = sparsity(1_000_000, 1, {1: 0.5, 2: 0.75, 4: 0.94, 8: 1.0})
    assert fastest(half, 8, network) == "dense"
    full = {m: 1.0 for m in (1, 2, 4, 8)}
    for n in (2, 4, 8):
        assert fastest(sparsity(100_000, 64, full), n, network) == "dense"


def test_fastest_picks_a_sparse_scheme_at_low_density() -> None:
    network = Network()
    # 1% of an embedding per rank, mostly the same rows on every rank: Zen's balanced parallelism.
    overlapping = sparsity(1_000_000, 64, {1: 0.01, 2: 0.011, 4: 0.0115, 8: 0.012})
    assert fastest(overlapping, 8, network) == "balanced"
    predicted = seconds(overlapping, 8, network)
    assert predicted["balanced"] < predicted["dense"] / 50
    # Far sparser, and each rank's rows its own: the few rows go fastest by recursive doubling.
    disjoint = sparsity(1_000_000, 64, {1: 0.001, 2: 0.002, 4: 0.004, 8: 0.008})
    assert fastest(disjoint, 8, network) == "recursive-doubling"
    # A tie goes to the first scheme in table order.
    assert (
        fastest(sparsity(100, 1, {1: 0.1, 2: 0.2}), 2, Network(alpha_s=0.0, bytes_per_s=math.inf)) == "dense"
    )
