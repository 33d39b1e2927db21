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
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from .units import format_bandwidth, parse_bandwidth, parse_latency

PREFIX = "gsync-"
SWITCH_NETNS = "gsync-sw"
BRIDGE = "br0"
HOST_IFNAME = "eth0"
SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
# Host i gets SUBNET's address i + 1, so a /24 holds at most 254 hosts.
MAX_HOSTS = SUBNET.num_addresses - 2
# A scratch namespace that available() creates and deletes to check what the kernel supports.
_CHECK_NETNS = "gsync-check"

# Bounds on every wait: one ip/tc command, the state lock, process shutdown.
_COMMAND_TIMEOUT_S = 15.0
_LOCK_TIMEOUT_S = 60.0
_KILL_TIMEOUT_S = 5.0

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

_PROBE_RESULT_PREFIX = "GSYNC_PROBE_SECONDS "
_REPO_ROOT = Path(__file__).resolve().parent.parent


class TestbedError(RuntimeError):
    """A testbed could not be built, torn down or used; the message names the command and its stderr."""


# ---------------------------------------------------------------------------------------------
# What a testbed is


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


# ---------------------------------------------------------------------------------------------
# The commands


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


def _tool_path(name: str) -> str | None:
    # sudo and cron often leave /usr/sbin out of PATH; iproute2 lives there.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def _resolved(argv: list[str]) -> list[str]:
    """argv with its program as a full path, or TestbedError if it is not installed."""
    executable = _tool_path(argv[0])
    if executable is None:
        raise TestbedError(f"`{shlex.join(argv)}`: {argv[0]!r} not found on PATH; install iproute2")
    return [executable, *argv[1:]]


