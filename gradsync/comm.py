"""Comm: the collectives gradsync needs, over a torch.distributed group or a world of one.

Collectives return torch Futures, so DDP can overlap them with the rest of the backward pass.
Every rank must issue the same collectives in the same order; gradsync issues them all from the
thread that runs the DDP hook, in bucket order, and never from a completion callback.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.futures import Future


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

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Future[list[torch.Tensor]]:
        """Send 1-D `parts[j]` to rank j; the future holds what each rank sent here, in rank order
        (`recv_numels[j]` elements from rank j). Every part has one dtype; sizes may differ."""
        ...

    def sendrecv(self, peer: int, send: torch.Tensor, recv_numel: int) -> torch.Tensor:
        """Send 1-D `send` to `peer` and receive `recv_numel` elements of its dtype from it. Blocks.
        Either side may be empty: a one-way send or receive."""
        ...


def allreduce_sent_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a bandwidth-optimal (ring) allreduce of `nbytes`: 2(n-1)/n m."""
    return 2 * (world_size - 1) * nbytes // world_size


def allgather_sent_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring allgather of `nbytes` per rank: (n-1) m."""
    return (world_size - 1) * nbytes


class TorchComm:
    """Comm over a torch.distributed process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def allreduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return work.get_future().then(lambda _: tensor)

    def allgather(self, tensor: torch.Tensor) -> Future[list[torch.Tensor]]:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, tensor, group=self.group, async_op=True)
        return work.get_future().then(lambda _: gathered)

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Future[list[torch.Tensor]]:
        # One all_to_all_single over the concatenation, cut by split sizes: gloo has no list form.
        send = torch.cat(parts)
        recv = send.new_empty(sum(recv_numels))
        send_numels = [part.numel() for part in parts]
        work = dist.all_to_all_single(recv, send, recv_numels, send_numels, group=self.group, async_op=True)
        return work.get_future().then(lambda _: list(recv.split(recv_numels)))

    def sendrecv(self, peer: int, send: torch.Tensor, recv_numel: int) -> torch.Tensor:
        recv = send.new_empty(recv_numel)
        peer = dist.get_global_rank(self.group, peer) if self.group is not None else peer
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, peer, self.group))
        if recv_numel:
            ops.append(dist.P2POp(dist.irecv, recv, peer, self.group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return recv


class LocalComm:
    """A world of one: every collective is the identity, completed at once."""

    rank = 0
    world_size = 1

    def allreduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return completed(tensor)

    def allgather(self, tensor: torch.Tensor) -> Future[list[torch.Tensor]]:
        return completed([tensor])

    def all_to_all(self, parts: list[torch.Tensor], recv_numels: list[int]) -> Future[list[torch.Tensor]]:
        return completed(list(parts))

    def sendrecv(self, peer: int, send: torch.Tensor, recv_numel: int) -> torch.Tensor:
        raise ValueError(f"a world of one has no peer {peer} to exchange with")


def completed(value: Any) -> Future:
    """A future that already holds `value`."""
    future: Future = Future()
    future.set_result(value)
    return future


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
