"""Comm: the collectives gradsync needs, over a torch.distributed group or a world of one.

Collectives return torch Futures, so DDP can overlap them with the rest of the backward pass.
Every rank must issue the same collectives in the same order: gradsync issues them through a
Lane (gradsync.lane).

A collective that fails (a peer died, or stalled past the process group's timeout) fails its
future with a CollectiveError naming it: the error is never dropped, and the buffer, which holds
nothing meaningful then, is never handed on as a result.
"""

from __future__ import annotations

import pickle
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.futures import Future


class CollectiveError(RuntimeError):
    """A collective failed on this rank: a peer died, or stalled past the process group's timeout.

    Raised on every surviving rank, through the future of the exchange that issued it; gradsync
    adds which bucket or group and which step. The training step must not go on: nothing of
    this step's exchange reached the gradients.
    """


class Comm(Protocol):
    """The collectives over one group of ranks."""

    rank: int
    world_size: int

    def allreduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        """Sum `tensor` over ranks, in place; the future holds `tensor`, equal on every rank."""
        ...

    def allgather(self, tensor: torch.Tensor) -> Future[list[torch.Tensor]]:
        """Every rank's `tensor` (same shape and dtype on every rank), in rank order."""
        ...

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, average: bool) -> Future[torch.Tensor]:
        """This rank's shard (world_size equal ones, in rank order) of the sum of `tensor` over
        ranks, or of their mean, written into `out`: the backend's own reduce-scatter."""
        ...

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Future[list[torch.Tensor]]:
        """Send 1-D `parts[j]` to rank j; the future holds what each rank sent here, in rank order
        (`recv_numels[j]` elements from rank j). Every part has one dtype; sizes may differ."""
        ...

    def sendrecv(self, peer: int, send: torch.Tensor, recv_numel: int) -> torch.Tensor:
        """Send 1-D `send` to `peer` and receive `recv_numel` elements of its dtype from it. Blocks.
        Either side may be empty: a one-way send or receive."""
        ...


def allreduce_sent_nbytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a bandwidth-optimal (ring) allreduce of `nbytes`: 2(n-1)/n m."""
    return 2 * (world_size - 1) * nbytes // world_size


def allgather_sent_nbytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring allgather of `nbytes` per rank: (n-1) m."""
    return (world_size - 1) * nbytes


