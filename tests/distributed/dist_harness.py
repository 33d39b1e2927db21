"""Run a function on N gloo ranks, one process each, and collect what they return.

    results = run_ranks(worker, world_size=4, args=(...,))   # results[r] is rank r's return value

`worker(rank, world_size, *args)` must be a picklable top-level function. Each rank runs it in a
fresh process with torch.set_num_threads(1), inside an initialized gloo process group over
127.0.0.1, and the process group is destroyed afterwards whatever happens. The processes are forked
by multiprocessing's forkserver, whose server imported torch, gradsync and this module once: a
spawned interpreter imports them again, about 2.5 s of CPU per rank, most of a short test's time
where 4 ranks share 2 cores. Nothing of the test process's state reaches a rank but its arguments
(the server forks from a clean import, as spawn would start one).

The rendezvous is a TCPStore that the test process itself hosts on a port the OS picks (port 0),
so two runs never contend for a port. A rank's exception fails the test with that rank's
traceback; a run that does not finish within `timeout_s` (a hang) is killed and fails the test
instead of blocking CI.

Also here: the small model, data and helpers that several distributed tests share.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync

HOST = "127.0.0.1"
# After one rank fails, the others get this long to report their own error before they are
# killed: they are usually stuck in a collective that the failed rank will never join.
_GRACE_S = 3.0


class RankError(AssertionError):
    """A rank raised, died or hung; the message carries every rank's report."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 90.0,
    pg_timeout_s: float | None = None,
    may_die: Sequence[int] = (),
    backend: str = "gloo",
) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; their results in rank order.

    `pg_timeout_s`: the process group's timeout (init_process_group(timeout=...)), how long a
    collective waits for its peers; default `timeout_s`. Ranks in `may_die` may end without a
    report (a test that kills one): their result is None. `backend`: "nccl" for one rank per GPU.
    """
    __tracebackhide__ = True  # a failure shows the ranks' tracebacks, not this harness
    ctx = mp.get_context("forkserver")
    # Taken when the server starts (the first run). Python 3.11's server ignores the test process's
    # sys.path, so this module may not import there (skipped silently): what it imports is named.
    ctx.set_forkserver_preload(["torch", "gradsync", "pytest", __name__])
    results: queue.Queue = ctx.Queue()
    # The test process hosts the rendezvous store on a port the OS chose, and holds it until the
    # ranks are done: no free-port race with other runs, even concurrent ones.
    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, store.port, pg_timeout_s or timeout_s, tuple(args), results, backend),
            name=f"gloo-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    reports = None
    try:
        for proc in procs:
            proc.start()
        reports = _collect(procs, results, time.monotonic() + timeout_s, timeout_s, set(may_die))
    finally:
        # Ranks that reported exit by themselves; after a failure the others are stuck: kill them.
        _stop(procs, grace_s=5.0 if reports is not None else 0.0)
        results.close()
        del store
    return [reports.get(rank) for rank in range(world_size)]


def _collect(
    procs: list, results: queue.Queue, deadline: float, timeout_s: float, may_die: set[int]
) -> dict[int, Any]:
    """Every rank's result; RankError as soon as one failed (after a short grace) or on timeout.
    A rank in `may_die` whose process ended without a report counts as done, with no result."""
    __tracebackhide__ = True
    world_size = len(procs)
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    exited_at: dict[int, float] = {}  # ranks whose process ended before their report arrived
    lost: set[int] = set()
    while len(done) + len(errors) + len(lost) < world_size:
        now = time.monotonic()
        if now >= deadline:
            missing = sorted(set(range(world_size)) - set(done) - set(errors) - lost)
            errors.update({r: f"no result within {timeout_s:.0f} s (hung?)" for r in missing})
            break
        try:
            rank, ok, data = results.get(timeout=min(0.2, deadline - now))
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if proc.exitcode is None or rank in done or rank in errors or rank in lost:
                    continue
                # A report sent just before exiting may still be in the pipe: wait a second.
                if now - exited_at.setdefault(rank, now) > 1.0:
                    if rank in may_die:
                        lost.add(rank)
                    else:
                        errors[rank] = f"process exited with code {proc.exitcode} without reporting"
            continue
        if ok:
            done[rank] = pickle.loads(data)
        else:
            errors[rank] = data
        if errors:
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))
        raise RankError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    return done


def _stop(procs: list, grace_s: float) -> None:
    """Wait up to `grace_s` for the processes to exit, then terminate, then kill what is left."""
    started = [proc for proc in procs if proc.pid is not None]
    deadline = time.monotonic() + grace_s
    for proc in started:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for signal_them in ("terminate", "kill"):
        alive = [proc for proc in started if proc.is_alive()]
        for proc in alive:
            getattr(proc, signal_them)()
        for proc in alive:
            proc.join(timeout=2.0)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    args: tuple,
    results: queue.Queue,
    backend: str = "gloo",
) -> None:
    """Body of one rank: join the group, run fn, report its result or traceback."""
    torch.set_num_threads(1)
    # Gloo's own connections go over loopback too, whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    reported = False
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(HOST, port, None, False, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            # Pickled here to plain bytes: a tensor put on the queue as it is would travel
            # through shared memory that vanishes when this process exits.
            report = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:
            report = (rank, False, traceback.format_exc())
        # Reported before the teardown, so that a failure is seen even if the teardown hangs.
        results.put(report)
        reported = True
        dist.destroy_process_group()
    except BaseException:
        if not reported:
            results.put((rank, False, traceback.format_exc()))
    # Wait until the report is in the pipe, then skip the interpreter's teardown (seconds with
    # torch loaded, when several ranks share few cores): nothing is left to clean up.
    results.close()
    results.join_thread()
    os._exit(0)


# -- shared model, data and helpers for the workers ------------------------------------------------

IN_FEATURES = 32
NUM_CLASSES = 8


def make_mlp(seed: int) -> nn.Module:
    """A small MLP (2,960 parameters in 6 tensors), initialized from `seed`."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 48), nn.Tanh(), nn.Linear(48, 24), nn.Tanh(), nn.Linear(24, NUM_CLASSES)
    )


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific data: every rank sees different samples, reproducibly."""
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    x = torch.randn(size, IN_FEATURES, generator=g)
    y = torch.randint(NUM_CLASSES, (size,), generator=g)
    return x, y


def ddp(module: nn.Module, **kwargs: Any) -> DistributedDataParallel:
    return DistributedDataParallel(module, **kwargs)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(
    model: DistributedDataParallel,
    opt: torch.optim.Optimizer,
    rank: int,
    steps: range,
) -> None:
    """One optimizer step per index in `steps`, on batch(rank, index)."""
    loss_fn = nn.CrossEntropyLoss()
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def config(**kwargs: Any) -> gradsync.SyncConfig:
    """A SyncConfig that compresses from the third step on, whatever the bucket size."""
    return gradsync.SyncConfig(**{"warmup_steps": 2, "min_compress_numel": 0, **kwargs})
