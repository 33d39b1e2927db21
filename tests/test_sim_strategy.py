"""Simulator strategies, phases and groupings: parsing, costs against the formulas, and errors."""

from __future__ import annotations

import pytest

from gradsync import compress, cost
from gradsync.sim import cluster as clusters
from gradsync.sim import groups
from gradsync.sim.phases import codec_seconds, phases
from gradsync.strategy import Strategy, default_collective, parse


def test_parse_round_trips_through_text():
    for text in [
        "none",
        "fp16",
        "qsgd",
        "topk:ratio=0.01",
        "fp16:collective=two-level",
        "dgc:on=cpu",
        "qsgd:collective=two-level:on=cpu",
    ]:
        assert parse(parse(text).text) == parse(text)
    assert parse("none") == parse("none") == Strategy()
    assert parse("qsgd").collective == "two-shot"  # not summable, but a shard's sum re-encodes
    assert parse("topk").collective == "allgather"  # sparse: each rank's payload decoded alone
    assert parse("fp16").collective == "allreduce"  # summable
    assert parse("powersgd").collective == parse("signsgd").collective == "allreduce"  # their own sums
    assert parse("topk:scheme=auto").scheme == "auto"
    assert parse("topk:ratio=0.01").args == (("ratio", 0.01),)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("nope", "unknown codec 'nope'"),
        ("qsgd:collective=allreduce", "cannot be summed"),
        ("fp16:exchange=ring", r"unknown option\(s\) \['exchange'\]"),
        ("fp16:collective=ring", "collective='ring'"),
        ("fp16:scheme=balanced", "not sparse rows"),
        ("topk:scheme=zen", "scheme='zen'"),
        ("signsgd:collective=allgather", "its own allreduces"),
        # Its support is drawn from a stream the ranks share: an owner's draw would part them.
        ("randk:collective=two-shot", "random stream the ranks share"),
        ("none:collective=allgather", "summed"),
        ("none:on=cpu", "nothing to offload"),
        ("fp16:on=gpu", "on='gpu'"),
        ("topk:ratio", "not key=value"),
        ("topk:colour=red", "colour"),
        ("none:ratio=0.1", "takes no codec arguments"),
        (":x=1", "names no codec"),
    ],
)
def test_bad_strategies_are_refused_by_name(text, match):
    with pytest.raises(ValueError, match=match):
        parse(text)


@pytest.mark.parametrize("name", compress.names())
def test_payload_bytes_are_the_codecs_own(name):
    if name == "powersgd":
        pytest.skip("PowerSGD's payload depends on the tensor's matrix shape, not only its numel")
    strategy = Strategy(name, (), default_collective(name))
    # A codec that warms up is priced as it runs after its warm-up: plans are for those steps.
    assert strategy.payload_bytes(12345) == compress.warmed_up(compress.build(name)).payload_bytes(12345)
    assert Strategy().payload_bytes(12345) == 4 * 12345


def test_flat_phases_use_the_faster_of_ring_and_tree_on_the_inter_node_link():
    where = clusters.cluster(4, 8, "v100", "25gbit")
    (big,) = phases(parse("none"), 10**8, where)
    assert big.resource == "net"
    assert big.seconds == pytest.approx(cost.ring_allreduce_s(4e8, 32, where.inter))  # bandwidth-bound
    (small,) = phases(parse("none"), 10, where)
    assert small.seconds == pytest.approx(cost.tree_allreduce_s(40, 32, where.inter))  # latency-bound
    gathered = parse("qsgd:collective=allgather")
    compress_, gather, decompress = phases(gathered, 10**6, where)
    payload = gathered.payload_bytes(10**6)
    assert gather.seconds == pytest.approx(cost.allgather_equal_s(payload, 32, where.inter))
    # Every worker's payload is decoded into the sum: 32 decodes.
    assert decompress.seconds == pytest.approx(codec_seconds(gathered, "decompress", 10**6, where, 32))
    assert compress_.resource == decompress.resource == "device"


def test_two_shot_sends_each_shard_to_its_owner_then_gathers_the_owners_sums():
    where = clusters.cluster(4, 8, "v100", "25gbit")
    n, numel = 32, 32 * 10**5
    strategy = parse("int8")
    shard = numel // n
    steps = phases(strategy, numel, where)
    assert [p.label for p in steps] == [
        "compress",
        "all_to_all",
        "decompress",
        "compress",
        "allgather",
        "decompress",
    ]
    to_owners, gathered = steps[1], steps[4]
    # Every worker of a node sends (n - g)/n of its payload off the node at once, through one NIC.
    g, payload = 8, strategy.payload_bytes(numel)
    off_node = g * (n - g) / n * payload / where.inter.bytes_per_s
    assert to_owners.seconds == pytest.approx((n - 1) * where.inter.alpha_s + off_node)
    shard_payload = strategy.payload_bytes(shard)
    assert gathered.seconds == pytest.approx(cost.allgather_equal_s(shard_payload, n, where.inter))
    # The owner decodes its shard from every worker; every worker decodes each owner's shard once.
    assert steps[2].seconds == pytest.approx(codec_seconds(strategy, "decompress", shard, where, n))
    # Through a NIC: g (n - g)/n payloads and a ring's share of the sums against the allgather's
    # n - 1 payloads.
    flat = phases(parse("int8:collective=allgather"), numel, where)[1]
    assert to_owners.seconds + gathered.seconds < flat.seconds / 3


