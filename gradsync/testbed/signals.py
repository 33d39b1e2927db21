"""The signal guard of session(): SIGINT/SIGTERM/SIGHUP become exceptions, so the teardown runs.

While the teardown itself runs, the guard holds signals back and raises the pending one after.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any


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
