"""Reproducible by default: two runs with equal seeds give the same bits, run after run.

Four ranks train 50 steps with SyncConfig() as a user writes it first (top-k 1% with error
feedback, sparse_scheme "auto"), on a model whose embedding table the sparse selector decides
on and whose buckets are large enough to be compressed. Every decision gradsync makes is taken
from the gradients, never from timings, so the two runs' parameters are torch.equal.
"""

from __future__ import annotations

import torch
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync

WORLD = 4
STEPS = 50
VOCAB, DIM, CONTEXT, HIDDEN, CLASSES = 4096, 16, 4, 256, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(CONTEXT * DIM, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.embedding(words).flatten(1))))


def train_with_defaults(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    state = gradsync.register(model, gradsync.SyncConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        words = (torch.rand(32, CONTEXT, generator=generator) ** 2 * VOCAB).long()
        labels = torch.randint(CLASSES, (32,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(words), labels).backward()
        optimizer.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": params, "compressed": state.stats()["total"]["compressed_groups"]}


def test_two_runs_with_equal_seeds_end_with_the_same_bits() -> None:
    first = run_ranks(train_with_defaults, WORLD, timeout_s=180)
    second = run_ranks(train_with_defaults, WORLD, timeout_s=180)
    assert first[0]["compressed"] > 0, "nothing was compressed: the defaults were not exercised"
    for rank in range(WORLD):
        assert torch.equal(first[rank]["params"], first[0]["params"]), f"rank {rank} differs within a run"
        diff = (first[rank]["params"] - second[rank]["params"]).abs().max().item()
        assert torch.equal(first[rank]["params"], second[rank]["params"]), (
            f"rank {rank}: runs differ by {diff:.3g}"
        )
