"""Testbed: unit parsing and the command plan (always); real namespaces, shaping and teardown (as root)."""

import dataclasses
import ipaddress
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync import testbed as tb
from gradsync.testbed import probing
from gradsync.testbed import state as tb_state

SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
REPO_ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------------------
# Pure


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 1e9), ("100mbit", 1e8), ("2.5gbit", 2.5e9), ("1000000bit", 1e6), ("64kbit", 64e3),
        ("1GBit", 1e9), (" 200Mbit ", 2e8), ("1000000", 1e6), ("1mibit", 2**20), ("1mbps", 8e6),
    ],
)  # fmt: skip
def test_parse_bandwidth_reads_tc_rate_units(text, bps):
    assert tb.parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    "text", ["fast", "", "1 gigabit", "gbit", "-1gbit", "0mbit", "1e400gbit", "1.2.3mbit"]
)
def test_parse_bandwidth_rejects_non_rates_naming_value_and_examples(text):
    with pytest.raises(ValueError, match=r"bandwidth .*'1gbit'") as caught:
        tb.parse_bandwidth(text)
    assert repr(text) in str(caught.value)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("0.2ms", 0.2),
        ("200us", 0.2),
        ("1s", 1000.0),
        ("0", 0.0),
        ("0.5MS", 0.5),
        ("3 msec", 3.0),
        ("0us", 0.0),
    ],
)
def test_parse_latency_reads_us_ms_s_as_milliseconds(text, ms):
    assert tb.parse_latency(text) == pytest.approx(ms)


@pytest.mark.parametrize("text", ["-1ms", "-0.2ms", "5", "fast", "1h", "", "ms"])
def test_parse_latency_rejects_negative_bare_or_unknown(text):
    with pytest.raises(ValueError, match=r"latency .*'0.2ms'") as caught:
        tb.parse_latency(text)
    assert repr(text) in str(caught.value)


def _namespace_of(argv: list[str]) -> str:
    """The namespace a planned command acts in; fails the test if it would act on the root namespace."""
    if argv[:3] == ["ip", "netns", "add"]:
        return argv[3]
    assert argv[0] in ("ip", "tc") and argv[1] == "-n", f"not confined to a namespace: {argv}"
    return argv[2]


@pytest.mark.parametrize("hosts", [2, 3])
def test_plan_acts_only_inside_gsync_namespaces_with_private_addresses(hosts):
    plan = tb.plan_commands(hosts, 1e9, 0.2)
    namespaces = {_namespace_of(argv) for argv in plan}
    assert namespaces == {"gsync-sw", *(f"gsync-h{i}" for i in range(hosts))}
    # A veth is created inside its host namespace with its peer placed straight in the switch's.
    veths = [argv for argv in plan if argv[3:5] == ["link", "add"] and "veth" in argv]
    assert len(veths) == hosts
    for argv in veths:
        assert argv[2].startswith("gsync-h") and argv[argv.index("netns") + 1] == "gsync-sw"
    # Every address in the plan is in the private subnet, one per host, none shared.
    addresses = [argv[argv.index("add") + 1] for argv in plan if argv[3:5] == ["addr", "add"]]
    interfaces = [ipaddress.ip_interface(address) for address in addresses]
    assert len(set(interfaces)) == hosts and all(i.network == SUBNET for i in interfaces)
    ips = [token for argv in plan for token in argv if token[:1].isdigit() and token.count(".") == 3]
    assert all(ipaddress.ip_interface(token).ip in SUBNET for token in ips)
    for i in range(hosts):
        assert ["ip", "-n", f"gsync-h{i}", "link", "set", "lo", "up"] in plan


@pytest.mark.parametrize("hosts", [2, 3])
def test_plan_shapes_both_directions_of_every_link_to_rate_and_half_latency(hosts):
    plan = tb.plan_commands(hosts, 2.5e8, 0.3)
    tbf = [argv for argv in plan if "tbf" in argv]
    netem = [argv for argv in plan if "netem" in argv]
    ends = {(f"gsync-h{i}", "eth0") for i in range(hosts)} | {
        ("gsync-sw", f"veth-h{i}") for i in range(hosts)
    }
    for qdiscs in (tbf, netem):
        assert {(argv[2], argv[argv.index("dev") + 1]) for argv in qdiscs} == ends
        assert len(qdiscs) == len(ends)
    assert all(argv[argv.index("rate") + 1] == "250000000bit" for argv in tbf)
    assert all(argv[argv.index("delay") + 1] == "150us" for argv in netem)  # half of 0.3 ms each way


