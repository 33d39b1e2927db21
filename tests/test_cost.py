"""The alpha-beta cost model: each formula against hand arithmetic, and the invariants between them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradsync import cost
from gradsync.cost import LinearFit, Link

LINK = Link(alpha_s=1e-5, bytes_per_s=1e9)
INTRA = Link(alpha_s=1e-6, bytes_per_s=1e11)
NO_LATENCY = Link(alpha_s=0.0, bytes_per_s=1e9)
SIZES = [0.0, 4.0, 1e3, 1e6, 64e6]


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-12, abs=1e-18)


# --- Link


def test_transfer_is_alpha_plus_bytes_over_bandwidth() -> None:
    assert LINK.transfer_s(1e6) == approx(1e-5 + 1e-3)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"alpha_s": 1e-5, "bytes_per_s": 0}, "bytes_per_s=0"),
        ({"alpha_s": 1e-5, "bytes_per_s": -1.0}, "bytes_per_s=-1.0"),
        ({"alpha_s": -1e-05, "bytes_per_s": 1e9}, "alpha_s=-1e-05"),
        ({"alpha_s": float("nan"), "bytes_per_s": 1e9}, "alpha_s=nan"),
    ],
)
def test_link_rejects_unphysical_values_naming_them(kwargs: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named) as error:
        Link(**kwargs)
    assert "e.g." in str(error.value)  # the message suggests a fix


# --- hand arithmetic, n = 1, 2, 4 (alpha = 1e-5 s, B = 1e9 B/s, S = 1e6 B)


def test_ring_allreduce_matches_hand_arithmetic() -> None:
    assert cost.ring_allreduce_s(1e6, 4, LINK) == approx(6e-5 + 1.5e-3)  # 2*3 alpha + 2*3/4 * 1e-3
    assert cost.ring_allreduce_s(1e6, 2, LINK) == approx(2e-5 + 1e-3)  # 2*1 alpha + 2*1/2 * 1e-3
    assert cost.ring_allreduce_s(1e6, 1, LINK) == 0.0


def test_tree_allreduce_matches_hand_arithmetic() -> None:
    assert cost.tree_allreduce_s(1e6, 4, LINK) == approx(4e-5 + 2e-3)  # 2*log2(4) alpha + 2 * 1e-3
    assert cost.tree_allreduce_s(1e6, 5, LINK) == approx(6e-5 + 2e-3)  # depth ceil(log2 5) = 3
    assert cost.tree_allreduce_s(1e6, 2, LINK) == approx(2e-5 + 2e-3)
    assert cost.tree_allreduce_s(1e6, 1, LINK) == 0.0


def test_reduce_scatter_matches_hand_arithmetic() -> None:
    assert cost.reduce_scatter_s(1e6, 4, LINK) == approx(3e-5 + 7.5e-4)  # 3 alpha + 3/4 * 1e-3
    assert cost.reduce_scatter_s(1e6, 2, LINK) == approx(1e-5 + 5e-4)
    assert cost.reduce_scatter_s(1e6, 1, LINK) == 0.0


def test_allgather_equal_matches_hand_arithmetic() -> None:
    assert cost.allgather_equal_s(1e6, 4, LINK) == approx(3e-5 + 3e-3)  # 3 (alpha + 1e-3)
    assert cost.allgather_equal_s(1e6, 2, LINK) == approx(1e-5 + 1e-3)
    assert cost.allgather_equal_s(1e6, 1, LINK) == 0.0


def test_all_to_all_uniform_matches_hand_arithmetic() -> None:
    assert cost.all_to_all_uniform_s(1e6, 4, LINK) == approx(3e-5 + 7.5e-4)  # 3 (alpha + 2.5e5 / 1e9)
    assert cost.all_to_all_uniform_s(1e6, 2, LINK) == approx(1e-5 + 5e-4)
    assert cost.all_to_all_uniform_s(1e6, 1, LINK) == 0.0


def test_reduce_scatter_allgather_matches_hand_arithmetic() -> None:
    # reduce-scatter 3e-5 + 7.5e-4, allgather of 2.5e5 B blocks 3 (1e-5 + 2.5e-4)
    assert cost.reduce_scatter_allgather_s(1e6, 4, LINK) == approx(6e-5 + 1.5e-3)
    assert cost.reduce_scatter_allgather_s(1e6, 1, LINK) == 0.0


# --- variable-size allgather


def test_skewed_allgather_costs_sum_minus_min_over_bandwidth() -> None:
    sizes = [1e6, 1e6, 1e6, 5e6]  # the links carry 7e6, 7e6, 3e6 (skips the 5e6), 7e6 bytes
    assert cost.allgather_s(sizes, LINK) == approx(3e-5 + 7e-3)  # 3 alpha + (8e6 - 1e6) / 1e9
    assert cost.allgather_s([2e6, 5e5], LINK) == approx(1e-5 + 2e-3)  # n = 2: each link carries one block
    assert cost.allgather_s([7e6], LINK) == 0.0


def test_skewed_allgather_costs_more_than_equal_sizes_with_the_same_minimum() -> None:
    skewed = cost.allgather_s([1e6, 1e6, 1e6, 5e6], LINK)
    assert skewed > cost.allgather_s([1e6] * 4, LINK)
    assert skewed < cost.allgather_equal_s(5e6, 4, LINK)  # cheaper than padding every block to 5e6


def test_allgather_of_equal_sizes_equals_allgather_equal() -> None:
    for n in (1, 2, 3, 8, 64):
        for nbytes in SIZES:
            assert cost.allgather_s([nbytes] * n, LINK) == approx(cost.allgather_equal_s(nbytes, n, LINK))


def test_allgather_rejects_no_ranks_and_negative_sizes() -> None:
    with pytest.raises(ValueError, match=r"len\(sizes\)=0"):
        cost.allgather_s([], LINK)
    with pytest.raises(ValueError, match=r"-1\.0"):
        cost.allgather_s([5.0, -1.0], LINK)


# --- all-to-all


def test_all_to_all_sums_each_rounds_largest_message() -> None:
    send = [
        [0, 100, 200],
        [300, 0, 400],
        [500, 600, 0],
    ]
    link = Link(alpha_s=1.0, bytes_per_s=100.0)
    # round 1 (i -> i+1): 100, 400, 500 -> 500 B; round 2 (i -> i+2): 200, 300, 600 -> 600 B
    assert cost.all_to_all_s(send, link) == approx(2 * 1.0 + (500 + 600) / 100)


def test_all_to_all_ignores_the_diagonal_and_is_free_on_one_rank() -> None:
    assert cost.all_to_all_s([[5e9]], LINK) == 0.0
    quiet = [[0, 1e3], [1e3, 0]]
    loud = [[1e9, 1e3], [1e3, 1e9]]  # a rank's bytes to itself never reach the wire
    assert cost.all_to_all_s(loud, LINK) == cost.all_to_all_s(quiet, LINK)


def test_all_to_all_of_a_uniform_matrix_equals_all_to_all_uniform() -> None:
    for n in (1, 2, 3, 8):
        for nbytes in SIZES:
            matrix = [[nbytes / n] * n for _ in range(n)]
            assert cost.all_to_all_s(matrix, LINK) == approx(cost.all_to_all_uniform_s(nbytes, n, LINK))


def test_all_to_all_rejects_a_non_square_matrix_naming_its_shape() -> None:
    with pytest.raises(ValueError, match=r"3 rows of lengths \[3, 2, 3\]"):
        cost.all_to_all_s([[0, 1, 2], [0, 1], [0, 1, 2]], LINK)
    with pytest.raises(ValueError, match="0 rows"):
        cost.all_to_all_s([], LINK)


# --- invariants


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 64])
def test_reduce_scatter_then_allgather_equals_ring_allreduce(n: int) -> None:
    for nbytes in SIZES:
        assert cost.reduce_scatter_allgather_s(nbytes, n, LINK) == approx(
            cost.ring_allreduce_s(nbytes, n, LINK)
        )


def test_every_collective_is_monotone_in_nbytes() -> None:
    for n in (1, 2, 5, 16):
        for fn in (
            cost.ring_allreduce_s,
            cost.tree_allreduce_s,
            cost.reduce_scatter_s,
            cost.allgather_equal_s,
            cost.all_to_all_uniform_s,
            cost.reduce_scatter_allgather_s,
        ):
            times = [fn(nbytes, n, LINK) for nbytes in SIZES]
            assert times == sorted(times), fn.__name__
            if n > 1:
                assert times[-1] > times[0], fn.__name__
        ps = [cost.parameter_server_s(nbytes, n, 2, LINK) for nbytes in SIZES]
        assert ps == sorted(ps)
        hier = [cost.hierarchical_allreduce_s(nbytes, n, 4, INTRA, LINK) for nbytes in SIZES]
        assert hier == sorted(hier)
        gather = [cost.hierarchical_allgather_s(nbytes, n, 4, INTRA, LINK) for nbytes in SIZES]
        assert gather == sorted(gather)


def test_ring_allreduce_bandwidth_term_rises_toward_two_s_over_b() -> None:
    limit = 2 * 1e6 / 1e9  # 2 S / B
    terms = [cost.ring_allreduce_s(1e6, n, NO_LATENCY) for n in (2, 4, 16, 256, 4096)]
    assert terms == sorted(terms)
    assert all(term < limit for term in terms)
    assert terms[-1] == pytest.approx(limit, rel=1e-3)  # 2 * 4095 / 4096


def test_tree_beats_ring_in_latency_for_many_ranks_and_small_messages() -> None:
    # n = 256, S = 4 B: tree 2 * 8 alpha vs ring 2 * 255 alpha
    assert cost.tree_allreduce_s(4.0, 256, LINK) < cost.ring_allreduce_s(4.0, 256, LINK) / 10
    assert cost.tree_allreduce_s(4.0, 256, LINK) == approx(16 * 1e-5 + 8e-9)


def test_ring_never_moves_more_bytes_than_tree() -> None:
    for n in range(1, 130):
        for nbytes in SIZES:
            assert cost.ring_allreduce_s(nbytes, n, NO_LATENCY) <= cost.tree_allreduce_s(
                nbytes, n, NO_LATENCY
            )


@pytest.mark.parametrize(
    "call",
    [
        lambda: cost.ring_allreduce_s(1e6, 0, LINK),
        lambda: cost.tree_allreduce_s(1e6, 0, LINK),
        lambda: cost.reduce_scatter_s(1e6, -2, LINK),
        lambda: cost.allgather_equal_s(1e6, 0, LINK),
        lambda: cost.all_to_all_uniform_s(1e6, 0, LINK),
    ],
)
def test_collectives_reject_fewer_than_one_rank(call: object) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        call()  # type: ignore[operator]


def test_collectives_reject_negative_sizes_naming_them() -> None:
    with pytest.raises(ValueError, match=r"nbytes=-1\.0"):
        cost.ring_allreduce_s(-1.0, 4, LINK)


# --- parameter server (alpha = 1e-5 s, B = 1e9 B/s, S = 1e6 B)


def test_separate_servers_bottleneck_on_the_server_in_link() -> None:
    # 8 workers, 2 servers: a server takes 8 * 1e6 / 2 = 4e6 B each way
    assert cost.parameter_server_s(1e6, 8, 2, LINK) == approx(2 * (1e-5 + 4e-3))
    # as many servers as workers: the worker's own 1e6 B binds; more servers no longer help
    assert cost.parameter_server_s(1e6, 8, 8, LINK) == approx(2 * (1e-5 + 1e-3))
    assert cost.parameter_server_s(1e6, 8, 16, LINK) == cost.parameter_server_s(1e6, 8, 8, LINK)
    times = [cost.parameter_server_s(1e6, 8, servers, LINK) for servers in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)


def test_parameter_server_pulls_a_different_size_when_given() -> None:
    # 4 workers, 4 servers: push 1e-5 + 1e6 / 1e9, pull 1e-5 + 2.5e5 / 1e9
    assert cost.parameter_server_s(1e6, 4, 4, LINK, pull_nbytes=2.5e5) == approx(2e-5 + 1e-3 + 2.5e-4)


def test_colocated_servers_cost_two_alphas_and_the_ring_allreduce_bytes() -> None:
    # 4 ranks: each way 1e-5 + 3/4 * 1e6 / 1e9
    assert cost.parameter_server_s(1e6, 4, 4, LINK, colocated=True) == approx(2 * (1e-5 + 7.5e-4))
    # pull of 2e5: 1e-5 + 7.5e-4 push, 1e-5 + 3/4 * 2e5 / 1e9 pull
    assert cost.parameter_server_s(1e6, 4, 4, LINK, 2e5, colocated=True) == approx(2e-5 + 7.5e-4 + 1.5e-4)
    for n in (2, 3, 8, 64):
        colocated = cost.parameter_server_s(1e6, n, n, LINK, colocated=True)
        ring = cost.ring_allreduce_s(1e6, n, LINK)
        assert colocated - 2 * LINK.alpha_s == approx(ring - 2 * (n - 1) * LINK.alpha_s)
    assert cost.parameter_server_s(1e6, 1, 1, LINK, colocated=True) == 0.0


def test_parameter_server_rejects_bad_counts_and_colocation() -> None:
    with pytest.raises(ValueError, match="workers=0"):
        cost.parameter_server_s(1e6, 0, 1, LINK)
    with pytest.raises(ValueError, match="servers=0"):
        cost.parameter_server_s(1e6, 4, 0, LINK)
    with pytest.raises(ValueError, match=r"servers == workers.*workers=4, servers=2"):
        cost.parameter_server_s(1e6, 4, 2, LINK, colocated=True)


# --- hierarchical (intra: alpha 1e-6 s, B 1e11 B/s; inter share: alpha 1e-5 s, B 1e9 B/s)


def test_hierarchical_allreduce_matches_hand_arithmetic() -> None:
    # 2 nodes x 4, S = 8e6: intra reduce-scatter 3e-6 + 3/4 * 8e6 / 1e11 = 3e-6 + 6e-5;
    # inter ring of 2e6 over 2 nodes 2e-5 + 2e-3; intra allgather of 2e6 blocks 3 (1e-6 + 2e-5)
    expected = (3e-6 + 6e-5) + (2e-5 + 2e-3) + (3e-6 + 6e-5)
    assert cost.hierarchical_allreduce_s(8e6, 2, 4, INTRA, LINK) == approx(expected)


def test_hierarchical_allreduce_with_one_rank_per_node_is_a_ring_over_the_nodes() -> None:
    for nodes in (1, 2, 5, 32):
        for nbytes in SIZES:
            got = cost.hierarchical_allreduce_s(nbytes, nodes, 1, INTRA, LINK)
            assert got == approx(cost.ring_allreduce_s(nbytes, nodes, LINK))


def test_hierarchical_allreduce_on_one_node_is_the_intra_ring() -> None:
    for per_node in (1, 2, 8):
        for nbytes in SIZES:
            got = cost.hierarchical_allreduce_s(nbytes, 1, per_node, INTRA, LINK)
            split = cost.reduce_scatter_s(nbytes, per_node, INTRA) + cost.allgather_equal_s(
                nbytes / per_node, per_node, INTRA
            )
            assert got == approx(split)
            assert got == approx(cost.ring_allreduce_s(nbytes, per_node, INTRA))


def test_hierarchical_allgather_matches_hand_arithmetic() -> None:
    # 4 nodes x 2, S = 1e6: inter allgather 3 (1e-5 + 1e6 / 1e9) = 3e-5 + 3e-3;
    # intra allgather of the 4e6 B collections: 1 (1e-6 + 4e6 / 1e11) = 1e-6 + 4e-5
    assert cost.hierarchical_allgather_s(1e6, 4, 2, INTRA, LINK) == approx(3e-5 + 3e-3 + 1e-6 + 4e-5)


def test_hierarchical_allgather_reduces_to_one_level_at_either_edge() -> None:
    for count in (1, 2, 6):
        for nbytes in SIZES:
            across = cost.hierarchical_allgather_s(nbytes, count, 1, INTRA, LINK)
            assert across == approx(cost.allgather_equal_s(nbytes, count, LINK))
            within = cost.hierarchical_allgather_s(nbytes, 1, count, INTRA, LINK)
            assert within == approx(cost.allgather_equal_s(nbytes, count, INTRA))


def test_hierarchical_collectives_name_a_bad_count() -> None:
    with pytest.raises(ValueError, match="per_node=0"):
        cost.hierarchical_allreduce_s(1e6, 2, 0, INTRA, LINK)
    with pytest.raises(ValueError, match="nodes=0"):
        cost.hierarchical_allgather_s(1e6, 0, 2, INTRA, LINK)


# --- fit_linear and LinearFit

POWERS = [float(2**k) for k in range(2, 27)]  # 4 B .. 64 MiB


def test_fit_recovers_exact_coefficients_from_noiseless_data() -> None:
    ys = [2e-4 + 1e-9 * x for x in POWERS]
    fit = cost.fit_linear(POWERS, ys)
    assert fit.fixed_s == pytest.approx(2e-4, rel=1e-9)
    assert fit.per_unit_s == pytest.approx(1e-9, rel=1e-9)
    assert fit.rel_error == pytest.approx(0.0, abs=1e-12)
    assert fit.max_rel_error == pytest.approx(0.0, abs=1e-12)
    assert fit.points == len(POWERS)


def test_fit_reports_a_positive_error_on_noisy_data() -> None:
    rng = np.random.default_rng(1234)
    noise = 1 + 0.05 * rng.standard_normal(len(POWERS))  # 5 % multiplicative noise
    ys = [(2e-4 + 1e-9 * x) * e for x, e in zip(POWERS, noise, strict=True)]
    fit = cost.fit_linear(POWERS, ys)
    assert 0.005 < fit.rel_error < 0.1
    assert fit.max_rel_error >= fit.rel_error
    assert fit.fixed_s == pytest.approx(2e-4, rel=0.1)
    assert fit.per_unit_s == pytest.approx(1e-9, rel=0.1)


def test_fit_weights_relative_error_so_a_large_size_does_not_swamp_the_fixed_cost() -> None:
    ys = [2e-4 + 1e-9 * x for x in POWERS]
    ys[-1] *= 1.1  # 10 % off at 64 MiB: 6.7 ms, 34 times the fixed cost
    fit = cost.fit_linear(POWERS, ys)
    # Unweighted least squares puts the intercept at 4.7e-5 s here (-76 %); the relative fit keeps it.
    assert fit.fixed_s == pytest.approx(2e-4, rel=0.01)


def test_fit_clamps_a_negative_intercept_and_refits_the_slope_alone() -> None:
    xs = [2000.0, 4000.0, 8000.0]
    ys = [1e-9 * x - 1e-6 for x in xs]  # 1e-6, 3e-6, 7e-6: the unclamped line crosses 0 at -1e-6
    fit = cost.fit_linear(xs, ys)
    assert fit.fixed_s == 0.0
    assert fit.per_unit_s > 0

    def relative_loss(slope: float) -> float:
        return sum((slope * x / y - 1) ** 2 for x, y in zip(xs, ys, strict=True))

    best = relative_loss(fit.per_unit_s)  # the best proportional fit: any other slope is worse
    assert best < relative_loss(fit.per_unit_s * 1.001)
    assert best < relative_loss(fit.per_unit_s * 0.999)


def test_fit_clamps_a_negative_slope_to_the_weighted_mean_time() -> None:
    fit = cost.fit_linear([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert fit.per_unit_s == 0.0
    # sum(y / y^2) / sum(1 / y^2) = (1/3 + 1/2 + 1) / (1/9 + 1/4 + 1) = 66 / 49
    assert fit.fixed_s == pytest.approx(66 / 49, rel=1e-12)
    # |66/49 - y| / y for y = 3, 2, 1: 27/49, 16/49, 17/49 -> median 17/49, max 27/49
    assert fit.rel_error == pytest.approx(17 / 49, rel=1e-12)
    assert fit.max_rel_error == pytest.approx(27 / 49, rel=1e-12)


@pytest.mark.parametrize(
    ("xs", "ys", "message"),
    [
        ([1.0, 2.0], [1.0], "2 xs and 1 ys"),
        ([1.0], [1.0], "2 distinct xs"),
        ([5.0, 5.0, 5.0], [1.0, 2.0, 3.0], "2 distinct xs"),
        ([1.0, 2.0], [1.0, 0.0], r"ys\[1\]=0.0 .*> 0"),
        ([1.0, 2.0], [-1.0, 1.0], r"ys\[0\]=-1.0"),
        ([-1.0, 2.0], [1.0, 1.0], r"xs\[0\]=-1.0"),
    ],
)
def test_fit_rejects_bad_input_naming_what_is_wrong(xs: list[float], ys: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cost.fit_linear(xs, ys)


def test_linear_fit_predicts_fixed_plus_per_unit_times_x() -> None:
    assert LinearFit(1.0, 2.0, 0.0, 0.0, 2)(3.0) == 7.0


def test_linear_fit_round_trips_through_a_dict_and_json_exactly() -> None:
    fit = cost.fit_linear(POWERS, [2e-4 + 1e-9 * x + 1e-7 * (k % 3) for k, x in enumerate(POWERS)])
    assert LinearFit.from_dict(fit.to_dict()) == fit
    assert LinearFit.from_dict(json.loads(json.dumps(fit.to_dict()))) == fit


def test_linear_fit_from_dict_names_a_missing_or_unknown_key() -> None:
    data = LinearFit(2e-4, 1e-9, 0.01, 0.05, 7).to_dict()
    del data["per_unit_s"]
    with pytest.raises(ValueError, match="per_unit_s"):
        LinearFit.from_dict(data)
    with pytest.raises(ValueError, match="slope"):
        LinearFit.from_dict({**LinearFit(2e-4, 1e-9, 0.01, 0.05, 7).to_dict(), "slope": 1.0})
