"""gradsync.comm.settle: a collective's completion callback runs every later step of its exchange
on the thread that completes it (gloo's worker), and settle() returns only once that thread has
dropped it. A process group destroyed before then, by a thread that holds the GIL, waits forever
for that worker: the hang this prevents."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.futures import Future

from gradsync.comm import CollectiveError, _outcome, settle, then


class _Work:
    """A collective's work whose completion the test controls, as gloo's worker would."""

    def __init__(self) -> None:
        self.future: Future = Future()

    def get_future(self) -> Future:
        return self.future


def test_settle_waits_for_every_step_a_completion_runs_on_the_completing_thread() -> None:
    work, tensor, steps = _Work(), torch.ones(4), []

    def slow_decode(value: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)  # a decode into the bucket, on the worker's thread
        steps.append(threading.current_thread().name)
        return value * 2

    result = then(_outcome(work, "allreduce", tensor, lambda: tensor), slow_decode)  # type: ignore[arg-type]
    assert not settle(timeout_s=0.05), "a callback not yet run counts as held"

    worker = threading.Thread(target=work.future.set_result, args=(None,), name="worker")
    worker.start()
    assert settle(timeout_s=5.0)
    assert steps == ["worker"], "settle returned before the callback's later steps had run"
    assert torch.equal(result.wait(), torch.full((4,), 2.0))
    worker.join()


def test_a_failed_collective_is_settled_too() -> None:
    work, tensor = _Work(), torch.ones(2)
    out = _outcome(work, "allgather", tensor, lambda: tensor)  # type: ignore[arg-type]
    work.future.set_exception(RuntimeError("peer gone"))
    assert settle(timeout_s=1.0)
    with pytest.raises(CollectiveError, match="allgather of 2 float32 elements failed: peer gone"):
        out.wait()
