"""The timeline simulator: invariants of every timeline, hand-computed steps, scale and workers."""

from __future__ import annotations

import itertools

import pytest

from gradsync import cost
from gradsync.sim import cluster as clusters
from gradsync.sim import compute as computes
from gradsync.sim import groups, models, simulate
from gradsync.sim.compute import Compute, Gradient
from gradsync.sim.engine import CODEC, COMPUTE, CPU, LINK_LANES

LINK = cost.Link(alpha_s=1e-4, bytes_per_s=1e8)


def hand_compute(numels=(1000, 200_000, 50_000, 3_000_000), backward_s=0.2) -> Compute:
    """Gradients ready evenly through a backward pass of `backward_s`."""
    count = len(numels)
    gradients = tuple(Gradient(f"t{i}", n, backward_s * (i + 1) / count) for i, n in enumerate(numels))
    return Compute(0.1, backward_s, 0.01, gradients, batch_size=8, name="hand")


def flat(workers: int, link: cost.Link = LINK) -> clusters.Cluster:
    """`workers` single-worker nodes joined by `link`."""
    return clusters.Cluster(workers, 1, clusters.device("v100"), link, link)


def overlaps(spans) -> list[tuple]:
    ordered = sorted(spans, key=lambda s: (s.start_s, s.end_s))
    return [(a, b) for a, b in itertools.pairwise(ordered) if b.start_s < a.end_s - 1e-12]


CASES = [
    ("flat 4", lambda: flat(4), "none"),
    ("flat 4 fp16", lambda: flat(4), "fp16"),
    ("flat 4 qsgd allgather", lambda: flat(4), "qsgd"),
    ("flat 4 topk on cpu", lambda: flat(4), "topk:ratio=0.01:on=cpu"),
    ("8x8 fp32", lambda: clusters.cluster(8, 8, "v100", "25gbit"), "none"),
    ("8x8 fp32 two-level", lambda: clusters.cluster(8, 8, "v100", "25gbit"), "none:collective=two-level"),
    ("8x8 qsgd two-level", lambda: clusters.cluster(8, 8, "a100", "25gbit"), "qsgd:collective=two-level"),
    ("8x8 fp16 two-level", lambda: clusters.cluster(8, 8, "h100", "100gbit"), "fp16:collective=two-level"),
]