def test_decoding_costs_grow_with_payloads_and_sparsifiers_touch_only_what_they_sent():
    where = clusters.cluster(4, 8, "v100", "25gbit")
    for text in ("qsgd", "topk:ratio=0.01"):
        one, many = (codec_seconds(parse(text), "decompress", 10**8, where, p) for p in (1, 32))
        assert many > one
    dense = codec_seconds(parse("qsgd"), "decompress", 10**8, where, 32)
    sparse = codec_seconds(parse("topk:ratio=0.01"), "decompress", 10**8, where, 32)
    assert sparse < dense / 4


def test_one_node_uses_the_intra_node_link():
    where = clusters.cluster(1, 8, "a100", "25gbit")
    (allreduce,) = phases(parse("none"), 10**6, where)
    ring, tree = cost.ring_allreduce_s(4e6, 8, where.intra), cost.tree_allreduce_s(4e6, 8, where.intra)
    assert allreduce.seconds == pytest.approx(min(ring, tree))


def test_two_level_phases_split_the_nic_among_the_nodes_workers():
    where = clusters.cluster(4, 8, "v100", "25gbit")
    rs, inter, ag = phases(parse("none:collective=two-level"), 8 * 10**6, where)
    share = cost.Link(where.inter.alpha_s, where.inter.bytes_per_s / 8)
    assert (rs.resource, inter.resource, ag.resource) == ("intra", "inter", "intra")
    assert inter.seconds == pytest.approx(cost.ring_allreduce_s(4e6, 4, share))
    total = rs.seconds + inter.seconds + ag.seconds
    assert total == pytest.approx(cost.hierarchical_allreduce_s(32e6, 4, 8, where.intra, share))
    # A non-summable codec compresses its 1/8 share after the intra-node reduce-scatter.
    steps = phases(parse("qsgd:collective=two-level"), 8 * 10**6, where)
    assert [p.resource for p in steps] == ["intra", "device", "inter", "device", "intra"]
    assert steps[2].seconds == pytest.approx(
        cost.allgather_equal_s(parse("qsgd").payload_bytes(10**6), 4, share)
    )


def test_offloading_pays_the_host_link_and_runs_on_the_cpu():
    where = clusters.cluster(2, 8, "v100", "25gbit")
    on_device = phases(parse("topk:ratio=0.01"), 10**6, where)
    on_cpu = phases(parse("topk:ratio=0.01:on=cpu"), 10**6, where)
    assert on_cpu[0].resource == "cpu"
    host = 4e6 / where.device.pcie_bytes_per_s
    assert on_cpu[0].seconds == pytest.approx(
        codec_seconds(parse("topk:ratio=0.01:on=cpu"), "compress", 10**6, where) + host
    )
    assert on_device[1].seconds == on_cpu[1].seconds  # the same transfer


def test_a_world_of_one_exchanges_nothing():
    assert phases(parse("qsgd"), 10**6, clusters.cluster(1, 1, "v100")) == []


