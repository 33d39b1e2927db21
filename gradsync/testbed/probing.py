"""Probing a testbed: the bandwidth a real gloo allreduce achieves, one rank process per host.

probe() starts one child per host inside its namespace (running _probe_rank), waits for all of
them under a deadline, kills them whatever happens, and reads rank 0's timings from its stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .layout import Host, Testbed, TestbedError
from .netns import _resolved, _run

# Bound on waiting for a killed rank to exit.
_KILL_TIMEOUT_S = 5.0

# Seconds of the configured rate a default probe's allreduce lasts at most: long enough that a
# shaped link's burst allowance (32 KiB, or 1 ms of its rate) does not count, short enough for
# slow links.
_PROBE_S = 2.0

_PROBE_RESULT_PREFIX = "GSYNC_PROBE_SECONDS "
_REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def probe(
    testbed: Testbed, megabytes: float | None = None, repeats: int = 3, timeout_s: float | None = None
) -> float:
    """Ring "bus bandwidth" in bits/s of a gloo allreduce of `megabytes` MB (1e6 bytes) of float32,
    one rank per host: 8 * bytes * 2(n-1)/n / median seconds, the per-link rate the ring achieved.

    Each rank does a warm-up allreduce, then `repeats` timed ones; a repeat's time is the slowest
    rank's. Children are killed on failure or after `timeout_s`; failure raises TestbedError with
    their stderr. By default the allreduce is 64 MB, or what the configured rate moves in about
    _PROBE_S seconds where that is less (a slow link), and the deadline leaves room for 4 times
    the time the rate allows.
    """
    world_size = len(testbed.hosts)
    if world_size < 2:
        raise ValueError(f"probe needs at least 2 hosts to allreduce between; this testbed has {world_size}")
    positive = [value is None or value > 0 for value in (megabytes, timeout_s)]
    if not (all(positive) and isinstance(repeats, int) and repeats >= 1):
        raise ValueError(
            f"megabytes={megabytes}, repeats={repeats}, timeout_s={timeout_s} must all be positive "
            "(repeats an integer >= 1) or None (sized from the link's rate), "
            "e.g. probe(testbed, megabytes=64, repeats=3, timeout_s=120)"
        )
    sized_megabytes, sized_timeout_s = _sized(testbed.bandwidth_bits_per_s, world_size, repeats, megabytes)
    megabytes = sized_megabytes if megabytes is None else megabytes
    timeout_s = sized_timeout_s if timeout_s is None else timeout_s
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


def _sized(
    bits_per_s: float, world_size: int, repeats: int, megabytes: float | None = None
) -> tuple[float, float]:
    """The default probe's allreduce size in MB (64, or what `bits_per_s` moves in _PROBE_S
    seconds where less) and its deadline: 4 times the time the rate allows for the warm-up and the
    `repeats` allreduces of `megabytes` (the default size where None), and at least 120 s."""
    per_link = 2 * (world_size - 1) / world_size  # bytes each link carries per byte reduced
    default = min(64.0, bits_per_s / 8 * _PROBE_S / per_link / 1e6)
    expected_s = (repeats + 1) * 8 * (megabytes or default) * 1e6 * per_link / bits_per_s
    return default, max(120.0, 4 * expected_s)


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
    code = "from gradsync.testbed.probing import _probe_rank; _probe_rank()"
    argv = host.wrap([sys.executable, "-c", code])
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
            return (
                f"ranks {running} still running after timeout_s={timeout_s:g}; killed them (a link "
                "slower than it was shaped? probe a smaller megabytes, or skip the probe: --no-probe)"
            )
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
