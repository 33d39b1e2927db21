"""gradsync.lane.Lane: programs issue in the order they were asked for, and the lane's thread
never outlives the interpreter (a daemon thread killed at finalization often aborts the process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest
import torch
from torch.futures import Future

from gradsync.comm import CollectiveError, _end_to_end, completed
from gradsync.lane import Lane


def _lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gradsync-lane"]


def test_programs_issue_in_the_order_asked_whether_they_block_or_not() -> None:
    lane, issued = Lane(), []

    def program(label: str, wait_s: float = 0.0):
        def run() -> Future:
            time.sleep(wait_s)
            issued.append(label)
            return completed(torch.tensor(len(issued)))

        return run

    futures = [
        lane.run(program("a", 0.05), blocking=True),  # on the lane's thread: the rest queue behind it
        lane.run(program("b"), blocking=False),
        lane.run(program("c", 0.01), blocking=True),
        lane.run(program("d"), blocking=False),
    ]
    lane.drain()
    assert issued == ["a", "b", "c", "d"]
    assert [int(f.wait()) for f in futures] == [1, 2, 3, 4]
    lane.stop()


def test_after_a_program_fails_every_later_one_fails_naming_the_first_with_an_error_of_its_own() -> None:
    lane, issued = Lane(), []

    def dead_peer() -> Future:
        raise CollectiveError("all_to_all of 12 elements failed: Connection closed by peer")

    def fine() -> Future:
        issued.append("fine")
        return completed(torch.zeros(1))

    first = lane.run(dead_peer, blocking=True)
    later = [lane.run(fine, blocking=True), lane.run(fine, blocking=False), lane.run(fine, blocking=True)]
    lane.drain()
    with pytest.raises(RuntimeError) as original:  # a future shows a program's error as a RuntimeError
        first.wait()
    assert "Connection closed by peer" in str(original.value)
    errors = []
    for future in later:
        with pytest.raises(RuntimeError) as caught:
            future.wait()
        errors.append(caught.value)
    assert issued == []  # nothing after the failure was issued
    for error in errors:
        assert "not issued: an earlier exchange failed (CollectiveError: all_to_all of 12" in str(error)
    # Each its own: the first error is not raised again, so its traceback does not grow.
    failed = lane._failed
    assert isinstance(failed, CollectiveError)
    depth = len(traceback.extract_tb(failed.__traceback__))
    with pytest.raises(CollectiveError) as direct:
        lane._issue(fine)
    assert direct.value is not failed
    assert len(traceback.extract_tb(failed.__traceback__)) == depth
    lane.stop()


def test_stop_issues_what_is_queued_and_ends_the_thread() -> None:
    lane, issued = Lane(), []

    def slow() -> Future:
        time.sleep(0.05)
        issued.append("slow")
        return completed(torch.zeros(1))

    future = lane.run(slow, blocking=True)
    assert lane._thread is not None and lane._thread.is_alive()
    thread = lane._thread
    lane.stop()
    assert issued == ["slow"] and future.done()
    assert not thread.is_alive()
    # A stopped lane still runs what it is asked afterwards, on a thread that idles as before
    # (SyncState.close() stops it, and a closed state may go on training)...
    late = lane.run(slow, blocking=True)
    late.wait()
    assert issued == ["slow", "slow"]
    idle = lane._thread
    lane.drain()
    time.sleep(0.2)  # a thread that ends once its queue is empty would have ended by now
    assert idle is not None and idle.is_alive()
    # ... but after a stop for good (at interpreter exit), on one that ends once its queue is empty.
    lane.stop(for_good=True)
    assert not idle.is_alive()
    lane.run(slow, blocking=True).wait()
    deadline = time.monotonic() + 5
    while lane._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane._thread is None


def test_no_lane_thread_is_left_when_the_interpreter_exits() -> None:
    # An exit handler registered before gradsync's runs after it (they run last in, first out):
    # it sees which threads gradsync left for the interpreter's finalization to kill.
    script = textwrap.dedent(
        """
        import atexit, threading
        atexit.register(lambda: print("left:", sorted(t.name for t in threading.enumerate())))
        import torch
        from gradsync.comm import completed
        from gradsync.lane import Lane
        lane = Lane()
        lane.run(lambda: completed(torch.zeros(1)), blocking=True).wait()
        print("alive:", [t.name for t in threading.enumerate()])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "gradsync-lane" in done.stdout.split("alive:")[1].splitlines()[0], done.stdout
    assert "left: ['MainThread']" in done.stdout, done.stdout


