"""comm.allgather_bytes and allgather_object over a real gloo group of 3 ranks.

Payloads differ in length from rank to rank, one of them empty, so the size exchange, the
padding and the trimming all have to be right for every rank to get every rank's exact bytes.

Also: a process group gradsync exchanged over outlives the script's own references to it, until
exit (freed earlier, it can hang or abort the process).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.comm import TorchComm, allgather_bytes, allgather_object, settle

WORLD_SIZE = 3
# Payload length per rank, one row per round.
LENGTHS = {
    "last_rank_longest": (5, 0, 1000),
    "first_rank_empty": (0, 7, 3),
    "all_one_byte": (1, 1, 1),
    "all_empty": (0, 0, 0),
}


def payload(round_name: str, rank: int) -> bytes:
    """Rank `rank`'s bytes in `round_name`: seeded, so the test process can rebuild them."""
    g = torch.Generator().manual_seed(list(LENGTHS).index(round_name) * 100 + rank)
    return bytes(torch.randint(256, (LENGTHS[round_name][rank],), generator=g, dtype=torch.uint8).tolist())


def gather_every_round(rank: int, world_size: int) -> dict:
    comm = TorchComm()
    out = {}
    for round_name in LENGTHS:
        mine = torch.tensor(list(payload(round_name, rank)), dtype=torch.uint8)
        gathered = allgather_bytes(comm, mine)
        out[round_name] = [(t.dtype, t.dim(), bytes(t.tolist())) for t in gathered]
    obj = {"rank": rank, "blob": "x" * (1000 * rank), "tensor": torch.arange(rank + 1)}
    out["objects"] = allgather_object(comm, obj, torch.device("cpu"))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(gather_every_round, WORLD_SIZE, timeout_s=60)


@pytest.mark.parametrize("round_name", list(LENGTHS))
def test_allgather_bytes_returns_every_ranks_exact_bytes_in_rank_order(
    runs: list[dict], round_name: str
) -> None:
    expected = [payload(round_name, r) for r in range(WORLD_SIZE)]
    assert [len(p) for p in expected] == list(LENGTHS[round_name])
    for rank, out in enumerate(runs):
        got = out[round_name]
        assert [data for _, _, data in got] == expected, f"rank {rank}"
        assert all(dtype == torch.uint8 and dim == 1 for dtype, dim, _ in got), f"rank {rank}"


def test_allgather_object_returns_every_ranks_object_in_rank_order(runs: list[dict]) -> None:
    for rank, out in enumerate(runs):
        objects = out["objects"]
        assert [o["rank"] for o in objects] == list(range(WORLD_SIZE)), f"rank {rank}"
        assert [len(o["blob"]) for o in objects] == [1000 * r for r in range(WORLD_SIZE)]
        assert all(torch.equal(o["tensor"], torch.arange(r + 1)) for r, o in enumerate(objects))


def outlive_the_model(rank: int, world_size: int) -> dict:
    """Train a step over a group of its own, then end as a script does: destroy the group right
    after the last step and drop the model and the SyncState."""
    group = dist.new_group(list(range(world_size)))
    model = DistributedDataParallel(nn.Linear(8, 4), process_group=group)
    state = gradsync.register(model, gradsync.SyncConfig(min_compress_numel=0, warmup_steps=2))
    for _ in range(3):
        model(torch.ones(2, 8)).sum().backward()
    kept = weakref.ref(group)
    dist.destroy_process_group(group)
    del model, group, state
    gc.collect()
    return {"kept": kept() is not None, "settled": settle(timeout_s=5.0)}


def test_a_process_group_gradsync_used_is_kept_until_exit() -> None:
    """Freed at the end of a script, by DDP's reducer or by a callback on gloo's worker thread, a
    group may hang the process or abort it (comm.py says why): gradsync holds it until exit."""
    for rank, out in enumerate(run_ranks(outlive_the_model, 2, timeout_s=60)):
        assert out == {"kept": True, "settled": True}, f"rank {rank}"