def _run(argv: list[str], timeout_s: float = _COMMAND_TIMEOUT_S) -> str:
    """Run one command; its stdout, or TestbedError naming the command and its stderr."""
    shown = shlex.join(argv)
    try:
        # Its own session, so a Ctrl-C meant for us cannot kill an `ip netns del` during teardown.
        done = subprocess.run(
            _resolved(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as error:
        raise TestbedError(f"`{shown}` did not finish within {timeout_s:g} s") from error
    if done.returncode != 0:
        stderr = done.stderr.strip() or "(no stderr)"
        raise TestbedError(f"`{shown}` failed (exit {done.returncode}): {stderr}")
    return done.stdout


def _namespaces() -> list[str]:
    """Every network namespace named gsync-*, sorted."""
    # `ip netns list` prints "name (id: 3)" or just "name".
    names = (line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip())
    return sorted(name for name in names if name.startswith(PREFIX))


def _delete_namespaces(names: list[str]) -> list[str]:
    """Delete the named namespaces (with their veths and qdiscs); the ones that were deleted."""
    removed, failures = [], []
    for name in names:
        _warn_about_processes_in(name)
        try:
            _run(["ip", "netns", "del", name])
            removed.append(name)
        except TestbedError as error:
            failures.append(str(error))
    left = [name for name in _namespaces() if name in names]
    if left:
        raise TestbedError(f"namespaces {left} survived deletion: {'; '.join(failures)}")
    return removed


def _warn_about_processes_in(netns: str) -> None:
    with contextlib.suppress(TestbedError):
        pids = _run(["ip", "netns", "pids", netns]).split()
        if pids:
            warnings.warn(
                f"processes {', '.join(pids)} still run in {netns}; deleting it leaves them without a "
                "network. Stop them before tearing the testbed down.",
                stacklevel=2,
            )


# ---------------------------------------------------------------------------------------------
# State: which testbed is up and who owns it


def state_path() -> Path:
    """Where the live testbed is recorded: /run if writable, else the system temp directory."""
    run = Path("/run")
    base = run if run.is_dir() and os.access(run, os.W_OK) else Path(tempfile.gettempdir())
    return base / "gradsync-testbed.json"


def _process_identity(pid: int) -> dict[str, int] | None:
    """pid and its start time (from /proc), which together survive pid reuse; None if not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 is the start time; split after the ")" that ends the command name, which may hold spaces.
    return {"pid": pid, "start": int(stat.rsplit(")", 1)[1].split()[19])}


def _is_running(identity: dict[str, int] | None) -> bool:
    return identity is not None and _process_identity(identity["pid"]) == identity


def _read_state() -> dict[str, Any] | None:
    try:
        return json.loads(state_path().read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        # An unreadable record explains nothing: its namespaces are then treated as stale.
        warnings.warn(f"ignoring unreadable testbed state {state_path()}: {error}", stacklevel=3)
        return None


def _write_state(testbed: Testbed, owner: dict[str, int] | None, complete: bool) -> None:
    state = {
        "testbed": testbed.to_dict(),
        "namespaces": [SWITCH_NETNS, *(host.netns for host in testbed.hosts)],
        "owner": owner,  # None: persistent, lives until down(); else torn down when this process dies
        "builder": _process_identity(os.getpid()),
        "complete": complete,  # False while up() runs: a dead builder then means a half-built testbed
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = state_path()
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(state, indent=2))
    temporary.replace(path)  # atomic: a reader never sees half a record


def _remove_state() -> None:
    state_path().unlink(missing_ok=True)


def _stale_reason(state: dict[str, Any], present: list[str]) -> str | None:
    """Why the recorded testbed is stale, or None if it is live (or still being built)."""
    owner = state.get("owner")
    if owner is not None and not _is_running(owner):
        return f"its owner, pid {owner['pid']}, has exited"
    if not state.get("complete") and not _is_running(state.get("builder")):
        return f"pid {(state.get('builder') or {}).get('pid')} died while building it"
    missing = [name for name in state.get("namespaces", []) if name not in present]
    if missing:
        return f"its namespaces {missing} are gone"
    return None


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """Serialise up/down/available across processes; waits at most _LOCK_TIMEOUT_S."""
    path = state_path().with_suffix(".lock")
    with open(path, "a") as handle:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as error:
                if time.monotonic() > deadline:
                    raise TestbedError(
                        f"another process held {path} for {_LOCK_TIMEOUT_S:g} s; wait for its testbed "
                        "command to finish, or check that it is not hung"
                    ) from error
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clean_stale() -> dict[str, Any] | None:
    """Remove a stale testbed and stray gsync-* namespaces, warning about each; the live state, if any."""
    state, present = _read_state(), _namespaces()
    reason = None if state is None else _stale_reason(state, present)
    if state is not None and reason is not None:
        recorded = [name for name in state.get("namespaces", []) if name in present]
        warnings.warn(
            f"removing a stale testbed ({reason}): namespaces {recorded or 'none left'} and {state_path()}",
            stacklevel=3,
        )
        _delete_namespaces(recorded)
        _remove_state()
        state, present = None, _namespaces()
    explained = state.get("namespaces", []) if state is not None else []
    strays = [name for name in present if name not in explained]
    if strays:
        warnings.warn(f"removing stale namespaces {strays}: no testbed state records them", stacklevel=3)
        _delete_namespaces(strays)
    return state


# ---------------------------------------------------------------------------------------------
# Lifecycle


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
            who = "persistent" if owner is None else f"owned by pid {owner['pid']}"
            raise TestbedError(
                f"a testbed is already up ({Testbed.from_dict(live['testbed']).describe()}, {who}); "
                "reuse it with current(), or remove it with down() / `gradsync testbed down` first"
            )
        owner = None if persistent else _process_identity(os.getpid())
        # Recorded before building, so a build killed midway is recognised as stale later.
        _write_state(testbed, owner, complete=False)
        try:
            for argv in commands:
                _run(argv)
        except BaseException:
            _delete_namespaces(_namespaces())
            _remove_state()
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
    """The live testbed the state file describes, or None if there is none or it is stale."""
    state = _read_state()
    if state is None or not state.get("complete") or _stale_reason(state, _namespaces()) is not None:
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


class _SignalGuard:
    """While active, turns SIGINT/SIGTERM/SIGHUP into exceptions; while `deferring`, holds them.

    A signal the caller ignores stays ignored. A handler the caller installed still runs first;
    if it returns instead of raising, the guard raises, since the session must end either way.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.deferring = False
        self.pending: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if self.pending is not None and kind is None:
            _raise_for_signal(self.pending)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.deferring:
            self.pending = signum
            return
        previous = self.previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
        _raise_for_signal(signum)


def _raise_for_signal(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)  # the exit status a shell reports for death by this signal


# ---------------------------------------------------------------------------------------------
# Probe: the bandwidth a real gloo allreduce achieves


def probe(testbed: Testbed, megabytes: float = 64, repeats: int = 3, timeout_s: float = 120) -> float:
    """Ring "bus bandwidth" in bits/s of a gloo allreduce of `megabytes` MB (1e6 bytes) of float32,
    one rank per host: 8 * bytes * 2(n-1)/n / median seconds, the per-link rate the ring achieved.

    Each rank does a warm-up allreduce, then `repeats` timed ones; a repeat's time is the slowest
    rank's. Children are killed on failure or after `timeout_s`; failure raises TestbedError with
    their stderr.
    """
    world_size = len(testbed.hosts)
    if world_size < 2:
        raise ValueError(f"probe needs at least 2 hosts to allreduce between; this testbed has {world_size}")
    if not (megabytes > 0 and isinstance(repeats, int) and repeats >= 1 and timeout_s > 0):
        raise ValueError(
            f"megabytes={megabytes}, repeats={repeats}, timeout_s={timeout_s} must all be positive "
            "(repeats an integer >= 1), e.g. probe(testbed, megabytes=64, repeats=3, timeout_s=120)"
        )
    numel = max(1, int(megabytes * 1e6 / 4))
    job = {
        "MASTER_ADDR": testbed.hosts[0].address,
        "MASTER_PORT": str(free_port(testbed.hosts[0])),
        "WORLD_SIZE": str(world_size),
        "GSYNC_PROBE_NUMEL": str(numel),
        "GSYNC_PROBE_REPEATS": str(repeats),
        "GSYNC_PROBE_TIMEOUT_S": str(timeout_s),
    }
    seconds = _run_ranks(testbed, job, timeout_s)
    nbytes = 4 * numel
    return 8 * nbytes * 2 * (world_size - 1) / world_size / statistics.median(seconds)


def free_port(host: Host) -> int:
    """A TCP port free inside host's namespace (the root namespace's ports say nothing about it)."""
    code = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
    return int(_run(host.wrap([sys.executable, "-c", code])))


@dataclass
class _Rank:
    """One probe child: its process and where its output goes."""

    index: int
    process: subprocess.Popen
    stdout: Path
    stderr: Path


def _run_ranks(testbed: Testbed, job: dict[str, str], timeout_s: float) -> list[float]:
    """One _probe_rank per host, run to the end (or first failure, or deadline); rank 0's timings."""
    with tempfile.TemporaryDirectory(prefix="gsync-probe-") as logs:
        ranks: list[_Rank] = []
        try:
            for host in testbed.hosts:
                ranks.append(_start_rank(host, job, Path(logs)))
            failure = _wait_for_ranks(ranks, timeout_s)
        finally:
            _kill(ranks)
        if failure is None:
            for line in ranks[0].stdout.read_text().splitlines():
                if line.startswith(_PROBE_RESULT_PREFIX):
                    return json.loads(line.removeprefix(_PROBE_RESULT_PREFIX))
            failure = "rank 0 exited without reporting its timings"
        raise TestbedError(f"probe on {testbed.describe()}: {failure}{_stderr_report(ranks)}")


def _start_rank(host: Host, job: dict[str, str], logs: Path) -> _Rank:
    pythonpath = os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **job, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    env |= {"RANK": str(host.index), "GLOO_SOCKET_IFNAME": host.ifname}
    argv = host.wrap([sys.executable, "-c", "from gradsync.testbed import _probe_rank; _probe_rank()"])
    out, err = logs / f"rank{host.index}.out", logs / f"rank{host.index}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        # Its own session: killpg then reaches the rank and anything it started, and a terminal's
        # Ctrl-C reaches only us, whose cleanup kills the ranks.
        process = subprocess.Popen(
            _resolved(argv), env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    return _Rank(host.index, process, out, err)


def _wait_for_ranks(ranks: list[_Rank], timeout_s: float) -> str | None:
    """None once every rank exits 0; else what went wrong (the first failure, or the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = {rank.index: rank.process.poll() for rank in ranks}
        failed = [(index, code) for index, code in codes.items() if code not in (None, 0)]
        if failed:
            return f"rank {failed[0][0]} exited with status {failed[0][1]}; the others were killed"
        if all(code == 0 for code in codes.values()):
            return None
        if time.monotonic() > deadline:
            running = [index for index, code in codes.items() if code is None]
            return f"ranks {running} still running after timeout_s={timeout_s:g}; killed them"
        time.sleep(0.05)


def _kill(ranks: list[_Rank]) -> None:
    for rank in ranks:
        if rank.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.process.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rank.process.wait(timeout=_KILL_TIMEOUT_S)


def _stderr_report(ranks: list[_Rank]) -> str:
    parts = []
    for rank in ranks:
        text = rank.stderr.read_text(errors="replace").strip() if rank.stderr.exists() else ""
        if text:
            header = f"--- rank {rank.index} (exit {rank.process.returncode}) stderr, last 2000 chars ---"
            parts.append(f"\n{header}\n{text[-2000:]}")
    return "".join(parts) or "\n(no rank wrote to stderr)"


def _probe_rank() -> None:
    """One rank of probe(), run inside its host's namespace; its job comes from the environment."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only contend
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=float(os.environ["GSYNC_PROBE_TIMEOUT_S"])),
    )
    try:
        tensor = torch.ones(int(os.environ["GSYNC_PROBE_NUMEL"]))
        dist.all_reduce(tensor)  # warm-up: first touch of the buffers, TCP windows opened
        seconds = []
        for _ in range(int(os.environ["GSYNC_PROBE_REPEATS"])):
            dist.barrier()  # start together, so a repeat measures the transfer, not a straggler
            start = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - start)
        slowest = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(_PROBE_RESULT_PREFIX + json.dumps(slowest.tolist()), flush=True)
    finally:
        dist.destroy_process_group()
