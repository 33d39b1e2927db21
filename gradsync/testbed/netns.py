"""Running ip/tc: resolving the tools, one bounded command, and listing or deleting gsync-* namespaces.

Every command the testbed runs goes through _run, so a failure always names the command and its
stderr as a TestbedError.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import subprocess
import warnings

from .layout import PREFIX, TestbedError

# Bound on one ip/tc command.
_COMMAND_TIMEOUT_S = 15.0


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
