"""The ip/tc commands that build a testbed: namespaces, veths, bridge, and each link end's qdiscs.

Pure: plan_commands only lists the commands, in the order up() runs them, so the plan can be
checked without root. The tbf/netem sizing below is why the shaped links reach their rate.
"""

from __future__ import annotations

from .layout import BRIDGE, SUBNET, SWITCH_NETNS, _layout, _switch_port

# tbf sizing. The burst must cover the token bucket's refill between timer wake-ups: measured on
# veths in a VM at 1 Gbit/s, a 16 KiB burst reached 68% of the rate, 32 KiB 84%, 64 KiB 94% and
# one millisecond of the rate (125 KB) the full 957 Mbit/s of TCP goodput (1448 of every 1514
# bytes are payload, as on real Ethernet). The cost: after an idle millisecond, up to that many
# bytes leave at veth speed, so a message smaller than that is not slowed by the rate.
_BURST_S = 1e-3
_MIN_BURST_BYTES = 32 * 1024
# The queue must hold what TCP keeps in flight into it (TSQ allows up to 4 MiB per socket) or the
# sender sees local drops; 20 ms of the rate covers faster links.
_QUEUE_S = 20e-3
_MIN_QUEUE_BYTES = 4 * 1024 * 1024
# netem counts packets, not bytes, and ACKs are ~66 bytes: room for a full tbf queue of small ones.
_NETEM_BYTES_PER_PACKET = 256


def plan_commands(hosts: int, bandwidth_bits_per_s: float, latency_ms: float) -> list[list[str]]:
    """Every ip/tc command that up() runs, in order. Pure: builds nothing.

    Every command names its namespace (`ip netns add`, `ip -n`, `tc -n`); veth pairs are created
    inside a host namespace with the peer placed directly in the switch namespace.
    """
    testbed = _layout(hosts, bandwidth_bits_per_s, latency_ms)
    sw = SWITCH_NETNS
    commands = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
        # No IPv6 link-local addresses: the links then carry only the job's traffic (no RS/MLD).
        ["ip", "-n", sw, "link", "set", BRIDGE, "addrgenmode", "none"],
        ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
    ]
    prefix_len = str(SUBNET.prefixlen)
    for host in testbed.hosts:
        ns, dev, port = host.netns, host.ifname, _switch_port(host)
        commands += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", sw],
            ["ip", "-n", ns, "link", "set", dev, "addrgenmode", "none"],
            ["ip", "-n", sw, "link", "set", port, "addrgenmode", "none"],
            ["ip", "-n", ns, "addr", "add", f"{host.address}/{prefix_len}", "dev", dev],
            ["ip", "-n", sw, "link", "set", port, "master", BRIDGE],
            # Host egress shapes host -> switch; switch-port egress shapes switch -> host.
            *_shaping_commands(ns, dev, testbed.bandwidth_bits_per_s, testbed.latency_ms / 2),
            *_shaping_commands(sw, port, testbed.bandwidth_bits_per_s, testbed.latency_ms / 2),
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", ns, "link", "set", dev, "up"],
        ]
    return commands


def _shaping_commands(netns: str, dev: str, rate_bits_per_s: float, delay_ms: float) -> list[list[str]]:
    """Egress qdiscs of one link end: tbf for the rate, under netem for the delay when there is one.

    Rate: tbf, not netem's `rate`, because kernels built without netem (like the VM this was
    measured on) still have tbf, and on veths it gives ~96% of the rate as TCP goodput, no drops
    (see _BURST_S). Delay: netem at the root with the tbf as its child, the layout the netem
    documentation gives for delay plus rate; up() plans no delay where the kernel lacks netem.
    """
    burst_bytes = max(_MIN_BURST_BYTES, round(rate_bits_per_s / 8 * _BURST_S))
    queue_bytes = max(_MIN_QUEUE_BYTES, round(rate_bits_per_s / 8 * _QUEUE_S))
    tbf = [
        "tbf",
        "rate",
        f"{round(rate_bits_per_s)}bit",
        "burst",
        str(burst_bytes),
        "limit",
        str(queue_bytes),
    ]
    tc = ["tc", "-n", netns, "qdisc", "add", "dev", dev]
    if delay_ms <= 0:
        return [[*tc, "root", "handle", "1:", *tbf]]
    netem_limit_packets = max(1000, queue_bytes // _NETEM_BYTES_PER_PACKET)
    netem = ["netem", "delay", f"{_plain(delay_ms * 1000)}us", "limit", str(netem_limit_packets)]
    return [[*tc, "root", "handle", "1:", *netem], [*tc, "parent", "1:1", "handle", "10:", *tbf]]


def _plain(number: float) -> str:
    """A number as tc reads it: no exponent, no trailing zeros ("100", "62.5")."""
    return f"{number:.3f}".rstrip("0").rstrip(".")
