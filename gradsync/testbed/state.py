"""The state file that records the live testbed and its owner, its lock, and stale-testbed cleanup.

A testbed whose owner (or, while being built, builder) has died, or whose namespaces are gone, is
stale; so are gsync-* namespaces no state file records. _clean_stale removes both, with a warning,
under _state_lock, which serialises up/down/available across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .layout import SWITCH_NETNS, Testbed, TestbedError
from .netns import _delete_namespaces, _namespaces

# Bound on waiting for the state lock.
_LOCK_TIMEOUT_S = 60.0


_RUN = Path("/run")


def state_path() -> Path:
    """Where the live testbed is recorded: /run where root can write it (the testbed needs root),
    else the system temp directory. A reader without root, who cannot write /run, still finds
    root's record there (`gradsync testbed status` as a user)."""
    recorded = _RUN / "gradsync-testbed.json"
    if _RUN.is_dir() and (os.access(_RUN, os.W_OK) or recorded.exists()):
        return recorded
    return Path(tempfile.gettempdir()) / "gradsync-testbed.json"


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