def test_ddp_buckets_follow_torchs_caps():
    mib = 1 << 18  # fp32 elements in one MiB
    numels = [mib // 2, mib // 2, 10 * mib, 10 * mib, 10 * mib, 1]
    # The first bucket closes at 1 MiB, the next at 25 MiB (the tensor that crosses it included).
    assert groups.ddp(numels) == [[0, 1], [2, 3, 4], [5]]
    assert groups.ddp([]) == []


def test_equal_groups_split_by_size():
    assert groups.equal([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert groups.equal([1, 1, 1, 97], 2) == [[0, 1, 2], [3]]
    assert groups.equal([5, 5], 4) == [[0], [1]]
    assert groups.equal([5, 5, 5], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="count=0"):
        groups.equal([1], 0)


def test_cuts_and_checks():
    assert groups.from_cuts(5, [2, 4]) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="strictly increasing"):
        groups.from_cuts(5, [4, 2])
    groups.check([[0, 1], [2]], 3)
    for bad in ([[0], [2]], [[1, 0], [2]], [[0, 1], [], [2]], [[0, 1, 2, 3]]):
        with pytest.raises(ValueError, match="must cover"):
            groups.check(bad, 3)


def test_presets_and_their_errors():
    assert clusters.cluster(8, 8, "v100", "25gbit").world_size == 64
    assert clusters.cluster(2, 8, "h100", "100gbit").inter.bytes_per_s == pytest.approx(100e9 / 8)
    with pytest.raises(KeyError, match="v100, a100, h100"):
        clusters.device("tpu")
    with pytest.raises(ValueError, match="nodes=0"):
        clusters.cluster(0, 8)
    with pytest.raises(ValueError, match="intra='infiniband'"):
        clusters.cluster(2, 8, intra="infiniband")
    with pytest.raises(ValueError, match="precision"):
        clusters.device("v100").flops("int4")
    with pytest.raises(ValueError, match="lack"):
        clusters.measured(2, {"allreduce": cost.LinearFit(0, 0, 0, 0, 2)}, {})


def test_a_two_level_quantizer_sends_the_payload_of_its_share():
    from gradsync.sim.phases import payload_nbytes

    where = clusters.cluster(4, 8, "v100", "25gbit")
    assert payload_nbytes(parse("qsgd:collective=two-level"), 8 * 10**6, where) == parse(
        "qsgd"
    ).payload_bytes(10**6)
    assert payload_nbytes(parse("qsgd"), 8 * 10**6, where) == parse("qsgd").payload_bytes(8 * 10**6)
    assert payload_nbytes(parse("fp16:collective=two-level"), 10**6, where) == 2 * 10**6


def test_the_sparse_exchange_sends_embedding_rows_by_the_cheapest_scheme_and_the_rest_dense():
    from gradsync.sim import compute as computes
    from gradsync.sim import models
    from gradsync.sparse import cost as sparse_cost

    where = clusters.cluster(8, 8, "v100", "25gbit")
    work = computes.from_model(models.build("lstm"), where.device)
    (embedding,) = [g for g in work.gradients if g.density]
    assert (embedding.name, embedding.rows, embedding.density) == ("encoder.weight", 33278, 0.0113)
    decoder = [g for g in work.gradients if g.name.startswith("decoder")]
    numel = embedding.numel + sum(g.numel for g in decoder)
    dense, rows = phases(parse("none:scheme=auto"), numel, where, [embedding])
    dense_nbytes = 4 * sum(g.numel for g in decoder)
    ring, tree = (f(dense_nbytes, 64, where.inter) for f in (cost.ring_allreduce_s, cost.tree_allreduce_s))
    assert dense.seconds == pytest.approx(min(ring, tree))

    # The rows go by the scheme gradsync.sparse's model prices lowest, at that price.
    union = {m: 1 - (1 - 0.0113) ** m for m in (1, 2, 4, 8, 16, 32, 64)}
    sparsity = sparse_cost.Sparsity(33278, 650, 4, union)
    predicted = sparse_cost.seconds(
        sparsity, 64, sparse_cost.Network(where.inter.alpha_s, where.inter.bytes_per_s)
    )
    assert rows.label == f"sparse {min(predicted, key=predicted.__getitem__)}"
    assert rows.seconds == pytest.approx(min(predicted.values()))
    assert rows.seconds < cost.ring_allreduce_s(4 * embedding.numel, 64, where.inter)
    with pytest.raises(ValueError, match="payload is not sparse rows"):
        parse("fp16:scheme=auto")


def test_a_sparsifier_payload_goes_by_the_cheapest_sparse_scheme_at_the_codecs_density():
    from gradsync.sparse import cost as sparse_cost

    where = clusters.cluster(4, 8, "v100", "25gbit")
    numel = 10**7
    compress, rows, decompress = phases(parse("topk:ratio=0.01:scheme=auto"), numel, where)
    assert (compress.label, decompress.label) == ("compress", "decompress")
    density = parse("topk:ratio=0.01").payload_bytes(numel) / 8 / numel
    assert density == pytest.approx(0.01, rel=1e-3)
    union = {m: 1 - (1 - density) ** m for m in (1, 2, 4, 8, 16, 32)}
    predicted = sparse_cost.seconds(
        sparse_cost.Sparsity(numel, 1, 4, union),
        32,
        sparse_cost.Network(where.inter.alpha_s, where.inter.bytes_per_s),
    )
    assert rows.label == f"sparse {min(predicted, key=predicted.__getitem__)}"
    assert rows.seconds == pytest.approx(min(predicted.values()))
    # One decode of the delivered sum, not one per worker as after an allgather.
    gathered = phases(parse("topk:ratio=0.01"), numel, where)
    assert decompress.seconds < gathered[-1].seconds