def test_parts_end_to_end_in_one_buffer_are_sent_from_it_and_others_are_concatenated() -> None:
    # TorchComm.all_to_all sends one tensor: two-shot's frames, slices of one buffer, need no copy.
    buffer = torch.arange(10.0)
    adjacent = list(buffer[2:].split([3, 0, 5]))
    joined = _end_to_end(adjacent)
    assert joined.data_ptr() == buffer[2:].data_ptr() and torch.equal(joined, buffer[2:])
    for parts in (
        [buffer[:3], buffer[4:6]],  # a gap
        [buffer[5:], buffer[:5]],  # out of order
        [buffer[:3], torch.arange(2.0)],  # another buffer
        [buffer[:4:2], buffer[4:6]],  # not contiguous
    ):
        joined = _end_to_end(parts)
        assert torch.equal(joined, torch.cat(parts))
        assert joined.data_ptr() != buffer.data_ptr()


def _numbered(issued: list[int], running: list[int], overlaps: list[bool], lock: threading.Lock):
    """Programs that note their label as they issue, and whether another was issuing meanwhile."""

    def program(label: int):
        def run() -> Future:
            with lock:
                running[0] += 1
                overlaps.append(running[0] > 1)
            time.sleep(0.0002 * (label % 3))
            issued.append(label)
            with lock:
                running[0] -= 1
            return completed(torch.tensor(label))

        return run

    return program


def _all_done(futures: list[Future], within_s: float) -> bool:
    """Whether every future completed within `within_s` (not drain() or wait(): a program left
    queued with no thread to serve it would hang them)."""
    deadline = time.monotonic() + within_s
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.001)
    return all(f.done() for f in futures)


def test_a_program_asked_for_as_the_idle_thread_ends_starts_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The lane's thread ends after idling, while the hook may be asking for the next program.
    # Here each thread, once it has given up, stays alive until the next program was asked for:
    # that program must start a new thread, not be queued for the one that is ending.
    monkeypatch.setattr("gradsync.lane._IDLE_S", 0.001)
    gave_up, asked = threading.Event(), threading.Event()
    serve = Lane._serve

    def serve_then_linger(self: Lane) -> None:
        serve(self)
        gave_up.set()
        asked.wait(timeout=10)

    monkeypatch.setattr(Lane, "_serve", serve_then_linger)
    lane, issued, overlaps = Lane(), [], []
    program = _numbered(issued, [0], overlaps, threading.Lock())
    try:
        for label in range(20):
            if label:
                assert gave_up.wait(timeout=10)  # the last program's thread is ending, still alive
                gave_up.clear()
            future = lane.run(program(label), blocking=True)
            asked.set()  # the ending thread may go now; the next one lingers in its turn
            asked.clear()
            assert _all_done([future], 10), f"program {label} was left queued for a thread that ended"
    finally:
        asked.set()
        lane.stop()
    assert issued == list(range(20)) and not any(overlaps)


def test_stopping_the_lane_while_programs_are_asked_for_loses_none_and_never_runs_two() -> None:
    # SyncState.close() stops the lane, and a closed state may go on training: programs asked for
    # meanwhile are served by the thread being stopped or by a new one, in order, one at a time.
    lane, issued, overlaps = Lane(), [], []
    program = _numbered(issued, [0], overlaps, threading.Lock())
    stopping = threading.Event()

    def stop_again_and_again() -> None:
        while not stopping.is_set():
            lane.stop(timeout_s=1.0)
            time.sleep(0.0005)

    stopper = threading.Thread(target=stop_again_and_again, daemon=True)
    stopper.start()
    futures = []
    try:
        for label in range(300):
            futures.append(lane.run(program(label), blocking=label % 4 != 0))
            if label % 10 == 9:
                assert _all_done(futures, 10), "a program was left queued with no thread to serve it"
    finally:
        stopping.set()
        stopper.join(timeout=10)
    assert issued == list(range(300))
    assert [int(f.value()) for f in futures] == list(range(300))
    assert not any(overlaps)
    lane.stop()