@pytest.mark.parametrize("jitter", [0.0, 0.1])
@pytest.mark.parametrize(("name", "make", "strategy"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("grouping", ["ddp", "layerwise", "single"])
def test_every_timeline_keeps_the_invariants(name, make, strategy, grouping, jitter):
    work = hand_compute()
    where = make()
    chosen = {"ddp": None, "layerwise": groups.layerwise(4), "single": groups.single(4)}[grouping]
    result = simulate(work, where, strategy, chosen, jitter=jitter, seed=3)

    # No link, and no CPU thread, carries two things at once; the compute lane runs one thing.
    cpu_lanes = {s.lane for s in result.spans if s.lane.startswith(CPU)}
    assert len(cpu_lanes) <= where.cpu_threads
    for lane in (*LINK_LANES, *cpu_lanes, COMPUTE):
        assert overlaps([s for s in result.spans if s.lane == lane]) == []
    # Nothing starts before its input is ready; phases of a group run in order.
    for timing in result.groups:
        mine = sorted(
            (s for s in result.spans if s.group == timing.index and s.lane != COMPUTE),
            key=lambda s: s.start_s,
        )
        assert all(s.start_s >= timing.ready_s - 1e-12 for s in mine)
        for before, after in itertools.pairwise(mine):
            assert after.start_s >= before.end_s - 1e-12
        # A collective over every worker waits for the slowest; an intra-node one for its node's.
        assert any(s.lane in LINK_LANES for s in mine)
        for s in mine:
            if s.lane in ("network", "inter-node"):
                assert s.start_s >= timing.all_ready_s - 1e-12
    # Collectives start in group order.
    starts = [t.start_s for t in result.groups]
    assert starts == sorted(starts)
    # The step covers the compute and every transfer.
    assert result.step_s >= work.step_s - 1e-12
    assert result.step_s >= result.communication_s
    assert result.step_s >= max(s.end_s for s in result.spans) - 1e-12
    assert 0 < result.scaling <= 1 + 1e-12


def test_a_flat_collective_holds_every_link_so_two_level_phases_wait_for_it():
    where = clusters.cluster(4, 8, "v100", "25gbit")
    mixed = ["none", "none:collective=two-level"] * 4
    result = simulate(hand_compute(numels=(4_000_000,) * 8), where, mixed, groups.layerwise(8))
    net = [s for s in result.spans if s.lane == "network"]
    two_level = [s for s in result.spans if s.lane in ("intra-node", "inter-node")]
    assert net and two_level
    assert not any(
        a.start_s < b.end_s - 1e-12 and b.start_s < a.end_s - 1e-12 for a in net for b in two_level
    )


def test_two_groups_on_a_flat_ring_match_the_hand_computed_step():
    # forward 0.1 s; backward 0.2 s with gradients of 1e6 and 2e6 elements ready at 0.1 and 0.2 s.
    work = Compute(0.1, 0.2, 0.01, (Gradient("a", 10**6, 0.1), Gradient("b", 2 * 10**6, 0.2)))
    result = simulate(work, flat(4), "none", [[0], [1]])
    first = cost.ring_allreduce_s(4e6, 4, LINK)  # 6 alpha + 1.5 * 4e6 / 1e8 = 0.0606 s
    second = cost.ring_allreduce_s(8e6, 4, LINK)  # 0.1206 s
    assert first == pytest.approx(0.0606)
    # Group a's allreduce runs 0.2..0.2606, b's can start only at 0.3 (its gradients' ready time).
    expected = 0.1 + 0.2 + second + 0.01
    assert result.step_s == pytest.approx(expected)
    assert [t.start_s for t in result.groups] == pytest.approx([0.2, 0.3])


def test_a_busy_link_delays_the_next_collective():
    # Both groups ready almost together: the second waits for the first to leave the link.
    work = Compute(0.0, 0.1, 0.0, (Gradient("a", 10**7, 0.09), Gradient("b", 10**7, 0.1)))
    result = simulate(work, flat(2), "none", [[0], [1]])
    one = cost.ring_allreduce_s(4e7, 2, LINK)
    assert result.groups[1].start_s == pytest.approx(0.09 + one)
    assert result.step_s == pytest.approx(0.09 + 2 * one)


def test_compression_on_the_device_delays_the_rest_of_the_backward_pass():
    work = hand_compute()
    where = flat(4)
    plain = simulate(work, where, "none", groups.layerwise(4))
    squeezed = simulate(work, where, "qsgd:collective=allgather", groups.layerwise(4))
    codec = [s for s in squeezed.spans if s.lane == CODEC and s.label == "compress"]
    assert len(codec) == 4
    # The last gradient is ready later by the three compressions before it.
    delay = sum(s.end_s - s.start_s for s in codec[:3])
    assert squeezed.groups[-1].ready_s == pytest.approx(plain.groups[-1].ready_s + delay)


def test_offloaded_compression_leaves_the_backward_pass_alone():
    work = hand_compute()
    where = flat(4)
    plain = simulate(work, where, "none", groups.layerwise(4))
    offloaded = simulate(work, where, "topk:ratio=0.01:on=cpu", groups.layerwise(4))
    assert [t.ready_s for t in offloaded.groups] == pytest.approx([t.ready_s for t in plain.groups])
    assert any(s.lane.startswith(CPU) for s in offloaded.spans)


def test_a_world_of_one_steps_at_compute_speed():
    work = hand_compute()
    result = simulate(work, flat(1), "fp16")
    assert result.step_s == pytest.approx(work.step_s)
    assert result.scaling == pytest.approx(1.0)
    assert result.communication_s == 0


def test_jitter_is_seeded_and_the_slowest_worker_sets_the_pace():
    work = hand_compute()
    where = flat(64)
    calm = simulate(work, where, "none")
    a = simulate(work, where, "none", jitter=0.1, seed=1)
    b = simulate(work, where, "none", jitter=0.1, seed=1)
    c = simulate(work, where, "none", jitter=0.1, seed=2)
    assert a.step_s == b.step_s
    assert a.step_s != c.step_s
    assert a.step_s > calm.step_s  # the max of 64 draws of 1 + 0.1 N(0, 1) exceeds 1


def test_measured_cluster_takes_collective_times_from_the_fits():
    fits = {
        "allreduce": cost.LinearFit(0.01, 1e-8, 0.0, 0.0, 5),
        "allgather": cost.LinearFit(0.02, 2e-8, 0.0, 0.0, 5),
    }
    codecs = {
        "fp16": {
            "compress": cost.LinearFit(1e-4, 1e-9, 0, 0, 5),
            "decompress": cost.LinearFit(1e-4, 1e-9, 0, 0, 5),
        }
    }
    where = clusters.measured(4, fits, codecs)
    work = Compute(0.0, 0.1, 0.0, (Gradient("a", 10**6, 0.1),))
    fp32 = simulate(work, where, "none")
    assert fp32.step_s == pytest.approx(0.1 + 0.01 + 1e-8 * 4e6)
    fp16 = simulate(work, where, "fp16")
    compress = 1e-4 + 1e-9 * 1e6
    assert fp16.step_s == pytest.approx(
        0.1 + compress + 0.01 + 1e-8 * fp16.groups[0].payload_bytes + compress
    )
    with pytest.raises(KeyError, match="qsgd"):
        simulate(work, where, "qsgd")


def test_strategies_per_group_must_match_the_groups():
    work = hand_compute()
    result = simulate(work, flat(4), ["none", "fp16"], [[0, 1], [2, 3]])
    assert [t.strategy for t in result.groups] == ["none", "fp16"]
    with pytest.raises(ValueError, match="3 strategies given for 2 groups"):
        simulate(work, flat(4), ["none"] * 3, [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="must cover"):
        simulate(work, flat(4), "none", [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="jitter"):
        simulate(work, flat(4), "none", jitter=-1)


@pytest.mark.parametrize("name", ["bert-base", "gpt2"])
def test_fp32_scaling_of_large_transformers_on_25gbit_is_far_from_linear(name):
    # Espresso (Table 1) measured 0.51 (BERT-base) and 0.58 (GPT-2) on 64 V100s; the simulator must
    # show the same regime: a 25 Gbit/s NIC cannot hide a 110-124M parameter fp32 allreduce.
    work = computes.from_model(models.build(name), clusters.device("v100"))
    slow = simulate(work, clusters.cluster(8, 8, "v100", "25gbit"), "none")
    fast = simulate(work, clusters.cluster(8, 8, "v100", "100gbit"), "none")
    assert slow.scaling < 0.7
    assert fast.scaling > slow.scaling
    # fp16 halves the bytes, so it helps where the network is the bottleneck.
    assert simulate(work, clusters.cluster(8, 8, "v100", "25gbit"), "fp16").step_s < slow.step_s


def test_the_16384_worker_cluster_simulates():
    work = computes.from_model(models.build("resnet50"), clusters.device("a100"))
    result = simulate(work, clusters.cluster(2048, 8, "a100", "100gbit"), "fp16", jitter=0.02)
    assert result.world_size == 16384
    assert 0 < result.scaling < 1


def test_two_level_exchange_of_a_quantizer_sends_less_across_nodes_than_a_flat_allgather():
    # A flat allgather carries n - 1 payloads over every NIC; two-level compresses 1/g shares after
    # an NVLink reduce-scatter, so only nodes - 1 payloads of a share cross the NIC.
    work = hand_compute(numels=(10**7,) * 4)
    where = clusters.cluster(16, 8, "v100", "25gbit")
    flat_gather = simulate(work, where, "qsgd:collective=allgather", groups.layerwise(4))
    two_level = simulate(work, where, "qsgd:collective=two-level", groups.layerwise(4))
    assert two_level.communication_s < flat_gather.communication_s / 4
    assert two_level.step_s < flat_gather.step_s


def test_invariants_hold_for_every_model_profile():
    where = clusters.cluster(4, 8, "a100", "25gbit")
    for name, text in itertools.product(
        models.names(), ["none", "fp16", "qsgd", "qsgd:collective=two-level"]
    ):
        result = simulate(computes.from_model(models.build(name), where.device), where, text)
        for lane in LINK_LANES:
            assert overlaps([s for s in result.spans if s.lane == lane]) == [], (name, text, lane)
        assert result.step_s >= max(result.compute_s, result.communication_s)


def test_a_contended_transfer_and_the_compute_slow_each_other_while_they_overlap():
    # A measured CPU host: an allreduce takes 0.1 s alone; overlapping the backward pass it runs at
    # half speed (transfer slowdown 1.0) and costs the compute half its overlap (compute slowdown 0.5).
    fits = {"allreduce": cost.LinearFit(0.1, 0.0, 0, 0, 2), "allgather": cost.LinearFit(0.1, 0.0, 0, 0, 2)}
    contention = {"allreduce": {"compute": 0.5, "transfer": 1.0}}
    work = Compute(0.0, 1.0, 0.0, (Gradient("a", 10**6, 0.2), Gradient("b", 10**6, 1.0)))
    calm = simulate(work, clusters.measured(2, fits, {}), "none", [[0], [1]])
    assert calm.step_s == pytest.approx(1.1)
    busy = simulate(work, clusters.measured(2, fits, {}, None, contention), "none", [[0], [1]])
    # a: 0.2 .. 0.4, all of it beside the backward pass (twice as long), which meanwhile does 0.2 / 1.5
    # of its work and so ends 0.2 - 0.2 / 1.5 = 1/15 s later: at 16/15. b: from 1.0, 1/15 s at half
    # speed (1/30 s of its work), the remaining 2/30 s alone: it ends at 1 + 2/15. The backward
    # pass's last 1/15 s of work, slowed, ends at 1.1.
    assert busy.groups[0].done_s == pytest.approx(0.4)
    assert busy.groups[1].done_s == pytest.approx(1 + 2 / 15)
    assert busy.step_s == pytest.approx(1 + 2 / 15)


def test_a_profile_becomes_a_compute_timeline_and_a_measured_cluster():
    from gradsync.profile import Profile, TensorTiming

    fit = cost.LinearFit(1e-3, 1e-8, 0.05, 0.1, 5)
    found = Profile(
        world_size=4, backend="gloo", device="cpu", threads=1, forward_s=0.05, backward_s=0.1,
        optimizer_s=0.01,
        # Medians may cross by a hair: the simulator keeps backprop order.
        tensors=(TensorTiming(1, "b", 1000, 0.031), TensorTiming(0, "w", 10**6, 0.03)),
        compression={"fp16": {"compress": fit, "decompress": fit}},
        collectives={"allreduce": fit, "allgather": fit},
        meta={"workload": "mlp", "batch_size": 16},
        hook={"fp16": {"before": fit, "after": fit}},
        contention={"allreduce": {"compute": 0.2, "transfer": 0.3}},
    )  # fmt: skip
    work = found.compute()
    assert [g.ready_s for g in work.gradients] == [0.031, 0.031]
    assert (work.name, work.batch_size, work.step_s) == ("mlp", 16, pytest.approx(0.16))
    where = found.cluster()
    assert (where.world_size, where.measured) == (4, True)
    result = simulate(work, where, "fp16")
    compress, _, decompress = (s for s in result.spans if s.group == 0 and s.lane != COMPUTE)
    # The hook path was measured: it, not the bare codec, is what the step pays.
    assert compress.end_s - compress.start_s == pytest.approx(fit(10**6 + 1000))
    assert decompress.end_s - decompress.start_s == pytest.approx(fit(10**6 + 1000))  # one summed payload
    assert result.step_s > work.step_s


def test_offloaded_codecs_share_the_workers_cpu_threads():
    import dataclasses

    # Four groups ready at once: two threads compress two at a time, one thread one at a time.
    work = Compute(0.0, 0.1, 0.0, tuple(Gradient(f"t{i}", 10**7, 0.1) for i in range(4)))
    two = flat(4)
    one = dataclasses.replace(two, cpu_threads=1)
    both = simulate(work, two, "topk:ratio=0.01:on=cpu", groups.layerwise(4))
    alone = simulate(work, one, "topk:ratio=0.01:on=cpu", groups.layerwise(4))
    first = [s for s in both.spans if s.label == "compress"]
    assert sorted({s.lane for s in first}) == ["cpu 0", "cpu 1"]
    assert first[0].start_s == first[1].start_s  # side by side
    serial = [s for s in alone.spans if s.label == "compress"]
    assert all(b.start_s >= a.end_s for a, b in itertools.pairwise(serial))
    assert alone.step_s > both.step_s


def test_sparse_embeddings_make_deepfm_faster_than_a_dense_allreduce():
    where = clusters.cluster(8, 8, "v100", "25gbit")
    work = computes.from_model(models.build("deepfm"), where.device)
    dense = simulate(work, where, "none")
    sparse = simulate(work, where, "none:scheme=auto")
    assert sparse.step_s < dense.step_s
    assert {s.label for s in sparse.spans if s.lane == "network"} >= {"allreduce"}
    assert any(s.label.startswith("sparse ") for s in sparse.spans)


def test_an_all_to_all_across_nodes_pays_for_every_rank_of_a_node_sharing_its_nic():
    # 8 nodes of 8: each rank sends 56/64 of its bytes off its node, all 8 at once through one NIC.
    from gradsync.sim.phases import _collective

    where = clusters.cluster(8, 8, "v100", "25gbit")
    nbytes, n, g = 10e6, 64, 8
    nic_bound = g * (n - g) / n * nbytes / where.inter.bytes_per_s
    seconds = _collective(where, "all_to_all", nbytes, n)
    assert seconds == pytest.approx((n - 1) * where.inter.alpha_s + nic_bound)
    # One rank per node: each rank has its NIC to itself, as the uniform formula has it.
    alone = clusters.cluster(8, 1, "v100", "25gbit")
    assert _collective(alone, "all_to_all", nbytes, 8) == pytest.approx(
        cost.all_to_all_uniform_s(nbytes, 8, alone.inter)
    )


def test_powersgd_pays_the_latency_of_each_of_its_two_allreduces():
    from gradsync.sim.phases import phases
    from gradsync.strategy import parse

    strategy = parse("powersgd:rank=4")
    numel, where = 1_000_000, flat(8)
    net = [p for p in phases(strategy, numel, where) if p.resource == "net"]
    payload = strategy.payload_bytes(numel)
    assert [p.label for p in net] == ["allreduce", "allreduce"]
    # Each round pays its messages' latency: one allreduce of P and Q together would pay it once
    # (here the tree's, 2 log2(8) = 6 messages, wins over the ring's 14).
    half = min(cost.ring_allreduce_s(payload / 2, 8, LINK), cost.tree_allreduce_s(payload / 2, 8, LINK))
    whole = min(cost.ring_allreduce_s(payload, 8, LINK), cost.tree_allreduce_s(payload, 8, LINK))
    assert sum(p.seconds for p in net) == pytest.approx(2 * half)
    assert 2 * half - whole == pytest.approx(6 * LINK.alpha_s)