def test_plan_without_latency_has_no_netem_and_still_shapes():
    plan = tb.plan_commands(2, 1e9, 0.0)
    assert not any("netem" in argv for argv in plan)
    assert sum("tbf" in argv for argv in plan) == 4


@pytest.mark.parametrize("hosts", [0, 255])
def test_plan_rejects_host_counts_outside_the_subnet(hosts):
    with pytest.raises(ValueError, match=f"hosts={hosts}"):
        tb.plan_commands(hosts, 1e9, 0.2)


def _testbed(hosts: int = 4) -> tb.Testbed:
    return tb.Testbed(
        tuple(tb.Host(i, f"gsync-h{i}", "eth0", f"10.213.0.{i + 1}") for i in range(hosts)), 1e9, 0.2
    )


def test_testbed_round_trips_through_json_and_describes_itself():
    testbed = _testbed(4)
    assert tb.Testbed.from_dict(json.loads(json.dumps(testbed.to_dict()))) == testbed
    assert testbed.describe() == "4 hosts, 1 Gbit/s per link, 0.2 ms one-way latency (netns gsync-h0..h3)"
    assert testbed.hosts[2].wrap(["python", "-c", "pass"]) == [
        "ip", "netns", "exec", "gsync-h2", "python", "-c", "pass",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="bandwidth_bits_per_s"):
        tb.Testbed.from_dict({"hosts": []})


def test_a_testbed_whose_owner_exited_is_stale():
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    owner = {"pid": finished.pid, "start": 0}
    state = {"owner": owner, "complete": True, "namespaces": ["gsync-sw"]}
    assert f"pid {finished.pid}" in tb._stale_reason(state, ["gsync-sw"])
    alive = {"owner": None, "complete": True, "namespaces": ["gsync-sw", "gsync-h0"]}
    assert tb._stale_reason(alive, ["gsync-sw", "gsync-h0"]) is None
    assert "gone" in tb._stale_reason(alive, ["gsync-sw"])


# ------------------------------------------------------------------------------------------------
# Real namespaces (root)

# This kernel may lack netem; the tests below are about rate and teardown, not latency.
no_netem_warning = pytest.mark.filterwarnings("ignore:latency .* is not emulated")


@pytest.fixture
def root_testbed():
    """Skips unless a testbed can be built and none is up; removes whatever a failed test left."""
    reason = tb.available()
    if reason is not None:
        pytest.skip(f"no testbed: {reason}")
    if _netns() or tb.state_path().exists():
        pytest.skip(f"gsync-* namespaces or {tb.state_path()} exist already; these tests would remove them")
    yield
    tb.down()


def _netns() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True)
    return sorted(line.split()[0] for line in listed.stdout.splitlines() if line.startswith("gsync-"))


def _root_links() -> set[str]:
    listed = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10, check=True
    )
    return {line.split(":")[1].strip().split("@")[0] for line in listed.stdout.splitlines()}


def _pids_in(netns: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10)
    return listed.stdout.split()


@no_netem_warning
def test_session_probe_measures_the_shaped_rate_and_leaves_nothing(root_testbed):
    links_before = _root_links()
    with tb.session(2, "200mbit", "0.2ms") as testbed:
        assert _netns() == ["gsync-h0", "gsync-h1", "gsync-sw"]
        assert _root_links() == links_before  # the whole network lives inside the namespaces
        assert tb.current() == testbed
        bandwidth_bits_per_s = tb.probe(testbed, megabytes=8, repeats=3)
    # Shaped: never above the rate (unshaped veth pairs move gigabits), and not far below it; how
    # far below depends on what else the 2 cores run meanwhile (126 Mbit/s measured once beside
    # other work), so the lower bound only catches a rate shaped in the wrong unit.
    assert 0.5 * 200e6 < bandwidth_bits_per_s < 1.15 * 200e6
    assert _netns() == []
    assert _root_links() == links_before
    assert not tb.state_path().exists() and tb.current() is None