class TorchComm:
    """Comm over a torch.distributed process group (gloo on CPU, NCCL on GPU).

    Collectives wait as long as the process group's timeout (init_process_group(timeout=...)),
    then fail with a CollectiveError.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        _KEPT.add(group if group is not None else dist.group.WORLD)

    @property
    def timeout(self) -> timedelta | None:
        """How long a collective waits for its peers: the timeout the process group was made with
        (init_process_group(timeout=...)); None where the backend does not say."""
        group = self.group if self.group is not None else dist.group.WORLD
        for device in ("cpu", "cuda"):
            try:
                return group._get_backend(torch.device(device)).options._timeout
            except (RuntimeError, AttributeError):
                continue
        return None

    def allreduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return _outcome(work, "allreduce", tensor, lambda: tensor)

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, average: bool) -> Future[torch.Tensor]:
        # As FSDP's own: gloo's reduce-scatter work has no future, so it is waited for here.
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        # torch 2.13 renamed reduce_scatter_tensor (deprecating that name); older torch has only it.
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            reduce_scatter(out, tensor, op=op, group=self.group)
        except RuntimeError as error:
            raise CollectiveError(_failed("reduce_scatter", tensor, error)) from None
        return completed(out)

    def allgather(self, tensor: torch.Tensor) -> Future[list[torch.Tensor]]:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, tensor, group=self.group, async_op=True)
        return _outcome(work, "allgather", tensor, lambda: gathered)

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Future[list[torch.Tensor]]:
        # One all_to_all_single over the concatenation, cut by split sizes: gloo has no list form.
        send = _end_to_end(parts)
        recv = send.new_empty(sum(recv_numels))
        send_numels = [part.numel() for part in parts]
        work = dist.all_to_all_single(recv, send, recv_numels, send_numels, group=self.group, async_op=True)
        return _outcome(work, "all_to_all", send, lambda: list(recv.split(recv_numels)))

    def sendrecv(self, peer: int, send: torch.Tensor, recv_numel: int) -> torch.Tensor:
        recv = send.new_empty(recv_numel)
        peer = dist.get_global_rank(self.group, peer) if self.group is not None else peer
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, peer, self.group))
        if recv_numel:
            ops.append(dist.P2POp(dist.irecv, recv, peer, self.group))
        try:
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
        except RuntimeError as error:
            raise CollectiveError(_failed("sendrecv", send, error, f" with rank {peer}")) from error
        return recv


def on_nccl(comm: Comm) -> bool:
    """Whether `comm`'s collectives run on NCCL: on the GPU, their futures complete once queued
    (not once run), and their tensors must be on the GPU. A TorchComm's group None is the default
    group, which may be NCCL too."""
    return isinstance(comm, TorchComm) and dist.get_backend(comm.group) == "nccl"


def _end_to_end(parts: list[torch.Tensor]) -> torch.Tensor:
    """The 1-D parts as one tensor: the buffer they already lie end to end in (slices of one send
    buffer, as two-shot's frames), else their concatenation."""
    first, after = parts[0], parts[0].data_ptr()
    storage = first.untyped_storage().data_ptr()
    for part in parts:
        if part.numel() == 0:  # lies nowhere: its data_ptr may be anything
            continue
        same_buffer = part.untyped_storage().data_ptr() == storage and part.data_ptr() == after
        if not (same_buffer and part.is_contiguous()):
            return torch.cat(parts)
        after += part.numel() * part.element_size()
    return first.as_strided((sum(part.numel() for part in parts),), (1,))


def _outcome(work: dist.Work, name: str, sent: torch.Tensor, value: Callable[[], Any]) -> Future:
    """The future of `work`'s result, `value()`, or of a CollectiveError naming the collective.

    The work's own future is read: a failed collective leaves its output untouched (or
    uninitialised), and must never pass for a result.
    """

    out: Future = Future(devices=[sent.device] if sent.device.type == "cuda" else None)

    def done(future: Future) -> None:
        try:
            future.value()
        except RuntimeError as error:
            # The CollectiveError raised from `out` in this block takes `error` as its context
            # (and a Python future keeps `error` itself): its traceback would hold this frame,
            # hence `done` and its token (below), as long as the error lives.
            error.__traceback__ = None
            out.set_exception(CollectiveError(_failed(name, sent, error)))
            return
        try:
            result = value()
        except BaseException:
            # torch only logs an error a done-callback raises: `out` would never complete. Its
            # traceback, kept as text, since the error's own would hold this frame (as above).
            failure = f"gradsync: reading the result of {name} failed:\n{traceback.format_exc()}"
            out.set_exception(RuntimeError(failure))
        else:
            out.set_result(result)

    # Every later step of the exchange runs inside `done`, on the backend's worker thread; it is
    # over once that thread has dropped `done`, and the token with it.
    done.running = _Running()  # type: ignore[attr-defined]
    work.get_future().add_done_callback(done)
    return out


def _failed(name: str, sent: torch.Tensor, error: BaseException, where: str = "") -> str:
    return (
        f"{name} of {sent.numel()} {str(sent.dtype).removeprefix('torch.')} elements{where} failed: {error}"
    )


class LocalComm:
    """A world of one: every collective is the identity, completed at once."""

    rank = 0
    world_size = 1
    timeout = None

    def allreduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return completed(tensor)

    def allgather(self, tensor: torch.Tensor) -> Future[list[torch.Tensor]]:
        return completed([tensor])

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, average: bool) -> Future[torch.Tensor]:
        return completed(out.copy_(tensor.view_as(out)))

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Future[list[torch.Tensor]]:
        return completed(list(parts))

    def sendrecv(self, peer: int, send: torch.Tensor, recv_numel: int) -> torch.Tensor:
        raise ValueError(f"a world of one has no peer {peer} to exchange with")


def completed(value: Any) -> Future:
    """A future that already holds `value`."""
    future: Future = Future()
    future.set_result(value)
    return future


def then(future: Future, fn: Callable[[Any], Any], device: torch.device | None = None) -> Future:
    """A future of fn(future's value), run when `future` completes.

    Unlike Future.then, an exception (the future's own, or one fn raises) reaches the new future
    as itself, not wrapped in a message of torch's: errors keep their type and text through any
    number of steps. `device`: where the value's tensors live, if on a GPU (stream order).
    """
    devices = [device] if device is not None and device.type == "cuda" else None
    out: Future = Future(devices=devices)

    def done(source: Future) -> None:
        try:
            out.set_result(fn(source.value()))
        except BaseException as error:  # the caller's wait() raises it
            out.set_exception(error)

    future.add_done_callback(done)
    return out


def for_ddp(future: Future) -> Future:
    """`future` as a hook returns it to DDP: chained by Future.then (which keeps `future`'s GPU
    devices). DDP shows an error that reaches it so as "... CollectiveError: <message>", but one
    set on a future directly (then's) as "Unable to cast <message> to Tensor"."""
    return future.then(_value)


