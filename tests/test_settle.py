"""gradsync.comm.settle: a collective's completion callback runs every later step of its exchange
on the thread that completes it (gloo's worker), and settle() returns only once that thread has
dropped it. A process group destroyed before then, by a thread that holds the GIL, waits forever
for that worker: the hang this prevents."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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
    assert settle(timeout_s=1.0), "a callback of an earlier test is still held: the count is process-wide"
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
    assert settle(timeout_s=1.0), "a callback of an earlier test is still held: the count is process-wide"
    work, tensor = _Work(), torch.ones(2)
    out = _outcome(work, "allgather", tensor, lambda: tensor)  # type: ignore[arg-type]
    work.future.set_exception(RuntimeError("peer gone"))
    assert settle(timeout_s=1.0)
    with pytest.raises(CollectiveError, match="allgather of 2 float32 elements failed: peer gone"):
        out.wait()


def test_a_result_that_cannot_be_read_fails_the_future_instead_of_leaving_it_pending() -> None:
    # torch only logs an error raised by a done-callback: the future it should complete would
    # then never complete, and DDP would wait on it with no timeout.
    work, tensor = _Work(), torch.ones(2)

    def unreadable() -> torch.Tensor:
        raise ValueError("decoded into the wrong shape")

    out = _outcome(work, "allreduce", tensor, unreadable)  # type: ignore[arg-type]
    work.future.set_result(None)
    assert out.done()
    with pytest.raises(RuntimeError, match="reading the result of allreduce failed") as raised:
        out.wait()
    assert "ValueError: decoded into the wrong shape" in str(raised.value)  # its traceback, as text
    assert settle(timeout_s=1.0)


def test_at_exit_the_callbacks_are_settled_and_the_groups_let_go() -> None:
    # A script that trains over gloo and destroys its group right after its last step, as one
    # ends. An exit handler registered before gradsync's runs after it (last in, first out): it
    # sees what gradsync left for the interpreter's finalization.
    script = textwrap.dedent(
        """
        import atexit, os, sys
        def left():
            comm = sys.modules["gradsync.comm"]
            print("left:", comm._Running.count, len(comm._KEPT))
        atexit.register(left)
        import torch, torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel
        import gradsync
        import gradsync.comm as comm
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        model = DistributedDataParallel(nn.Linear(8, 4))
        gradsync.register(model, gradsync.SyncConfig(min_compress_numel=0, warmup_steps=2))
        for _ in range(4):
            model(torch.ones(2, 8)).sum().backward()
        print("kept:", len(comm._KEPT))
        dist.destroy_process_group()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kept: 1" in done.stdout, done.stdout
    assert "left: 0 0" in done.stdout, done.stdout