@no_netem_warning
def test_an_exception_inside_the_session_still_tears_everything_down(root_testbed):
    with pytest.raises(RuntimeError, match="boom"), tb.session(3, "100mbit", "0.2ms"):
        assert len(_netns()) == 4
        raise RuntimeError("boom")
    assert _netns() == []
    assert not tb.state_path().exists()
    assert tb.down() == []  # idempotent


def _start_session_child(hosts: int = 2) -> subprocess.Popen:
    """A process that builds a testbed with session(), says "ready", then sleeps inside the block.

    It has a SIGTERM handler of its own that only reports, as a training runner might. It takes
    SIGINT as an interactive Python does: a shell without job control starts background commands
    (`make test &`) with SIGINT ignored, the child inherits that, and session() rightly leaves an
    ignored signal ignored."""
    code = (
        "import signal, time\nfrom gradsync.testbed import session\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('own handler ran', flush=True))\n"
        f"with session({hosts}, '100mbit', '0'):\n    print('ready', flush=True)\n    time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT
    )
    ready, _, _ = select.select([child.stdout], [], [], 30)
    line = child.stdout.readline() if ready else ""
    if line.strip() != "ready":
        child.kill()
        pytest.fail(f"session child did not become ready: {line!r} {child.stderr.read()}")
    return child


# SIGTERM becomes SystemExit(143); an uncaught KeyboardInterrupt ends Python by re-raising SIGINT.
@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)]
)
def test_sigterm_or_sigint_during_a_session_tears_it_down(root_testbed, signum, status):
    child = _start_session_child()
    assert len(_netns()) == 3
    child.send_signal(signum)
    try:
        code = child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail(f"the session child still ran 30 s after signal {signum}: {child.communicate()}")
    assert code == status, child.stderr.read()
    assert ("own handler ran" in child.stdout.read()) == (signum == signal.SIGTERM)  # chained, not replaced
    assert _netns() == []
    assert not tb.state_path().exists()


def test_a_sigkilled_owner_leaves_a_stale_testbed_that_up_detects_and_replaces(root_testbed):
    child = _start_session_child(hosts=3)
    child.kill()
    child.wait(timeout=10)
    assert len(_netns()) == 4 and tb.current() is None  # left behind, and known to be stale
    with pytest.warns(UserWarning, match=rf"stale testbed \(its owner, pid {child.pid}, has exited\)"):
        testbed = tb.up(2, "100mbit", "0")
    assert _netns() == ["gsync-h0", "gsync-h1", "gsync-sw"]  # gsync-h2 of the dead testbed is gone
    assert tb.current() == testbed
    assert tb.down() == ["gsync-h0", "gsync-h1", "gsync-sw"]
    assert _netns() == []


def test_up_removes_gsync_namespaces_no_state_explains(root_testbed):
    subprocess.run(["ip", "netns", "add", "gsync-h7"], check=True, timeout=10)
    with pytest.warns(UserWarning, match=r"stale namespaces \['gsync-h7'\]"):
        tb.up(2, "100mbit", "0", persistent=True)
    assert _netns() == ["gsync-h0", "gsync-h1", "gsync-sw"]
    with pytest.raises(tb.TestbedError, match="already up"):
        tb.up(2, "100mbit", "0")
    assert _netns() == ["gsync-h0", "gsync-h1", "gsync-sw"]  # the refusal left the live one alone
    tb.down()


def test_a_testbed_another_running_process_owns_is_not_reused_and_up_says_to_wait(root_testbed):
    # A second benchmark on it would lose its network when the owner's run ends and removes it.
    built = tb.up(2, "100mbit", "0", persistent=True)
    owner = subprocess.Popen(["sleep", "60"])
    try:
        tb_state._write_state(built, tb_state._process_identity(owner.pid), complete=True)
        assert tb.current() is None
        with pytest.raises(tb.TestbedError, match=rf"built for the run of pid {owner.pid}.*wait for it"):
            tb.up(2, "100mbit", "0")
        assert _netns() == ["gsync-h0", "gsync-h1", "gsync-sw"]  # the owner's testbed is left alone
        tb_state._write_state(built, tb_state._process_identity(os.getpid()), complete=True)
        assert tb.current() == built  # this process's own
    finally:
        owner.kill()
        owner.wait(timeout=10)