def _value(future: Future) -> Any:
    return future.value()


def forward(source: Future, target: Future) -> None:
    """Complete `target` with `source`'s value or error."""

    def done(future: Future) -> None:
        try:
            target.set_result(future.value())
        except BaseException as error:
            target.set_exception(error)

    source.add_done_callback(done)


def allgather_sizes(comm: Comm, sizes: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's list of integers (all lists of one length), in rank order. Blocks."""
    mine = torch.tensor(sizes, dtype=torch.int64, device=device)
    return [t.tolist() for t in comm.allgather(mine).wait()]


def allgather_bytes(comm: Comm, data: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-D uint8 tensor, whatever its length, in rank order. Blocks.

    Sizes are exchanged first; each rank then sends its bytes padded to the longest, and the
    padding is cut off again, so no payload is truncated and none need equal sizes.
    """
    sizes = [s for (s,) in allgather_sizes(comm, [data.numel()], data.device)]
    padded = data.new_zeros(max(sizes))
    padded[: data.numel()] = data
    gathered = comm.allgather(padded).wait()
    return [chunk[:size] for chunk, size in zip(gathered, sizes, strict=True)]


def allgather_object(comm: Comm, obj: Any, device: torch.device) -> list[Any]:
    """Every rank's picklable object, in rank order. Blocks; meant for rare checks, not for steps."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    return [pickle.loads(chunk.cpu().numpy().tobytes()) for chunk in allgather_bytes(comm, data)]


def gather_object(comm: Comm, obj: Any, dst: int, device: torch.device) -> list[Any] | None:
    """Every rank's picklable object, in rank order, on rank `dst` alone (None on the others),
    which hold only their own meanwhile. Blocks; for checkpoints, not for steps."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = [s for (s,) in allgather_sizes(comm, [data.numel()], device)]
    if comm.rank != dst:
        comm.sendrecv(dst, data, 0)
        return None
    chunks = [
        data if peer == dst else comm.sendrecv(peer, data[:0], sizes[peer]) for peer in range(comm.world_size)
    ]
    return [pickle.loads(chunk.cpu().numpy().tobytes()) for chunk in chunks]


# A process group's destructor joins its worker threads, and those threads need the GIL while they
# finish gradsync's work: they run each collective's completion callback (every later step of its
# exchange), then free the work and the tensors it held. If a callback drops the last reference to
# the group, its destructor runs on that worker, joins the thread it runs on, and aborts the
# process ("Resource deadlock avoided": 1 run in 40 of a two-rank script that destroyed its group
# right after its last step). Held weakly instead, the group was freed by DDP's reducer, with the
# model, on a thread that held the GIL, and waited forever for a worker that needed it (twice in
# the next ~100 runs). torch's destroy_process_group waits for its own completion hooks, not for
# Future callbacks. So gradsync keeps every group it exchanges over until the interpreter exits;
# then, once every callback has been freed, it lets go of them on the main thread, where torch
# frees a ProcessGroup object with the GIL released (a model still alive then frees its own
# reference later, as without gradsync). A group destroyed earlier keeps its threads and sockets
# until exit (two sockets and three threads per gloo group, measured). The lanes' exit handler
# (gradsync.lane) calls let_go_of_groups once they have stopped.
_KEPT: set[dist.ProcessGroup] = set()


class _Running:
    """Counts a completion callback as running from its creation until it is freed. The count
    lives on the class, which every token holds: one freed late in finalization still finds it."""

    count = 0
    changed = threading.Condition()  # reentrant: a token may be freed by a collection inside wait_for

    def __init__(self) -> None:
        with _Running.changed:
            _Running.count += 1

    def __del__(self) -> None:
        with self.changed:
            type(self).count -= 1
            self.changed.notify_all()


def settle(timeout_s: float = 10.0) -> bool:
    """Wait, at most `timeout_s`, until every collective's completion callback has run and been
    freed; whether they all have. Returns at once, False, on a thread Python did not start (a
    backend's worker, which may be holding one itself)."""
    if isinstance(threading.current_thread(), threading._DummyThread):
        return False
    with _Running.changed:
        return _Running.changed.wait_for(lambda: _Running.count == 0, timeout=timeout_s)


def let_go_of_groups(timeout_s: float) -> None:
    """At interpreter exit, once every lane has stopped: release the groups kept in _KEPT if every
    completion callback has run and been freed within `timeout_s`. A collective still waiting on
    a peer would make a group's destructor wait with it (up to the group's timeout): those groups
    are then left to the process's end."""
    if settle(timeout_s):
        _KEPT.clear()
