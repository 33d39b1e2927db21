"""Testbed: an emulated multi-host network on one Linux machine, for measuring real communication.

Each "host" is a network namespace (`gsync-h0`, `gsync-h1`, ...) whose `eth0` is one end of a veth
pair; the other end sits in a switch namespace (`gsync-sw`) on a Linux bridge. Both ends of every
link are shaped with `tc`, so gloo traffic between ranks launched with `host.wrap(argv)` crosses a
rate-limited (and, where the kernel has netem, delayed) link. Nothing touches the root namespace:
every link, address and qdisc lives inside a `gsync-*` namespace, and deleting the namespaces
deletes all of it.

A state file records the live testbed and its owner; a testbed whose owner has died, or `gsync-*`
namespaces that no state file explains, are stale and are cleaned (with a warning) before the next
build. Needs root and iproute2.

    >>> with session(4, "1gbit", "0.2ms") as testbed:
    ...     print(testbed.describe(), probe(testbed) / 1e9, "Gbit/s")

This package holds the entry points (available, up, down, current, format_status, session) and
re-exports the names callers use; each concern they draw on has its own module: layout (Host,
Testbed, TestbedError, naming and addresses), shaping (the ip/tc command plan), netns (running
ip/tc, listing and deleting namespaces), state (the state file, its lock, stale cleanup), signals
(session's signal guard) and probing (the allreduce bandwidth probe and its rank processes).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

from ..units import format_bandwidth as format_bandwidth
from ..units import parse_bandwidth, parse_latency
from .layout import BRIDGE as BRIDGE
from .layout import HOST_IFNAME as HOST_IFNAME
from .layout import MAX_HOSTS as MAX_HOSTS
from .layout import PREFIX as PREFIX
from .layout import SUBNET as SUBNET
from .layout import SWITCH_NETNS as SWITCH_NETNS
from .layout import Host as Host
from .layout import Testbed, TestbedError, _layout
from .netns import _delete_namespaces, _namespaces, _run, _tool_path
from .probing import _probe_rank as _probe_rank
from .probing import free_port as free_port
from .probing import probe as probe
from .shaping import _shaping_commands as _shaping_commands
from .shaping import plan_commands
from .signals import _SignalGuard
from .state import (
    _clean_stale,
    _process_identity,
    _read_state,
    _remove_state,
    _stale_reason,
    _state_lock,
    _write_state,
    state_path,
)

# A scratch namespace that available() creates and deletes to check what the kernel supports.
_CHECK_NETNS = "gsync-check"


def available() -> str | None:
    """None when this machine can build a testbed, else why not (not root, no iproute2, no netns)."""
    return _check_kernel()[0]


def _check_kernel() -> tuple[str | None, bool]:
    """(why no testbed can be built or None, whether tc has netem), from a scratch namespace."""
    if os.geteuid() != 0:
        return f"the testbed needs root to create network namespaces (euid is {os.geteuid()})", False
    for tool in ("ip", "tc"):
        if _tool_path(tool) is None:
            return f"{tool!r} is not installed (it comes with iproute2)", False
    with _state_lock():
        with contextlib.suppress(TestbedError):
            _run(["ip", "netns", "del", _CHECK_NETNS])  # left by a check that was killed
        try:
            _run(["ip", "netns", "add", _CHECK_NETNS])
        except TestbedError as error:
            return f"cannot create a network namespace: {error}", False
        try:
            tc = ["tc", "-n", _CHECK_NETNS, "qdisc", "add", "dev", "lo", "root"]
            _run([*tc, "tbf", "rate", "1gbit", "burst", "32768", "limit", "65536"])
            _run(["tc", "-n", _CHECK_NETNS, "qdisc", "del", "dev", "lo", "root"])
            try:
                _run([*tc, "netem", "delay", "100us"])
                has_netem = True
            except TestbedError:
                has_netem = False
        except TestbedError as error:
            return f"tc cannot shape a link here: {error}", False
        finally:
            with contextlib.suppress(TestbedError):  # a leftover is removed by the next down()
                _run(["ip", "netns", "del", _CHECK_NETNS])
    return None, has_netem


def up(hosts: int, bandwidth: str = "1gbit", latency: str = "0.2ms", persistent: bool = True) -> Testbed:
    """Build a testbed of `hosts` namespaces, each link shaped to `bandwidth` and half of `latency`.

    Stale testbeds are removed first (with a warning). A persistent testbed lives until down();
    otherwise it belongs to this process and counts as stale once the process has exited.
    On any failure, or an interrupt, what was built is torn down before the error propagates.

        >>> testbed = up(4, "1gbit", "0.2ms"); print(testbed.describe()); down()
    """
    bandwidth_bits_per_s, latency_ms = parse_bandwidth(bandwidth), parse_latency(latency)
    _layout(hosts, bandwidth_bits_per_s, latency_ms)  # argument errors before any side effect
    reason, has_netem = _check_kernel()
    if reason is not None:
        raise TestbedError(f"cannot build a testbed: {reason}")
    if latency_ms > 0 and not has_netem:
        warnings.warn(
            f"latency {latency!r} is not emulated: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), "
            "so links add only the veths' own few microseconds and the testbed records latency_ms=0. "
            "Use a kernel with sch_netem to emulate latency.",
            stacklevel=2,
        )
        latency_ms = 0.0
    testbed = _layout(hosts, bandwidth_bits_per_s, latency_ms)
    commands = plan_commands(hosts, bandwidth_bits_per_s, latency_ms)
    with _state_lock():
        live = _clean_stale()
        if live is not None:
            owner = live.get("owner")
            described = Testbed.from_dict(live["testbed"]).describe()
            if owner is None:
                raise TestbedError(
                    f"a testbed is already up ({described}, persistent); reuse it with current(), "
                    "or remove it with down() / `gradsync testbed down` first"
                )
            raise TestbedError(
                f"a testbed is already up ({described}), built for the run of pid {owner['pid']}, "
                "which removes it when that run ends; wait for it (two runs at once would also "
                "share the links and the cores), or end it and run `gradsync testbed down`"
            )
        owner = None if persistent else _process_identity(os.getpid())
        # Recorded before building, so a build killed midway is recognised as stale later.
        _write_state(testbed, owner, complete=False)
        try:
            for argv in commands:
                _run(argv)
        except BaseException:
            try:
                _delete_namespaces(_namespaces())
            finally:
                _remove_state()  # also where a namespace survived deletion: that error names it
            raise
        _write_state(testbed, owner, complete=True)
    return testbed


def down() -> list[str]:
    """Remove every gsync-* namespace (with its veths and qdiscs) and the state file, whatever their
    state; the namespaces removed. Idempotent."""
    if os.geteuid() != 0:
        raise TestbedError(
            f"down() needs root to delete network namespaces (euid is {os.geteuid()}); run it as root"
        )
    with _state_lock():
        removed = _delete_namespaces(_namespaces())
        _remove_state()
    return removed


def current() -> Testbed | None:
    """The live testbed this process may use: a persistent one (`gradsync testbed up`) or its own;
    None if there is none, it is stale, or it belongs to another running process, whose run
    removes it when it ends (a second run on it would lose its network midway)."""
    state = _read_state()
    if state is None or not state.get("complete") or _stale_reason(state, _namespaces()) is not None:
        return None
    owner = state.get("owner")
    if owner is not None and owner != _process_identity(os.getpid()):
        return None
    return Testbed.from_dict(state["testbed"])


def format_status() -> str:
    """What `gradsync testbed status` prints."""
    state = _read_state()
    present = _namespaces() if _tool_path("ip") else []  # listing needs no root
    if state is None:
        if present:
            return f"no testbed recorded, but stale namespaces {present} exist; run `gradsync testbed down`"
        reason = available()
        return "no testbed is up" + (f" (and none can be built: {reason})" if reason else "")
    testbed = Testbed.from_dict(state["testbed"])
    reason = _stale_reason(state, present)
    if reason is not None:
        return f"stale testbed ({reason}): {testbed.describe()}; run `gradsync testbed down`"
    if not state.get("complete"):
        return f"testbed being built by pid {state['builder']['pid']}: {testbed.describe()}"
    owner = state.get("owner")
    lifetime = f"owned by pid {owner['pid']}" if owner else "persistent (until `gradsync testbed down`)"
    lines = [f"testbed up: {testbed.describe()}, {lifetime}, recorded in {state_path()}"]
    lines += [f"  host {h.index}: netns {h.netns}, {h.ifname} {h.address}" for h in testbed.hosts]
    return "\n".join(lines)


@contextlib.contextmanager
def session(hosts: int, bandwidth: str = "1gbit", latency: str = "0.2ms") -> Iterator[Testbed]:
    """A testbed owned by this process for the `with` block, torn down however the block ends.

    SIGTERM and SIGHUP become SystemExit (SIGINT stays KeyboardInterrupt) while the block runs, so
    the teardown runs on them too; a signal that arrives during the teardown is held until it ends.
    (Signal handlers can only be set from the main thread; elsewhere only exceptions are covered.)

        >>> with session(2, "200mbit", "0.2ms") as testbed:
        ...     bandwidth_bits_per_s = probe(testbed)
    """
    guard = _SignalGuard()
    with guard:
        try:
            yield up(hosts, bandwidth, latency, persistent=False)
        finally:
            guard.deferring = True
            _down_if_owned()


def _down_if_owned() -> None:
    """down(), if the recorded testbed belongs to this process (up() may have failed on another's)."""
    state = _read_state()
    if state is not None and state.get("owner") == _process_identity(os.getpid()):
        down()
