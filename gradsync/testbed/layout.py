"""What a testbed is: its hosts, their namespaces and addresses, and the error every part raises.

Host and Testbed are plain data (they round-trip through the state file as JSON); _layout turns a
host count, rate and delay into one, checking the arguments, and fixes the naming every other
module relies on: host i is namespace gsync-h<i> with address i + 1 of SUBNET, and all hosts hang
off one bridge in SWITCH_NETNS.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass
from typing import Any

from ..units import format_bandwidth

PREFIX = "gsync-"
SWITCH_NETNS = "gsync-sw"
BRIDGE = "br0"
HOST_IFNAME = "eth0"
SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
# Host i gets SUBNET's address i + 1, so a /24 holds at most 254 hosts.
MAX_HOSTS = SUBNET.num_addresses - 2


class TestbedError(RuntimeError):
    """A testbed could not be built, torn down or used; the message names the command and its stderr."""


@dataclass(frozen=True)
class Host:
    """One emulated host: a network namespace with one shaped interface."""

    index: int  # 0-based; rank i of a job runs on host i
    netns: str  # network namespace, e.g. "gsync-h0"
    ifname: str  # interface inside netns that gloo binds to (GLOO_SOCKET_IFNAME), e.g. "eth0"
    address: str  # IPv4 address of ifname, e.g. "10.213.0.1"

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace: `ip netns exec <netns> argv...`."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass(frozen=True)
class Testbed:
    """N hosts on one switch; every host's link shaped to one rate and delay, in both directions."""

    hosts: tuple[Host, ...]
    bandwidth_bits_per_s: float  # per link and per direction, counted in Ethernet frame bytes (as tc does)
    latency_ms: float  # one-way host-to-host delay actually added (0 where the kernel has no netem)

    def describe(self) -> str:
        """One line, e.g. "4 hosts, 1 Gbit/s per link, 0.2 ms one-way latency (netns gsync-h0..h3)"."""
        latency = f"{self.latency_ms:g} ms one-way latency" if self.latency_ms > 0 else "no added latency"
        first, last = self.hosts[0].netns, self.hosts[-1].netns
        names = first if len(self.hosts) == 1 else f"{first}..{last.removeprefix(PREFIX)}"
        plural = "s" if len(self.hosts) != 1 else ""
        return (
            f"{len(self.hosts)} host{plural}, {format_bandwidth(self.bandwidth_bits_per_s)} per link, "
            f"{latency} (netns {names})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly; Testbed.from_dict inverts it."""
        return {
            "hosts": [dataclasses.asdict(host) for host in self.hosts],
            "bandwidth_bits_per_s": self.bandwidth_bits_per_s,
            "latency_ms": self.latency_ms,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Testbed:
        try:
            hosts = tuple(Host(**host) for host in data["hosts"])
            return cls(hosts, float(data["bandwidth_bits_per_s"]), float(data["latency_ms"]))
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"not a testbed description ({error!r}); expected the keys of Testbed.to_dict(): "
                f"hosts (index, netns, ifname, address), bandwidth_bits_per_s, latency_ms; got {data!r}"
            ) from error


def _layout(hosts: int, bandwidth_bits_per_s: float, latency_ms: float) -> Testbed:
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts={hosts} must be between 1 and {MAX_HOSTS} (one address each in {SUBNET})")
    if not (bandwidth_bits_per_s > 0 and math.isfinite(bandwidth_bits_per_s)):
        raise ValueError(f"bandwidth_bits_per_s={bandwidth_bits_per_s} must be positive and finite, e.g. 1e9")
    if not (latency_ms >= 0 and math.isfinite(latency_ms)):
        raise ValueError(f"latency_ms={latency_ms} must be zero or positive and finite, e.g. 0.2")
    return Testbed(
        hosts=tuple(Host(i, f"{PREFIX}h{i}", HOST_IFNAME, str(SUBNET[i + 1])) for i in range(hosts)),
        bandwidth_bits_per_s=float(bandwidth_bits_per_s),
        latency_ms=float(latency_ms),
    )


def _switch_port(host: Host) -> str:
    """The switch-side end of host's veth, in SWITCH_NETNS."""
    return f"veth-h{host.index}"
