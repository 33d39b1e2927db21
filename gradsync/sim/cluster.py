"""Devices and clusters the simulator runs on: presets, and one built from a measured profile.

A cluster is `nodes` machines of `gpus_per_node` workers each. Workers of a node talk over the
intra-node link (NVLink, PCIe); nodes talk over one NIC each (25 or 100 Gbit/s). Collective times
come from the alpha-beta formulas of gradsync.cost over those links, or, for a cluster measured
by gradsync.profile, from the fitted time of each collective on the real process group.

The preset numbers are vendors' peak figures (dense tensor-core FLOP/s, HBM bandwidth, NVLink
bandwidth per GPU one way); `efficiency` turns peak FLOP/s into what training achieves. They are
modelled, not measured here: no GPU was available to calibrate them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cost import LinearFit, Link
from ..units import parse_bandwidth

# Per GPU kernel: what one PyTorch op costs before it moves a byte (launch and dispatch).
KERNEL_S = 10e-6
# Socket-based inter-node messages (NCCL over TCP, gloo): about 25 us per message.
INTER_ALPHA_S = 25e-6
INTRA_ALPHA_S = 5e-6


@dataclass(frozen=True)
class Device:
    """A compute device: the throughput that turns FLOPs into time, and its memory and host links."""

    name: str
    peak_flops: float  # dense mixed-precision (fp16/bf16 tensor core) FLOP/s
    peak_fp32_flops: float  # plain fp32 FLOP/s (no tensor cores)
    memory_bytes_per_s: float  # HBM bandwidth, bytes per second: compression kernels are bound by it
    nvlink_bytes_per_s: float  # NVLink bandwidth per GPU, one way
    pcie_bytes_per_s: float  # host link, one way: what offloading a tensor to CPU threads costs
    efficiency: float = 0.4  # achieved / peak FLOP/s in training (model FLOPs utilisation)

    def flops(self, precision: str) -> float:
        """Achieved FLOP/s in training at `precision` ("mixed" or "fp32")."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}; e.g. 'mixed'")
        peak = self.peak_flops if precision == "mixed" else self.peak_fp32_flops
        return peak * self.efficiency


PRECISIONS = ("mixed", "fp32")

# SXM parts; peak numbers from the vendors' data sheets (dense, no sparsity).
DEVICES: dict[str, Device] = {
    "v100": Device("V100", 125e12, 15.7e12, 900e9, 150e9, 12e9),
    "a100": Device("A100", 312e12, 19.5e12, 2.0e12, 300e9, 24e9),
    "h100": Device("H100", 989e12, 67e12, 3.35e12, 450e9, 50e9),
}


def device(name: str) -> Device:
    """A device preset by name: v100, a100, h100."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise KeyError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)}") from None


@dataclass(frozen=True)
class Cluster:
    """Where a step runs: nodes x gpus_per_node workers, their links, and how fast they compress.

    `collectives` and `compression`, when given (a measured profile), replace the formulas: the
    time of a collective of b bytes per rank is collectives[name](b) (collectives["allreduce:float16"]
    for an fp16 sum, where measured), a codec's compress and decompress time are
    compression[spec]["compress" | "decompress"](numel), and gradsync's whole hook path around it,
    where measured, hook[spec]["before" | "after"](numel). A measured cluster has one worker per
    node, as the testbed has one rank per host.
    """

    nodes: int
    gpus_per_node: int
    device: Device
    intra: Link
    inter: Link
    precision: str = "mixed"
    cpu_bytes_per_s: float = 5e9  # one CPU thread streaming through memory: offloaded compression
    cpu_threads: int = 2  # CPU threads per worker that offloaded codecs share
    collectives: Mapping[str, LinearFit] | None = None
    compression: Mapping[str, Mapping[str, LinearFit]] | None = None
    hook: Mapping[str, Mapping[str, LinearFit]] | None = None
    # collective ("allreduce", "allreduce:float16") -> {"compute": c, "transfer": t}: while that
    # collective overlaps the backward pass, it runs slower by t and the compute by c (fractions),
    # as where ranks share CPU cores. Measured by gradsync.profile; none on the presets.
    contention: Mapping[str, Mapping[str, float]] | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for label, value in (("nodes", self.nodes), ("gpus_per_node", self.gpus_per_node)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r} must be an integer >= 1; e.g. {label}=8")
        for name, slowdowns in (self.contention or {}).items():
            if not all(v >= 0 for v in slowdowns.values()):
                raise ValueError(f"contention[{name!r}]={dict(slowdowns)} must be fractions >= 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}; e.g. 'mixed'")
        if self.collectives is not None and self.gpus_per_node != 1:
            raise ValueError(
                f"a measured cluster has one worker per node (gpus_per_node=1), got {self.gpus_per_node}; "
                "profile each host's ranks as nodes"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def measured(self) -> bool:
        return self.collectives is not None

    def describe(self) -> str:
        if self.name:
            return self.name
        link = f"{self.inter.bytes_per_s * 8 / 1e9:g} Gbit/s"
        return f"{self.nodes} x {self.gpus_per_node} {self.device.name}, {link} between nodes"


def cluster(
    nodes: int,
    gpus_per_node: int = 8,
    device_name: str = "v100",
    inter: str = "25gbit",
    intra: str = "nvlink",
    precision: str = "mixed",
) -> Cluster:
    """A cluster preset: `nodes` machines of `gpus_per_node` GPUs joined by NVLink (or PCIe),
    one NIC of `inter` (a tc-style rate: "25gbit", "100gbit") per node.

    Example:
        >>> cluster(8, 8, "v100", "25gbit").world_size
        64
    """
    dev = device(device_name)
    if intra not in ("nvlink", "pcie"):
        raise ValueError(f"intra={intra!r} must be 'nvlink' or 'pcie'")
    intra_bytes_per_s = dev.nvlink_bytes_per_s if intra == "nvlink" else dev.pcie_bytes_per_s
    inter_bytes_per_s = parse_bandwidth(inter) / 8
    return Cluster(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        device=dev,
        intra=Link(INTRA_ALPHA_S, intra_bytes_per_s),
        inter=Link(INTER_ALPHA_S, inter_bytes_per_s),
        precision=precision,
        name=f"{nodes} x {gpus_per_node} {dev.name} ({intra}), {inter} between nodes",
    )


# The host a measured profile comes from: its "device" is the CPU the ranks compute on.
CPU_HOST = Device("CPU", 0.0, 0.0, 10e9, 10e9, 10e9, efficiency=1.0)


def measured(
    world_size: int,
    collectives: Mapping[str, LinearFit],
    compression: Mapping[str, Mapping[str, LinearFit]],
    hook: Mapping[str, Mapping[str, LinearFit]] | None = None,
    contention: Mapping[str, Mapping[str, float]] | None = None,
    name: str = "",
) -> Cluster:
    """A cluster of `world_size` single-worker hosts whose costs were measured (gradsync.profile)."""
    missing = {"allreduce", "allgather"} - set(collectives)
    if missing:
        raise ValueError(f"measured collectives lack {sorted(missing)}; profile them (gradsync.profile)")
    unused = Link(0.0, 1.0)  # every collective time comes from the fits
    return Cluster(
        world_size,
        1,
        CPU_HOST,
        unused,
        unused,
        "fp32",
        collectives=collectives,
        compression=compression,
        hook=hook,
        contention=contention,
        name=name or f"{world_size} measured hosts",
    )
