"""Lane: a SyncState's exchanges issued in the order they were asked for, on every rank alike.

An exchange is issued on the hook's thread where nothing waits, or on the lane's own thread where
it must wait for one collective before it can issue the next (PowerSGD's rounds, a size exchange,
the sparse schemes), so that the backward pass never waits for it.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.futures import Future

from .comm import CollectiveError, forward, let_go_of_groups

_IDLE_S = 60.0  # how long the lane's thread waits for a program before it ends


class Lane:
    """Issues a SyncState's exchanges in the order they were asked for, on every rank alike.

    An exchange is a program: a function that issues its collectives and returns the future of
    its result. A program that never waits runs at once, on the caller's thread, when nothing is
    queued; one that waits for a collective before issuing the next (blocking) runs on the lane's
    own thread, and every program asked for after it queues behind it. So the caller (DDP's
    backward pass) never waits, and the collectives go out in the same order on every rank.

    drain() returns once every program asked for has issued all its collectives: the hook calls it
    at a step's last bucket, so nothing of gradsync is still being issued when DDP or the user
    issue collectives of their own. After a program fails as it issues (a collective it waited
    on failed), every later one fails with its error: its peers are gone, and waiting for each
    collective's timeout in turn would only delay the error. A collective that fails later,
    through the future a program returned, fails that exchange alone (SyncState names it).
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[[], Future], Future]] = deque()
        self._busy = False
        self._failed: BaseException | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        _LANES.add(self)

    def run(
        self, program: Callable[[], Future], blocking: bool, device: torch.device | None = None
    ) -> Future:
        """The future of `program`'s result, issued after every program asked for before it."""
        with self._changed:
            inline = not blocking and not self._queue and not self._busy
            if inline:
                self._busy = True
            else:
                out: Future = Future(
                    devices=[device] if device is not None and device.type == "cuda" else None
                )
                self._queue.append((program, out))
                self._start()
                self._changed.notify_all()
        if not inline:
            return out
        try:
            return self._issue(program)
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()

    def drain(self) -> None:
        """Wait until every program asked for so far has issued its collectives."""
        with self._changed:
            self._changed.wait_for(lambda: not self._queue and not self._busy)

    def _issue(self, program: Callable[[], Future]) -> Future:
        failed = self._failed
        if failed is not None:
            # A new error each time, naming the first: raising that one again would name it as
            # this exchange's (SyncState adds the bucket and step it is raised for) and grow its
            # traceback with every later program, keeping their frames and buffers alive.
            kind = CollectiveError if isinstance(failed, CollectiveError) else RuntimeError
            raise kind(f"not issued: an earlier exchange failed ({type(failed).__name__}: {failed})")
        try:
            return program()
        except BaseException as error:
            self._failed = error
            raise

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name="gradsync-lane", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0, *, for_good: bool = False) -> None:
        """End the lane's thread once what is queued has been issued; wait for it at most
        `timeout_s`. A later program starts a thread again, which idles as before unless the lane
        was stopped `for_good` (at interpreter exit): then each ends once its queue is empty."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=max(timeout_s, 0.0))
        if not for_good:
            with self._changed:  # a thread started since, or still running, idles as before
                self._stopping = False

    def _serve(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: (self._queue and not self._busy) or (self._stopping and not self._queue),
                    timeout=_IDLE_S,
                )
                if not self._queue:  # idle for a while, or stopped: a later program starts a new one
                    self._thread = None
                    return
                if self._busy:
                    continue
                program, out = self._queue.popleft()
                self._busy = True
            try:
                forward(self._issue(program), out)
            except BaseException as error:
                out.set_exception(error)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


# Every lane, so that their threads end before the interpreter does. A daemon thread still waiting
# when Python finalizes is killed inside the C runtime, and the process then often aborts
# ("terminate called without an active exception"): measured, 13 of 30 runs of a 2-rank torchrun
# script that ended without destroy_process_group, 0 of 30 with the lanes' threads ended first.
_LANES: weakref.WeakSet[Lane] = weakref.WeakSet()


@atexit.register
def _stop_lanes() -> None:
    deadline = time.monotonic() + 10.0  # one bound for all: a lane stuck in a collective delays exit once
    for lane in list(_LANES):
        lane.stop(deadline - time.monotonic(), for_good=True)
    let_go_of_groups(max(deadline - time.monotonic(), 0.0))
