"""torchft's DiLoCo as a training benchmark's baseline (`torchft-diloco[:sync_every=H...]`).

torchft (pytorch/torchft, `pip install torchft`) runs DiLoCo through its fault-tolerance machinery:
a lighthouse server that forms a quorum of replica groups, a Manager per replica group with its own
store, and torchft's reconfigurable gloo process group for the outer all-reduce. Here each rank is
a replica group of one: rank 0 hosts the lighthouse, every rank a store and a Manager, all on the
addresses the benchmark's ranks already reach each other by (loopback, or the testbed's hosts).

Its outer gradients go as fp32 (torchft quantizes only on CUDA, with Triton kernels), one
all-reduce per parameter every `sync_every` inner steps; the outer optimizer is DiLoCo's (Nesterov
SGD). A torchft fragment is a whole module, so only one fragment (no streaming) is run here.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..exchange import allreduce_sent_nbytes

OPTIONS = {"sync_every": 50, "outer_lr": 0.7, "outer_momentum": 0.9}


class TorchftDiLoCo:
    """torchft.local_sgd.DiLoCo on `model` and its inner `optimizer`, started at once; the methods
    the benchmark asks of gradsync.DiLoCo: global_parameters(), stats(), close()."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # its quorum logs every sync otherwise
        from torchft import Manager
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.process_group import ProcessGroupGloo

        rank, world_size = dist.get_rank(), dist.get_world_size()
        host = _own_address()
        self.lighthouse = LighthouseServer(bind="0.0.0.0:0", min_replicas=world_size) if rank == 0 else None
        box = [f"http://{host}:{self.lighthouse.address().rsplit(':', 1)[1]}" if self.lighthouse else None]
        dist.broadcast_object_list(box)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.model, self.sync_every = model, options["sync_every"]
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.world_size = world_size
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(minutes=10)),
            min_replica_size=world_size,
            use_async_quorum=False,
            load_state_dict=lambda state: model.load_state_dict(state["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            replica_id=f"rank{rank}",
            store_addr=host,
            store_port=self.store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=box[0],
            hostname=host,
            timeout=timedelta(minutes=10),
            # Every rank starts from the same seeded weights. With init_sync torchft's first quorum
            # (at the first sync) would load one replica's local weights into the others.
            init_sync=False,
        )
        lr, momentum = options["outer_lr"], options["outer_momentum"]
        outer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.diloco = DiLoCo(
            self.manager, [model], optimizer, outer, sync_every=self.sync_every, pin_memory=False
        )
        self.diloco.__enter__()  # registers its hooks on the inner optimizer
        self.steps = 0
        optimizer.register_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.steps += 1

    def global_parameters(self) -> list[torch.Tensor]:
        """The global parameters torchft keeps (as of its last sync), in model.parameters() order."""
        (fragment,) = self.diloco._fragments
        saved = fragment.original_parameters
        return [saved[name].clone() for name, p in self.model.named_parameters() if p.requires_grad]

    def stats(self) -> dict[str, Any]:
        """gradsync.DiLoCo.stats()'s totals, by the formula (torchft counts no bytes): an fp32
        ring all-reduce of the parameters per committed sync (torchft's step; quorum traffic not
        counted)."""
        sent = self.manager.current_step() * allreduce_sent_nbytes(4 * self.numel, self.world_size)
        return {"total": {"sent_nbytes": sent, "compress_s": 0.0, "decompress_s": 0.0}}

    def close(self) -> None:
        """Leave torchft; a sync it failed to commit (it trains on, restoring the parameters) is
        an error here, since a benchmark must not compare a run that skipped syncs."""
        syncs = self.manager.current_step()
        if syncs != self.steps // self.sync_every:
            raise RuntimeError(
                f"torchft committed {syncs} syncs in {self.steps} steps of sync_every={self.sync_every}"
            )
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown()
        dist.barrier()  # every Manager has left the quorum before its lighthouse goes
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def _own_address() -> str:
    """This rank's address as its peers reach it: the local end of a route to rank 0."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, 9))  # UDP: no packet is sent
        return probe.getsockname()[0]
