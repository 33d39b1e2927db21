"""What each phase of a group's exchange costs on a cluster: the simulator's view of a Strategy.

A group's strategy (gradsync.strategy) becomes a list of phases (`Phase`): work on the worker's
device or CPU, or a transfer on the intra-node or inter-node links, which the simulator lays out in
time.

Two-level exchange (collective=two-level), as Espresso's and HiTopKComm's: summable payloads are
allreduced in two levels; other payloads are reduce-scattered in fp32 inside the node, each worker
compresses its 1/g share, the shares' payloads are allgathered across nodes and decoded, and the
node allgathers the decoded shares in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from .. import compress, cost
from ..sparse import cost as sparse_cost
from ..sparse.cost import Network, Sparsity
from ..strategy import Strategy, codec, sums
from .cluster import KERNEL_S, Cluster
from .compute import Gradient

# A codec's compress cost on a GPU, modelled from its kernels: (kernel launches, bytes moved per
# fp32 input byte). Counted from the implementations' tensor passes, not measured (no GPU here); a
# profile measured on the GPU replaces them. Unlisted codecs take _DEFAULT_COMPRESS.
_COMPRESS_COST: dict[str, tuple[int, float]] = {
    "none": (0, 0.0),
    "fp16": (1, 1.5),  # read 4 bytes, write 2
    "bf16": (1, 1.5),
    "topk": (6, 6.0),  # |x|, a sampled threshold, a select and a gather
    "randk": (3, 1.2),
    "dgc": (8, 6.0),
    "int8": (3, 2.5),
    "qsgd": (5, 3.5),
    "signsgd": (3, 2.1),
    "efsignsgd": (4, 3.1),
}
_DEFAULT_COMPRESS = (5, 4.0)
_DECODE_KERNELS = 2  # unpack, then add into the sum


@dataclass(frozen=True)
class Phase:
    """One piece of a group's exchange on one resource.

    resource: "device" or "cpu" (per worker), "net" (a flat collective: every link of every node),
    "intra" (each node's own intra-node links) or "inter" (the links between nodes).
    """

    resource: str
    label: str
    seconds: float
    # Where measured (CPU hosts): while this transfer overlaps the backward pass, it runs slower by
    # transfer_slowdown and the compute by compute_slowdown (fractions).
    compute_slowdown: float = 0.0
    transfer_slowdown: float = 0.0


def phases(strategy: Strategy, numel: int, cluster: Cluster, sparse: Sequence[Gradient] = ()) -> list[Phase]:
    """The phases of exchanging one group of `numel` fp32 elements, in order; `sparse` are the
    group's embedding gradients, which a scheme sends as rows."""
    n, g = cluster.world_size, cluster.gpus_per_node
    if n == 1:
        return []
    if strategy.scheme is not None and not strategy.compressed:
        return _sparse_rows(numel, sparse, cluster)
    if strategy.collective == "two-level" and cluster.nodes > 1 and g > 1:
        return _two_level(strategy, numel, cluster)
    if strategy.collective == "two-shot":
        return _two_shot(strategy, numel, cluster)
    payload = strategy.payload_bytes(numel)
    steps: list[Phase] = []
    if strategy.compressed:
        steps += _codec_phase(strategy, "compress", numel, cluster, 1)
    if strategy.scheme is not None:
        # The payload's values as rows of one element: the union of n workers' picks is modelled as
        # independent draws, as for embedding rows (_sparse_rows).
        kept = payload / 8  # index and value per element sent
        steps.append(_sparse_phase(numel, 1, kept / numel, cluster))
        decodes = 1  # the schemes deliver the summed rows
    elif strategy.collective == "allgather":
        steps.append(_transfer(cluster, "allgather", payload, n))
        decodes = n  # every worker's payload is decoded and added
    else:
        dtype = payload_dtype(strategy)
        # A multi-round codec (PowerSGD: P, then Q from the summed P) pays each round's latency.
        rounds = type(codec(strategy.codec, strategy.args)).rounds if strategy.compressed else 1
        steps += [_transfer(cluster, "allreduce", payload / rounds, n, dtype) for _ in range(rounds)]
        decodes = 1  # the payloads were summed on the way
    if strategy.compressed:
        steps += _codec_phase(strategy, "decompress", numel, cluster, decodes)
    return steps


def copy_phases(steps: list[Phase], numel: int, cluster: Cluster) -> list[Phase]:
    """`steps` of a group the hook cuts out of DDP's buckets: its gradients are copied into one
    tensor when it is ready and the result back into the buckets at the end, a pass over its
    fp32 bytes each way through device memory. Nothing to copy where nothing is exchanged."""
    if not steps:
        return steps
    seconds = 2 * 4 * numel / cluster.device.memory_bytes_per_s  # read and write
    return [Phase("device", "copy out", seconds), *steps, Phase("device", "copy back", seconds)]


def _sparse_rows(numel: int, sparse: Sequence[Gradient], cluster: Cluster) -> list[Phase]:
    """Zen's use: the group's dense tensors in one allreduce, each embedding's rows by the sparse
    scheme gradsync.sparse's cost model predicts fastest.

    The union of n workers' rows is modelled as independent draws, d_n = 1 - (1 - d)^n: an upper
    bound, since real rows overlap (Zipf-skewed tokens) and their union grows slower.
    """
    n = cluster.world_size
    dense = numel - sum(t.numel for t in sparse)
    steps = [_transfer(cluster, "allreduce", 4 * dense, n)] if dense else []
    for t in sparse:
        assert t.rows is not None and t.density is not None
        steps.append(_sparse_phase(t.rows, t.numel // t.rows, t.density, cluster))
    return steps


def _sparse_phase(num_rows: int, width: int, density: float, cluster: Cluster) -> Phase:
    """Rows of a [num_rows, width] fp32 table, `density` of them on each worker, sent by the sparse
    scheme gradsync.sparse's cost model prices cheapest."""
    n = cluster.world_size
    sizes = {1 << i for i in range(n.bit_length())} | {n}
    union = {m: 1 - (1 - density) ** m for m in sorted(sizes)}
    predicted = sparse_cost.seconds(Sparsity(num_rows, width, 4, union), n, _sparse_network(cluster))
    scheme = min(predicted, key=predicted.__getitem__)
    return Phase("net", f"sparse {scheme}", predicted[scheme])


def _sparse_network(cluster: Cluster) -> Network:
    """The alpha-beta network gradsync.sparse's cost model prices schemes on."""
    if cluster.collectives is None:
        link = cluster.inter if cluster.nodes > 1 else cluster.intra
        # Every round at the full link, a ring's or not: the balanced scheme's all_to_all and
        # recursive doubling's swaps share a node's NIC among its ranks, which is not modelled.
        return Network(link.alpha_s, link.bytes_per_s)
    # Measured: the ring allreduce's fit read back as per-message latency and link bandwidth.
    n, fit = cluster.world_size, cluster.collectives["allreduce"]
    bandwidth = 2 * (n - 1) / n / fit.per_unit_s if fit.per_unit_s else float("inf")
    return Network(fit.fixed_s / (2 * (n - 1)), bandwidth)


def payload_nbytes(strategy: Strategy, numel: int, cluster: Cluster) -> int:
    """Bytes of one worker's payload for a group of `numel` elements on `cluster`: a two-level
    exchange of a non-summable codec compresses only the worker's 1/g share."""
    g = cluster.gpus_per_node
    if _splits_into_shares(strategy, cluster):
        return strategy.payload_bytes(math.ceil(numel / g))
    return strategy.payload_bytes(numel)


def _splits_into_shares(strategy: Strategy, cluster: Cluster) -> bool:
    two_level = strategy.collective == "two-level" and cluster.nodes > 1 and cluster.gpus_per_node > 1
    return two_level and strategy.compressed and not _summable(strategy)


def _two_level(strategy: Strategy, numel: int, cluster: Cluster) -> list[Phase]:
    g, nodes = cluster.gpus_per_node, cluster.nodes
    # The g workers of a node run their inter-node rings at once: each gets 1/g of the NIC.
    share = cost.Link(cluster.inter.alpha_s, cluster.inter.bytes_per_s / g)
    if not _splits_into_shares(strategy, cluster):
        payload = strategy.payload_bytes(numel)
        steps = _codec_phase(strategy, "compress", numel, cluster, 1) if strategy.compressed else []
        steps += [
            Phase("intra", "reduce-scatter", cost.reduce_scatter_s(payload, g, cluster.intra)),
            Phase("inter", "allreduce", cost.ring_allreduce_s(payload / g, nodes, share)),
            Phase("intra", "allgather", cost.allgather_equal_s(payload / g, g, cluster.intra)),
        ]
        if strategy.compressed:
            steps += _codec_phase(strategy, "decompress", numel, cluster, 1)
        return steps
    shard = math.ceil(numel / g)
    return [
        Phase("intra", "reduce-scatter", cost.reduce_scatter_s(4 * numel, g, cluster.intra)),
        *_codec_phase(strategy, "compress", shard, cluster, 1),
        Phase("inter", "allgather", cost.allgather_equal_s(strategy.payload_bytes(shard), nodes, share)),
        *_codec_phase(strategy, "decompress", shard, cluster, nodes),
        Phase("intra", "allgather", cost.allgather_equal_s(4 * shard, g, cluster.intra)),
    ]


def _two_shot(strategy: Strategy, numel: int, cluster: Cluster) -> list[Phase]:
    """Every shard encoded and sent to its owner (all_to_all), which decodes the n payloads of its
    shard and encodes their sum; the owners' payloads allgathered and decoded, one per shard."""
    n = cluster.world_size
    shard = math.ceil(numel / n)
    return [
        *_codec_phase(strategy, "compress", numel, cluster, 1),
        _transfer(cluster, "all_to_all", strategy.payload_bytes(numel), n),
        *_codec_phase(strategy, "decompress", shard, cluster, n),
        *_codec_phase(strategy, "compress", shard, cluster, 1),
        _transfer(cluster, "allgather", strategy.payload_bytes(shard), n),
        *_codec_phase(strategy, "decompress", numel, cluster, 1),
    ]


def _transfer(cluster: Cluster, name: str, nbytes_per_rank: float, n: int, dtype: str = "float32") -> Phase:
    """A flat collective over every worker, with the contention measured for it, if any."""
    contention = cluster.contention or {}
    slowdowns = contention.get(f"{name}:{dtype}", contention.get(name, {}))
    return Phase(
        "net",
        name,
        _collective(cluster, name, nbytes_per_rank, n, dtype),
        slowdowns.get("compute", 0.0),
        slowdowns.get("transfer", 0.0),
    )


def _collective(cluster: Cluster, name: str, nbytes_per_rank: float, n: int, dtype: str = "float32") -> float:
    if cluster.collectives is not None:
        if name == "all_to_all" and name not in cluster.collectives:
            # Unmeasured: a ring all_to_all moves what a reduce-scatter does, half an allreduce.
            return cluster.collectives["allreduce"](nbytes_per_rank) / 2
        # A sum's speed depends on its dtype (gloo adds fp16 far slower per byte than fp32).
        fit = cluster.collectives.get(f"{name}:{dtype}", cluster.collectives[name])
        return fit(nbytes_per_rank)
    link = cluster.inter if cluster.nodes > 1 else cluster.intra  # a flat ring crosses every NIC
    if name == "allgather":
        return cost.allgather_equal_s(nbytes_per_rank, n, link)
    if name == "all_to_all":
        return cost.all_to_all_uniform_s(nbytes_per_rank, n, _all_to_all_link(cluster, link))
    # NCCL picks ring or tree per size: the tree's log-depth latency wins for small tensors on
    # many workers, the ring's bandwidth for large ones.
    return min(
        cost.ring_allreduce_s(nbytes_per_rank, n, link), cost.tree_allreduce_s(nbytes_per_rank, n, link)
    )


def _all_to_all_link(cluster: Cluster, link: cost.Link) -> cost.Link:
    """`link` as an all_to_all sees it. Unlike a ring, where one rank of a node crosses its NIC at a
    time, every rank of a node sends (n - g)/n of its bytes off the node at once: the NIC carries
    g(n - g)/n of a rank's bytes, which the uniform formula's (n - 1)/n over this link prices."""
    g, n = cluster.gpus_per_node, cluster.world_size
    if cluster.nodes == 1 or g == 1:
        return link
    return cost.Link(link.alpha_s, link.bytes_per_s * (n - 1) / (g * (n - g)))


def _codec_phase(strategy: Strategy, which: str, numel: int, cluster: Cluster, payloads: int) -> list[Phase]:
    seconds = codec_seconds(strategy, which, numel, cluster, payloads)
    if strategy.on == "cpu":
        # The fp32 data crosses the host link to the CPU and back (compress: out; decompress: in).
        seconds += 4 * numel / cluster.device.pcie_bytes_per_s
    return [Phase(strategy.on, which, seconds)]


def codec_seconds(strategy: Strategy, which: str, numel: int, cluster: Cluster, payloads: int = 1) -> float:
    """Seconds to compress `numel` elements, or to decode `payloads` payloads of them into one sum,
    on the strategy's place (the device or a CPU thread)."""
    measured = cluster.compression
    if measured is not None:
        fits = measured.get(strategy.spec)
        if fits is None:
            raise KeyError(
                f"the profile has no measured cost for {strategy.spec!r}; it measured {sorted(measured)}. "
                "Profile that codec too (gradsync.profile.run(..., compressors=[...]))"
            )
        hook = (cluster.hook or {}).get(strategy.spec)
        if hook is not None:
            # gradsync's whole hook path was measured: before the collective (compression and
            # everything around it), after it (one payload's decode and the rest); each further
            # payload costs one more decode.
            if which == "compress":
                return hook["before"](numel)
            return hook["after"](numel) + (payloads - 1) * fits["decompress"](numel)
        # A measured decode is of one payload into a fresh tensor; each payload pays it.
        return fits[which](numel) * (payloads if which == "decompress" else 1)
    bandwidth = cluster.cpu_bytes_per_s if strategy.on == "cpu" else cluster.device.memory_bytes_per_s
    launch = 0.0 if strategy.on == "cpu" else KERNEL_S
    if which == "compress":
        kernels, passes = _COMPRESS_COST.get(strategy.codec, _DEFAULT_COMPRESS)
        return kernels * launch + passes * 4 * numel / bandwidth
    # Decoding reads each payload and adds it into the sum: every element for a dense codec, only
    # the sent ones (8 bytes each: index and value, as in the payload) for a sparsifier.
    payload = strategy.payload_bytes(numel)
    touched = payload if codec(strategy.codec, strategy.args).sparse_rows else 8 * numel
    per_payload = _DECODE_KERNELS * launch + (payload + touched) / bandwidth
    return 4 * numel / bandwidth + payloads * per_payload  # zero the sum once, then add each


def _summable(strategy: Strategy) -> bool:
    """Whether the payloads are summed on the way (allreduce in two levels), not gathered."""
    return sums(type(codec(strategy.codec, strategy.args)))


@lru_cache(maxsize=256)
def _payload_dtype(name: str, args: tuple[tuple[str, Any], ...]) -> str:
    payload, _ = compress.build(name, **dict(args)).compress(torch.zeros(64))
    return str(payload[0].dtype).removeprefix("torch.")


def payload_dtype(strategy: Strategy) -> str:
    """The dtype a strategy's payload is summed in: "float32" uncompressed, "float16" for fp16."""
    return _payload_dtype(strategy.codec, strategy.args) if strategy.compressed else "float32"