def test_a_reader_who_cannot_write_run_finds_roots_record_there(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(tb_state, "_RUN", run)
    monkeypatch.setattr(tb_state.os, "access", lambda path, mode: False)  # not root
    assert tb_state.state_path().parent != run  # nothing recorded: the temp directory
    (run / "gradsync-testbed.json").write_text("{}")  # root's record
    assert tb_state.state_path() == run / "gradsync-testbed.json"


def test_probe_whose_rank_cannot_start_raises_with_its_stderr_and_leaves_nothing(root_testbed):
    with tb.session(2, "100mbit", "0") as testbed:
        broken = dataclasses.replace(testbed.hosts[1], netns="gsync-missing")
        started = time.monotonic()
        with pytest.raises(tb.TestbedError, match=r"(?s)rank 1 exited.*gsync-missing"):
            tb.probe(dataclasses.replace(testbed, hosts=(testbed.hosts[0], broken)), timeout_s=60)
        assert time.monotonic() - started < 30  # rank 0 was killed, not left to its gloo timeout
        assert _pids_in("gsync-h0") == []
    assert _netns() == []


def test_probe_past_its_timeout_kills_the_ranks_and_raises(root_testbed):
    with tb.session(2, "10mbit", "0") as testbed:
        with pytest.raises(tb.TestbedError, match=r"still running after timeout_s=3.*--no-probe"):
            tb.probe(testbed, megabytes=64, repeats=1, timeout_s=3)  # ~55 s of traffic at 10 Mbit/s
        assert _pids_in("gsync-h0") == [] and _pids_in("gsync-h1") == []
    assert _netns() == []


def test_a_default_probe_of_a_slow_link_is_sized_to_finish_and_measures_its_rate(root_testbed):
    # 64 MB at 10 Mbit/s would take 51 s per allreduce, past the fixed 120 s deadline of old.
    with tb.session(2, "10mbit", "0") as testbed:
        megabytes, timeout_s = probing._sized(testbed.bandwidth_bits_per_s, 2, 3)
        assert megabytes * 1e6 * 8 / 10e6 == pytest.approx(probing._PROBE_S)  # one allreduce's share
        started = time.monotonic()
        measured = tb.probe(testbed)
        assert time.monotonic() - started < timeout_s / 4 + 15
        assert 0.5 * 10e6 < measured < 1.15 * 10e6


def test_the_default_probe_is_64_mb_on_fast_links_and_its_deadline_covers_what_it_sends() -> None:
    assert probing._sized(1e9, 4, 3)[0] == 64.0
    for bits_per_s, world in [(1e9, 4), (20e6, 4), (1e6, 8)]:
        megabytes, timeout_s = probing._sized(bits_per_s, world, 3)
        sent_bits = 4 * 8 * megabytes * 1e6 * 2 * (world - 1) / world  # warm-up and 3 repeats, per link
        assert sent_bits / bits_per_s <= 4 * probing._PROBE_S + 1e-9
        assert timeout_s >= max(120.0, 4 * sent_bits / bits_per_s) - 1e-9
    # An explicit size gets a deadline for its own traffic.
    assert probing._sized(10e6, 2, 1, megabytes=64)[1] == pytest.approx(4 * 2 * 64e6 * 8 / 10e6)


def test_up_that_fails_midway_removes_what_it_built_and_names_the_command(root_testbed, monkeypatch):
    plan = tb.plan_commands

    def plan_with_a_bad_last_step(*args):
        return [*plan(*args), ["ip", "-n", "gsync-h1", "link", "set", "no-such-dev", "up"]]

    monkeypatch.setattr(tb, "plan_commands", plan_with_a_bad_last_step)
    with pytest.raises(
        tb.TestbedError, match=r"`ip -n gsync-h1 link set no-such-dev up` failed .*no-such-dev"
    ):
        tb.up(2, "100mbit", "0")
    assert _netns() == []
    assert not tb.state_path().exists()


def test_the_cli_reports_a_testbed_error_as_one_line_and_fails(monkeypatch, capsys):
    from gradsync.cli import main

    message = "down() needs root to delete network namespaces (euid is 1000); run it as root"

    def refuse() -> list[str]:
        raise tb.TestbedError(message)

    monkeypatch.setattr(tb, "down", refuse)
    assert main(["testbed", "down"]) == 1
    assert capsys.readouterr().err.strip() == f"gradsync: error: {message}"  # no traceback
